"""memory.py and estimate.py: the ledger sees real allocations on CPU; the estimate's arithmetic
by hand and vs real models."""

import inspect
import os
import types
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from estimate import estimate_memory, knobs_to_fit, largest_sub_group, param_sizes
from memory import GB, MemoryLedger
from shapes import PRESETS, lora_params, model_shape

MB = 2**20
# small Llama-style shape: per layer q,k,v 64*3*64 + o 64*64 + MLP 3*64*128 + norms 2*64 = 41088
SMALL = dict(
    model_type="llama",
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=1,
    num_key_value_heads=1,
    head_dim=64,
    tie_word_embeddings=False,
)
N_SMALL = 2 * 41088 + 2 * 1000 * 64 + 64  # layers + embed + lm_head + final norm = 210240

linux = pytest.mark.skipif(
    not os.path.exists("/proc/self/clear_refs"), reason="VmHWM reset needs Linux /proc"
)


@linux
def test_ledger_sees_an_allocation_inside_a_phase():
    ledger = MemoryLedger("cpu")
    with ledger.phase("idle"):
        sum(range(1000))
    with ledger.phase("alloc"):
        x = torch.ones(50 * 2**20 // 1, dtype=torch.float32)  # 200 MiB, every page touched
        del x
    with ledger.phase("after"):  # freed above: the high-water mark was reset, nothing new
        sum(range(1000))
    assert abs(ledger.rise["alloc"] - 200 * MB) < 30 * MB, ledger.rise
    assert ledger.rise["idle"] < 20 * MB and ledger.rise["after"] < 20 * MB, ledger.rise
    assert ledger.step["alloc"] - ledger.step["after"] > 170 * MB
    s = ledger.summary()
    assert s["highest"] == "alloc" and "alloc" in s["text"]
    assert "alloc" in ledger.line() and "*" in ledger.line()
    metrics = ledger.step_metrics()
    assert set(metrics) == {"mem/idle", "mem/alloc", "mem/after"} and ledger.step == {}
    assert ledger.summary()["highest"] == "alloc"  # the run's peaks survive the step reset
    with pytest.raises(RuntimeError, match="do not nest"):
        with ledger.phase("a"):
            with ledger.phase("b"):
                pass


@linux
def test_ledger_leaves_out_a_sleeping_vllm_pool():
    """On CUDA, torch keeps counting a sleeping vLLM's pool (sleep unmaps its memory, not its
    tensors); the ledger subtracts not_resident (VLLMGenerator.sleeping_bytes) from a phase vLLM
    sleeps through, and not from one in which it wakes or falls asleep. Here a resident 200 MiB
    tensor stands for that pool, so the same subtraction shows on the CPU measure."""
    pool = {"bytes": 0}
    ledger = MemoryLedger("cpu", not_resident=lambda: pool["bytes"])
    x = torch.ones(50 * 2**20)  # 200 MiB, every page touched
    for name, at_start, at_end in [
        ("awake", 0, 0),
        ("asleep", 200 * MB, 200 * MB),
        ("wakes", 200 * MB, 0),  # weight_sync
        ("falls_asleep", 0, 200 * MB),  # rollout
    ]:
        pool["bytes"] = at_start
        with ledger.phase(name):
            pool["bytes"] = at_end
    step = ledger.step
    assert abs(step["awake"] - step["asleep"] - 200 * MB) < 30 * MB, step
    assert abs(step["wakes"] - step["awake"]) < 30 * MB, step
    assert abs(step["falls_asleep"] - step["awake"]) < 30 * MB, step
    assert ledger.rise["asleep"] < 20 * MB and ledger.rise["wakes"] > 170 * MB, ledger.rise
    del x


def test_parameter_count_matches_real_models():
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    assert model_shape(SMALL)["N"] == N_SMALL
    assert (
        LlamaForCausalLM(
            LlamaConfig(**{k: v for k, v in SMALL.items() if k != "model_type"})
        ).num_parameters()
        == N_SMALL
    )
    # tied, q/k/v biases
    qwen = dict(
        PRESETS["qwen2.5-0.5b"],
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=500,
    )
    assert model_shape(qwen)["N"] == Qwen2ForCausalLM(Qwen2Config(**qwen)).num_parameters()
    # the presets are the published sizes: 0.49 B, 1.54 B, 3.09 B, 7.62 B
    assert [round(model_shape(k)["N"] / 1e9, 2) for k in PRESETS] == [0.49, 1.54, 3.09, 7.62]


@pytest.mark.parametrize("targets", ["all-linear", "q_proj,v_proj"])
def test_lora_params_match_peft_and_only_they_carry_states(targets):
    """lora_params counts what peft's LoRA trains (every linear layer but the lm_head for
    "all-linear"); the estimate's gradients and Adam states follow them, the weights all N."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    qwen = dict(PRESETS["qwen2.5-0.5b"], hidden_size=128, intermediate_size=256, vocab_size=500)
    qwen.update(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    names = targets if targets == "all-linear" else targets.split(",")
    model = get_peft_model(
        Qwen2ForCausalLM(Qwen2Config(**qwen)), LoraConfig(r=4, target_modules=names)
    )
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_params(qwen, 4, targets) == trained
    full = estimate_memory(qwen, world_size=2, zero_stage=3)["pieces"]
    lora = estimate_memory(qwen, world_size=2, zero_stage=3, trainable_params=trained)["pieces"]
    assert lora["params"] == full["params"]  # the frozen weights are still there
    assert (lora["grads"], lora["optimizer"]) == (2 * trained // 2, 12 * trained // 2)


def test_config_from_path(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(SMALL))
    assert (
        model_shape(str(tmp_path))["N"]
        == model_shape(str(tmp_path / "config.json"))["N"]
        == N_SMALL
    )
    with pytest.raises(ValueError, match="presets"):
        model_shape("no-such-model")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_states_by_hand_per_zero_stage(stage):
    W, N = 4, N_SMALL
    p = estimate_memory(SMALL, world_size=W, zero_stage=stage, dtype="bf16")["pieces"]
    assert p["params"] == (2 * N // W if stage == 3 else 2 * N)
    assert p["grads"] == (2 * N // W if stage >= 2 else 2 * N)
    assert p["optimizer"] == (12 * N // W if stage >= 1 else 12 * N)  # fp32 master + m + v
    p32 = estimate_memory(SMALL, world_size=W, zero_stage=stage, dtype="fp32")["pieces"]
    assert (
        p32["optimizer"] == (8 * N // W if stage >= 1 else 8 * N)
        and p32["fp32_grad_partition"] == 0
    )
    if stage >= 1:
        off = estimate_memory(
            SMALL, world_size=W, zero_stage=stage, dtype="bf16", offload_optimizer=True
        )
        # one reduce bucket
        assert off["pieces"]["optimizer"] == 0 and off["pieces"]["grads"] == 64 * 64 * 2
        assert off["cpu"] == 12 * N // W + 4 * N // W


def test_activations_by_hand():
    # A = 2(4 + b)H + b(2h + 2k)d + 4h + 4bI bytes per token per layer; bf16: 768 + 512 + 4 + 1024 =
    # 2308
    m, S = 2, 100
    p = estimate_memory(SMALL, micro_batch_size=m, seq_len=S, completion_len=50, dtype="bf16")[
        "pieces"
    ]
    assert p["activations_full"] == 3 * 2308 * m * S  # (L + 1) A m S
    assert p["activations_ckpt"] == 2 * 2 * 64 * m * S + 2308 * m * S  # L b H m S + A m S
    assert p["kv_cache"] == 2 * 2 * 1 * 64 * 2 * min(256, 1 * 8) * S  # 2 L k d b x sequences x S


def test_monotonic_in_the_knobs():
    base = dict(world_size=2, zero_stage=3, micro_batch_size=8, seq_len=1536, completion_len=1024)
    e = lambda **kw: estimate_memory("qwen2.5-1.5b", **{**base, **kw})  # noqa: E731
    top = lambda est: max(est["phases"].values())  # noqa: E731
    assert e(gradient_checkpointing=True)["phases"]["update"] < e()["phases"]["update"]
    assert all(
        a < b for a, b in zip(e(offload_optimizer=True)["phases"].values(), e()["phases"].values())
    )
    assert top(e(offload_params=True)) < top(e())
    assert top(e(micro_batch_size=2)) < top(e())
    assert (
        e(fused_logprobs=False)["pieces"]["logprob_update"] > 10 * e()["pieces"]["logprob_update"]
    )
    z2, z3 = e(zero_stage=2, world_size=8)["pieces"], e(zero_stage=3, world_size=8)["pieces"]
    assert (
        z3["params"] * 8 == z2["params"]
        and e(world_size=4)["pieces"]["params"] * 2 == e()["pieces"]["params"]
    )
    assert e(gather_for_generation=False)["phases"]["rollout"] < e()["phases"]["rollout"]


def test_knobs_bring_7b_under_80gb():
    kw = dict(world_size=1, zero_stage=3, micro_batch_size=8, seq_len=1536, completion_len=1024)
    assert max(estimate_memory("qwen2.5-7b", **kw)["phases"].values()) > 80 * GB
    steps = knobs_to_fit("qwen2.5-7b", 80, **kw)
    assert steps and steps[-1][1] <= 80 and any("offload_optimizer" in s for s, _ in steps)
    assert knobs_to_fit("qwen2.5-0.5b", 80, **kw) == []  # already fits: nothing to change


def test_cli_prints_table_and_knobs(capsys):
    from estimate import main

    argv = ["--model", "qwen2.5-7b", "--world_size", "1", "--zero_stage", "3", "--device_gb", "80"]
    main(argv)
    out = capsys.readouterr().out
    assert out.startswith("assumes: 1 GPU, 80 GiB per GPU, bf16 (fp32 master weights), ZeRO-3, ")
    assert "update" in out and "OVER 80 GiB" in out and " GB" not in out  # GiB: 2**30 bytes
    # the changes as this CLI's flags, which pasted back fit
    flags = out.split("to fit in 80 GiB per GPU, add: ")[1].split(" (highest phase")[0]
    assert flags == "--offload_optimizer True --gradient_checkpointing True"
    main(argv + flags.split())
    assert "(fits 80 GiB per GPU)" in capsys.readouterr().out
    with pytest.raises(ValueError, match="offload_params needs zero_stage 3"):
        estimate_memory("qwen2.5-7b", zero_stage=2, offload_params=True)


# ---- The optimizer step by device and stage --------------------------------------------------
class Temporaries(TorchDispatchMode):
    """A stand-in for a device allocator that counts what torch's Adam allocates in a step: every
    new tensor an op returns (not an input's storage, as an in-place op's), live until its last
    reference goes; `peak` the most bytes live at once."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = tree_flatten((args, kwargs))[0]
        inputs = {t.untyped_storage().data_ptr() for t in given if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if (
                isinstance(t, torch.Tensor)
                and t.dim()
                and t.untyped_storage().data_ptr() not in inputs
            ):
                n = t.untyped_storage().nbytes()
                self.live += n
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self.free, n)
        return out

    def free(self, n):
        self.live -= n


def counted_step(sizes, foreach):
    """torch.optim.AdamW as DeepSpeed builds it ("torch_adam": true), one step over fp32 tensors
    of these sizes after the one that makes its states: the bytes the stand-in saw at its peak.
    foreach=True is the path torch takes for CUDA tensors with DeepSpeed's foreach=None."""
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    for x in params:
        x.grad = torch.randn(x.numel())
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1, foreach=foreach)
    opt.step()
    with Temporaries() as count:
        opt.step()
    return count.peak


QWEN_SMALL = dict(PRESETS["qwen2.5-0.5b"], hidden_size=64, intermediate_size=96, vocab_size=300)
QWEN_SMALL.update(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)


@pytest.mark.parametrize("config", [SMALL, QWEN_SMALL], ids=["llama", "qwen2"])
def test_param_sizes_are_the_models_parameters_in_order(config):
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    assert param_sizes(model_shape(config)) == [p.numel() for p in model.parameters()]


def test_largest_sub_group_is_deepspeeds():
    """largest_sub_group against DeepSpeed's own grouping (stage3._create_fp16_sub_groups over
    parameters whose partitions are ceil(n / W)), and the estimate's default sub_group_size is
    DeepSpeed's (fit.py reads it from the config)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3

    from fit import ZERO_SUB_GROUP_SIZE

    sizes = param_sizes(model_shape(QWEN_SMALL))
    for W, group in [(1, 10_000), (2, 10_000), (3, 7_000), (1, 30_000), (4, 10**9)]:
        params = [types.SimpleNamespace(partition_numel=lambda n=n, W=W: -(-n // W)) for n in sizes]
        ds = Stage3._create_fp16_sub_groups(types.SimpleNamespace(sub_group_size=group), params)
        largest = max(sum(p.partition_numel() for p in g) for g in ds)
        assert largest_sub_group(sizes, W, group) == largest, (W, group)
    assert inspect.signature(estimate_memory).parameters["sub_group_size"].default == (
        ZERO_SUB_GROUP_SIZE
    )


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop (CPU)", "foreach (CUDA)"])
def test_adam_temporaries_are_what_torch_allocates(stage, foreach):
    """The estimate's Adam temporaries against the stand-in's count of torch's AdamW over the
    tensors each stage steps in one call: ZeRO-0 every parameter (the model's, in order), ZeRO-1/2
    the flat partition, ZeRO-3 its largest sub-group (here 20,000 elements: two of them)."""
    W, group = 2, 20_000
    shape = model_shape(QWEN_SMALL)
    kw = dict(world_size=W, zero_stage=stage, sub_group_size=group, adam_foreach=foreach)
    p = estimate_memory(QWEN_SMALL, dtype="bf16", **kw)["pieces"]
    N = shape["N"]
    stepped = {0: param_sizes(shape), 3: [largest_sub_group(param_sizes(shape), W, group)]}
    stepped = stepped.get(stage, [N // W])
    assert stage != 3 or stepped[0] < N // W  # two sub-groups: one is stepped at a time
    assert p["adam_temporaries"] == counted_step(stepped, foreach)
    assert p["fp32_grad_partition"] == 4 * sum(stepped)  # each one's fp32 gradient beside it
    if foreach:  # one fp32 temporary of all of it: as many bytes as its fp32 gradient
        assert p["adam_temporaries"] == p["fp32_grad_partition"]


def test_optimizer_step_at_the_gpu_tiers_shapes():
    """Qwen2.5-0.5B and 1.5B, ZeRO-3 on one GPU: the step holds the resident states (16 N), the
    fp32 gradient and one foreach temporary of one sub-group (the whole model at 0.5B, a
    ~1e9-element one at 1.5B); the CPU for-loop has two temporaries."""
    kw = dict(world_size=1, zero_stage=3, seq_len=512, completion_len=256, micro_batch_size=2)
    for name in ("qwen2.5-0.5b", "qwen2.5-1.5b"):
        N = model_shape(name)["N"]
        group = min(N, largest_sub_group(param_sizes(model_shape(name)), 1, 10**9))
        assert (group == N) == (name == "qwen2.5-0.5b") and group < 1.02e9
        for foreach, temps in ((True, 1), (False, 2)):
            est = estimate_memory(name, adam_foreach=foreach, **kw)
            assert est["phases"]["optimizer_step"] == 16 * N + 4 * group * (1 + temps), name
    cuda = estimate_memory("qwen2.5-1.5b", adam_foreach=True, **kw)["phases"]["optimizer_step"]
    assert round(cuda / GB, 2) == 30.46


def test_fused_logps_backward_holds_its_bf16_copies():
    """At the end of the fused backward in bf16 both fp32 gradients are cast beside their
    accumulators ((V + mC) H x 2 bytes): at these shapes more than the loop's tile and weight
    slice, so it is the log-prob term's peak; in fp32 the cast is no copy."""
    m, C = 2, 256
    kw = dict(micro_batch_size=m, seq_len=512, completion_len=C, logprob_chunk=(256, 4096))
    s = model_shape("qwen2.5-0.5b")
    V, H = s["V"], s["H"]
    bf16 = estimate_memory("qwen2.5-0.5b", dtype="bf16", **kw)["pieces"]
    fp32 = estimate_memory("qwen2.5-0.5b", dtype="fp32", **kw)["pieces"]
    held = 4 * V * H + 4 * m * C * H
    assert bf16["logprob_update"] == held + 2 * (V + m * C) * H
    assert fp32["logprob_update"] == held + fp32["logprob_fwd"] + 4 * 4096 * H

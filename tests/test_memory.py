"""memory.py and estimate.py: the ledger sees real allocations on CPU; the estimate's arithmetic
by hand and vs real models."""

import os

import pytest
import torch

from estimate import PRESETS, estimate_memory, knobs_to_fit, lora_params, model_shape
from memory import GB, MemoryLedger

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

"""Long sequences (docs/long-context.md): --activation_offload and --tiled_mlp, the attention path,
and what the estimate and the fitter make of them.

- tests/dist_long_context.py (2 ranks, ZeRO-2 and ZeRO-3): each knob and both leave the loss
  and the update as they are (offload bit for bit, tiling to fp32 noise), ranks with rows of
  different lengths running as many MLP tiles under ZeRO-3.
- Offload: the layer checkpoints go through torch's save_on_cpu, not the caller's saved-tensor
  hooks; without checkpointing it is refused in the pre-flight.
- The attention path: what transformers 5.19 builds for the loops' micro-batches (a forward
  pre-hook on a decoder layer) is what estimate.attention_path says, and one unpadded sequence
  per row builds no (T, T) mask.
- The estimate: offload, tiling and sequence parallelism lower the terms they should; the
  fitter takes them as rungs; --estimate_memory says the path and answers for 128k tokens.
- `bash run.sh grpo` with the knobs on: the same steps as without them; ppo and rm run with them.
"""

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from batching import forward_logps, make_batch, micro_slice
from conftest import SMALL, run_sh, torchrun
from estimate import ATTENTION_PATHS, attention_path, estimate_memory
from exits import RunError
from generation import Generations
from shapes import model_shape
from tiled_mlp import tile_mlps
from tiny_models import build_tiny
from zero3_load import enable_gradient_checkpointing, load_model

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def narrow_model(tmp_path_factory):
    """hidden 64, 3 layers: rows of a few hundred tokens go through each MLP in several tiles."""
    path = str(tmp_path_factory.mktemp("narrow") / "model")
    return build_tiny(path, hidden_size=64, num_layers=3, intermediate_size=256)


def test_knobs_leave_the_update_as_it_is_on_real_deepspeed(narrow_model):
    torchrun(os.path.join(HERE, "dist_long_context.py"), narrow_model)


def saved_bytes(model, ids):
    """Bytes the caller's saved-tensor hooks pack in a forward (what stays where autograd put it),
    and the gradients of the loss."""
    model.zero_grad()
    packed = []

    def pack(t):
        packed.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, use_cache=False).logits.float().pow(2).mean()
    loss.backward()
    return sum(packed), loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_offload_hands_the_checkpoints_to_save_on_cpu_and_changes_nothing(narrow_model):
    ids = torch.randint(4, 90, (2, 200))
    kept, plain_loss, plain = saved_bytes(
        load_model(AutoModelForCausalLM, narrow_model, torch.float32), ids
    )
    out = {}
    for offload in (False, True):
        model = load_model(AutoModelForCausalLM, narrow_model, torch.float32)
        enable_gradient_checkpointing(model, offload=offload)
        out[offload] = saved_bytes(model, ids)
    (ckpt, loss, grads), (offloaded, loss_o, grads_o) = out[False], out[True]
    assert ckpt < kept  # checkpointing keeps less than the whole forward
    # the layer inputs (one (2, 200, 64) fp32 tensor per layer) left the caller's hooks
    layers = model.config.num_hidden_layers
    assert ckpt - offloaded >= layers * ids.numel() * 64 * 4
    assert torch.equal(loss, loss_o) and torch.equal(loss, plain_loss)
    for a, b, c in zip(grads, grads_o, plain):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c)


def test_tiled_mlp_matches_the_mlp_in_one_process(narrow_model):
    ids = torch.randint(4, 90, (2, 300))
    want = saved_bytes(load_model(AutoModelForCausalLM, narrow_model, torch.float32), ids)
    model = load_model(AutoModelForCausalLM, narrow_model, torch.float32)
    assert tile_mlps(model) == model.config.num_hidden_layers
    got = saved_bytes(model, ids)
    assert got[0] < want[0]  # the MLPs' (T, I) temporaries are not kept for backward
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=0)
    for g, w in zip(got[2], want[2]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * float(w.abs().max()))
    with pytest.raises(ValueError, match="--tiled_mlp"):
        tile_mlps(torch.nn.Linear(2, 2))


def test_offload_without_checkpointing_is_refused():
    from grpo import parse_args

    with pytest.raises(RunError, match="--gradient_checkpointing True"):
        parse_args(["--activation_offload", "True"])


def masks_seen(model, mb, packing):
    """What the first decoder layer is handed as attention_mask in forward_logps."""
    seen = []

    def hook(module, args, kwargs):
        seen.append(kwargs.get("attention_mask"))

    handle = model.model.layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    with torch.no_grad():
        forward_logps(model, mb, 1.0, packing, "cpu")
    handle.remove()
    return seen[0]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_the_attention_path_is_what_transformers_builds(narrow_model, attn):
    model = load_model(AutoModelForCausalLM, narrow_model, torch.float32, attn_implementation=attn)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13]]  # left-padded to 6
    gens = Generations(
        completion_ids=torch.tensor([[14, 15, 16, 0], [17, 18, 19, 20]]),
        completion_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]),
    )
    batch = make_batch(prompts, gens, 0)
    for rows, packing in (([0], False), ([0, 1], False), ([0, 1], True)):
        mb = micro_slice(batch, torch.tensor(rows))
        mask = masks_seen(model, mb, packing)
        path = attention_path(attn, len(rows), packing)
        T = int(mb["attention_mask"].sum()) if packing else mb["input_ids"].shape[1]
        rows_t = 1 if packing else len(rows)
        if path == "sdpa_causal":  # one unpadded sequence per row: no (T, T) mask at all
            assert mask is None, (rows, packing)
        else:
            assert mask.shape == (rows_t, 1, T, T), (path, mask.shape)
            assert path in ("sdpa_mask", "eager")
    assert attention_path(attn, 1, False) == ("eager" if attn == "eager" else "sdpa_causal")
    assert set(ATTENTION_PATHS) >= {attention_path("flash_attention_2", 4, True)}


def test_the_estimate_learns_the_knobs():
    kw = dict(
        world_size=8,
        gradient_checkpointing=True,
        micro_batch_size=1,
        seq_len=32768 + 512,
        completion_len=32768,
    )
    s = model_shape("qwen2.5-7b")
    base = estimate_memory("qwen2.5-7b", **kw)
    p = base["pieces"]
    assert p["attention_mask"] == 0  # one sequence per row under sdpa
    padded = estimate_memory("qwen2.5-7b", **{**kw, "micro_batch_size": 2})["pieces"]
    assert padded["attention_mask"] == 2 * kw["seq_len"] ** 2  # (2, 1, T, T) bool
    off = estimate_memory("qwen2.5-7b", activation_offload=True, **kw)
    tok = kw["seq_len"]
    assert p["activations"] - off["pieces"]["activations"] == (s["L"] - 2) * 2 * s["H"] * tok
    assert off["cpu"] - base["cpu"] == p["layer_checkpoints"]
    tiled = estimate_memory("qwen2.5-7b", tiled_mlp=True, **kw)["pieces"]
    # the MLP's 4bI per token held for one tile of H tokens (x2 in backward), not every token
    assert p["activations"] - tiled["activations"] == 4 * 2 * s["I"] * (tok - 2 * s["H"])
    sp = estimate_memory("qwen2.5-7b", sequence_parallel_size=4, **kw)
    assert sp["pieces"]["layer_checkpoints"] == p["layer_checkpoints"] // 4
    assert sp["pieces"]["optimizer"] == p["optimizer"]  # ZeRO still over all 8 ranks
    for est in (off, sp):
        assert est["phases"]["update"] < base["phases"]["update"]


def test_estimate_memory_says_the_path_and_answers_for_128k(capsys):
    import grpo

    common = ["--estimate_memory", "True", "--gpu_gb", "80", "--recipe", "pretrained"]
    common += ["--gradient_checkpointing", "True", "--max_completion_length", "131072"]
    grpo.main([*common, "--model", "qwen2.5-1.5b"])
    out = capsys.readouterr().out
    assert "attention: " + ATTENTION_PATHS["sdpa_mask"] in out  # the recipe's micro-batch > 1
    # fitted: one sequence per row, which builds no mask
    assert "memory: every phase under" in out and "--per_device_train_batch_size 1" in out
    assert "with the fitted micro-batch, attention: " + ATTENTION_PATHS["sdpa_causal"] in out
    with pytest.raises(RunError) as e:  # 7B: not on one GPU; on paper on more, with the knobs
        grpo.main([*common, "--model", "qwen2.5-7b"])
    assert "GPUs in all" in str(e.value) and "--activation_offload True" in str(e.value)


def rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "step_s" in r]  # the step rows


KNOBS = ["--gradient_checkpointing", "True", "--activation_offload", "True", "--tiled_mlp", "True"]


def test_run_sh_with_the_knobs(tmp_path):
    """grpo: the same two steps with the knobs as without (ZeRO-3, 2 ranks); ppo under ZeRO-2
    and rm.py train with them."""
    runs = {}
    for name, extra in (("off", ["--gradient_checkpointing", "True"]), ("on", KNOBS)):
        run_dir = str(tmp_path / name)
        run_sh("grpo", "--run_dir", run_dir, "--max_steps", "2", *SMALL, *extra)
        runs[name] = rows(run_dir)
    assert len(runs["on"]) == 2
    for a, b in zip(runs["off"], runs["on"]):
        for key in ("loss", "grad_norm", "reward", "entropy"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    ppo_dir, rm_dir = str(tmp_path / "ppo"), str(tmp_path / "rm")
    env = {"DS_CONFIG": "configs/zero2.json"}
    run_sh("ppo", "--run_dir", ppo_dir, "--max_steps", "1", *SMALL, *KNOBS, env=env)
    run_sh("rm", "--run_dir", rm_dir, "--max_steps", "1", "--prompts_per_rank", "4", *KNOBS)
    assert rows(ppo_dir) and rows(rm_dir)
    with open(os.path.join(ppo_dir, "args.json")) as f:
        assert json.load(f)["knobs"]["tiled_mlp"] is True

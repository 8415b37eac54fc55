"""ZeRO-3 partitioned loading (zero3_load.py) against the full load every rank did before, and
--attn_implementation's pre-flight check in both loops.

- tests/dist_zero3_load.py (2 ranks): gathered parameters identical for an untied and a tied
  causal LM (frozen and trained), LoRA on top, both critics of ppo.build_critic, a reward model
  and every architecture family of tiny_models.FAMILIES; each rank holds only its shard.
- `bash run.sh grpo` (reference model, beta > 0) and `bash run.sh ppo` (a reward model that also
  initialises the critic, a reference model), one step each with --partitioned_loading True and
  False: the first step's metrics are equal.
- --attn_implementation flash_attention_2 without flash-attn: exit 2 and how to install it.
- Under ZeRO-3 a checkpoint without safetensors weights: exit 2 in the pre-flight.
"""

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest
import torch

import conftest
from conftest import ROOT, train_rows
from tasks import TASK_CHARS
from tiny_models import FAMILIES, build_family, build_tiny

# what the first step computed (timings and memory excluded: they differ run to run)
GRPO_KEYS = ("reward", "reward_std", "loss", "entropy", "kl", "ratio", "clip_frac", "grad_norm")
PPO_KEYS = ("reward", "reward_std", "kl", "entropy", "value_loss", "policy_loss", "grad_norm")


def test_partitioned_load_equals_full_load(
    tiny_model, tiny_tied_model, tiny_reward_model, tmp_path
):
    families = [f"{f}={build_family(str(tmp_path / f), f)}" for f in FAMILIES]
    models = (tiny_model, tiny_tied_model, tiny_reward_model)
    proc = conftest.torchrun("tests/dist_zero3_load.py", *models, *families, timeout=900)
    cases = ("frozen_untied", "frozen_tied", "trained_tied", "lora")
    cases += ("critic_from_lm", "critic_from_rm", "reward_model")
    cases += tuple(f"family_{f}" for f in FAMILIES)
    for case in cases:
        assert f"OK {case}\n" in proc.stdout, (case, proc.stdout[-3000:])


def first_step(algo, run_dir, partitioned, *args):
    conftest.run_sh(
        algo,
        *args,
        "--max_steps",
        "1",
        "--num_eval_prompts",
        "0",
        "--save_model",
        "False",
        "--partitioned_loading",
        str(partitioned),
        env={"RUN_DIR": str(run_dir), "PREFLIGHT": "0"},
    )
    (row,) = train_rows(run_dir)
    return row


def assert_same_step(a, b, keys):
    for k in keys:
        if k in a or k in b:
            # the same weights give the same step; 1e-6 leaves room for a reduction order
            assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-9), (k, a[k], b[k])


def test_grpo_first_step_same_as_full_load(tmp_path):
    small = ("--prompts_per_rank", "2", "--num_generations", "4")
    args = (*small, "--per_device_train_batch_size", "4", "--beta", "0.04")
    new = first_step("grpo", tmp_path / "new", True, *args)
    old = first_step("grpo", tmp_path / "old", False, *args)
    assert new["kl"] == 0.0  # the reference equals the policy before its first update
    assert_same_step(new, old, GRPO_KEYS)


def test_ppo_first_step_same_as_full_load(tmp_path):
    rm = build_tiny(str(tmp_path / "rm"), reward_model=True, chars=TASK_CHARS, seed=3)
    args = ("--reward_model", rm, "--prompts_per_rank", "4", "--num_generations", "2")
    args += ("--per_device_train_batch_size", "4")
    new = first_step("ppo", tmp_path / "new", True, *args)
    old = first_step("ppo", tmp_path / "old", False, *args)
    assert new["value_loss"] > 0
    assert_same_step(new, old, PPO_KEYS)


@pytest.mark.skipif(
    importlib.util.find_spec("flash_attn") is not None and torch.cuda.is_available(),
    reason="flash-attn is installed and a GPU is present: flash_attention_2 is allowed here",
)
@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_flash_attention_unavailable_fails_in_preflight(algo):
    proc = subprocess.run(
        [sys.executable, f"{algo}.py", "--attn_implementation", "flash_attention_2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": ROOT},
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "flash_attention_2" in proc.stderr
    assert "pip install flash-attn" in proc.stderr or "CUDA" in proc.stderr


def test_preflight_refuses_non_safetensors_under_zero3(tiny_model, tmp_path):
    """A .bin-only checkpoint: exit 2 under ZeRO-3 with partitioned loading (saying what to
    change), accepted with --partitioned_loading False."""
    from safetensors.torch import load_file

    model = tmp_path / "bin_model"
    shutil.copytree(tiny_model, model)
    torch.save(load_file(str(model / "model.safetensors")), model / "pytorch_model.bin")
    os.remove(model / "model.safetensors")

    def preflight(*extra):
        cmd = [sys.executable, "grpo.py", "--model", str(model), "--preflight", "True"]
        cmd += ["--run_dir", str(tmp_path / "r"), "--prompts_per_rank", "2", *extra]
        env = {**os.environ, "PYTHONPATH": ROOT, "WORLD_SIZE": "2"}
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)

    proc = preflight()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "safetensors" in proc.stderr and "--partitioned_loading False" in proc.stderr
    proc = preflight("--partitioned_loading", "False")
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_gradient_checkpointing_recomputes_in_eval_mode(tiny_model):
    """The loops train in eval mode (as load_model returns a model); checkpointing must still
    recompute each layer in backward (gradient_checkpointing_enable() alone does not: transformers
    checkpoints a layer only while it is flagged training), give the same gradients, keep dropout
    off, and survive generation's unwrap."""
    from transformers import AutoModelForCausalLM

    from generation import unwrap_for_generation
    from zero3_load import enable_gradient_checkpointing, load_model

    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])

    def layer_calls_and_grads(model):
        calls = []
        for layer in model.model.layers:
            layer.register_forward_pre_hook(lambda m, a, k: calls.append(1), with_kwargs=True)
        model.zero_grad()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        return len(calls), [p.grad.clone() for p in model.parameters()]

    plain = load_model(AutoModelForCausalLM, tiny_model, dtype=torch.float32)
    n_layers = len(plain.model.layers)
    calls, want = layer_calls_and_grads(plain)
    assert calls == n_layers  # no checkpointing: each layer runs once

    model = load_model(AutoModelForCausalLM, tiny_model, dtype=torch.float32)
    enable_gradient_checkpointing(model)
    assert not model.training and not model.model.layers[0].self_attn.training  # no dropout
    calls, got = layer_calls_and_grads(model)
    assert calls == 2 * n_layers  # forward, then recomputed in backward
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)

    with unwrap_for_generation(model, gather=False):
        assert not any(m.training for m in model.modules())
    calls, _ = layer_calls_and_grads(model)
    assert calls == 2 * n_layers  # still recomputed after generation

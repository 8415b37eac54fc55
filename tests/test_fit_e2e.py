"""End to end: `bash run.sh grpo` (and ppo) with --memory_budget_gb on 2 CPU processes, ZeRO-3,
where the ledger measures each process's resident set (MALLOC_MMAP_THRESHOLD_ low, so freed
tensors leave it and a lowered knob shows in the next phase's peak).

- A budget far above: the micro-batch rises every step up to the whole batch, and the weights
  after 4 steps equal a fixed-knob run's (to floating-point summation order: measured 7e-8);
  the same for PPO's actor.
- A budget below what the defaults need: the pre-flight lowers the micro-batch, and every phase
  of every step stays under the budget (the ledger's figures).
- A budget just above: nothing changes, before the run or between steps.
- `--estimate_memory True --gpu_gb 80` through run.sh for several nodes (no rank starts): the
  first line says 8 GPUs per node x 2 nodes and the recipe MODEL= brings.
Figures measured on this 2-core machine are in docs/memory.md, "Fit measured".
"""

import json
import random

import pytest
import torch
from safetensors.torch import load_file

import conftest
from conftest import train_rows

ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def run(tmp_path, name, *args, algo="grpo"):
    out = conftest.run_sh(
        algo, "--num_eval_prompts", "0", *args, env={**ENV, "RUN_DIR": str(tmp_path / name)}
    )
    with open(tmp_path / name / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    return out, train_rows(tmp_path / name), [r for r in rows if "fit/knob" in r]


def test_run_sh_estimate_for_several_nodes_states_its_assumptions():
    env = {"NPROC": "8", "NNODES": "2", "MODEL": "qwen2.5-7b"}
    # "--estimate_memory=True" as well as "--estimate_memory True": run.sh starts no ranks
    out = conftest.run_sh("grpo", "--estimate_memory=True", "--gpu_gb", "80", env=env)
    (line,) = [line for line in out.splitlines() if line.startswith("estimate for: ")]
    assert line.startswith("estimate for: 8 GPUs per node x 2 nodes, 80 GiB per GPU (--gpu_gb)")
    assert ", recipe pretrained, " in line  # run.sh's MODEL= adds it
    assert "memory: every phase under 90% of --gpu_gb 80 " in out and "GiB/GPU" in out


def test_adapting_run_equals_the_fixed_run(tmp_path):
    short = ["--max_steps", "4", "--prompts_per_rank", "2", "--num_generations", "4"]
    short += ["--max_prompt_length", "16", "--per_device_train_batch_size", "1"]
    _, fixed, none = run(tmp_path, "fixed", *short)
    out, adapted, changes = run(tmp_path, "adapt", *short, "--memory_budget_gb", "100")
    assert none == [] and "with the flags as given" in out
    # far below half the budget: up one doubling per step, to the whole batch (8 per rank)
    assert [(c["step"], c["fit/from"], c["fit/to"]) for c in changes] == [
        (1, 1, 2),
        (2, 2, 4),
        (3, 4, 8),
    ]
    assert all("under 50% of the budget" in c["fit/reason"] for c in changes)
    assert [r["reward"] for r in adapted] == [r["reward"] for r in fixed]  # the same samples
    a = load_file(tmp_path / "adapt" / "final" / "model.safetensors")
    b = load_file(tmp_path / "fixed" / "final" / "model.safetensors")
    for k in b:  # summation order only: accumulation over 1, 2, 4, 8 sequences per micro-batch
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


def test_ppo_adapting_run_equals_the_fixed_run(tmp_path):
    short = ["--max_steps", "3", "--prompts_per_rank", "4", "--num_generations", "2"]
    short += [
        "--max_prompt_length",
        "16",
        "--per_device_train_batch_size",
        "1",
        "--ppo_epochs",
        "1",
    ]
    _, fixed, none = run(tmp_path, "fixed", *short, algo="ppo")
    _, adapted, changes = run(tmp_path, "adapt", *short, "--memory_budget_gb", "100", algo="ppo")
    assert none == [] and [c["fit/to"] for c in changes] == [2, 4, 8]  # 8: after the last step
    assert {c["fit/knob"] for c in changes} == {"per_device_train_batch_size"}
    assert [r["reward"] for r in adapted] == [r["reward"] for r in fixed]
    a = load_file(tmp_path / "adapt" / "final" / "model.safetensors")
    b = load_file(tmp_path / "fixed" / "final" / "model.safetensors")
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def long_prompts(tmp_path_factory):
    """201-token prompts: micro-batches of 32 x 233 tokens, activations the knob really moves."""
    r, path = random.Random(0), tmp_path_factory.mktemp("data") / "long.jsonl"
    with open(path, "w") as f:
        for _ in range(32):
            digits = "".join(r.choice("0123456789") for _ in range(200))
            f.write(json.dumps({"prompt": digits + "=", "answer": max(digits)}) + "\n")
    return ["--data", str(path), "--max_prompt_length", "202", "--max_completion_length", "32"]


LONG = ["--max_steps", "2", "--prompts_per_rank", "4", "--num_generations", "8"]
LONG += ["--save_model", "False"]


@pytest.fixture(scope="module")
def default_peak(tmp_path_factory, long_prompts):
    """The defaults' (micro-batch 32) highest measured phase, GB per process, in this
    environment: the budgets below are set from it, not as fixed figures, because the runtime's
    own resident set (torch, DeepSpeed, datasets' pyarrow) differs between installs. Measured
    here: 0.68-0.78 GB, in the update."""
    _, rows, _ = run(tmp_path_factory.mktemp("defaults"), "r", *LONG, *long_prompts)
    return max(v for r in rows for k, v in r.items() if k.startswith("mem/"))


def test_budget_below_the_defaults_lowers_the_knobs_and_holds(tmp_path, long_prompts, default_peak):
    budget = round(0.95 * default_peak, 3)
    out, rows, _ = run(tmp_path, "r", *LONG, *long_prompts, "--memory_budget_gb", str(budget))
    fitted = next(line for line in out.splitlines() if line.startswith("memory: every phase"))
    assert "--per_device_train_batch_size " in fitted.split(" with: ")[1].split(" (as given")[0]
    saved = json.load(open(tmp_path / "r" / "args.json"))
    assert saved["knobs"]["per_device_train_batch_size"] < 32  # what the run started with
    assert saved["per_device_train_batch_size"] == 32  # the arguments as given
    for r in rows:
        peaks = {k: v for k, v in r.items() if k.startswith("mem/")}
        assert peaks and max(peaks.values()) <= budget, (r["step"], peaks)


def test_budget_just_above_the_defaults_changes_nothing(tmp_path, long_prompts, default_peak):
    budget = round(1.25 * default_peak, 3)  # the measured peak under the 90 % high-water mark
    out, rows, changes = run(tmp_path, "r", *LONG, *long_prompts, "--memory_budget_gb", str(budget))
    assert "with the flags as given" in out and changes == []
    assert json.load(open(tmp_path / "r" / "args.json"))["per_device_train_batch_size"] == 32
    for r in rows:
        assert max(v for k, v in r.items() if k.startswith("mem/")) <= budget

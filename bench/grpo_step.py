"""Seconds per GRPO step and peak memory per phase (rollout, log-probs, update), measured by
running grpo.py itself through torchrun for a few steps and reading its metrics.jsonl.

    python bench/grpo_step.py                 # CPU: 2 processes; tiny default task + a larger model
    python bench/grpo_step.py --steps 10      # more steps per config (the first is warm-up)

On a GPU machine the same command uses every GPU (one process each). Prints a Markdown table
(copied into docs/benchmarks.md). Memory: on GPU, peak allocated per phase (reset between phases);
on CPU, the peak resident set of rank 0's process during each phase (Linux VmHWM, reset between
phases), which includes the Python/torch/DeepSpeed runtime (~0.5 GB).
Configs run one after another in one invocation, so their ratios are comparable; absolute
seconds on a shared 2-core machine are noisy.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from tiny_models import build_tiny  # noqa: E402

LARGER = [
    "--max_completion_length",
    "32",
    "--prompts_per_rank",
    "4",
    "--num_generations",
    "8",
    "--per_device_train_batch_size",
    "8",
]


def configs(tmp):
    big = build_tiny(os.path.join(tmp, "h512-l4"), hidden_size=512, num_layers=4)  # ~14M parameters
    return [
        (
            "tiny default task (h128 l2, 16x8 completions/rank, C=2), ZeRO-3",
            "configs/zero3.json",
            [],
        ),
        ("tiny default task, ZeRO-2", "configs/zero2.json", []),
        (
            "h512 l4, 4x8 completions/rank, C=32, ZeRO-3, gathered generation",
            "configs/zero3.json",
            ["--model", big, *LARGER],
        ),
        (
            "h512 l4, same, ZeRO-3, sharded generation",
            "configs/zero3.json",
            ["--model", big, *LARGER, "--gather_for_generation", "False"],
        ),
        (
            "h512 l4, same, ZeRO-3, token-budget micro-batches (1024)",
            "configs/zero3.json",
            ["--model", big, *LARGER, "--max_tokens_per_microbatch", "1024"],
        ),
        (
            "h512 l4, same, ZeRO-3, vLLM generation (weights synced every step)",
            "configs/zero3.json",
            ["--model", big, *LARGER, "--use_vllm", "True"],
        ),
    ]


def run(name, ds_config, extra, steps, tmp, nproc):
    run_dir = os.path.join(tmp, str(abs(hash(name))))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_port=29517",
        "grpo.py",
        "--ds_config",
        ds_config,
        "--run_dir",
        run_dir,
        "--max_steps",
        str(steps),
        "--num_eval_prompts",
        "0",
        "--save_model",
        "False",
        *extra,
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "WANDB_MODE": "offline",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
    }
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "step_s" in r][1:]  # drop the warm-up step
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    return [
        name,
        f"{med('step_s'):.2f}",
        f"{med('rollout_s'):.2f}",
        f"{med('update_s'):.2f}",
        f"{med('tokens_per_s'):.0f}",
        *(f"{med(f'mem/{p}'):.2f}" for p in ("rollout", "update", "optimizer_step")),
    ]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    a = p.parse_args()
    nproc = torch.cuda.device_count() or 2
    device = (
        torch.cuda.get_device_name(0)
        if torch.cuda.is_available()
        else f"CPU ({os.cpu_count()} cores)"
    )
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run(*c, a.steps, tmp, nproc) for c in configs(tmp)]
    print(f"\n{device}, {nproc} processes, median of {a.steps - 1} steps\n")
    head = [
        "config",
        "s/step",
        "rollout s",
        "update s",
        "completion tok/s",
        "peak GB rollout",
        "peak GB update",
        "peak GB optimizer step",
    ]
    print("| " + " | ".join(head) + " |\n|" + " --- |" * len(head))
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()

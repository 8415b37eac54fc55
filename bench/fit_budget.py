"""--memory_budget_gb measured: `bash run.sh grpo` on 2 CPU processes (ZeRO-3) with 201-token
prompts (micro-batches of 32 x 233 tokens: activations the micro-batch really moves), for the
defaults, a budget below what they need, one just above, and a far budget from micro-batch 1.

    python bench/fit_budget.py                # prints a Markdown table (docs/memory.md)
    python bench/fit_budget.py --steps 6

Peaks: rank 0's resident set per phase (the ledger on CPU, MALLOC_MMAP_THRESHOLD_=65536 so freed
tensors leave it); s/step: the mean over steps after the first. Configs run one after another, so
their ratios compare; absolute seconds on a shared 2-core machine are noisy.
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = [  # (label, extra args)
    ("defaults (micro-batch 32)", []),
    ("budget 0.65 GB (below the defaults' 0.68)", ["--memory_budget_gb", "0.65"]),
    ("budget 0.85 GB (just above)", ["--memory_budget_gb", "0.85"]),
    ("micro-batch 1, fixed", ["--per_device_train_batch_size", "1"]),
    (
        "micro-batch 1, budget 100 GB",
        ["--per_device_train_batch_size", "1", "--memory_budget_gb", "100"],
    ),
]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    a = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="fit_budget_")
    data, r = os.path.join(tmp, "long.jsonl"), random.Random(0)
    with open(data, "w") as f:
        for _ in range(64):
            digits = "".join(r.choice("0123456789") for _ in range(200))
            f.write(json.dumps({"prompt": digits + "=", "answer": max(digits)}) + "\n")
    base = ["--max_steps", str(a.steps), "--prompts_per_rank", "4", "--num_generations", "8"]
    base += ["--max_prompt_length", "202", "--max_completion_length", "32", "--data", data]
    base += ["--num_eval_prompts", "0", "--save_model", "False"]
    print(
        "| config | knobs chosen (pre-flight; between steps) | s/step | peak GB rollout / update "
        "/ optimizer_step (highest step) |"
    )
    print("| --- | --- | ---: | --- |")
    for i, (label, extra) in enumerate(CONFIGS):
        run_dir = os.path.join(tmp, str(i))
        env = {**os.environ, "RUN_DIR": run_dir, "NPROC": "2", "OMP_NUM_THREADS": "1"}
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
        out = subprocess.run(
            ["bash", "run.sh", "grpo", *base, *extra],
            cwd=ROOT,
            env=env,
            text=True,
            capture_output=True,
            check=True,
        ).stdout
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        steps = [r for r in rows if "reward" in r]
        changes = [
            f"{c['fit/from']}->{c['fit/to']} after step {c['step']}"
            for c in rows
            if "fit/knob" in c
        ]
        pre = next(  # fit.py's "memory: every phase under 90% of ... (...) with: <flags> ..."
            (
                line.split(") with", 1)[1].strip(": ")
                for line in out.splitlines()
                if line.startswith("memory: every phase under")
            ),
            "-",
        )
        s = statistics.mean(r["step_s"] for r in steps[1:])
        peak = {
            k: max(r.get(f"mem/{k}", 0) for r in steps)
            for k in ("rollout", "update", "optimizer_step")
        }
        print(
            f"| {label} | {pre}; {', '.join(changes) or 'no change'} | {s:.2f} | "
            + " / ".join(f"{v:.2f}" for v in peak.values())
            + " |"
        )


if __name__ == "__main__":
    main()

"""Start-up: seconds from `bash run.sh grpo` to its first step row, against a bare
`python -c "import torch, transformers, deepspeed"`, measured side by side (alternating, one run).

    python bench/startup.py                     # the default task, 3 rounds
    python bench/startup.py --config smollm2    # SmolLM2-135M-Instruct with colocated vLLM

Each round runs the bare import, then `bash run.sh grpo --max_steps 1` (2 ranks, ZeRO-3, a fresh
run dir) with every output line stamped on arrival. From the stamps: the pre-flight process (to
its "preflight: ... fine" line), torchrun and the ranks up to the first held-out score (model,
DeepSpeed, vLLM's engine with --config smollm2, the score itself), then step 1. Prints the
medians and the ratio first step / bare import; writes bench/out/startup/<config>.json.
"""

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

from transformers import HfArgumentParser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Args:
    config: str = field(default="default", metadata={"help": "default or smollm2"})
    rounds: int = field(default=3, metadata={"help": "bare import + run, this many times"})
    out_dir: str = field(default="bench/out/startup", metadata={"help": "runs and results"})


FLAGS = {
    "default": [],
    "smollm2": ["--recipe", "smollm2-addition", "--num_eval_prompts", "32"],
}
MARKS = {  # the first output line containing this text: the stage it ends
    "preflight": "preflight: ",
    "first_score": "held-out reward at step 0",
    "first_step": "step 1/",
}


def bare_import():
    t0 = time.time()
    subprocess.run([sys.executable, "-c", "import torch, transformers, deepspeed"], check=True)
    return time.time() - t0


def stamped_run(args, i):
    """`bash run.sh grpo --max_steps 1` with each line's arrival time: {mark: seconds}."""
    run_dir = os.path.join(ROOT, args.out_dir, args.config, f"round{i}")
    argv = ["bash", "run.sh", "grpo", *FLAGS[args.config], "--max_steps", "1"]
    argv += ["--save_model", "False", "--overwrite", "True"]
    env = {**os.environ, "RUN_DIR": run_dir}
    t0, seen = time.time(), {}
    with subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        for line in proc.stdout:
            for mark, text in MARKS.items():
                if mark not in seen and text in line:
                    seen[mark] = time.time() - t0
    if proc.returncode != 0 or len(seen) < len(MARKS):
        raise SystemExit(f"round {i}: run.sh exited {proc.returncode}, saw {seen}")
    seen["total"] = time.time() - t0
    return seen


def main():
    (args,) = HfArgumentParser(Args).parse_args_into_dataclasses()
    os.makedirs(os.path.join(ROOT, args.out_dir), exist_ok=True)
    rounds = []
    for i in range(args.rounds):
        r = {"bare_import": bare_import(), **stamped_run(args, i)}
        r["ratio"] = r["first_step"] / r["bare_import"]
        rounds.append(r)
        print(json.dumps({k: round(v, 2) for k, v in r.items()}), flush=True)
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(
        f"{args.config}: bare import {med['bare_import']:.1f} s; run.sh: pre-flight done at "
        f"{med['preflight']:.1f} s, first held-out score at {med['first_score']:.1f} s, step 1's "
        f"row at {med['first_step']:.1f} s ({med['ratio']:.1f}x the bare import), all "
        f"{med['total']:.1f} s (medians of {args.rounds})"
    )
    with open(os.path.join(ROOT, args.out_dir, f"{args.config}.json"), "w") as f:
        json.dump({"args": vars(args), "rounds": rounds, "median": med}, f, indent=1)


if __name__ == "__main__":
    main()

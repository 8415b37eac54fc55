"""PPO's step against GRPO's at the same work: SmolLM2-135M-Instruct on GSM8K, both loops' smollm2
recipe with the same completions, lengths, micro-batches and checkpointing, alternating in one run.

    python bench/ppo_vs_grpo.py                               # PPO's recipe vs GRPO's, reduced
    python bench/ppo_vs_grpo.py --ppo_flags "--ppo_epochs 2"  # any ppo.py flag on PPO's side

Each run is `bash run.sh {grpo,ppo} --recipe smollm2-gsm8k ...` on 2 ranks (ZeRO-3, colocated
vLLM), a fresh run dir, no evaluation or saving; GRPO, PPO, GRPO, PPO, ... (--rounds pairs). Per
run: the median of each metrics.jsonl time after the first step (warm-up): step, rollout
(weight sync, vLLM, rewards), the no-grad log-prob/value forwards, update, and PPO's per-model
profile (time/* in its metrics: old log-probs, values, reference, actor and critic forward and
backward, optimizer steps); the mean completion length (both sides sample, so the token counts
are printed beside the ratio) and each rank's peak per phase.

The passes each side does per step are counted from the loops' own parsed Args (parse_args with
the same flags), in forward equivalents (a backward ~ 2 forwards; gradient checkpointing adds a
forward to each backward), so the ratio can be read against the arithmetic: PPO's critic is the
body without the (V, H) head, so its passes cost a little less than the actor's.
Writes bench/out/ppo_vs_grpo/result.json.
"""

import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

from transformers import HfArgumentParser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


@dataclass
class Args:
    steps: int = field(
        default=3, metadata={"help": "training steps per run (the first is dropped)"}
    )
    rounds: int = field(default=1, metadata={"help": "pairs of runs (GRPO, then PPO)"})
    prompts: int = field(default=2, metadata={"help": "prompts per rank, both"})
    generations: int = field(default=8, metadata={"help": "completions per prompt, both"})
    completion: int = field(default=64, metadata={"help": "max completion tokens, both"})
    micro: int = field(default=4, metadata={"help": "sequences per micro-batch, both"})
    gradient_checkpointing: bool = field(default=True, metadata={"help": "both sides"})
    ppo_flags: str = field(default="", metadata={"help": "more ppo.py flags (PPO's side only)"})
    grpo_flags: str = field(default="", metadata={"help": "more grpo.py flags (GRPO's side only)"})
    out_dir: str = field(default="bench/out/ppo_vs_grpo", metadata={"help": "runs and results"})


def flags(loop, args):
    """The run.sh flags of one side: the recipe, the shared work, that side's extras."""
    argv = ["--recipe", "smollm2-gsm8k", "--max_steps", str(args.steps), "--eval_steps", "0"]
    argv += ["--num_eval_prompts", "0", "--save_steps", "0", "--save_model", "False"]
    argv += ["--prompts_per_rank", str(args.prompts), "--num_generations", str(args.generations)]
    argv += ["--max_completion_length", str(args.completion)]
    argv += ["--per_device_train_batch_size", str(args.micro)]
    argv += ["--gradient_checkpointing", str(args.gradient_checkpointing)]
    return argv + shlex.split(args.ppo_flags if loop == "ppo" else args.grpo_flags)


def passes(loop, argv):
    """(forwards, backwards, forward equivalents) per sequence per step, from the loop's Args."""
    import grpo
    import ppo
    import vllm_is

    a = (grpo if loop == "grpo" else ppo).parse_args(argv)
    gc = int(a.gradient_checkpointing)
    if loop == "grpo":
        fwd = int(a.num_iterations > 1 or vllm_is.importance_cap(a) > 0) + int(a.beta > 0)
        fwd += a.num_iterations * (1 + gc)  # the update's forward (+ its recompute)
        bwd = a.num_iterations
    else:  # values, old log-probs (where needed), the reference; per epoch actor and critic
        fwd = 1 + int(ppo.needs_old_logps(a)) + int(a.kl_coef > 0) + a.ppo_epochs * 2 * (1 + gc)
        bwd = a.ppo_epochs * 2
    return {"forwards": fwd, "backwards": bwd, "forward_equivalents": fwd + 2 * bwd}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(loop, argv, name, args):
    run_dir = os.path.join(args.out_dir, name)
    env = {**os.environ, "RUN_DIR": run_dir, "NPROC": "2", "MASTER_PORT": str(free_port())}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # as the recipes were measured
    t0 = time.time()
    cmd = ["bash", "run.sh", loop, *argv, "--overwrite", "True"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(
            f"{name} exited {out.returncode}:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
        )
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if "step_s" in r]
    later = steps[1:] or steps
    med = lambda key: statistics.median(r.get(key, 0.0) for r in later)  # noqa: E731
    keys = sorted({k for r in later for k in r if k.startswith("time/")})
    return {
        "loop": loop,
        "run": name,
        "command": " ".join(cmd),
        "wall_s": time.time() - t0,
        "steps": len(later),
        "step_s": med("step_s"),
        "rollout_s": med("rollout_s"),
        "update_s": med("update_s"),
        "forwards_s": med("step_s") - med("rollout_s") - med("update_s"),  # no-grad passes, misc
        "profile_s": {k[5:]: med(k) for k in keys},
        "completion_len": statistics.mean(r["completion_len"] for r in later),
        "peak_gb": {k[4:]: max(r[k] for r in later) for k in later[0] if k.startswith("mem/")},
    }


def main():
    (args,) = HfArgumentParser(Args).parse_args_into_dataclasses()
    os.makedirs(args.out_dir, exist_ok=True)
    argv = {loop: flags(loop, args) for loop in ("grpo", "ppo")}
    count = {loop: passes(loop, argv[loop]) for loop in argv}
    for loop, c in count.items():
        print(f"{loop}: {c['forwards']} forwards + {c['backwards']} backwards per sequence", end="")
        print(f" = {c['forward_equivalents']} forward equivalents", flush=True)
    runs = []
    for i in range(args.rounds):
        for loop in ("grpo", "ppo"):
            r = one_run(loop, argv[loop], f"round{i}-{loop}", args)
            runs.append(r)
            prof = ", ".join(f"{k} {v:.1f}" for k, v in r["profile_s"].items())
            print(
                f"{r['run']}: {r['step_s']:.1f} s/step (rollout {r['rollout_s']:.1f}, no-grad "
                f"forwards {r['forwards_s']:.1f}, update {r['update_s']:.1f}"
                + (f"; {prof}" if prof else "")
                + f"), completion {r['completion_len']:.1f} tokens, peak "
                f"{max(r['peak_gb'].values()):.2f} GB",
                flush=True,
            )
    med = {
        loop: {
            k: statistics.median(r[k] for r in runs if r["loop"] == loop)
            for k in ("step_s", "rollout_s", "forwards_s", "update_s", "completion_len")
        }
        for loop in ("grpo", "ppo")
    }
    per_token = {
        loop: m["step_s"] / m["completion_len"] for loop, m in med.items()
    }  # both sides sample: their lengths differ a little
    units = count["ppo"]["forward_equivalents"] / count["grpo"]["forward_equivalents"]
    summary = {
        "median": med,
        "ratio_step_s": med["ppo"]["step_s"] / med["grpo"]["step_s"],
        "ratio_per_completion_token": per_token["ppo"] / per_token["grpo"],
        "ratio_forward_equivalents": units,
        "passes": count,
    }
    print(
        f"PPO / GRPO: {summary['ratio_step_s']:.2f}x s/step, "
        f"{summary['ratio_per_completion_token']:.2f}x per completion token; the passes alone: "
        f"{units:.2f}x"
    )
    with open(os.path.join(args.out_dir, "result.json"), "w") as f:
        json.dump({"args": vars(args), "runs": runs, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()

"""Asynchronous GRPO (--max_staleness 1) against synchronous (0) at equal work, alternating in one
run, with this machine's cores split between a vLLM CPU server and the trainer (taskset).

    python bench/async_grpo.py                                  # the default task, 30 steps
    python bench/async_grpo.py --config smollm2 --steps 4       # SmolLM2-135M-Instruct on GSM8K

Method: one vLLM CPU server (vllm_server.py, fp32, eager) pinned to --server_cpus, started once and
left running (each run sends its own starting weights first); each run is `bash run.sh grpo ...
--use_vllm True --vllm_mode server --vllm_server_url URL --max_staleness K` pinned to --trainer_cpus
(2 ranks, ZeRO-3, a fresh run dir), the same seed, data and steps; K = 0, 1, 0, 1, ... (--rounds
pairs), both with --vllm_importance_cap 3 (the passes are the same). Per run: the median seconds per
step after the first (the first step of an asynchronous run waits for its first batch), its rollout
and update seconds, and the held-out reward at the start and the end. Per pair: the K = 1 run's
gain as a share of the ideal one (share_of_ideal: overlap makes a step at best the larger of
generation and the rest), and what it waited for (rollouts, the weight sync). Prints a table and
writes bench/out/async_grpo/<config>.json.
"""

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

from transformers import HfArgumentParser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


@dataclass
class Args:
    config: str = field(
        default="default", metadata={"help": "default (the built-in task) or smollm2"}
    )
    steps: int = field(default=30, metadata={"help": "training steps per run"})
    rounds: int = field(default=2, metadata={"help": "pairs of runs (K = 0, then K = 1)"})
    server_cpus: str = field(default="0", metadata={"help": "taskset cores of the vLLM server"})
    trainer_cpus: str = field(default="1", metadata={"help": "taskset cores of the 2 ranks"})
    out_dir: str = field(default="bench/out/async_grpo", metadata={"help": "runs and results"})


def config_flags(args):
    """(model dir for the server, run.sh flags) of --config."""
    if args.config == "default":
        from tasks import task_model

        model = task_model("", os.path.join(args.out_dir, "default"), rank=0, seed=0)
        flags = ["--prompts_per_rank", "8", "--num_generations", "8", "--num_eval_prompts", "64"]
        return model, flags + ["--max_completion_length", "2"]
    if args.config == "smollm2":
        import smollm2

        flags = ["--recipe", "smollm2-gsm8k", "--prompts_per_rank", "2", "--num_generations", "4"]
        flags += ["--max_completion_length", "96", "--num_eval_prompts", "32"]
        return smollm2.model_dir(), flags
    raise SystemExit(f"--config {args.config}: default or smollm2")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model, args):
    port, log = free_port(), open(os.path.join(args.out_dir, "vllm_server.log"), "w")
    env = {**os.environ, "OMP_NUM_THREADS": str(len(args.server_cpus.split(",")))}
    env |= {"VLLM_CPU_OMP_THREADS_BIND": args.server_cpus, "VLLM_CPU_KVCACHE_SPACE": "1"}
    argv = ["taskset", "-c", args.server_cpus, sys.executable, "vllm_server.py", model, str(port)]
    argv += ["127.0.0.1", "1", "--dtype", "float32", "--enforce-eager"]
    argv += ["--max-model-len", "512"] if args.config == "smollm2" else []  # prompt 320 + 96
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while True:
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=5)
            return proc, url
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"the vLLM server did not start; see {log.name}") from None
            time.sleep(2)


def one_run(url, flags, k, name, args, extra=()):
    """One `bash run.sh grpo` against the server at `url` with --max_staleness k (extra: more
    flags); its step timings, held-out rewards and metrics.jsonl rows."""
    run_dir = os.path.join(args.out_dir, args.config, name)
    env = {**os.environ, "RUN_DIR": run_dir, "NPROC": "2", "OMP_NUM_THREADS": "1"}
    env["MASTER_PORT"] = str(free_port())
    argv = ["taskset", "-c", args.trainer_cpus, "bash", "run.sh", "grpo", *flags]
    argv += ["--max_steps", str(args.steps), "--eval_steps", "0", "--save_model", "False"]
    argv += ["--use_vllm", "True", "--vllm_mode", "server", "--vllm_server_url", url]
    # equal work: the importance weights (and the old log-probs they need) on both sides
    argv += ["--max_staleness", str(k), "--vllm_importance_cap", "3", "--overwrite", "True"]
    argv += list(extra)
    t0 = time.time()
    out = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(
            f"{name} exited {out.returncode}:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
        )
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if "step_s" in r]
    evals = [r["eval/reward"] for r in rows if "eval/reward" in r]
    later = steps[1:] or steps
    return {
        "K": k,
        "run": name,
        "wall_s": time.time() - t0,
        "step_s": statistics.median(r["step_s"] for r in later),
        "rollout_s": statistics.median(r["rollout_s"] for r in later),
        "update_s": statistics.median(r["update_s"] for r in later),
        "weight_sync_s": statistics.median(r["weight_sync_s"] for r in later),
        "staleness_max": max((r.get("async/staleness_max", 0) for r in steps), default=0),
        "trainer_wait_s": statistics.median(r.get("async/trainer_wait_s", 0.0) for r in later),
        "server_wait_s": statistics.median(r.get("async/server_wait_s", 0.0) for r in later),
        "eval_start": evals[0] if evals else None,
        "eval_end": evals[-1] if evals else None,
        "rows": steps,
    }


KEYS = ("step_s", "rollout_s", "weight_sync_s", "trainer_wait_s")


def share_of_ideal(sync, overlapped):
    """What overlap can give at best: the synchronous run's step is generation + the rest (log-
    probs, update, weight sync; its rollout_s counts the sync before generating), the asynchronous
    one's at best the larger of the two; the gain achieved (1 - K1/K0) as a share of that ideal
    gain (1 - max / sum)."""
    gen = sync["rollout_s"] - sync["weight_sync_s"]
    rest = sync["step_s"] - gen
    ideal = max(gen, rest) / sync["step_s"]
    achieved = overlapped["step_s"] / sync["step_s"]
    return {
        "generation_s": gen,
        "rest_s": rest,
        "ideal": ideal,
        "achieved": achieved,
        "share": (1 - achieved) / (1 - ideal) if ideal < 1 else float("nan"),
        "trainer_wait_s": overlapped["trainer_wait_s"],
        "weight_sync_s": overlapped["weight_sync_s"],
    }


def main():
    (args,) = HfArgumentParser(Args).parse_args_into_dataclasses()
    os.makedirs(args.out_dir, exist_ok=True)
    model, flags = config_flags(args)
    server, url = start_server(model, args)
    results = []
    try:
        for i in range(args.rounds):
            for k in (0, 1):
                results.append(one_run(url, flags, k, f"round{i}-K{k}", args))
                r = results[-1]
                print(
                    f"{r['run']}: {r['step_s']:.2f} s/step (rollout {r['rollout_s']:.2f}, update "
                    f"{r['update_s']:.2f}, sync {r['weight_sync_s']:.2f}), held-out "
                    f"{r['eval_start']:.3f} -> {r['eval_end']:.3f}, staleness <= "
                    f"{r['staleness_max']}",
                    flush=True,
                )
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)
    by_k = {k: [r for r in results if r["K"] == k] for k in (0, 1)}
    med = {k: statistics.median(r["step_s"] for r in rs) for k, rs in by_k.items()}
    ends = {k: [r["eval_end"] for r in rs] for k, rs in by_k.items()}
    pairs = [share_of_ideal(r0, r1) for r0, r1 in zip(by_k[0], by_k[1])]
    medians = [
        {k: statistics.median(r[k] for r in by_k[K]) for k in by_k[K][0] if k in KEYS}
        for K in (0, 1)
    ]
    overall = share_of_ideal(*medians)  # the medians of all runs: less noise than one pair
    summary = {"s_per_step": med, "ratio_K1_over_K0": med[1] / med[0], "eval_end": ends}
    summary.update(pairs=pairs, share_of_ideal=overall)
    print(
        f"{args.config}: s/step K=0 {med[0]:.2f}, K=1 {med[1]:.2f} (ratio {med[1] / med[0]:.2f}); "
        f"held-out reward at the end K=0 {ends[0]}, K=1 {ends[1]}"
    )
    for name, p in [*((f"round {i}", p) for i, p in enumerate(pairs)), ("medians", overall)]:
        print(
            f"{name}: K=1 / K=0 {p['achieved']:.3f}, ideal {p['ideal']:.3f} (generation "
            f"{p['generation_s']:.2f} s vs the rest {p['rest_s']:.2f} s): {p['share']:.0%} of the "
            f"ideal gain; K=1 waited {p['trainer_wait_s']:.2f} s per step for rollouts, synced "
            f"{p['weight_sync_s']:.2f} s"
        )
    with open(os.path.join(args.out_dir, f"{args.config}.json"), "w") as f:
        json.dump({"args": vars(args), "runs": results, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()

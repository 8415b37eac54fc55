"""Sequence parallelism measured on this machine (docs/long-context.md): exactness of whole runs
and the update's memory per rank.

    python bench/sequence_parallel_runs.py exactness     # S = 2 on 2 ranks vs 1 rank, 3 loops
    python bench/sequence_parallel_runs.py memory        # the update's peak per rank, S = 1, 2
    python bench/sequence_parallel_runs.py memory --lengths 4096,8192,16384 --layers 8

exactness: `bash run.sh grpo|ppo|rm` seeded, once with --sequence_parallel_size 2 on 2 ranks and
once on 1 rank, every metric compared (seconds and memory left out); fp32 noise only, since the
2 ranks sample and train what the 1 rank does. memory: one sequence of L tokens (64 prompt, the
rest completion) through a narrow, deep tiny Llama with gradient checkpointing, its log-probs and
entropies scored (batching.forward_logps) and backpropagated, on 1 rank (S = 1) and on 2 ranks
(S = 2); the peak resident memory of that phase above what was resident before it (memory.py's
ledger), per rank, with MALLOC_MMAP_THRESHOLD_=65536 so freed tensors leave the resident set (as
the other benches; glibc's default keeps freed blocks for reuse, so its peak measures the
allocator's high water rather than the tensors alive at once: --glibc_default measures that);
then the longest L (to 1,024 tokens) whose update stays within S = 1's increment at the largest
length. Ratios side by side in one run; results in bench/out/sequence_parallel.json.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SKIP = ("_s", "mem", "tokens_per", "elapsed", "time/")
STEP = 1024  # the longest length's resolution, in tokens


def worst_difference(a, b):
    """The largest relative difference between two metrics.jsonl files' numbers."""
    rows = [[json.loads(line) for line in open(p)] for p in (a, b)]
    assert len(rows[0]) == len(rows[1]), (a, b)
    worst = 0.0
    for x, y in zip(*rows):
        for k, v in x.items():
            if any(s in k for s in SKIP) or isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            worst = max(worst, abs(v - y[k]) / max(abs(v), 1e-12))
    return worst


def exactness(out_dir):
    grpo = "--max_steps 3 --prompts_per_rank 4 --num_generations 4 --beta 0.04 --num_iterations 2"
    ppo, cut = "--max_steps 2 --prompts_per_rank 4", " --top_k 5 --top_p 0.9"
    runs = {  # name: (loop, flags)
        "grpo": ("grpo", grpo),
        "grpo_cut": ("grpo", grpo + cut),  # the sampler's cut, sliced with the positions
        "ppo": ("ppo", ppo),
        "ppo_cut": ("ppo", ppo + cut),
        "rm": ("rm", "--max_steps 3"),
    }
    result = {}
    for run, (loop, f) in runs.items():
        dirs = {}
        for name, extra, nproc in (
            ("one_rank", "", "1"),
            ("sp2", "--sequence_parallel_size 2", "2"),
        ):
            d = dirs[name] = os.path.join(out_dir, f"{run}-{name}")
            cmd = (
                f"bash run.sh {loop} {f} --eval_steps 0 --num_eval_prompts 0 {extra} --run_dir {d}"
            )
            env = {**os.environ, "NPROC": nproc}
            subprocess.run(cmd.split(), cwd=ROOT, env=env, check=True, capture_output=True)
        a, b = (os.path.join(dirs[n], "metrics.jsonl") for n in ("one_rank", "sp2"))
        result[run] = worst_difference(a, b)
        print(f"{run}: S = 2 on 2 ranks vs 1 rank, worst relative difference {result[run]:.1e}")
    return result


def worker(a):
    """One configuration under torchrun: prints the update phase's peak increment in GB."""
    import torch
    from transformers import AutoModelForCausalLM

    import sequence_parallel
    from batching import forward_logps, init_distributed
    from memory import MemoryLedger
    from tiny_models import build_tiny
    from zero3_load import enable_gradient_checkpointing

    rank, world, device = init_distributed()
    path = os.path.join(a.tmp, "model")
    if rank == 0 and not os.path.exists(path):
        build_tiny(
            path,
            hidden_size=256,
            num_layers=a.layers,
            num_heads=4,
            num_kv_heads=2,
            max_position_embeddings=a.length + 64,
        )
    torch.distributed.barrier()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    enable_gradient_checkpointing(model)
    model.train()
    if world > 1:
        sequence_parallel.init(world)
        sequence_parallel.install("sdpa")
    torch.manual_seed(0)
    L, P = a.length, 64
    ids = torch.randint(3, model.config.vocab_size, (1, L))
    mb = {
        "input_ids": ids,
        "attention_mask": torch.ones(1, L, dtype=torch.long),
        "completion_mask": torch.ones(1, L - P, dtype=torch.long),
        "logits_to_keep": L - P,
    }
    ledger = MemoryLedger(device)
    before = ledger.current()
    with ledger.phase("update"):
        logps, entropy = forward_logps(model, mb, 1.0, False, device, return_entropy=True)
        (logps.sum() + 0.01 * entropy.sum()).backward()
    peak = ledger.summary()["peak_gb"]["update"]
    if rank == 0:
        print(json.dumps({"S": world, "L": L, "increment_gb": peak - before / 2**30}))
    torch.distributed.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(S, L, layers, tmp, glibc_default=False):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={S}",
        f"--master_port={free_port()}",
        __file__,
        "worker",
        "--length",
        str(L),
        "--layers",
        str(layers),
        "--tmp",
        tmp,
    ]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    if not glibc_default:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"  # each tensor over 64 KiB: its own mapping
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stdout[-3000:] + out.stderr[-3000:])
    line = next(x for x in out.stdout.splitlines() if x.startswith('{"S"'))
    return json.loads(line)["increment_gb"]


def memory(lengths, layers, glibc_default=False):
    result = {"layers": layers, "glibc_default": glibc_default, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        for L in lengths:
            one = run_one(1, L, layers, tmp, glibc_default)
            two = run_one(2, L, layers, tmp, glibc_default)
            result["rows"].append({"L": L, "S1_gb": one, "S2_gb": two, "ratio": two / one})
            print(
                f"L {L}: update peak per rank S=1 {one:.3f} GB, S=2 {two:.3f} GB ({two / one:.2f}x)"
            )
        budget, L = result["rows"][-1]["S1_gb"], lengths[-1]
        # the longest S = 2 length within S = 1's increment at the largest length, to STEP tokens:
        # from the linear guess (the increment grows about linearly), then STEP at a time
        fits = {}

        def fit(n):
            if n not in fits:
                fits[n] = run_one(2, n, layers, tmp, glibc_default) <= budget
                print(f"  S=2 at {n} tokens: {'within' if fits[n] else 'over'} {budget:.3f} GB")
            return fits[n]

        n = max(L, int(L * budget / result["rows"][-1]["S2_gb"]) // STEP * STEP)
        while fit(n) and fit(n + STEP):
            n += STEP
        while not fit(n) and n - STEP >= L:
            n -= STEP
        longest = n if fit(n) else L
        result.update(budget_gb=budget, longest_S1=L, longest_S2=longest, longer=longest / L)
        print(f"within {budget:.3f} GB: S=1 {L} tokens, S=2 {longest} tokens ({longest / L:.2f}x)")
    return result


def main():
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=("exactness", "memory", "worker"))
    p.add_argument("--lengths", default="4096,8192")
    p.add_argument("--length", type=int, default=0)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tmp", default="")
    p.add_argument("--glibc_default", action="store_true", help="glibc's own mmap threshold")
    a = p.parse_args()
    if a.what == "worker":
        return worker(a)
    out = os.path.join(ROOT, "bench", "out")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "sequence_parallel.json")
    results = json.load(open(path)) if os.path.exists(path) else {}
    if a.what == "exactness":
        with tempfile.TemporaryDirectory() as tmp:
            results["exactness"] = exactness(tmp)
    else:
        key = "memory_glibc_default" if a.glibc_default else "memory"
        results[key] = memory([int(x) for x in a.lengths.split(",")], a.layers, a.glibc_default)
    json.dump(results, open(path, "w"), indent=1)


if __name__ == "__main__":
    main()

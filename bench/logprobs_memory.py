"""Peak memory and wall time of per-token log-probs, forward + backward, at a real head shape.

    python bench/logprobs_memory.py                  # Qwen2.5-0.5B head, fp32, 4x512 and 8x1024
    python bench/logprobs_memory.py --shapes 16x512 --methods fused_logps,liger
    python bench/logprobs_memory.py --quick          # small V, seconds (run.sh's smoke mode)

Methods (each in its own subprocess, so one method's peak never hides another's):
  naive                  logits = h @ W.T (B, T, V); log_softmax; gather
  per_token_logps        the upstream fix: one sequence at a time (batch_size=1), K + 1 logits
  selective_log_softmax  full logits, then gathered logit - logsumexp (no log_softmax copy)
  fused_logps            this project: lm_head + online log-softmax + gather fused per (C, v) tile
  fused_logps_softcap    the same with Gemma-2's logit soft-cap, 30 * tanh(logits / 30), per tile
  liger                  Liger-Kernel 0.8.5 LigerFusedLinearPPOBase.chunk_forward, the peer to
                         beat (installed with --no-deps into bench/.liger, off the project's venv)

Only the head runs: hidden states (B, T, H) are a leaf tensor standing in for the decoder's
output, so every method pays for exactly the same work. The loss is sum(logp * g) for a fixed
random g, so every position's gradient matters. Memory: on CPU the peak RSS (VmHWM, reset
through /proc/self/clear_refs) over a baseline taken after the inputs exist; on a GPU
torch.cuda.max_memory_allocated over memory_allocated. Both less the (V, H) fp32 weight
gradient that every method must hold. Time: one timed forward + backward after a warm-up.
"""

import argparse
import gc
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIGER_DIR = os.path.join(ROOT, "bench", ".liger")
LIGER_VERSION = "0.8.5"
METHODS = [
    "naive",
    "per_token_logps",
    "selective_log_softmax",
    "fused_logps",
    "fused_logps_softcap",
    "liger",
]
GEMMA2_SOFTCAP = 30.0  # Gemma-2's final_logit_softcapping
MiB = 2**20


def rss_bytes(field):
    """VmRSS (current) or VmHWM (peak since the last reset) of this process, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # 5 resets VmHWM to the current RSS (Linux >= 4.0)


def worker(method, B, T, H, V, device, chunk_size, vocab_chunk_size):
    """Runs in a subprocess: build inputs, warm up, measure one forward + backward."""
    import torch

    sys.path.insert(0, ROOT)
    from logprobs import fused_logps, per_token_logps, selective_log_softmax

    if method == "liger":
        sys.path.insert(0, LIGER_DIR)
        from liger_kernel.chunked_loss.fused_linear_ppo import LigerFusedLinearPPOBase

    class HeadOnly(torch.nn.Module):
        """A causal LM whose decoder output is the fixed leaf `hidden` (B, T + 1, H): row b is
        selected by input_ids[b, 0]. Lets per_token_logps run exactly as on a real model."""

        def __init__(self, hidden, weight):
            super().__init__()
            self.hidden = hidden
            self.lm_head = torch.nn.Linear(H, V, bias=False)
            self.lm_head.weight = weight

        def forward(self, input_ids, attention_mask, position_ids, logits_to_keep, use_cache):
            h = self.hidden[input_ids[:, 0]]  # (b, T + 1, H)
            return argparse.Namespace(logits=self.lm_head(h[:, -logits_to_keep:]))  # (b, K + 1, V)

    def run(B, T):
        g = torch.Generator().manual_seed(0)
        # T + 1 positions: per_token_logps asks for K + 1 = T + 1 logits and drops the last,
        # the other methods use the first T (position t predicts target t).
        hidden = torch.randn(B, T + 1, H, generator=g).to(device).requires_grad_()
        weight = torch.nn.Parameter((torch.randn(V, H, generator=g) * 0.02).to(device))
        targets = torch.randint(0, V, (B, T), generator=g).to(device)
        upstream = torch.randn(B, T, generator=g).to(device)
        # (B, T + 1) row id, then targets
        ids = torch.cat([torch.arange(B)[:, None].to(device), targets], 1)
        return hidden, weight, targets, upstream, ids

    def step(hidden, weight, targets, upstream, ids):
        h = hidden[:, :-1]  # (B, T, H)
        if method == "naive":
            logp = (h @ weight.t()).log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
        elif method == "per_token_logps":
            logp = per_token_logps(
                HeadOnly(hidden, weight), ids, torch.ones_like(ids), T_, batch_size=1
            )
        elif method == "selective_log_softmax":
            logp = selective_log_softmax(h @ weight.t(), targets)
        elif method == "fused_logps":
            logp = fused_logps(
                h, weight, targets, chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size
            )
        elif method == "fused_logps_softcap":
            logp = fused_logps(
                h,
                weight,
                targets,
                chunk_size=chunk_size,
                vocab_chunk_size=vocab_chunk_size,
                softcap=GEMMA2_SOFTCAP,
            )
        elif method == "liger":
            logp = LigerFusedLinearPPOBase.chunk_forward(h, weight, targets)
        (logp.float() * upstream).sum().backward()
        return logp

    T_ = 8
    step(*run(2, 8))  # warm-up: kernels, allocator, lazy imports
    T_ = T
    inputs = run(B, T)
    gc.collect()
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = rss_bytes("VmRSS")
        reset_peak()
    t0, c0 = time.perf_counter(), time.process_time()
    logp = step(*inputs)
    if cuda:
        torch.cuda.synchronize()
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    peak = torch.cuda.max_memory_allocated() if cuda else rss_bytes("VmHWM")
    weight_grad = V * H * 4
    return {
        "method": method,
        "B": B,
        "T": T,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "extra_mib": (peak - base - weight_grad) / MiB,
        "weight_grad_mib": weight_grad / MiB,
        "logp_sum": float(logp.detach().float().sum()),
        "device": device,
    }


def ensure_liger():
    if os.path.isdir(os.path.join(LIGER_DIR, "liger_kernel")):
        return
    print(
        f"installing liger-kernel=={LIGER_VERSION} into {os.path.relpath(LIGER_DIR, ROOT)} "
        "(--no-deps)",
        flush=True,
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            LIGER_DIR,
            f"liger-kernel=={LIGER_VERSION}",
        ],
        check=True,
    )


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shapes", default="4x512,8x1024", help="comma-separated BxT")
    ap.add_argument("--hidden", type=int, default=896, help="H (Qwen2.5-0.5B: 896)")
    ap.add_argument("--vocab", type=int, default=151936, help="V (Qwen2.5: 151936)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument(
        "--chunk_size",
        type=int,
        default=None,
        help="fused_logps rows per tile (default: its default)",
    )
    ap.add_argument(
        "--vocab_chunk_size", type=int, default=None, help="fused_logps vocabulary entries per tile"
    )
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument(
        "--quick", action="store_true", help="tiny shapes (V=4096, 2x64): a smoke run in seconds"
    )
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "logprobs_memory.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.quick:
        a.shapes, a.hidden, a.vocab = "2x64", 128, 4096
    if a.device is None:
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    methods = a.methods.split(",")
    for m in methods:
        if m not in METHODS:
            sys.exit(f"unknown method {m!r}; choose from {','.join(METHODS)}")

    if a.worker:  # inside the subprocess
        B, T = map(int, a.shapes.split("x"))
        print(
            json.dumps(
                worker(
                    a.worker, B, T, a.hidden, a.vocab, a.device, a.chunk_size, a.vocab_chunk_size
                )
            )
        )
        return

    if "liger" in methods:
        ensure_liger()
    rows = []
    for shape in a.shapes.split(","):
        for m in methods:
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                m,
                "--shapes",
                shape,
                "--hidden",
                str(a.hidden),
                "--vocab",
                str(a.vocab),
                "--device",
                a.device,
            ]
            for knob in ("chunk_size", "vocab_chunk_size"):
                if getattr(a, knob):
                    cmd += [f"--{knob}", str(getattr(a, knob))]
            # Passive OpenMP waits: CPU time then counts work, not spinning, on a shared machine.
            proc = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"},
            )
            if proc.returncode != 0:
                print(
                    f"{m} {shape}: failed (exit {proc.returncode})\n{proc.stderr[-2000:]}",
                    flush=True,
                )
                rows.append({"method": m, "shape": shape, "failed": proc.returncode})
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            r["shape"] = shape
            rows.append(r)
            print(
                f"{shape:>8} {m:<22} {r['extra_mib']:9.0f} MiB extra {r['seconds']:8.2f} s "
                f"{r['cpu_seconds']:8.2f} CPU s",
                flush=True,
            )

    print(
        f"\nH={a.hidden} V={a.vocab} fp32 {a.device}; extra = peak over inputs, less the "
        f"{a.vocab * a.hidden * 4 / MiB:.0f} MiB weight gradient; time = forward + backward, wall "
        "and "
        "CPU (process time, all threads; steadier than wall on a shared machine)\n"
    )
    print("| B x T | method | extra memory (MiB) | vs naive | wall (s) | CPU (s) | CPU vs naive |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for shape in a.shapes.split(","):
        naive = next(
            (
                r
                for r in rows
                if r["shape"] == shape and r["method"] == "naive" and "failed" not in r
            ),
            None,
        )
        for r in (r for r in rows if r["shape"] == shape):
            if "failed" in r:
                print(f"| {shape} | {r['method']} | failed | | | | |")
                continue
            mem_ratio = f"{r['extra_mib'] / naive['extra_mib']:.3f}" if naive else ""
            time_ratio = f"{r['cpu_seconds'] / naive['cpu_seconds']:.2f}x" if naive else ""
            print(
                f"| {shape} | {r['method']} | {r['extra_mib']:.0f} | {mem_ratio} | "
                f"{r['seconds']:.2f} "
                f"| {r['cpu_seconds']:.2f} | {time_ratio} |"
            )
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

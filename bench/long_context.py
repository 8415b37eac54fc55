"""Activation offload and tiled MLP at a long sequence: the update's peak memory and time, each as
a ratio to gradient checkpointing alone, side by side in one run; and, from the estimate, the
longest GRPO completion that fits an 80 GB GPU with and without each knob (docs/memory.md).

    python bench/long_context.py                       # 8,192 tokens, 8 layers of hidden 64
    python bench/long_context.py --tokens 16384 --layers 16
    python bench/long_context.py --quick               # 1,024 tokens, 2 layers, no table
    python bench/long_context.py --table               # the estimate's long-context table only

The model is a narrow, deep tiny Llama (hidden 64, one head, MLP width 6 x hidden as Qwen2.5's,
a 96-token vocabulary) so that activations, not weights or logits, fill the memory. The update
is one row of `tokens` tokens through the project's own pieces: zero3_load.load_model,
enable_gradient_checkpointing (offload=...), tiled_mlp.tile_mlps, logprobs.model_logps (fused
log-probs of every token), the mean's backward. Each mode runs in its own subprocess, so one
mode's peak never hides another's. Memory: on CPU the peak RSS (VmHWM, reset through
/proc/self/clear_refs) over a baseline taken after the model and inputs exist; on a GPU
torch.cuda.max_memory_allocated over memory_allocated. On a CPU the host is the device, so
offloading cannot lower the resident set: what it moves is measured instead as `device_saved`,
the bytes of the tensors autograd saves outside torch's save_on_cpu (what stays on a GPU until
backward: a caller's saved-tensor hooks count them). Time: one forward + backward after a
warm-up at a short length, wall and CPU (process) seconds; the ratio is the CPU seconds'.
"""

import argparse
import gc
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = {  # name: (gradient checkpointing, activation offload, tiled MLP)
    "checkpointing": (True, False, False),
    "offload": (True, True, False),
    "tiled": (True, False, True),
    "offload+tiled": (True, True, True),
}
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


def build(path, layers):
    sys.path.insert(0, ROOT)
    from tiny_models import build_tiny

    if not os.path.isfile(os.path.join(path, "config.json")):
        build_tiny(path, hidden_size=64, num_layers=layers, intermediate_size=384)
    return path


def worker(mode, model_dir, tokens, device):
    """In a subprocess: one update of a `tokens`-token row with the mode's knobs."""
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, ROOT)
    from logprobs import model_logps
    from tiled_mlp import tile_mlps
    from zero3_load import enable_gradient_checkpointing, load_model

    ckpt, offload, tiled = MODES[mode]
    model = load_model(AutoModelForCausalLM, model_dir, torch.float32).to(device)
    if ckpt:
        enable_gradient_checkpointing(model, offload=offload)
    if tiled:
        tile_mlps(model)
    saved = []

    def pack(t):  # what autograd keeps outside save_on_cpu: on a GPU, in device memory
        saved.append(t.numel() * t.element_size() if t.device.type == device else 0)
        return t

    def step(T):
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(4, 96, (1, T), generator=g).to(device)
        mask = torch.ones_like(ids)
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logps = model_logps(model, ids, mask, T - 1)  # (1, T - 1)
        loss = -logps.mean()
        loss.backward()
        model.zero_grad(set_to_none=False)
        return float(loss)

    step(256)  # warm-up: kernels, allocator, lazy imports; the gradients exist from here
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
    loss = step(tokens)
    if cuda:
        torch.cuda.synchronize()
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    peak = torch.cuda.max_memory_allocated() if cuda else rss_bytes("VmHWM")
    return {
        "mode": mode,
        "tokens": tokens,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,  # on a shared CPU: less noisy than the wall clock
        "peak_mib": (peak - base) / MiB,
        "device_saved_mib": sum(saved) / MiB,
        "loss": loss,
        "device": device,
    }


def predicted(model_dir, tokens, mode):
    """The estimate's activation and log-prob terms of the same update (fp32, one row), MiB."""
    sys.path.insert(0, ROOT)
    from estimate import estimate_memory

    ckpt, offload, tiled = MODES[mode]
    est = estimate_memory(
        model_dir,
        dtype="fp32",
        micro_batch_size=1,
        seq_len=tokens,
        completion_len=tokens - 1,
        gradient_checkpointing=ckpt,
        activation_offload=offload,
        tiled_mlp=tiled,
    )
    p = est["pieces"]
    return (p["activations"] + p["logprob_update"]) / MiB


# ---- The estimate's table: the longest GRPO completion on 80 GB GPUs ---------------------------
TABLE_KNOBS = {  # row label: estimate_memory's kwargs beside gradient checkpointing
    "checkpointing": {},
    "+ offload": {"activation_offload": True},
    "+ tiled MLP": {"tiled_mlp": True},
    "+ offload + tiled": {"activation_offload": True, "tiled_mlp": True},
    "+ SP": {"sp": True},
    "+ SP + offload + tiled": {"sp": True, "activation_offload": True, "tiled_mlp": True},
}


CAP = 1 << 20  # searched up to 1M tokens: past it a cell reads "1M+" (memory only: attention's
# time grows as T^2, and Qwen2.5 has 32,768 positions, past which it needs RoPE scaling, YaRN)


def longest_completion(model, gpus, knobs, gpu_gb=80.0, prompt=512, step=1024):
    """The longest completion (a multiple of `step` tokens) whose GRPO step's every phase is under
    fit.HIGH_WATER of gpu_gb on `gpus` GPUs, on paper: ZeRO-3, bf16, fused Adam, micro-batch 1,
    gradient checkpointing, a vLLM server on GPUs of its own (the rollout's memory is not the
    trainer's), 1 prompt x 8 completions per rank; "sp": the largest sequence-parallel degree
    the GPUs and heads allow. Returns (tokens, at most CAP, or 0; the degree)."""
    sys.path.insert(0, ROOT)
    from estimate import estimate_memory
    from fit import HIGH_WATER
    from memory import GB
    from shapes import heads_split

    kw = dict(knobs)
    sp = 1
    if kw.pop("sp", False):
        sp = max(p for p in (1, 2, 4, 8) if gpus % p == 0 and heads_split(model, p) is None)
    kw.update(
        world_size=gpus,
        zero_stage=3,
        dtype="bf16",
        fused_adam=True,
        micro_batch_size=1,
        gradient_checkpointing=True,
        vllm_server=True,
        num_generations=8,
        prompts_per_rank=1,
        sequence_parallel_size=sp,
        device_gb=gpu_gb,
    )

    def fits(c):
        est = estimate_memory(model, seq_len=prompt + c, completion_len=c, **kw)
        return max(est["phases"].values()) <= HIGH_WATER * gpu_gb * GB

    lo, hi = 0, CAP // step
    while lo < hi:  # the largest multiple of step that fits (the phases grow with length)
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid * step) else (lo, mid - 1)
    return lo * step, sp


GEMMA3_1B = dict(  # google/gemma-3-1b-pt's config.json shape (TRL's published long-context figure)
    model_type="gemma3_text",
    vocab_size=262144,
    hidden_size=1152,
    intermediate_size=6912,
    num_hidden_layers=26,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    tie_word_embeddings=True,
)


def table(models=("qwen2.5-1.5b", "qwen2.5-7b"), gpus=(1, 2, 4, 8)):
    """Markdown rows: model, knobs, then the longest completion on each GPU count."""
    head = "| model | knobs (with gradient checkpointing) | " + " | ".join(
        f"{g} x 80 GB" for g in gpus
    )
    lines = [head + " |", "|" + " --- |" * (2 + len(gpus))]
    for model in models:
        for label, knobs in TABLE_KNOBS.items():
            cells = []
            for g in gpus:
                tokens, sp = longest_completion(model, g, knobs)
                note = f" (SP {sp})" if "sp" in knobs else ""
                text = "1M+" if tokens >= CAP else f"{tokens:,}" if tokens else "none"
                cells.append(text + note)
            lines.append(f"| {model} | {label} | " + " | ".join(cells) + " |")
    gemma = [longest_completion(GEMMA3_1B, 1, k, gpu_gb=79.0)[0] for k in TABLE_KNOBS.values()]
    lines.append(
        "| gemma-3-1b shape, 1 x 79 GiB | checkpointing; + offload; + tiled; + both | "
        + "; ".join(f"{t:,}" if t < CAP else "1M+" for t in gemma[:4])
        + " | | | |"
    )
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", type=int, default=8192, help="tokens of the row")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers (hidden 64)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--quick", action="store_true", help="1,024 tokens, 2 layers")
    ap.add_argument("--table", action="store_true", help="only the estimate's table")
    ap.add_argument("--model_dir", default="", help="default: bench/.long_context/L<layers>")
    ap.add_argument("--out", default="", help="write the results as JSON here")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, a.model_dir, a.tokens, a.device)))
        return
    if a.table:
        print(table())
        return
    if a.quick:
        a.tokens, a.layers = 1024, 2
    import torch

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model_dir = a.model_dir or os.path.join(ROOT, "bench", ".long_context", f"L{a.layers}")
    build(model_dir, a.layers)
    results = []
    for mode in a.modes.split(","):
        cmd = [sys.executable, __file__, "--worker", mode, "--model_dir", model_dir]
        cmd += ["--tokens", str(a.tokens), "--device", device]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if out.returncode:
            sys.exit(f"{mode} failed:\n{out.stderr[-3000:]}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        r["predicted_mib"] = predicted(model_dir, a.tokens, mode)
        results.append(r)
        print(f"{mode}: {r['peak_mib']:.1f} MiB peak, {r['seconds']:.2f} s", flush=True)
    base = next(r for r in results if r["mode"] == "checkpointing")
    print(
        f"\n{a.tokens} tokens, {a.layers} layers of hidden 64 on {device}; ratios to "
        "gradient checkpointing alone (measured side by side in this run)"
    )
    print(
        f"{'mode':<16}{'peak':>10}{'x':>7}{'on device':>12}{'x':>7}{'CPU time':>9}{'x':>7}"
        f"{'estimate':>11}{'x':>7}"
    )
    for r in results:
        r["peak_x"] = r["peak_mib"] / base["peak_mib"]
        r["device_saved_x"] = r["device_saved_mib"] / base["device_saved_mib"]
        r["time_x"] = r["cpu_seconds"] / base["cpu_seconds"]
        r["predicted_x"] = r["predicted_mib"] / base["predicted_mib"]
        print(
            f"{r['mode']:<16}{r['peak_mib']:>8.1f}Mi{r['peak_x']:>7.2f}"
            f"{r['device_saved_mib']:>10.1f}Mi{r['device_saved_x']:>7.2f}"
            f"{r['cpu_seconds']:>8.2f}s{r['time_x']:>7.2f}"
            f"{r['predicted_mib']:>9.1f}Mi{r['predicted_x']:>7.2f}"
        )
    text = "" if a.quick else table()  # --quick: the measurement only
    if text:
        print("\nthe estimate: the longest GRPO completion under 90% of 80 GB per GPU\n" + text)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"results": results, "table": text}, f, indent=1)


if __name__ == "__main__":
    main()

"""Generation throughput and memory per rank, side by side in one run (2 ranks, ZeRO-3).

Modes: HF generate with the model ZeRO-3 gathered / sharded / middle (half the parameter bytes
resident), vLLM with vllm_batch_size off / on, plus the vLLM weight sync; with --server True also a
vLLM server (vllm_server.py, one CPU process started here by rank 0) that both ranks send their
prompts to, off / on, and its weight sync (gloo stream from rank 0). Per mode: tokens/s
(all ranks' completion tokens over the slowest rank's wall time), the peak bytes of full parameters
held by one rank while generating (HF modes; vLLM holds a full copy plus its KV cache), and the
peak RSS rise of the process during the mode (gather included; meaningful on CPU with
--mmap_rss, which makes freed memory leave the process but slows every mode). Ratios are the point,
not the absolute numbers.

    torchrun --nproc_per_node 2 bench/generation.py --hidden_size 1024 --num_layers 8
"""

import ctypes
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

# This file is named like the module it measures: put the repo root first, not bench/.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Args:
    out_dir: str = field(
        default="runs/bench-generation", metadata={"help": "model and results go here"}
    )
    hidden_size: int = field(default=1024, metadata={"help": "model width (multiple of 64)"})
    num_layers: int = field(default=8, metadata={"help": "decoder layers"})
    prompts_per_rank: int = field(default=16, metadata={"help": "prompts per rank"})
    max_new_tokens: int = field(default=32, metadata={"help": "tokens generated per prompt"})
    batch_size: int = field(default=16, metadata={"help": "HF sequences per generate call"})
    vllm_batch_size: int = field(
        default=4, metadata={"help": "prompts per vLLM call in the 'on' mode"}
    )
    skip_vllm: bool = field(default=False, metadata={"help": "HF modes only"})
    server: bool = field(
        default=False, metadata={"help": "also a vLLM server (vllm_server.py) beside the ranks"}
    )
    mmap_rss: bool = field(
        default=False,
        metadata={
            "help": "CPU: serve large allocations from mmap so RSS "
            "tracks live memory (slows every mode down)"
        },
    )


class PeakRSS:
    """Samples this process's resident set every 2 ms; .peak - .base = rise during the block."""

    def __enter__(self):
        self.base = self.peak = self.rss()
        self.running = True
        self.thread = threading.Thread(target=self.loop, daemon=True)
        self.thread.start()
        return self

    def loop(self):
        while self.running:
            self.peak = max(self.peak, self.rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()

    @staticmethod
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakParams:
    """Forward pre-hooks (after ZeRO-3's fetch hooks) record the most full-parameter bytes held at
    once."""

    def __init__(self, model):
        self.model, self.peak = model, 0
        self.params = list(model.parameters())

    def __enter__(self):
        self.handles = [m.register_forward_pre_hook(self.record) for m in self.model.modules()]
        return self

    def record(self, *_):
        held = sum(
            p.data.numel() * p.element_size()
            for p in self.params
            if p.data.numel() == getattr(p, "ds_numel", p.numel())
        )
        self.peak = max(self.peak, held)

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def timed(fn):
    dist.barrier()
    t = time.perf_counter()
    out = fn()
    dist.barrier()
    return out, time.perf_counter() - t


def total(x):
    t = torch.tensor([float(x)])
    dist.all_reduce(t)
    return t.item()


def server_rows(a, engine, prompts, model_dir, record):
    """The server rows: rank 0 starts a vLLM CPU server on model_dir (own session), both ranks
    send their prompts to it; it is stopped with its process group at the end."""
    import signal
    import subprocess
    import urllib.request

    from vllm_server import VLLMServerGenerator

    rank = dist.get_rank()
    url = [None]
    proc = None
    if rank == 0:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        argv = [sys.executable, os.path.join(root, "vllm_server.py"), model_dir, str(port)]
        argv += ["127.0.0.1", "1", "--dtype", "float32", "--max-model-len", "256"]
        argv += ["--enforce-eager"]
        log = open(os.path.join(a.out_dir, "vllm_server.log"), "w")
        env = {**os.environ, "PYTHONPATH": root}
        proc = subprocess.Popen(
            argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=root
        )
        url[0] = f"http://127.0.0.1:{port}"
        while True:
            try:
                urllib.request.urlopen(url[0] + "/v1/models", timeout=5)
                break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError(f"vLLM server failed; see {log.name}") from None
                time.sleep(2)
    dist.broadcast_object_list(url, src=0)
    try:
        gen = VLLMServerGenerator(url[0])
        gen.sync_weights(engine)  # first one: also creates the weight group
        gen.generate(prompts[:2], max_new_tokens=2, greedy=True)  # warm-up
        _, sync_s = timed(lambda: gen.sync_weights(engine))
        for name, size in (
            ("vLLM server, vllm_batch_size off", 0),
            (f"vLLM server, vllm_batch_size={a.vllm_batch_size}", a.vllm_batch_size),
        ):
            gen.vllm_batch_size = size
            with PeakRSS() as rss:
                out, sec = timed(
                    lambda: gen.generate(prompts, max_new_tokens=a.max_new_tokens, greedy=True)
                )
            # a training rank holds no full copy: the server's workers do, in their process
            record(name, sec, out.completion_mask.sum().item(), 0, rss.peak - rss.base, sync_s)
    finally:
        dist.barrier()
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)


def main():
    import deepspeed
    from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser

    from generation import VLLMGenerator, generate_hf, unwrap_for_generation
    from tiny_models import build_tiny
    from zero3_utils import save_hf

    (a,) = HfArgumentParser(Args).parse_args_into_dataclasses()
    if a.mmap_rss:  # glibc keeps freed heap blocks, so RSS shows every layer ever fetched; blocks
        # of 64 KiB and up from mmap are returned on free, so RSS follows the live tensors.
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    path = os.path.join(a.out_dir, f"model-h{a.hidden_size}-l{a.num_layers}")
    if rank == 0 and not os.path.exists(os.path.join(path, "config.json")):
        build_tiny(path, hidden_size=a.hidden_size, num_layers=a.num_layers)
    dist.barrier()
    tok = AutoTokenizer.from_pretrained(path)
    words = "the cat sat on a mat while 42 dogs ran past quickly".split()
    prompts = [
        tok(" ".join(words[(rank * 7 + i) % len(words) :][: 3 + i % 5]))["input_ids"]
        for i in range(a.prompts_per_rank)
    ]

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        # HF's "auto" persistence and prefetch, no reuse-distance caching and at most ~2 decoder
        # layers live, so "sharded" frees layers after use as it would for a model far larger
        # than these knobs (DeepSpeed's 1e9 defaults keep a model this small entirely resident).
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 10 * a.hidden_size,
            "stage3_prefetch_bucket_size": int(0.9 * a.hidden_size**2),
            "stage3_max_reuse_distance": 0,
            "stage3_max_live_parameters": 20 * a.hidden_size**2,
        },
    }
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-5), config=cfg
    )
    rows = []

    def record(name, seconds, tokens, params_bytes, rss, sync_s=None):
        rows.append(
            {
                "mode": name,
                "tokens_per_s": total(tokens) / seconds,
                "seconds": seconds,
                "param_mib_per_rank": params_bytes / 2**20,
                "rss_rise_mib": rss / 2**20,
                "sync_s": sync_s,
            }
        )
        if rank == 0:
            print(f"{name}: {rows[-1]}", flush=True)

    hf_modes = [
        ("HF, ZeRO-3 gathered", dict(gather=True)),
        ("HF, ZeRO-3 sharded", dict(gather=False)),
        ("HF, ZeRO-3 middle (1/2 resident)", dict(gather=False, resident_bytes=model_bytes // 2)),
    ]
    for name, kw in hf_modes:
        with unwrap_for_generation(engine, **kw) as m:
            generate_hf(m, prompts[:2], max_new_tokens=2, greedy=True)  # warm-up
        # gather included
        with PeakRSS() as rss, unwrap_for_generation(engine, **kw) as m, PeakParams(m) as pp:
            out, sec = timed(
                lambda: generate_hf(
                    m,
                    prompts,
                    batch_size=a.batch_size,
                    max_new_tokens=a.max_new_tokens,
                    greedy=True,
                )
            )
        record(name, sec, out.completion_mask.sum().item(), pp.peak, rss.peak - rss.base)

    if not a.skip_vllm:
        saved = os.path.join(a.out_dir, "saved")
        save_hf(engine, tok, saved)
        gen = VLLMGenerator(saved, max_model_len=256, dtype="float32", enforce_eager=True)
        gen.generate(prompts[:2], max_new_tokens=2, greedy=True)  # warm-up
        _, sync_s = timed(lambda: gen.sync_weights(engine))
        if rank == 0:
            print(f"vLLM weight sync: {sync_s:.2f} s", flush=True)
        for name, size in (
            ("vLLM, vllm_batch_size off", 0),
            (f"vLLM, vllm_batch_size={a.vllm_batch_size}", a.vllm_batch_size),
        ):
            gen.vllm_batch_size = size
            with PeakRSS() as rss:
                out, sec = timed(
                    lambda: gen.generate(prompts, max_new_tokens=a.max_new_tokens, greedy=True)
                )
            record(
                name,
                sec,
                out.completion_mask.sum().item(),
                model_bytes,
                rss.peak - rss.base,
                sync_s,
            )

    if a.server and not a.skip_vllm:
        server_rows(a, engine, prompts, saved, record)

    if rank == 0:
        by = {r["mode"]: r for r in rows}
        g, s = by["HF, ZeRO-3 gathered"], by["HF, ZeRO-3 sharded"]
        lines = [
            f"CPU, {world} ranks, Llama h={a.hidden_size} x {a.num_layers} layers "
            f"({n_params / 1e6:.0f}M params, "
            f"fp32 {model_bytes / 2**20:.0f} MiB), {a.prompts_per_rank} prompts/rank x "
            f"{a.max_new_tokens} new tokens, greedy",
            "",
            "| mode | tokens/s (all ranks) | full params held per rank (MiB) | RSS rise (MiB) |",
            "| --- | ---: | ---: | ---: |",
        ]
        lines += [
            f"| {r['mode']} | {r['tokens_per_s']:.1f} | {r['param_mib_per_rank']:.0f} | "
            f"{r['rss_rise_mib']:.0f} |"
            for r in rows
        ]
        lines += [
            "",
            f"gathered / sharded: {g['tokens_per_s'] / s['tokens_per_s']:.2f}x tokens/s, "
            f"{g['param_mib_per_rank'] / max(s['param_mib_per_rank'], 1e-9):.1f}x parameter memory "
            "per rank",
        ]
        if not a.skip_vllm:
            v0 = by["vLLM, vllm_batch_size off"]
            vb = rows[-1]
            lines += [
                f"vLLM / HF gathered: {v0['tokens_per_s'] / g['tokens_per_s']:.2f}x tokens/s; "
                f"vllm_batch_size={a.vllm_batch_size} / off: "
                f"{vb['tokens_per_s'] / v0['tokens_per_s']:.2f}x tokens/s; "
                f"weight sync {sync_s:.2f} s"
            ]
        if a.server and not a.skip_vllm:
            s0, sb = by["vLLM server, vllm_batch_size off"], rows[-1]
            lines += [
                f"vLLM server / colocated (batch size off): "
                f"{s0['tokens_per_s'] / v0['tokens_per_s']:.2f}x tokens/s; "
                f"vllm_batch_size={a.vllm_batch_size} / off: "
                f"{sb['tokens_per_s'] / s0['tokens_per_s']:.2f}x tokens/s; weight sync "
                f"{s0['sync_s']:.2f} s (colocated {sync_s:.2f} s); full parameters per training "
                f"rank {s0['param_mib_per_rank']:.0f} MiB "
                f"(colocated {v0['param_mib_per_rank']:.0f})"
            ]
        print("\n".join(lines), flush=True)
        with open(os.path.join(a.out_dir, "results.json"), "w") as f:
            json.dump({"args": asdict(a), "rows": rows, "table": lines}, f, indent=2)
    dist.barrier()


if __name__ == "__main__":
    main()

"""Peak resident memory per rank while loading a ~300M-parameter model under ZeRO-3 on 2 CPU ranks:
the full load every rank did before (from_pretrained, then DeepSpeed partitions), transformers'
own DeepSpeed integration (HfDeepSpeedConfig alive during from_pretrained) and zero3_load.py.

    python bench/partitioned_load.py               # Markdown table (docs/zero3.md)
    python bench/partitioned_load.py --dtype bf16  # a bf16 checkpoint loaded in bf16

A random Llama (hidden 1024, 20 layers, MLP 2816, vocab 32000, untied: 322M parameters, 1.20 GiB in
fp32) is written once as safetensors to a temporary directory; each method then runs in a fresh
2-rank torchrun with glibc's mmap threshold fixed at 64 KiB (freed tensors leave the process, so
the resident set follows live bytes). "Loading" is the model built and wrapped in a frozen ZeRO-3
engine (zero3_utils.frozen_engine): what the loops hold before the first step. Each rank reports
its VmHWM during loading minus its VmRSS just before (the Python/torch/DeepSpeed runtime and the
process group), as a fraction of the full model's bytes.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SHAPE = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=20,
    num_attention_heads=16,
    num_key_value_heads=16,
    head_dim=64,
    tie_word_embeddings=False,
)
METHODS = {
    "full": "from_pretrained on every rank, then frozen_engine partitions (before)",
    "hf": "transformers' integration: HfDeepSpeedConfig alive during from_pretrained",
    "partitioned": "zero3_load.load_model (after)",
}


def ds_config():
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 2,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 3},
    }


def worker(method, path, dtype_name):
    """One rank: baseline, load, peak; rank 0 prints every rank's figures as one JSON line."""
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from memory import MemoryLedger
    from zero3_load import load_model
    from zero3_utils import frozen_config, frozen_engine

    deepspeed.init_distributed(dist_backend="gloo")
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    cfg = ds_config()
    cfg["bf16"] = {"enabled": dtype == torch.bfloat16}
    kw = dict(dtype=dtype, attn_implementation="sdpa")
    ledger = MemoryLedger("cpu")
    dist.barrier()
    base = ledger.current()
    ledger.reset_peak()
    t0 = time.time()
    if method == "full":
        model = AutoModelForCausalLM.from_pretrained(path, **kw)
    elif method == "hf":
        from transformers.integrations import HfDeepSpeedConfig

        keep = HfDeepSpeedConfig(frozen_config(cfg))  # noqa: F841  (alive while loading)
        model = AutoModelForCausalLM.from_pretrained(path, **kw)
    else:
        model = load_model(AutoModelForCausalLM, path, ds_config=frozen_config(cfg), **kw)
    engine = frozen_engine(model, cfg)
    seconds = time.time() - t0
    peak = ledger.peak() - base
    held = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in engine.module.parameters())
    row = torch.tensor([base, peak, held, seconds], dtype=torch.float64)
    rows = [torch.zeros_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps([r.tolist() for r in rows]), flush=True)
    dist.barrier()


def build(path, dtype_name):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    model = LlamaForCausalLM(LlamaConfig(**SHAPE)).to(dtype)
    model.save_pretrained(path)
    n = sum(p.numel() for p in model.parameters())
    return n, n * model.dtype.itemsize


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    p.add_argument("--path", default="", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a.worker, a.path, a.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model")
        numel, nbytes = build(path, a.dtype)
        print(f"model: {numel / 1e6:.0f}M parameters, {nbytes / 2**30:.2f} GiB in {a.dtype}")
        env = {
            **os.environ,
            "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "OMP_NUM_THREADS": "1",
            "MALLOC_MMAP_THRESHOLD_": "65536",
        }
        lines = [
            "| method | rank | peak above baseline (GiB) | x model bytes | shard held (GiB) | s |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for method in a.methods.split(","):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]
            cmd += ["--master_port=29533", os.path.abspath(__file__)]
            cmd += ["--worker", method, "--path", path, "--dtype", a.dtype]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
            result = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not result:
                sys.exit(f"{method} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
            for rank, (_, peak, held, seconds) in enumerate(json.loads(result[0][7:])):
                lines.append(
                    f"| {method}: {METHODS[method]} | {rank} | {peak / 2**30:.2f} | "
                    f"{peak / nbytes:.2f} | {held / 2**30:.2f} | {seconds:.0f} |"
                )
        print("\n".join(lines))


if __name__ == "__main__":
    main()

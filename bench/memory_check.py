"""Estimate vs measurement on CPU: estimate.estimate_memory against memory.MemoryLedger for a plain
fp32 forward/backward + AdamW step (ZeRO stage 0, one process), per phase, for the tiny default
config and a ~100M Llama, with and without gradient checkpointing.

    python bench/memory_check.py            # prints a Markdown table (docs/memory.md)

Each config runs in a fresh process with glibc's mmap threshold fixed at 64 KiB (freed tensors
leave the process, so the resident set follows live bytes). Measured = the phase's peak resident
set minus the resident set before the model was built (the Python/torch runtime), at step 2 (the
optimizer states exist from step 1's step on). Gradients are kept between steps (zero_grad to 0,
not None), as DeepSpeed keeps its gradient buffers.
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CONFIGS = {  # name: (Llama config, micro-batch sequences, tokens per sequence, completion tokens)
    "tiny default (h128 l2 V15), 32 x 7 tokens": (
        dict(
            vocab_size=15,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=64,
        ),
        32,
        7,
        2,
    ),
    "Llama h768 l8 V32000 (106M), 4 x 512 tokens": (
        dict(
            vocab_size=32000,
            hidden_size=768,
            intermediate_size=2048,
            num_hidden_layers=8,
            num_attention_heads=12,
            num_key_value_heads=12,
            head_dim=64,
        ),
        4,
        512,
        256,
    ),
}
PHASES = ("build", "old_logprobs", "update", "optimizer_step")


def child(spec):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from logprobs import model_logps
    from memory import MemoryLedger

    cfg, m, S, C, ckpt = spec["config"], spec["m"], spec["S"], spec["C"], spec["ckpt"]
    torch.manual_seed(0)
    ledger = MemoryLedger("cpu")
    base = ledger.current()
    with ledger.phase("build"):
        model = LlamaForCausalLM(LlamaConfig(**cfg, attn_implementation="sdpa"))
        if ckpt:
            model.gradient_checkpointing_enable()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(3, cfg["vocab_size"], (m, S))  # (B, T)
    mask = torch.ones_like(ids)  # (B, T)
    out = {}
    for _ in range(2):
        ledger.step_metrics()
        with ledger.phase("old_logprobs"), torch.no_grad():
            model_logps(model, ids, mask, C)  # (B, C)
        with ledger.phase("update"):
            model.train()
            model_logps(model, ids, mask, C).mean().backward()
        with ledger.phase("optimizer_step"):
            opt.step()
            opt.zero_grad(set_to_none=False)
        out = {k: ledger.step[k] - base for k in ledger.step}
    out["build"] = ledger.run["build"] - base
    print(json.dumps(out))


def main():
    from estimate import estimate_memory

    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="2")
    rows = [
        "| config | checkpointing | phase | estimate MiB | measured MiB | error |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    for name, (cfg, m, S, C) in CONFIGS.items():
        for ckpt in (False, True):
            spec = {"config": cfg, "m": m, "S": S, "C": C, "ckpt": ckpt}
            res = subprocess.run(
                [sys.executable, __file__, "--child", json.dumps(spec)],
                env=env,
                cwd=ROOT,
                capture_output=True,
                text=True,
                check=True,
            )
            measured = json.loads(res.stdout.strip().splitlines()[-1])
            est = estimate_memory(
                dict(cfg, model_type="llama"),
                world_size=1,
                zero_stage=0,
                dtype="fp32",
                gradient_checkpointing=ckpt,
                micro_batch_size=m,
                seq_len=S,
                completion_len=C,
            )
            p = est["pieces"]
            predicted = {"build": p["params"], **{k: est["phases"][k] for k in PHASES[1:]}}
            for k in PHASES:
                e, mm = predicted[k] / 2**20, measured[k] / 2**20
                rows.append(
                    f"| {name} | {ckpt} | {k} | {e:.1f} | {mm:.1f} | {(e - mm) / mm:+.0%} |"
                )
            print(rows[-1], file=sys.stderr, flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(json.loads(sys.argv[2]))
    else:
        main()

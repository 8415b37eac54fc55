"""The one-GPU scale run: 3 GRPO steps of grpo.py itself at the Qwen2.5 0.5B / 1.5B / 3B / 7B shapes
(random weights from shapes.PRESETS: no download), bf16, ZeRO-3 with the optimizer offloaded to
CPU, gradient checkpointing, HF generation, 8 generations x 1024 completion tokens; fused log-probs
(logprobs.py) and, for contrast, naive ones (full (B, C, V) logits + log_softmax,
bench/naive_grpo.py). Each run's ledger peaks per phase (metrics.jsonl `mem/<phase>`) go beside
estimate.py's prediction.

    python bench/scale.py --shapes qwen2.5-7b --impls fused     # one config per call (10 min)
    python bench/scale.py --shapes qwen2.5-7b --impls naive
    python bench/scale.py --table                               # docs/memory.md, results.jsonl
    python bench/scale.py --shapes tiny --completion_length 16 --steps 2   # CPU smoke test (fp32)

Results are appended to bench/out/scale/results.jsonl (one line per run: shape, impl, exit code,
steps done, seconds per step, measured and estimated GB per phase, the error line if any), so
several calls build one table. A run that runs out of memory is a result too: its exit code is 4
and the message names the phase. Models are built once under bench/out/scale/models/<shape>
(bf16 safetensors: 15 GB for the 7B shape) with the built-in task's char tokenizer; the model's
vocabulary is the real one, and sampled ids outside the tokenizer decode to nothing.
Optimizer offload uses torch's AdamW on the CPU partitions (`torch_adam`), so nothing is compiled;
`--cpu_adam` uses DeepSpeed's compiled CPU Adam instead (faster, needs a build toolchain).
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
OUT = os.path.join(ROOT, "bench", "out", "scale")
SHAPES = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b")
# `--shapes tiny`: the same pipeline in seconds on a CPU
TINY = dict(
    model_type="qwen2",
    vocab_size=4096,
    max_position_embeddings=2048,
    hidden_act="silu",
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    tie_word_embeddings=True,
)
PHASES = ("rollout", "update", "optimizer_step")


def build_model(shape, dtype, out):
    """A random-weight model of `shape` with the task's char tokenizer, saved once; returns its
    directory."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from shapes import PRESETS
    from tasks import TASK_CHARS
    from tiny_models import build_tokenizer

    path = os.path.join(out, "models", shape)
    if os.path.exists(os.path.join(path, "model.safetensors.index.json")) or os.path.exists(
        os.path.join(path, "model.safetensors")
    ):
        return path
    preset = dict(TINY if shape == "tiny" else PRESETS[shape])
    config = AutoConfig.for_model(**preset)
    tok = build_tokenizer(path, chars=TASK_CHARS)
    config.update(
        {
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
        }
    )
    torch.manual_seed(0)
    t = time.time()
    # initialising on the GPU is minutes faster
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path, max_shard_size="4GB")
    n = sum(p.numel() for p in model.parameters())
    print(
        f"built {shape}: {n / 1e9:.2f} B parameters in {time.time() - t:.0f}s -> {path}", flush=True
    )
    return path


def ds_config(args):
    """ZeRO-3, optimizer states (and with --offload_params the parameters too) in pinned CPU
    memory."""
    cfg = json.load(open(os.path.join(ROOT, "configs", "zero3_offload.json")))
    if not args.offload_params:
        del cfg["zero_optimization"]["offload_param"]
    cfg["optimizer"]["params"]["torch_adam"] = not args.cpu_adam
    path = os.path.join(
        args.out, f"zero3_offload_opt{'_params' if args.offload_params else ''}.json"
    )
    os.makedirs(args.out, exist_ok=True)
    json.dump(cfg, open(path, "w"), indent=1)
    return path, cfg


def grpo_args(args, model, ds, run_dir):
    return [
        "--model",
        model,
        "--ds_config",
        ds,
        "--run_dir",
        run_dir,
        "--dtype",
        args.dtype,
        "--gradient_checkpointing",
        "True",
        "--num_generations",
        "8",
        "--prompts_per_rank",
        "1",
        "--max_completion_length",
        str(args.completion_length),
        "--max_prompt_length",
        "256",
        "--per_device_train_batch_size",
        str(args.micro_batch_size),
        "--generation_batch_size",
        "8",
        "--gather_for_generation",
        str(not args.sharded_generation),
        "--max_steps",
        str(args.steps),
        "--num_eval_prompts",
        "0",
        "--save_model",
        "False",
        "--learning_rate",
        "1e-6",
    ]


def estimate(shape, args, cfg, impl):
    """estimate.py's predicted GB per phase for the same run."""
    import torch

    from estimate import estimate_memory
    from memory import GB
    from shapes import PRESETS

    cuda = torch.cuda.is_available()
    est = estimate_memory(
        dict(TINY if shape == "tiny" else PRESETS[shape]),
        world_size=1,
        zero_stage=3,
        offload_optimizer=True,
        offload_params=args.offload_params,
        dtype="bf16" if args.dtype in ("bf16", "auto") and cuda else "fp32",
        gradient_checkpointing=True,
        micro_batch_size=args.micro_batch_size,
        seq_len=8 + args.completion_length,
        completion_len=args.completion_length,
        num_generations=8,
        prompts_per_rank=1,
        fused_logprobs=impl == "fused",
        gather_for_generation=not args.sharded_generation,
        generation_batch_size=8,
        fused_adam=cuda and args.cpu_adam,
        device_gb=torch.cuda.get_device_properties(0).total_memory / GB if cuda else 80.0,
    )
    return {k: v / GB for k, v in est["phases"].items()}


def run(shape, impl, args):
    import torch

    bf16 = args.dtype == "bf16" or (args.dtype == "auto" and torch.cuda.is_available())
    model = build_model(shape, torch.bfloat16 if bf16 else torch.float32, args.out)
    ds, cfg = ds_config(args)
    run_dir = os.path.join(args.out, "runs", f"{shape}-{impl}")
    script = "grpo.py" if impl == "fused" else os.path.join("bench", "naive_grpo.py")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "1",
        "--master_port",
        str(args.master_port),
        script,
        *grpo_args(args, model, ds, run_dir),
    ]
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        os.remove(os.path.join(run_dir, "metrics.jsonl"))
    print(" ".join(cmd), flush=True)
    t = time.time()
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout
    )
    rows = []
    if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        rows = [
            r
            for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl")))
            if "reward" in r
        ]
    lines = (proc.stdout + "\n" + proc.stderr).splitlines()
    errors = [ln for ln in lines if "error:" in ln] or [
        ln for ln in lines if "Error" in ln and "ChildFailed" not in ln
    ]
    result = {
        "shape": shape,
        "impl": impl,
        "exit_code": proc.returncode,
        "steps": len(rows),
        "wall_s": round(time.time() - t, 1),
        "step_s": [round(r["step_s"], 1) for r in rows],
        "measured_gb": {
            p: max((r.get(f"mem/{p}", 0.0) for r in rows), default=None) for p in PHASES
        },
        "estimated_gb": {p: round(v, 2) for p, v in estimate(shape, args, cfg, impl).items()},
        "error": errors[-1][:300] if errors and proc.returncode else "",
        "command": " ".join(
            ["python", script, *grpo_args(args, "<model>", os.path.relpath(ds, ROOT), "<run_dir>")]
        ),
        "device": _device(),
    }
    with open(os.path.join(args.out, "results.jsonl"), "a") as f:
        f.write(json.dumps(result) + "\n")
    print(json.dumps(result, indent=1), flush=True)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")


def _device():
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def table(out):
    """The newest result per (shape, impl) as a Markdown table."""
    latest = {}
    for r in map(json.loads, open(os.path.join(out, "results.jsonl"))):
        latest[(r["shape"], r["impl"])] = r
    print(
        "| shape | log-probs | completed | s/step | "
        + " | ".join(f"{p} GB measured / est." for p in PHASES)
        + " | device |"
    )
    print("| --- | --- | --- | ---: | " + " | ".join("---:" for _ in PHASES) + " | --- |")
    for (shape, impl), r in sorted(
        latest.items(), key=lambda kv: (SHAPES + ("tiny",)).index(kv[0][0])
    ):
        done = "yes" if r["exit_code"] == 0 else f"no (exit {r['exit_code']}: {r['error'][:80]})"
        step_s = sorted(r["step_s"])[len(r["step_s"]) // 2] if r["step_s"] else float("nan")
        cells = [
            f"{r['measured_gb'][p]:.1f} / {r['estimated_gb'][p]:.1f}"
            if r["measured_gb"].get(p)
            else f"- / {r['estimated_gb'][p]:.1f}"
            for p in PHASES
        ]
        print(
            f"| {shape} | {impl} | {done} | {step_s:.1f} | "
            + " | ".join(cells)
            + f" | {r['device']} |"
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--shapes", default=",".join(SHAPES), help=f"comma-separated: {', '.join(SHAPES)}, tiny"
    )
    ap.add_argument("--impls", default="fused,naive", help="fused, naive or both")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--completion_length", type=int, default=1024)
    ap.add_argument(
        "--micro_batch_size",
        type=int,
        default=8,
        help="sequences per micro-batch (8: the whole step)",
    )
    ap.add_argument("--dtype", default="auto", help="auto: bf16 on GPU, fp32 on CPU")
    ap.add_argument("--offload_params", action="store_true", help="offload the parameters too")
    ap.add_argument(
        "--sharded_generation", action="store_true", help="generate layer by layer (ZeRO-3)"
    )
    ap.add_argument(
        "--cpu_adam", action="store_true", help="DeepSpeed's compiled CPU Adam, not torch's AdamW"
    )
    ap.add_argument("--master_port", type=int, default=29533)
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per run")
    ap.add_argument(
        "--table", action="store_true", help="print the table of results.jsonl and exit"
    )
    ap.add_argument("--out", default=OUT, help="models, runs and results.jsonl")
    args = ap.parse_args()
    if args.table:
        return table(args.out)
    for shape in args.shapes.split(","):
        if shape not in SHAPES + ("tiny",):
            raise SystemExit(f"--shapes {shape}: one of {SHAPES + ('tiny',)}")
        for impl in args.impls.split(","):
            if impl not in ("fused", "naive"):
                raise SystemExit("--impls: fused, naive")
            run(shape, impl, args)


if __name__ == "__main__":
    main()

"""The GPU tier: `bash test.sh --gpu` (tests/conftest.py keeps only these tests then). On a CUDA
device at the issue's shapes; with GPU_TIER_ON_CPU=1 on a CPU stand-in at small shapes; otherwise
each test skips with its reason. Results are printed as they come and summed up in
$GPU_TIER_OUT/gpu_tier.json and gpu_tier.md (gpu_tier.Summary; docs/gpu.md, "The GPU tier").

  a  bf16 parity on the device: ZeRO-3 partitioned vs a plain load (exact), the trainer's bf16
     log-probs vs an fp32 load's by position bucket (tests/gpu/dist_tier.py)
  b  the fused log-prob op (logprobs.fused_logps) against naive: values, gradients, peak memory
  c  both loops end to end through run.sh: one rank, --dtype auto, ZeRO-3, every ledger phase in
     metrics.jsonl; ZeRO-2, LoRA, gradient checkpointing; a checkpoint and --resume
  d  the estimate (fit.estimate_kwargs -> estimate.estimate_memory) against the ledger's phases
  e  the step benchmark: the update's tokens/s and MFU at ZeRO 0/2/3, HF generation's tokens/s
     (tests/gpu/dist_tier.py)
vLLM's GPU paths run only where vLLM's CUDA build is installed (a skip with its reason here).
"""

import importlib.util
import json
import math
import os
import time

import pytest
import torch
from gpu.gpu_tier import CUDA, DEVICE, Summary, build_shape, shapes

import conftest
from conftest import train_rows

S = shapes()
ROOT = conftest.ROOT
# the built-in task at a short, small run (one rank); the tests' args last win over these
SMALL = ["--dtype", "auto", "--prompts_per_rank", "2", "--num_generations", "4",
         "--per_device_train_batch_size", "4", "--num_eval_prompts", "0", "--eval_steps", "0",
         "--save_model", "False"]  # fmt: skip
STEPS = ["--max_steps", "2" if CUDA else "1"]


@pytest.fixture(scope="module")
def summary():
    return Summary()


# each test's check letter, for its wall-time row
CHECKS = {
    "test_parity_and_benchmark": "a",
    "test_fused_logprobs_against_naive": "b",
    "test_loops_end_to_end": "c",
    "test_estimate_against_the_ledger": "d",
}


@pytest.fixture(autouse=True)
def wall_time(request, summary):
    """Each test's wall time a row of gpu_tier.json (the runs a module fixture makes fall to the
    first test that asks for them), written whether the test passed or not."""
    t0 = time.perf_counter()
    yield
    name = request.node.name
    summary.add(CHECKS[name], f"{name} wall time", time.perf_counter() - t0, "s")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tier's models, random weights: Qwen2.5-0.5B and 1.5B shapes on CUDA, a tiny Qwen2 on
    the stand-in."""
    root = tmp_path_factory.mktemp("tier_models")
    return [build_shape(str(root / name), name) for name in S["models"]]


def run(summary, algo, name, *args, env=None):
    """`bash run.sh algo` on one rank into summary.dir/name; (run dir, output)."""
    run_dir = os.path.join(summary.dir, name)
    env = {"NPROC": "1", "RUN_DIR": run_dir, **(env or {})}
    out = conftest.run_sh(algo, *SMALL, *args, env=env)
    return run_dir, out


@pytest.fixture(scope="module")
def grpo_run(summary):
    """The default task through `bash run.sh grpo`, ZeRO-3, with a checkpoint at its last step."""
    return run(summary, "grpo", "grpo", *STEPS, "--save_steps", STEPS[1])


def ledger_phases(out):
    """The phases the run's ledger summed up at its end ("peak memory (...): ...; a 1.2, b 3.4")."""
    line = next(x for x in out.splitlines() if x.startswith("peak memory ("))
    return [p.strip().rsplit(" ", 1)[0] for p in line.split("; ", 1)[1].split(",")]


def check_run(summary, name, run_dir, out, steps):
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), rows
    phases = ledger_phases(out)
    assert {"rollout", "update"} <= set(phases), phases  # ppo's optimizer steps are in update
    for r in rows:  # every phase of the ledger, every step, measured
        assert all(r[f"mem/{p}"] > 0 for p in phases), (phases, r)
    summary.add("c", f"{name}: exit 0, ledger phases in metrics.jsonl", " ".join(phases))
    summary.add("c", f"{name}: tokens/s (last step)", float(rows[-1]["tokens_per_s"]), "tok/s")
    return rows


# ---- a and e: parity on the device and the step benchmark (one torchrun, first) ---------------
def test_parity_and_benchmark(summary, models):
    """Each check of the worker runs on its own: one that fails is a row of gpu_tier.json with
    its message (after its figures), the others still run; this test fails at the end with all."""
    proc = conftest.torchrun(
        os.path.join(ROOT, "tests", "gpu", "dist_tier.py"), S["T"], S["steps"], *models, nproc=1
    )
    rows = [json.loads(x[7:]) for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    for r in rows:
        summary.add(**r)
    by = {r["measure"].split(",")[0]: r["value"] for r in rows}
    failed = [f"{r['measure']}: {r['value']}" for r in rows if r["measure"].endswith(" failed")]
    assert not failed, failed
    # the same weights run the same computation; on a GPU the partitioned build's RoPE table is
    # the device's pow (within BUFFER_ULPS of the CPU's), and bf16 rounding shows it by position
    assert by["ZeRO-3 partitioned vs plain"] == [0.0, 0.0, 0.0] or CUDA, by
    assert max(by["ZeRO-3 partitioned vs plain"]) < 0.1, by
    from dist_parity import BUFFER_ULPS

    assert by["buffers"] <= (BUFFER_ULPS if CUDA else 0), by
    # bf16 against fp32: rounding, not a wrong position or weight (a rotary angle or a missing
    # weight puts whole nats between them)
    top = by["trainer bf16 vs fp32 log-probs"]
    assert all(0 < x < 1.0 for x in top), top
    bench = [r for r in rows if r["measure"].startswith(("update", "HF generation"))]
    assert len(bench) == len(models) * (3 * 2 + 2), [r["measure"] for r in bench]
    assert all(math.isfinite(r["value"]) and r["value"] > 0 for r in bench), bench


# ---- b: the fused log-prob op -------------------------------------------------------------------
def test_fused_logprobs_against_naive(summary):
    from logprobs import fused_logps
    from memory import GB, MemoryLedger

    N, H, V = S["N"], S["H"], S["V"]
    g = torch.Generator(device=DEVICE).manual_seed(0)
    hidden = torch.randn(N, H, generator=g, device=DEVICE).bfloat16()  # (N, H)
    weight = (torch.randn(V, H, generator=g, device=DEVICE) / H**0.5).bfloat16()  # (V, H)
    targets = torch.randint(0, V, (N,), generator=g, device=DEVICE)  # (N,)
    grad_out = torch.randn(N, generator=g, device=DEVICE)  # (N,) a random functional of logp
    ledger = MemoryLedger(DEVICE)

    def naive(h, w):
        logits = h @ w.T  # (N, V) bf16, as the model's lm_head
        return logits.float().log_softmax(-1).gather(-1, targets[:, None])[:, 0]  # (N,)

    out = {}
    for name, fn in (("fused", fused_logps), ("naive", naive)):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with ledger.phase(name):
            logp = fn(h, w) if name == "naive" else fn(h, w, targets)  # (N,) fp32
            gh, gw = torch.autograd.grad(logp, (h, w), grad_out)
        out[name] = (logp.detach(), gh, gw)
        del h, w, logp, gh, gw
    (lf, hf, wf), (ln, hn, wn) = out["fused"], out["naive"]
    d_val = (lf - ln).abs().max().item()
    d_h = ((hf.float() - hn.float()).abs().max() / hn.float().abs().max()).item()
    d_w = ((wf.float() - wn.float()).abs().max() / wn.float().abs().max()).item()
    shape = f"N={N} H={H} V={V} bf16"
    summary.add("b", f"fused vs naive log-probs max|d|, {shape}", d_val, "nats")
    summary.add("b", "fused vs naive grad max|d| / max|naive|, hidden", d_h)
    summary.add("b", "fused vs naive grad max|d| / max|naive|, lm_head weight", d_w)
    assert d_val < 2e-2 and d_h < 2e-2 and d_w < 2e-2, (d_val, d_h, d_w)
    what = "torch.cuda.max_memory_allocated" if CUDA else "peak RSS rise of this process (CPU)"
    fused, naive_ = ledger.rise["fused"], ledger.rise["naive"]
    summary.add("b", "peak memory, fused forward + backward", fused / GB, "GiB", what)
    summary.add("b", "peak memory, naive forward + backward", naive_ / GB, "GiB", what)
    # naive holds the (N, V) logits, their fp32 log_softmax and its gradient; fused one tile
    assert fused < naive_, (fused, naive_)
    liger(summary, hidden, weight, targets, ln)
    if CUDA:  # the runs after it start processes of their own on this GPU
        del hidden, weight, out, lf, hf, wf, ln, hn, wn
        torch.cuda.empty_cache()


def liger(summary, hidden, weight, targets, naive_logp):
    """Liger-Kernel's fused linear cross-entropy (a CUDA/Triton op) where it is installed: its
    summed loss against naive's -sum(logp), and its peak memory."""
    if not CUDA or importlib.util.find_spec("liger_kernel") is None:
        why = "no CUDA device" if not CUDA else "liger_kernel is not installed"
        summary.add("b", "Liger-Kernel fused linear cross-entropy", "skipped", "", why)
        return
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    from memory import GB, MemoryLedger

    ledger = MemoryLedger(DEVICE)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with ledger.phase("liger"):
        loss = LigerFusedLinearCrossEntropyLoss(reduction="sum")(w, h, targets)
        loss.backward()
    d = abs(loss.item() + naive_logp.sum().item()) / naive_logp.abs().sum().item()
    summary.add("b", "Liger-Kernel loss vs naive -sum(logp), relative", d)
    peak = ledger.rise["liger"] / GB
    summary.add("b", "peak memory, Liger-Kernel forward + backward", peak, "GiB")


# ---- c: both loops end to end ------------------------------------------------------------------
def test_loops_end_to_end(summary, grpo_run):
    steps = int(STEPS[1])
    run_dir, out = grpo_run
    check_run(summary, "grpo ZeRO-3", run_dir, out, steps)
    ppo_dir, out = run(summary, "ppo", "ppo", *STEPS)
    check_run(summary, "ppo ZeRO-3", ppo_dir, out, steps)
    # --resume from the grpo run's checkpoint at its last step, one step more
    out = conftest.run_sh("grpo", *SMALL, "--max_steps", str(steps + 1), "--resume", "True",
                          env={"NPROC": "1", "RUN_DIR": run_dir})  # fmt: skip
    assert f"step {steps + 1}/{steps + 1}" in out, out[-3000:]
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 2)), rows
    summary.add("c", "grpo --resume from the last checkpoint: steps in metrics.jsonl", len(rows))
    # ZeRO-2, LoRA and gradient checkpointing: one run of all three, one step (a launch costs
    # 35-50 s on a GPU, most of it start-up)
    args = ["--max_steps", "1", "--lora_r", "8", "--gradient_checkpointing", "True"]
    d, out = run(
        summary, "grpo", "grpo-zero2+lora+ckpt", *args, env={"DS_CONFIG": "configs/zero2.json"}
    )
    check_run(summary, "grpo zero2+lora+ckpt", d, out, 1)
    vllm(summary)


def vllm(summary):
    """vLLM's GPU paths (colocated sleep/wake, server mode, NCCL weight transfer) need its CUDA
    build: tests/test_gpu_paths.py and the e2e tests run them where it is installed."""
    try:
        from vllm.platforms import current_platform

        platform = current_platform.device_type
    except ImportError:
        platform = None
    if not CUDA or platform != "cuda":
        why = "no CUDA device" if not CUDA else f"vLLM's CUDA build is not installed ({platform})"
        summary.add("c", "vLLM GPU paths", "skipped", "", why)
        return
    d, out = run(summary, "grpo", "grpo-vllm", *STEPS, "--use_vllm", "True")
    check_run(summary, "grpo vLLM colocated (sleep/wake)", d, out, int(STEPS[1]))


# ---- d: the estimate against the ledger --------------------------------------------------------
def test_estimate_against_the_ledger(summary, grpo_run, models):
    from estimate import estimate_memory
    from fit import estimate_kwargs
    from grpo import memory_models, parse_args
    from memory import GB

    runs = [("built-in task", [], grpo_run)]  # the stand-in: the tiny task's run of c
    if CUDA:  # the Qwen2.5 shapes, random weights
        runs = []
        for m in models:
            name = os.path.basename(m)
            runs.append(
                (
                    name,
                    ["--model", m],
                    run(summary, "grpo", f"grpo-{name}", "--max_steps", "1", "--model", m),
                )
            )
    for name, model_args, (run_dir, _) in runs:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            peaks = [r for r in map(json.loads, f) if "mem/highest_phase" in r][-1]
        measured = {k.split("/")[-1]: v for k, v in peaks.items() if k.startswith("mem/run_peak/")}
        args = parse_args(["--ds_config", "configs/zero3.json", *SMALL, *model_args])
        predicted = estimate_memory(**estimate_kwargs(args, 1, memory_models(args)))["phases"]
        assert set(measured) <= set(predicted), (measured, predicted)  # every phase predicted
        note = "" if CUDA else "CPU: measured is the process RSS, ~0.5 GiB runtime included"
        for phase, gb in measured.items():
            p = predicted[phase] / GB
            summary.add(
                "d",
                f"{name} {phase}: predicted {p:.3f} GiB, measured {gb:.3f} GiB, error",
                (p - gb) / gb,
                "",
                note,
            )

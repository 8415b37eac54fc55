"""The GPU tier: `bash test.sh --gpu` (tests/conftest.py keeps only these tests then). On a CUDA
device at the issue's shapes; with GPU_TIER_ON_CPU=1 on a CPU stand-in at small shapes; otherwise
each test skips with its reason. Results are recorded as they come, the worker's too, in
$GPU_TIER_OUT/gpu_tier.json and gpu_tier.md (gpu_tier.Summary; docs/gpu.md, "The GPU tier"), so a
run cut short keeps what it gave. In the order a short loan needs them:

  a  bf16 parity on the device: ZeRO-3 partitioned vs a plain load (exact), the trainer's bf16
     log-probs vs an fp32 load's by position bucket (tests/gpu/dist_tier.py)
  e  the step benchmark: the update's tokens/s and MFU at ZeRO 0/2/3, HF generation's tokens/s
     (the same worker, right after a, alone on the device)
  b  the fused log-prob op (logprobs.fused_logps) against naive: values, gradients, peak memory
  c  both loops end to end through run.sh, one rank, --dtype auto, every ledger phase in
     metrics.jsonl: GRPO at the first model's shape (ZeRO-3, the pretrained recipe) with a
     checkpoint and --resume one step on; PPO (ZeRO-3) and GRPO with ZeRO-2, LoRA and gradient
     checkpointing on the built-in task
  d  the estimate (fit.estimate_kwargs -> estimate.estimate_memory) against the ledger's phases
     of every model's GRPO run (the first model's is c's)
  c  colocated vLLM (sleep/wake), last and alone, where vLLM's CUDA build is installed (a skip
     with its reason elsewhere)
The runs of c and d start together, one rank each (their start-up, most of a launch's time, is
CPU work and overlaps on a GPU node's cores): 4 run.sh launches on CUDA, 3 on the stand-in, and
c's --resume, started when the first GRPO run ends; 5 and 4 in all. Each launch's wall time is a
row of gpu_tier.json, as are each test's, the models' build and each of the worker's checks.
Budget by reading and CPU times: docs/gpu.md, "Time budget".
"""

import importlib.util
import json
import math
import os
import subprocess
import threading
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
# one step, no checkpoint (nothing resumes these runs; a 1.5B one would write ~20 GB)
ONE = ["--max_steps", "1", "--save_last", "False"]


def model_args(path):
    """A model of the tier's as `run.sh --model` runs it: the pretrained recipe (gradient
    checkpointing), answers of C tokens (the recipe's 256 on CUDA)."""
    return ["--model", path, "--recipe", "pretrained", "--max_completion_length", str(S["C"])]


@pytest.fixture(scope="module")
def summary():
    return Summary()


# each test's check letter, for its wall-time row
CHECKS = {
    "test_parity_and_benchmark": "a",
    "test_fused_logprobs_against_naive": "b",
    "test_loops_end_to_end": "c",
    "test_estimate_against_the_ledger": "d",
    "test_vllm_colocated": "c",
}


@pytest.fixture(autouse=True)
def wall_time(request, summary):
    """Each test's wall time a row of gpu_tier.json, written whether the test passed or not. A
    module fixture's work is not in it (pytest sets it up first): the models' build and each
    run.sh launch have rows of their own."""
    t0 = time.perf_counter()
    yield
    name = request.node.name
    summary.add(CHECKS[name], f"{name} wall time", time.perf_counter() - t0, "s")


@pytest.fixture(scope="module")
def models(tmp_path_factory, summary):
    """The tier's models, random weights: Qwen2.5-0.5B and 1.5B shapes on CUDA, a tiny Qwen2 on
    the stand-in."""
    root = tmp_path_factory.mktemp("tier_models")
    t0 = time.perf_counter()
    paths = [build_shape(str(root / name), name) for name in S["models"]]
    summary.add("a", "the tier's models built and saved: wall time", time.perf_counter() - t0, "s")
    return paths


def start(summary, check, name, algo, *args, env=None, run_dir=None):
    """`bash run.sh algo` on one rank into run_dir (default summary.dir/name) for check (its wall
    time's row), started: a dict of what the checks read. A thread drains its output as it comes
    (so no run blocks on a full pipe beside the others) and keeps it, its exit code and wall
    time."""
    run_dir = run_dir or os.path.join(summary.dir, name)
    env = {"NPROC": "1", "RUN_DIR": run_dir, **(env or {})}
    proc = conftest.run_sh(algo, *SMALL, *args, env=env, wait=False)
    launch = dict(check=check, name=name, dir=run_dir, args=list(args), t0=time.perf_counter())

    def drain():
        try:
            out = proc.communicate(timeout=900)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            out = proc.communicate()[0] + "\n(killed after 900 s)"
        launch.update(out=out, rc=proc.returncode, s=time.perf_counter() - launch["t0"])

    launch["thread"] = threading.Thread(target=drain)
    launch["thread"].start()
    return launch


def wait(summary, *launches):
    """The launches to their end: each one's wall time a row; its training rows and the ledger's
    run peaks read now, before a later run in its directory (--resume) adds to them."""
    for x in launches:
        x["thread"].join()
        summary.add(x["check"], f"run.sh {x['name']}: wall time", x["s"], "s")
        ran = os.path.exists(os.path.join(x["dir"], "metrics.jsonl"))
        x["rows"], x["peaks"] = (train_rows(x["dir"]), run_peaks(x["dir"])) if ran else ([], None)
    return launches


def finished(launch):
    """The launch's output; the test fails with its tail unless run.sh exited 0."""
    if launch["rc"] != 0:
        pytest.fail(f"run.sh {launch['name']} exited {launch['rc']}\n{launch['out'][-8000:]}")
    return launch["out"]


def run_peaks(run_dir):
    """The ledger's peak per phase (GiB) that the run wrote at its end ("mem/run_peak/<phase>"),
    None without one."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        peaks = [r for r in map(json.loads, f) if "mem/highest_phase" in r]
    if not peaks:
        return None
    return {k.split("/")[-1]: v for k, v in peaks[-1].items() if k.startswith("mem/run_peak/")}


def each(summary, check, parts):
    """(name, fn) parts one after another: one that fails is a row "<name> failed" with its
    message and the next still runs; the test fails at the end with all of them."""
    failed = []
    for name, fn in parts:
        try:
            fn()
        except (Exception, pytest.fail.Exception) as e:  # noqa: BLE001 - reported, then the next
            msg = str(e)  # its first line and its end, where a run's error is
            msg = msg if len(msg) <= 2000 else f"{msg[:200]} ... {msg[-1800:]}"
            summary.add(check, f"{name} failed", msg)
            failed.append(name)
    assert not failed, failed


def ledger_phases(out):
    """The phases the run's ledger summed up at its end ("peak memory (...): ...; a 1.2, b 3.4")."""
    line = next(x for x in out.splitlines() if x.startswith("peak memory ("))
    return [p.strip().rsplit(" ", 1)[0] for p in line.split("; ", 1)[1].split(",")]


def check_run(summary, name, launch, steps):
    out = finished(launch)
    rows = launch["rows"]
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), rows
    phases = ledger_phases(out)
    assert {"rollout", "update"} <= set(phases), phases  # ppo's optimizer steps are in update
    for r in rows:  # every phase of the ledger, every step, measured
        assert all(r[f"mem/{p}"] > 0 for p in phases), (phases, r)
    summary.add("c", f"{name}: exit 0, ledger phases in metrics.jsonl", " ".join(phases))
    note = "beside the other runs of c and d" if launch["name"] != "grpo-vllm" else ""
    summary.add(
        "c", f"{name}: tokens/s (last step)", float(rows[-1]["tokens_per_s"]), "tok/s", note
    )
    return rows


# ---- a and e: parity on the device and the step benchmark (one torchrun, first) ---------------
def test_parity_and_benchmark(summary, models):
    """Each check of the worker runs on its own: one that fails is a row of gpu_tier.json with
    its message (after its figures), the others still run; this test fails at the end with all.
    Each result is recorded as the worker prints it."""
    rows = []

    def on_line(line):
        if line.startswith("RESULT "):
            rows.append(json.loads(line[7:]))
            summary.add(**rows[-1])

    script = os.path.join(ROOT, "tests", "gpu", "dist_tier.py")
    conftest.torchrun(script, S["T"], S["steps"], *models, nproc=1, on_line=on_line)
    by = results(rows)
    failed = [f"{m}: {v}" for m, v in by.items() if m.endswith(" failed")]
    assert not failed, failed
    # the same weights run the same computation; on a GPU the partitioned build's RoPE table is
    # the device's pow (within BUFFER_ULPS of the CPU's), and bf16 rounding shows it by position
    partitioned = one(by, "ZeRO-3 partitioned vs plain, bf16, max|d|")
    assert partitioned == [0.0, 0.0, 0.0] or CUDA, partitioned
    assert max(partitioned) < 0.1, partitioned
    from dist_parity import BUFFER_ULPS

    ulps = one(by, "buffers, ZeRO-3 partitioned vs plain")
    assert ulps <= (BUFFER_ULPS if CUDA else 0), ulps
    # bf16 against fp32: rounding, not a wrong position or weight (a rotary angle or a missing
    # weight puts whole nats between them); the bound is on the largest difference, each bucket
    top = one(by, "trainer bf16 vs fp32 log-probs max|d|,")
    assert all(0 < x < 1.0 for x in top), top
    assert all(m < x for m, x in zip(one(by, "trainer bf16 vs fp32 log-probs mean|d|,"), top))
    bench = [r for r in rows if r["measure"].startswith(("update", "HF generation"))]
    assert len(bench) == len(models) * (3 * 2 + 2), [r["measure"] for r in bench]
    assert all(math.isfinite(r["value"]) and r["value"] > 0 for r in bench), bench
    # what the loops run: at ZeRO-0 on one rank no backward all-reduce (harness.Run.train_engine)
    for r in bench:
        if r["measure"].startswith("update"):
            zero0 = ", ZeRO-0," in r["measure"]
            assert r["note"].endswith(f"all-reduce {'off' if zero0 else 'on'}"), r


def results(rows):
    """The worker's RESULT rows as {measure: value}, every measure once (one printed twice would
    hide the other's figure)."""
    by = {}
    for r in rows:
        assert r["measure"] not in by, f"the worker printed {r['measure']!r} twice"
        by[r["measure"]] = r["value"]
    return by


def one(by, start):
    """The value of the one measure of results() that begins with `start`: none, or several (the
    maximum and the mean of one comparison), is a wrong key, and fails."""
    hits = [m for m in by if m.startswith(start)]
    assert len(hits) == 1, f"{start!r} begins {len(hits)} of the worker's measures: {hits}"
    return by[hits[0]]


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


# ---- c and d: the runs, started together ----------------------------------------------------
@pytest.fixture(scope="module")
def launches(summary, models):
    """c's and d's runs, started at once: GRPO at each model's shape (ZeRO-3; the first model's
    with a checkpoint at its step, and when it ends its --resume one step on; the others d's
    alone), PPO and GRPO with ZeRO-2, LoRA and gradient checkpointing on the built-in task;
    waited for. {name: launch}."""
    first, *rest = models
    zero2 = {"DS_CONFIG": "configs/zero2.json"}
    grpo = start(summary, "c", "grpo", "grpo", "--max_steps", "1", "--save_steps", "1",
                 *model_args(first))  # fmt: skip
    others = [
        start(summary, "c", "ppo", "ppo", *ONE),
        start(summary, "c", "grpo-zero2+lora+ckpt", "grpo", *ONE, "--lora_r", "8",
              "--gradient_checkpointing", "True", env=zero2),
    ]  # fmt: skip
    for m in rest:
        others.append(
            start(summary, "d", f"grpo-{os.path.basename(m)}", "grpo", *ONE, *model_args(m))
        )
    wait(summary, grpo)
    if grpo["rc"] == 0:  # beside the others still running
        args = ["--max_steps", "2", "--resume", "True", "--save_last", "False", *model_args(first)]
        others.append(start(summary, "c", "grpo-resume", "grpo", *args, run_dir=grpo["dir"]))
    return {x["name"]: x for x in [grpo, *wait(summary, *others)]}


# ---- c: both loops end to end ------------------------------------------------------------------
def test_loops_end_to_end(summary, launches):
    grpo = launches["grpo"]

    def resume():  # from the grpo run's checkpoint at its step, one step more
        finished(grpo)
        resumed = launches["grpo-resume"]
        out = finished(resumed)
        assert "step 2/2" in out, out[-3000:]
        rows = resumed["rows"]
        assert [r["step"] for r in rows] == [1, 2], rows
        what = "grpo --resume from the last checkpoint: steps in metrics.jsonl"
        summary.add("c", what, len(rows))

    variants = launches["grpo-zero2+lora+ckpt"]
    each(summary, "c", [
        ("grpo ZeRO-3", lambda: check_run(summary, "grpo ZeRO-3", grpo, 1)),
        ("ppo ZeRO-3", lambda: check_run(summary, "ppo ZeRO-3", launches["ppo"], 1)),
        ("grpo zero2+lora+ckpt", lambda: check_run(summary, "grpo zero2+lora+ckpt", variants, 1)),
        ("grpo --resume", resume),
    ])  # fmt: skip


# ---- d: the estimate against the ledger --------------------------------------------------------
def test_estimate_against_the_ledger(summary, launches, models):
    from estimate import estimate_memory
    from fit import estimate_kwargs
    from grpo import memory_models, parse_args
    from memory import GB

    def estimate(name, launch):
        finished(launch)
        measured = launch["peaks"]  # read before c's --resume added to the first run's metrics
        assert measured, f"run.sh {launch['name']} wrote no mem/run_peak row"
        args = parse_args(["--ds_config", "configs/zero3.json", *SMALL, *launch["args"]])
        predicted = estimate_memory(**estimate_kwargs(args, 1, memory_models(args)))["phases"]
        assert set(measured) <= set(predicted), (measured, predicted)  # every phase predicted
        note = "" if CUDA else "CPU: measured is the process RSS, ~0.5 GiB runtime included"
        for phase, gb in measured.items():
            p = predicted[phase] / GB
            what = f"{name} {phase}: predicted {p:.3f} GiB, measured {gb:.3f} GiB, error"
            summary.add("d", what, (p - gb) / gb, "", note)

    names = [os.path.basename(m) for m in models]
    runs = [launches["grpo"]] + [launches[f"grpo-{n}"] for n in names[1:]]
    each(summary, "d", [(n, lambda n=n, x=x: estimate(n, x)) for n, x in zip(names, runs)])


# ---- c, last: colocated vLLM -------------------------------------------------------------------
def test_vllm_colocated(summary):
    """vLLM's GPU paths (colocated sleep/wake) need its CUDA build: tests/test_gpu_paths.py and
    the e2e tests run them where it is installed. Last and alone: vLLM takes a share of the
    device's memory. Two steps: the second wakes the engine the first put to sleep."""
    try:
        from vllm.platforms import current_platform

        platform = current_platform.device_type
    except ImportError:
        platform = None
    if not CUDA or platform != "cuda":
        why = "no CUDA device" if not CUDA else f"vLLM's CUDA build is not installed ({platform})"
        summary.add("c", "vLLM GPU paths", "skipped", "", why)
        pytest.skip(why)
    args = ["--max_steps", "2", "--save_last", "False", "--use_vllm", "True"]
    x = wait(summary, start(summary, "c", "grpo-vllm", "grpo", *args))[0]
    check_run(summary, "grpo vLLM colocated (sleep/wake)", x, 2)

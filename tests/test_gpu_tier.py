"""The GPU tier (tests/gpu, `bash test.sh --gpu`) within the suite: no CUDA device and no switch,
each of its tests skips with its reason; with GPU_TIER_ON_CPU=1 it runs to the end on the CPU
stand-in and writes its summary (gpu_tier.json, gpu_tier.md) with every check's figures."""

import json
import os
import subprocess
import sys

from conftest import ROOT


def tier(out_dir, on_cpu, path="tests/gpu", **extra):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "GPU_TIER_OUT": str(out_dir), **extra}
    env.pop("GPU_TIER_ON_CPU", None)
    if on_cpu:
        env["GPU_TIER_ON_CPU"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        path,
        "--gpu",
        "-q",
        "-rs",
        "-p",
        "no:cacheprovider",
    ]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def test_tier_skips_without_a_device_and_runs_on_the_cpu_stand_in(tmp_path):
    # as test.sh runs it (all of tests/) on a node without vLLM or `datasets`: the suite's other
    # files are not imported (test_data.py's `import datasets` once stopped the tier there)
    lacking = tmp_path / "lacking"
    lacking.mkdir()
    for name in ("datasets", "vllm"):
        (lacking / f"{name}.py").write_text(f"raise ImportError('no {name} on this node')\n")
    path = os.pathsep.join([str(lacking), os.environ.get("PYTHONPATH", "")])
    proc = tier(tmp_path / "off", on_cpu=False, path="tests", PYTHONPATH=path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "5 skipped" in proc.stdout and "no CUDA device" in proc.stdout, proc.stdout[-3000:]
    assert not (tmp_path / "off" / "gpu_tier.json").exists()

    proc = tier(tmp_path / "on", on_cpu=True)
    assert proc.returncode == 0 and "4 passed, 1 skipped" in proc.stdout, proc.stdout[-6000:]
    with open(tmp_path / "on" / "gpu_tier.json") as f:
        summary = json.load(f)
    assert summary["mode"] == "cpu stand-in" and "CPU" in summary["device"], summary
    rows = summary["results"]
    assert {r["check"] for r in rows} == set("abcde"), rows
    measures = " | ".join(r["measure"] for r in rows)
    for part in (
        "ZeRO-3 partitioned vs plain, bf16, max|d| by position",
        "buffers, ZeRO-3 partitioned vs plain: largest difference",
        "parity wall time",
        "benchmark tiny wall time",
        "test_parity_and_benchmark wall time",
        "test_loops_end_to_end wall time",
        "test_estimate_against_the_ledger wall time",
        "trainer bf16 vs fp32 log-probs max|d|, by position 0-128/128-512/512-640",
        "fused vs naive log-probs",
        "peak memory, naive",
        "grpo ZeRO-3: exit 0",
        "ppo ZeRO-3: exit 0",
        "grpo --resume",
        "grpo zero2+lora+ckpt: exit 0",
        "update MFU, ZeRO-0",
        "update MFU, ZeRO-2",
        "update MFU, ZeRO-3",
        "HF generation tokens/s, ZeRO-3 gathered",
        "HF generation tokens/s, ZeRO-3 sharded",
        "tiny update: predicted",
        "vLLM GPU paths",
    ):
        assert part in measures, (part, measures)
    # what a short loan needs most comes first: the worker's parity and benchmark, then b
    checks = [r["check"] for r in rows]
    assert checks.index("b") > max(i for i, c in enumerate(checks) if c in "ae"), checks
    assert min(checks.index("c"), checks.index("d")) > checks.index("b"), checks
    # the run.sh launches, each one's wall time a row: c's and d's runs started together, then
    # c's --resume (the stand-in has one model: its GRPO run is both c's and d's)
    launches = [m for m in measures.split(" | ") if m.startswith("run.sh ")]
    assert launches == [
        "run.sh grpo: wall time",
        "run.sh ppo: wall time",
        "run.sh grpo-zero2+lora+ckpt: wall time",
        "run.sh grpo-resume: wall time",
    ], launches
    with open(tmp_path / "on" / "gpu_tier.md") as f:
        table = f.read()
    assert "| check | measure | value | note |" in table and "not a GPU's" in table, table
    assert table.count("\n| ") == len(rows) + 1, table  # a row per result under the header


def test_tier_worker_checks_are_independent(tmp_path):
    """tests/gpu/dist_tier.py with a second model that does not load: its benchmark is a row
    "... failed" with the error, and the parity and the first model's benchmark still give every
    figure; each check's wall time is a row. (CPU stand-in, the tiny model, T 640.)"""
    from gpu.test_tier import one, results

    from conftest import torchrun
    from tiny_models import build_family

    good = build_family(str(tmp_path / "tiny"), "qwen2")
    missing = str(tmp_path / "no-such-model")
    script = os.path.join(ROOT, "tests", "gpu", "dist_tier.py")
    proc = torchrun(script, 640, 1, good, missing, nproc=1, env={"GPU_TIER_ON_CPU": "1"})
    rows = [json.loads(x[7:]) for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    measures = [r["measure"] for r in rows]
    failed = [r for r in rows if r["measure"].endswith(" failed")]
    assert [r["measure"] for r in failed] == ["benchmark no-such-model failed"], measures
    assert "no-such-model" in failed[0]["value"], failed
    parts = ["ZeRO-3 partitioned vs plain, bf16", "buffers, ZeRO-3 partitioned vs plain"]
    parts += ["trainer bf16 vs fp32", "update MFU, ZeRO-3, tiny", "HF generation tokens/s"]
    for part in parts:
        assert any(m.startswith(part) or part in m for m in measures), (part, measures)
    walls = [m for m in measures if m.endswith(" wall time")]
    assert walls == [
        "parity wall time",
        "benchmark tiny wall time",
        "benchmark no-such-model wall time",
    ]
    # the tier's parser over the worker's own rows: each measure once, the maximum and the mean
    # of bf16 vs fp32 apart, the ZeRO-0 rows the loops' engine (no backward all-reduce)
    by = results(rows)
    top = one(by, "trainer bf16 vs fp32 log-probs max|d|,")
    mean = one(by, "trainer bf16 vs fp32 log-probs mean|d|,")
    assert all(0 < m < x for m, x in zip(mean, top)), (mean, top)
    update = [r for r in rows if r["measure"].startswith("update")]
    assert len(update) == 3 * 2, update  # tokens/s and MFU at ZeRO 0, 2 and 3
    for r in update:
        stage = r["measure"].split(", ")[1]
        assert r["note"].endswith(f"all-reduce {'off' if stage == 'ZeRO-0' else 'on'}"), r


def test_the_tiers_parser_keeps_every_figure_and_names_one():
    """tests/gpu/test_tier.py reads the worker's rows by measure: a measure printed twice fails,
    and so does a key that begins several measures (once the maximum of bf16 vs fp32 and then
    its mean shared one key, and the bound on the maximum checked the mean)."""
    import pytest
    from gpu.test_tier import one, results

    names = "0-128/128-512/512-640"
    rows = [
        dict(measure=f"trainer bf16 vs fp32 log-probs max|d|, by position {names}", value=[3.0]),
        dict(measure=f"trainer bf16 vs fp32 log-probs mean|d|, by position {names}", value=[0.1]),
        dict(measure="buffers, ZeRO-3 partitioned vs plain: largest difference", value=0),
    ]
    by = results(rows)
    assert one(by, "trainer bf16 vs fp32 log-probs max|d|,") == [3.0]
    assert one(by, "trainer bf16 vs fp32 log-probs mean|d|,") == [0.1]
    assert one(by, "buffers") == 0
    with pytest.raises(AssertionError, match="begins 2 of the worker's measures"):
        one(by, "trainer bf16 vs fp32 log-probs")
    with pytest.raises(AssertionError, match="begins 0"):
        one(by, "trainer bf16 vs fp32 log-probs, max")
    with pytest.raises(AssertionError, match="printed 'buffers, ZeRO-3 .*' twice"):
        results(rows + rows[-1:])


# What the tier's processes import, as docs/gpu.md lists it ("What a GPU node needs"): these
# distributions and what they require (their metadata's dependencies, followed down)
TIER_NEEDS = ["torch", "transformers", "tokenizers", "huggingface_hub", "safetensors", "accelerate",
              "peft", "deepspeed", "hjson", "pydantic", "pydantic_core", "msgpack", "einops",
              "psutil", "pytest", "matplotlib", "numpy"]  # fmt: skip
# imported only where installed (torch's triton, transformers' sentencepiece/protobuf probes, the
# "google" namespace they share), never required
OPTIONAL = {"triton", "dill", "protobuf", "googleapis-common-protos", "sentencepiece", "sniffio"}


def test_what_the_tier_imports_is_what_docs_gpu_lists():
    """A fresh interpreter imports what the tier's processes import (the loops, the worker
    tests/gpu/dist_tier.py, the tier's tests and conftest, peft for LoRA, matplotlib for the
    curves): every distribution it loads is one of TIER_NEEDS or what they require, never vLLM,
    datasets or wandb; every one of TIER_NEEDS is loaded."""
    import importlib.metadata as md
    import re

    code = (
        "import importlib.metadata as md, json, os, sys\n"
        "sys.path[:0] = [os.getcwd(), 'tests', os.path.join('tests', 'gpu')]\n"
        "import grpo, ppo, dist_tier, gpu_tier, conftest, test_tier, peft, matplotlib.pyplot\n"
        "dists = md.packages_distributions()\n"
        "tops = {m.split('.')[0] for m in sys.modules}\n"
        "print(json.dumps(sorted({d for t in tops for d in dists.get(t, [])})))"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported = json.loads(proc.stdout.strip().splitlines()[-1])

    def norm(name):
        return re.sub(r"[-_.]+", "-", name).lower()

    allowed, todo = set(), list(TIER_NEEDS)
    while todo:  # the closure of TIER_NEEDS under their requirements (extras left out)
        name = todo.pop()
        if norm(name) in allowed:
            continue
        allowed.add(norm(name))
        try:
            reqs = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        todo += [re.split(r"[ <>=!~;\[(]", r.strip())[0] for r in reqs if "extra ==" not in r]
    found = {norm(d) for d in imported}
    assert not {"vllm", "datasets", "wandb"} & found, found
    assert {norm(d) for d in TIER_NEEDS} <= found, sorted(found)
    unlisted = found - allowed - {norm(d) for d in OPTIONAL}
    assert not unlisted, f"the tier imports {sorted(unlisted)}: add them to docs/gpu.md"

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
    assert "4 skipped" in proc.stdout and "no CUDA device" in proc.stdout, proc.stdout[-3000:]
    assert not (tmp_path / "off" / "gpu_tier.json").exists()

    proc = tier(tmp_path / "on", on_cpu=True)
    assert proc.returncode == 0 and "4 passed" in proc.stdout, proc.stdout[-6000:]
    with open(tmp_path / "on" / "gpu_tier.json") as f:
        summary = json.load(f)
    assert summary["mode"] == "cpu stand-in" and "CPU" in summary["device"], summary
    rows = summary["results"]
    assert {r["check"] for r in rows} == set("abcde"), rows
    measures = " | ".join(r["measure"] for r in rows)
    for part in (
        "ZeRO-3 partitioned vs plain",
        "trainer bf16 vs fp32 log-probs, max|d| by position 0-128/128-512/512-640",
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
        "built-in task update: predicted",
    ):
        assert part in measures, (part, measures)
    with open(tmp_path / "on" / "gpu_tier.md") as f:
        table = f.read()
    assert "| check | measure | value | note |" in table and "not a GPU's" in table, table
    assert table.count("\n| ") == len(rows) + 1, table  # a row per result under the header

"""bench/scale.py (the one-GPU scale run) end to end at a tiny shape on CPU: grpo.py and
bench/naive_grpo.py each run 2 steps under ZeRO-3 with the optimizer offloaded (torch AdamW on the
CPU partitions), the results line has the ledger's peaks and the estimate, and both log-prob paths
score the same samples alike. A random model earns reward 0, so the gradient norm is exactly 0: that
step once broke metrics.jsonl under offload (DeepSpeed then returns the norm as a 0-d tensor)."""

import json
import os
import subprocess
import sys

from conftest import ROOT, free_port


def test_scale_bench_tiny_offload_fused_and_naive(tmp_path):
    cmd = [
        sys.executable,
        os.path.join("bench", "scale.py"),
        "--shapes",
        "tiny",
        "--completion_length",
        "8",
        "--steps",
        "2",
        "--out",
        str(tmp_path),
        "--master_port",
        str(free_port()),
    ]
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = {r["impl"]: r for r in map(json.loads, open(tmp_path / "results.jsonl"))}
    assert set(results) == {"fused", "naive"}
    for r in results.values():
        assert r["exit_code"] == 0 and r["steps"] == 2, r
        assert r["measured_gb"]["update"] > 0 and r["estimated_gb"]["update"] > 0, r
    first = {
        impl: json.loads(open(tmp_path / "runs" / f"tiny-{impl}" / "metrics.jsonl").readline())
        for impl in results
    }
    assert first["fused"]["grad_norm"] == 0.0  # the case that once crashed
    assert abs(first["fused"]["entropy"] - first["naive"]["entropy"]) < 1e-4
    table = subprocess.run(
        [sys.executable, os.path.join("bench", "scale.py"), "--table", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "| tiny | fused | yes |" in table and "| tiny | naive | yes |" in table, table

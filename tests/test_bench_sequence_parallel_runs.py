"""bench/sequence_parallel_runs.py: its comparison of two runs' metrics and one short memory
measurement per sequence-parallel size (the bench's own worker, under torchrun)."""

import json
import os
import sys

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import sequence_parallel_runs as bench  # noqa: E402


def test_worst_difference_skips_seconds_and_memory(tmp_path):
    rows = [{"step": 1, "loss": 2.0, "step_s": 1.0, "mem/update": 3.0, "time/x": 1.0}]
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(json.dumps(rows[0]) + "\n")
    b.write_text(json.dumps({**rows[0], "loss": 2.002, "step_s": 9.0, "mem/update": 9.0}) + "\n")
    assert abs(bench.worst_difference(a, b) - 1e-3) < 1e-12


def test_one_short_update_per_size(tmp_path):
    one = bench.run_one(1, 256, 2, str(tmp_path))
    two = bench.run_one(2, 256, 2, str(tmp_path))
    assert one > 0 and two > 0

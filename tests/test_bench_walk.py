"""bench/walk.py: the reader's walk from a loop's main. Its walk and its count of moves against a
call tree written out by hand, then one real GRPO step under the profiler (one process, ~15 s)."""

import json
import os
import subprocess
import sys

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import walk  # noqa: E402


def test_walk_reads_each_function_once_and_counts_file_changes():
    children = {
        "a.main": ["b.f", "a.g", "b.f"],  # b.f a second time: read already, not a stop
        "b.f": ["c.h", "b.k"],
        "a.g": ["b.k", "a.m"],  # b.k read under b.f
    }
    order = walk.walk(children, "a.main")
    assert order == [(0, "a.main"), (1, "b.f"), (2, "c.h"), (2, "b.k"), (1, "a.g"), (2, "a.m")]
    # a -> b, b -> c, c -> b (same depth: not back up), b -> a (shallower: back up)
    assert walk.moves(order) == (4, 1)
    assert walk.moves([(0, "a.x")]) == (0, 0)
    # a -> b, b -> c, c -> b under main's call of b.f; b -> a into a.g; a.m stays in a
    assert walk.moves_by_call(order) == {"b.f": 3, "a.g": 1}


def test_walk_of_a_real_grpo_step(tmp_path):
    out = subprocess.run(
        [sys.executable, "bench/walk.py", "--loop", "grpo", "--out_dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "grpo.json").read_text())
    stops = [line.strip() for line in report["walk"]]
    assert stops[0] == "grpo.main" and len(stops) == len(set(stops)) == report["stops"]
    # the algorithm is read on the way: the loss, the update, the training loop
    assert {"grpo.grpo_loss", "grpo.update", "harness.Run.steps"} <= set(stops)
    depth = [(len(line) - len(line.lstrip())) // 2 for line in report["walk"]]
    assert (report["moves"], report["moves_back_up"]) == walk.moves(list(zip(depth, stops)))
    assert report["stops_before_the_loop"] == stops.index("harness.Run.steps")
    files = {s.split(".")[0] for s in stops}
    assert report["files"] == len(files) and sorted(files) == report["file_list"]
    assert f"{report['moves']} moves between files" in out.stdout
    # every move is under one of main's calls; the pre-flight's under Run's
    assert sum(report["moves_by_call"].values()) == report["moves"]
    assert set(report["moves_by_call"]) <= {s.strip() for s in report["walk"] if s[:2] == "  "}
    assert report["moves_by_call"]["harness.Run.__init__"] > 0

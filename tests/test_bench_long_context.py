"""bench/long_context.py: its measurement at a small size (every mode runs, the same loss with each
knob: offload's bit for bit) and one cell of its estimated table against the estimate itself."""

import json
import os
import subprocess
import sys

from conftest import ROOT

sys.path.append(os.path.join(ROOT, "bench"))  # after the project: bench has a generation.py
import long_context  # noqa: E402


def test_quick_run_measures_every_mode_with_the_same_loss(tmp_path):
    out = tmp_path / "out.json"
    cmd = [sys.executable, "bench/long_context.py", "--quick", "--out", str(out)]
    cmd += ["--model_dir", str(tmp_path / "model")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == set(long_context.MODES)
    base = results["checkpointing"]
    assert results["offload"]["loss"] == base["loss"]  # the same arithmetic
    for r in results.values():
        assert abs(r["loss"] - base["loss"]) <= 1e-6 * abs(base["loss"])
        assert r["peak_mib"] > 0 and r["device_saved_mib"] > 0 and r["predicted_mib"] > 0


def test_a_table_cell_is_the_longest_that_fits():
    from estimate import estimate_memory
    from fit import HIGH_WATER
    from memory import GB

    tokens, sp = long_context.longest_completion("qwen2.5-7b", 8, {"activation_offload": True})
    assert sp == 1 and tokens % 1024 == 0 and 8192 <= tokens < long_context.CAP

    def top(c):
        kw = dict(world_size=8, micro_batch_size=1, gradient_checkpointing=True, fused_adam=True)
        kw.update(vllm_server=True, prompts_per_rank=1, activation_offload=True)
        est = estimate_memory("qwen2.5-7b", seq_len=512 + c, completion_len=c, **kw)
        return max(est["phases"].values())

    assert top(tokens) <= HIGH_WATER * 80 * GB < top(tokens + 1024)
    _, sp = long_context.longest_completion("qwen2.5-7b", 8, {"sp": True})
    assert sp == 4  # 28 query heads: 8 does not divide them

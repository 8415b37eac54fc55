"""guard.py: non-finite steps are counted and a streak stops the run (exit 3); on 2 real ranks
DeepSpeed skips such a step on both and the guard sees it (dist_nan_guard.py)."""

import os

import pytest

from conftest import ROOT, torchrun
from exits import EXIT_DIVERGED, RunError
from guard import StepGuard


def test_step_guard_counts_skips_and_stops_after_a_few_in_a_row():
    guard = StepGuard(max_bad_steps=3)
    guard.update(1, float("nan"), float("nan"), skipped=True)
    guard.update(2, 0.5, 1.0, skipped=False)  # a good step resets the streak
    guard.update(3, float("inf"), float("inf"), skipped=True)
    guard.update(4, float("nan"), None, skipped=True)
    assert guard.skipped == 3
    with pytest.raises(RunError, match="3 steps in a row") as e:
        guard.update(5, float("nan"), float("nan"), skipped=True)
    assert e.value.exit_code == EXIT_DIVERGED
    # never go on with possibly-NaN weights
    with pytest.raises(RunError, match="applied the update anyway"):
        StepGuard().update(1, float("nan"), 1.0, skipped=False)


def test_non_finite_steps_are_skipped_on_every_rank_and_a_streak_stops(tiny_model):
    """Real DeepSpeed ZeRO-2 and ZeRO-3 (AdamW from configs/zero3.json) on 2 ranks: see
    dist_nan_guard.py."""
    out = torchrun(
        os.path.join(ROOT, "tests", "dist_nan_guard.py"), tiny_model, os.path.join(ROOT, "configs")
    ).stdout
    assert (
        "ZeRO-2: non-finite steps skipped" in out and "ZeRO-3: non-finite steps skipped" in out
    ), out

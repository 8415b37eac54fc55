"""runlog.py's curves.png, read as matplotlib objects (not pixels): the run's name as the title, a
label on every axis, whole-number step ticks, one legend entry per series."""

import json

from runlog import RunLog, curves_figure

# as grpo.py passes them with --beta 0: the reward, then the policy's entropy
PANELS = [
    ("reward", [("reward", "train", "-"), ("eval/reward", "held-out", "o-")]),
    ("entropy (nats/token)", [("entropy", "train", "-")]),
]


def test_curves_title_labels_and_whole_step_ticks(tmp_path):
    run_dir = tmp_path / "grpo-20250101-120000"
    run_dir.mkdir()
    log = RunLog(str(run_dir), __file__, {}, rank=0)
    log.record({"step": 0, "eval/reward": 0.2})
    for step in (1, 2, 3):  # three steps: matplotlib's own ticks would be 0.5 apart
        log.record({"step": step, "reward": 0.1 * step, "entropy": 2.0 - 0.1 * step})
    log.record({"step": 3, "eval/reward": 0.6})
    log.close(panels=PANELS)
    assert (run_dir / "curves.png").stat().st_size > 0
    with open(run_dir / "metrics.jsonl") as f:
        assert len([json.loads(line) for line in f]) == 5

    fig = curves_figure(str(run_dir), PANELS)
    fig.canvas.draw()  # ticks are placed when drawn
    assert fig.get_suptitle() == "grpo-20250101-120000"
    assert [ax.get_ylabel() for ax in fig.axes] == ["reward", "entropy (nats/token)"]
    for ax, (_, series) in zip(fig.axes, PANELS):
        assert ax.get_xlabel() == "step"
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
        assert [t.get_text() for t in ax.get_legend().get_texts()] == [s[1] for s in series]
    assert [len(line.get_xdata()) for line in fig.axes[0].lines] == [3, 2]  # train, held-out

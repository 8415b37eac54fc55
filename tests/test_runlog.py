"""runlog.py's curves.png, read as matplotlib objects (not pixels): the run's name as the title, a
label on every axis, whole-number step ticks, one legend entry per series."""

import json

import pytest

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


def test_compare_runs_on_one_figure(tmp_path, capsys):
    """python runlog.py a b c: curves.png's panels (merged over the runs: one run's KL panel, one
    run without panels.json), a colour per run, each labelled by its name and the flags in which
    the runs differ; one PNG."""
    from runlog import compare_figure, main

    kl = ("KL to reference", [("kl", "train", "-")])
    runs = []
    for name, beta, lr, panels in [
        ("grpo-a", 0.0, 1e-3, PANELS),
        ("grpo-b", 0.04, 1e-3, [PANELS[0], kl]),
        ("grpo-c", 0.0, 1e-4, PANELS),
    ]:
        run_dir = tmp_path / name
        run_dir.mkdir()
        log = RunLog(str(run_dir), __file__, {"beta": beta, "learning_rate": lr, "seed": 0}, 0)
        for step in (1, 2, 3):
            log.record({"step": step, "reward": lr * step, "entropy": 2.0, "kl": beta * step})
        log.close(panels=panels)
        runs.append(str(run_dir))
    (tmp_path / "grpo-c" / "panels.json").unlink()  # a run from before panels.json

    out = tmp_path / "compare.png"
    main([*runs, "-o", str(out)])
    assert out.stat().st_size > 0 and capsys.readouterr().out == f"{out}: 3 runs\n"
    fig = compare_figure(runs)
    assert fig.get_suptitle() == "3 runs"
    assert [ax.get_ylabel() for ax in fig.axes] == [
        "reward",
        "entropy (nats/token)",
        "KL to reference",
    ]
    (runs_legend,) = fig.legends
    assert [t.get_text() for t in runs_legend.get_texts()] == [
        "grpo-a --beta 0.0 --learning_rate 0.001",
        "grpo-b --beta 0.04 --learning_rate 0.001",
        "grpo-c --beta 0.0 --learning_rate 0.0001",
    ]  # seed is the same in all three: not shown
    for ax, (_, series) in zip(fig.axes, [*PANELS, kl]):  # each panel's legend: its series
        assert [t.get_text() for t in ax.get_legend().get_texts()] == [s[1] for s in series]
    drawn = [line for line in fig.axes[0].lines if len(line.get_xdata())]
    assert len({line.get_color() for line in drawn}) == 3  # a colour per run
    kl_lines = [len(line.get_xdata()) for line in fig.axes[2].lines if len(line.get_xdata())]
    assert kl_lines == [3, 3, 3]  # every run recorded kl

    with pytest.raises(SystemExit) as e:  # not a run directory: argparse's message, exit 2
        main([runs[0], str(tmp_path)])
    assert e.value.code == 2 and "has no metrics.jsonl" in capsys.readouterr().err


def test_completions_log_and_resume(tmp_path):
    """--log_completions' file: a step's rows appended as they come, one per completion with its
    prompt and rewards; a resume from the checkpoint of step 1 drops the rows a killed run wrote
    after it, as in metrics.jsonl; only rank 0 writes."""
    (tmp_path / "r").mkdir()
    run_dir = str(tmp_path / "r")
    log = RunLog(run_dir, __file__, {}, rank=0)
    for step in (1, 2):
        log.record({"step": step, "reward": 0.5})
        log.completions(step, ["1="], ["a", "b"], [1.0, 0.5], {"f": [1.0, 0.0]})
    log.close(panels=PANELS[:1])
    with open(tmp_path / "r" / "completions.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [(r["step"], r["completion"]) for r in rows] == [(1, "a"), (1, "b"), (2, "a"), (2, "b")]
    assert rows[1] == {"step": 1, "prompt": "1=", "completion": "b", "reward": 0.5, "rewards/f": 0}
    RunLog(run_dir, __file__, {}, rank=0, resume_step=1).close(panels=PANELS[:1])
    with open(tmp_path / "r" / "completions.jsonl") as f:
        assert [r["step"] for r in map(json.loads, f)] == [1, 1]
    RunLog(run_dir, __file__, {}, rank=1).completions(3, ["1="], ["c"], [1.0], {})  # rank 0 writes
    with open(tmp_path / "r" / "completions.jsonl") as f:
        assert len(f.readlines()) == 2

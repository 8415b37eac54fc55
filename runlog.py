"""What a run leaves in its directory: the script and arguments that ran, every source file of this
repository it imported (src/, with the git commit and diff), metrics.jsonl (and wandb when asked),
completions.jsonl (with --log_completions: each step's samples) and curves.png. (Peak memory per
phase: memory.py's MemoryLedger.)

    from runlog import RunLog
    log = RunLog(run_dir, __file__, vars(args), rank, report_to="none", extra={"world_size": world})
    # on resume from a checkpoint at step 40: RunLog(..., resume_step=40) drops rows past step 40
    log.record({"step": 1, "reward": 0.5})
    log.close(panels=[("reward", [("reward", "train", "-"), ("eval/reward", "held-out", "o-")])])

curves.png: one panel per (y label, series), each series (metrics key, legend label, line style)
against the step, titled with the run's name (run_dir's last part); wandb's run has that name too.
The panels are kept beside it in panels.json, so that runs can be compared on one figure:

    python runlog.py runs/a runs/b runs/c -o compare.png   # the same panels, a colour per run

each run labelled by its name and the flags in which the runs' args.json differ.

Only rank 0 writes; on other ranks every call does nothing. Imports no sibling file.
"""

import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))  # the repository: the loops and their helpers
COMPLETIONS = "completions.jsonl"  # --log_completions: each step's samples (RunLog.completions)


class RunLog:
    """Rank 0 copies the script into run_dir and the sources it ran into run_dir/src/
    (save_sources), writes args.json (`config` + `extra`), appends each record() row to
    metrics.jsonl (and logs it to wandb with report_to="wandb", offline unless WANDB_MODE says
    otherwise); close() plots curves.png. Values in `config` must be JSON-able. resume_step: a run
    resumed from the checkpoint of this step; rows with a larger step, written by the killed run
    after that checkpoint, are dropped so metrics.jsonl stays one history."""

    def __init__(
        self, run_dir, script, config, rank, report_to="none", extra=None, resume_step=None
    ):
        self.run_dir, self.file, self.wandb, self.completions_file = run_dir, None, None, None
        if rank != 0:
            return
        shutil.copyfile(script, os.path.join(run_dir, os.path.basename(script)))
        save_sources(os.path.join(run_dir, "src"))
        with open(os.path.join(run_dir, "args.json"), "w") as f:
            json.dump({**config, **(extra or {})}, f, indent=1)
        if report_to == "wandb":
            import wandb

            os.environ.setdefault("WANDB_MODE", "offline")
            # offline: <run_dir>/wandb/offline-run-<time>-<id>/, `wandb sync` uploads it
            wandb.init(project="lean-rl", dir=run_dir, config=config, name=run_name(run_dir))
            self.wandb = wandb
        for name in ("metrics.jsonl", COMPLETIONS):
            path = os.path.join(run_dir, name)
            if resume_step is not None and os.path.exists(path):
                truncate_after(path, resume_step)
        self.file = open(os.path.join(run_dir, "metrics.jsonl"), "a")

    def record(self, row):
        """One JSON line; row["step"] is the x axis of wandb and of the curves."""
        if self.file is None:
            return
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.wandb:
            self.wandb.log(row, step=row["step"])

    def completions(self, step, prompts, completions, rewards, per_func, advantages=None):
        """One step's samples appended to completions.jsonl, a row per completion (prompt-major,
        len(completions) / len(prompts) of each prompt): {"step", "prompt", "completion",
        "reward", "rewards/<name>" for each of per_func, "advantage" when given}; with wandb, its
        table "completions" at that step. Returns the rows."""
        G = len(completions) // max(len(prompts), 1)
        rows = []
        for i, text in enumerate(completions):
            row = {"step": step, "prompt": prompts[i // G], "completion": text}
            row["reward"] = float(rewards[i])
            row.update({f"rewards/{k}": float(v[i]) for k, v in per_func.items()})
            if advantages is not None:
                row["advantage"] = float(advantages[i])
            rows.append(row)
        if self.file is None or not rows:
            return rows
        if self.completions_file is None:
            self.completions_file = open(os.path.join(self.run_dir, COMPLETIONS), "a")
        self.completions_file.writelines(json.dumps(r) + "\n" for r in rows)
        self.completions_file.flush()
        if self.wandb:
            columns = list(rows[0])
            table = self.wandb.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])
            self.wandb.log({"completions": table}, step=step)
        return rows

    def close(self, panels):
        """Close metrics.jsonl and plot it: one subplot per panel, a panel (y label, [(key, label,
        style), ...])."""
        if self.file is None:
            return
        self.file.close()
        if self.completions_file is not None:
            self.completions_file.close()
        plot_curves(self.run_dir, panels)
        if self.wandb:
            self.wandb.finish()


def imported_sources(root=ROOT):
    """Paths, relative to `root`, of the .py files under it that this process has imported (the
    entry script included; nothing from a virtualenv or hidden directory inside it)."""
    found = set()
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not path or not path.endswith(".py") or not os.path.isfile(path):
            continue  # built-in, compiled, or generated without a file
        rel = os.path.relpath(os.path.abspath(path), root)
        parts = rel.split(os.sep)
        if rel.startswith("..") or any(p.startswith(".") or p == "site-packages" for p in parts):
            continue
        found.add(rel)
    return sorted(found)


def save_sources(dest, root=ROOT):
    """Copy every source file of `root` this process imported into `dest` (same relative paths),
    and, in a git checkout, write git_commit.txt (HEAD, `git status --short`) and git.diff (`git
    diff HEAD`): enough to run the same code again."""
    for rel in imported_sources(root):
        os.makedirs(os.path.dirname(os.path.join(dest, rel)) or dest, exist_ok=True)
        shutil.copyfile(os.path.join(root, rel), os.path.join(dest, rel))
    os.makedirs(dest, exist_ok=True)

    def git(*args):
        try:
            out = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True)
        except OSError:  # no git on this machine
            return None
        return out.stdout if out.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:  # not a git checkout
        return
    with open(os.path.join(dest, "git_commit.txt"), "w") as f:
        f.write(commit + (git("status", "--short") or ""))
    with open(os.path.join(dest, "git.diff"), "w") as f:
        f.write(git("diff", "HEAD") or "")


def truncate_after(path, step):
    """Rewrite the JSONL file `path` atomically without the rows whose "step" is > step (and without
    a last line cut short by a kill)."""
    keep = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a torn last line
                continue
            if row.get("step", 0) <= step:
                keep.append(line if line.endswith("\n") else line + "\n")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(keep)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def run_name(run_dir):
    """The run's name: the last part of its directory (runs/grpo-<time> -> grpo-<time>)."""
    return os.path.basename(os.path.normpath(os.path.abspath(run_dir)))


def curves_figure(run_dir, panels):
    """metrics.jsonl -> a matplotlib figure titled with the run's name: per panel (y label,
    series), each series (key, label, style) against step over the rows that have it; steps on
    whole-number ticks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.5), squeeze=False)
    fig.suptitle(run_name(run_dir))
    for ax, (ylabel, series) in zip(axes[0], panels):
        for key, label, style in series:
            have = [r for r in rows if key in r]
            ax.plot([r["step"] for r in have], [r[key] for r in have], style, label=label)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no step 1.5
        ax.legend()
    fig.tight_layout()
    return fig


def plot_curves(run_dir, panels):
    """curves_figure saved as run_dir/curves.png, and the panels as run_dir/panels.json."""
    import matplotlib.pyplot as plt

    fig = curves_figure(run_dir, panels)
    fig.savefig(os.path.join(run_dir, "curves.png"), dpi=100)
    plt.close(fig)
    with open(os.path.join(run_dir, "panels.json"), "w") as f:
        json.dump(panels, f)


# ---- Several runs on one figure: python runlog.py runs/a runs/b ... ---------------------------
# a run from before panels.json was kept: the reward panel every run has
REWARD_PANEL = ["reward", [["reward", "train", "-"], ["eval/reward", "held-out", "o-"]]]
NOT_A_FLAG = ("run_dir",)  # differs between every two runs: the name says it


def read_json(path, default):
    if not os.path.exists(path):
        return default
    with open(path) as f:
        return json.load(f)


def run_flags(run_dirs):
    """{run_dir: "--flag value ..."}: the flags (args.json's values that are not a section, such as
    the resolved DeepSpeed config, which the flags decide) in which the runs differ, in args.json's
    order; one missing from a run's args.json shows as None, an empty string as ''."""
    configs = [read_json(os.path.join(d, "args.json"), {}) for d in run_dirs]
    keys = [k for c in configs for k, v in c.items() if not isinstance(v, (dict, list))]
    keys = [k for k in dict.fromkeys(keys) if k not in NOT_A_FLAG]
    differ = [k for k in keys if len({json.dumps(c.get(k)) for c in configs}) > 1]

    def shown(v):
        return "''" if v == "" else v

    return {
        d: " ".join(f"--{k} {shown(c.get(k))}" for k in differ) for d, c in zip(run_dirs, configs)
    }


def merged_panels(run_dirs):
    """The runs' panels (panels.json) in first-seen order, a panel's series the union over the
    runs, so every run's curves.png panels are there; REWARD_PANEL when no run kept any."""
    panels = {}
    for d in run_dirs:
        for ylabel, series in read_json(os.path.join(d, "panels.json"), []):
            have = panels.setdefault(ylabel, [])
            have += [s for s in series if s[0] not in {h[0] for h in have}]
    return [[y, s] for y, s in panels.items()] or [REWARD_PANEL]


def compare_figure(run_dirs, panels=None):
    """One figure of several runs: curves.png's panels (merged_panels unless given), a colour per
    run and a line style per series (as curves.png's); under the panels one legend line per run,
    its name and the flags in which the runs differ (run_flags); in each panel a legend of its
    series' styles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    panels = panels or merged_panels(run_dirs)
    flags = run_flags(run_dirs)
    legend_in = 0.25 * (len(run_dirs) + 1)  # inches under the panels, a line per run
    fig, axes = plt.subplots(
        1, len(panels), figsize=(5 * len(panels), 3.5 + legend_in), squeeze=False
    )
    fig.suptitle(f"{len(run_dirs)} runs")
    for i, d in enumerate(run_dirs):
        with open(os.path.join(d, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        for ax, (_, series) in zip(axes[0], panels):
            for key, _, style in series:
                have = [r for r in rows if key in r]
                ax.plot([r["step"] for r in have], [r[key] for r in have], style, color=f"C{i}")
    for ax, (ylabel, series) in zip(axes[0], panels):
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no step 1.5
        for _, name, style in series:  # the series' styles, in gray, for the panel's legend
            ax.plot([], [], style, color="gray", label=name)
        ax.legend(fontsize="small")
    runs = [Line2D([], [], color=f"C{i}") for i in range(len(run_dirs))]
    names = [" ".join(filter(None, [run_name(d), flags[d]])) for d in run_dirs]
    fig.legend(runs, names, loc="lower left", fontsize="small", frameon=False)
    fig.tight_layout(rect=(0, legend_in / (3.5 + legend_in), 1, 1))
    return fig


def main(argv=None):
    import argparse

    import matplotlib.pyplot as plt

    parser = argparse.ArgumentParser(
        description="Several runs' curves on one figure: curves.png's panels, a colour per run, "
        "each labelled by its name and the flags in which the runs' args.json differ."
    )
    parser.add_argument("run_dirs", nargs="+", help="run directories (runs/<algo>-<time>)")
    parser.add_argument("-o", "--out", default="compare.png", help="the PNG written")
    args = parser.parse_args(argv)
    for d in args.run_dirs:
        if not os.path.exists(os.path.join(d, "metrics.jsonl")):
            parser.error(f"{d} has no metrics.jsonl: give the directories runs are written to")
    fig = compare_figure(args.run_dirs)
    fig.savefig(args.out, dpi=100)
    plt.close(fig)
    print(f"{args.out}: {len(args.run_dirs)} runs")


if __name__ == "__main__":
    main()

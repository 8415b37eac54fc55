"""What a run leaves in its directory: the script and arguments that ran, every source file of this
repository it imported (src/, with the git commit and diff), metrics.jsonl (and wandb when asked),
and curves.png. (Peak memory per phase: memory.py's MemoryLedger.)

    from runlog import RunLog
    log = RunLog(run_dir, __file__, vars(args), rank, report_to="none", extra={"world_size": world})
    # on resume from a checkpoint at step 40: RunLog(..., resume_step=40) drops rows past step 40
    log.record({"step": 1, "reward": 0.5})
    log.close(panels=[("reward", [("reward", "train", "-"), ("eval/reward", "held-out", "o-")])])

curves.png: one panel per (y label, series), each series (metrics key, legend label, line style)
against the step, titled with the run's name (run_dir's last part); wandb's run has that name too.

Only rank 0 writes; on other ranks every call does nothing. Imports no sibling file.
"""

import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.abspath(__file__))  # the repository: the loops and their helpers


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
        self.run_dir, self.file, self.wandb = run_dir, None, None
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
        path = os.path.join(run_dir, "metrics.jsonl")
        if resume_step is not None and os.path.exists(path):
            truncate_after(path, resume_step)
        self.file = open(path, "a")

    def record(self, row):
        """One JSON line; row["step"] is the x axis of wandb and of the curves."""
        if self.file is None:
            return
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.wandb:
            self.wandb.log(row, step=row["step"])

    def close(self, panels):
        """Close metrics.jsonl and plot it: one subplot per panel, a panel (y label, [(key, label,
        style), ...])."""
        if self.file is None:
            return
        self.file.close()
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
    """curves_figure saved as run_dir/curves.png."""
    import matplotlib.pyplot as plt

    fig = curves_figure(run_dir, panels)
    fig.savefig(os.path.join(run_dir, "curves.png"), dpi=100)
    plt.close(fig)

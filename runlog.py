"""What a run leaves in its directory: the script and arguments that ran, metrics.jsonl (and wandb
when asked), and curves.png. (Peak memory per phase: memory.py's MemoryLedger.)

    from runlog import RunLog
    log = RunLog(run_dir, __file__, vars(args), rank, report_to="none", extra={"world_size": world})
    # on resume from a checkpoint at step 40: RunLog(..., resume_step=40) drops rows past step 40
    log.record({"step": 1, "reward": 0.5})
    log.close(panels=[[("reward", "train reward", "-"), ("eval/reward", "held-out reward", "o-")]])

Only rank 0 writes; on other ranks every call does nothing. Imports no sibling file.
"""

import json
import os
import shutil


class RunLog:
    """Rank 0 copies the script into run_dir, writes args.json (`config` + `extra`), appends each
    record() row to metrics.jsonl (and logs it to wandb with report_to="wandb", offline unless
    WANDB_MODE says otherwise); close() plots curves.png. Values in `config` must be JSON-able.
    resume_step: a run resumed from the checkpoint of this step; rows with a larger step, written by
    the killed run after that checkpoint, are dropped so metrics.jsonl stays one history."""

    def __init__(
        self, run_dir, script, config, rank, report_to="none", extra=None, resume_step=None
    ):
        self.run_dir, self.file, self.wandb = run_dir, None, None
        if rank != 0:
            return
        shutil.copyfile(script, os.path.join(run_dir, os.path.basename(script)))
        with open(os.path.join(run_dir, "args.json"), "w") as f:
            json.dump({**config, **(extra or {})}, f, indent=1)
        if report_to == "wandb":
            import wandb

            os.environ.setdefault("WANDB_MODE", "offline")
            wandb.init(project="lean-rl", dir=run_dir, config=config)
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
        """Close metrics.jsonl and plot it: one subplot per panel, a panel a list of (key, label,
        style)."""
        if self.file is None:
            return
        self.file.close()
        plot_curves(self.run_dir, panels)
        if self.wandb:
            self.wandb.finish()


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


def plot_curves(run_dir, panels):
    """metrics.jsonl -> curves.png: per panel, each (key, label, style) against step over the rows
    that have it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for key, label, style in panel:
            have = [r for r in rows if key in r]
            ax.plot([r["step"] for r in have], [r[key] for r in have], style, label=label)
        ax.set_xlabel("step")
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(run_dir, "curves.png"), dpi=100)
    plt.close(fig)

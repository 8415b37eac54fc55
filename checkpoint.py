"""Atomic DeepSpeed checkpoints for the RL loops: save, prune, check a resume before loading, load.

    from checkpoint import check_resume, load_checkpoint, run_config, save_checkpoint
    config = run_config(args, world)              # vars(args), world size, the DeepSpeed JSON
    ckpt_dir = os.path.join(args.run_dir, "checkpoints")
    if args.resume:
        check_resume(ckpt_dir, config)            # pre-flight: file reads only, no process group
    engines = {"policy": engine}                  # PPO: {"actor": engine, "critic": critic_engine}
    start_step = load_checkpoint(engines, ckpt_dir) if args.resume else 0
    for step in range(start_step, args.max_steps):
        ...
        if (step + 1) % args.save_steps == 0:     # every rank calls it
            save_checkpoint(engines, ckpt_dir, step + 1, config, save_total_limit=2)

Layout: ckpt_dir/step{N}/{engine name}/ holds DeepSpeed's files (every rank's ZeRO shards, optimizer
and LR-scheduler states, {"step": N}), ckpt_dir/step{N}/config.json the run's config and the size of
every file saved, and the file ckpt_dir/latest names the newest complete step dir. A LoRA run also
keeps the policy's adapter in ckpt_dir/step{N}/adapter/, as peft saves it.

Why a kill at any moment loses nothing: every rank writes into ckpt_dir/.tmp-step{N}/; after a
barrier (all shards written) rank 0 fsyncs them, renames the directory to step{N}, and only then
replaces `latest` (temp file, fsync, os.replace): `latest` always names a complete checkpoint.
Leftover .tmp-* dirs and step dirs newer than the one being saved (a killed run's) are removed on
the next save. Assumes ckpt_dir is one filesystem seen by all ranks (shared across nodes), as
DeepSpeed does.

A new run (no --resume) refuses a run_dir that already holds checkpoints or metrics (check_new_run):
it would replace the old checkpoints and append a second history to metrics.jsonl. --overwrite True
removes them first (clear_run). The loops also save the last step (--save_last, harness.Run), so a
finished run continues with --resume True and a larger --max_steps; the messages offer --resume
only where there is a checkpoint to continue from.

Preemption (StopOnSignal): SIGTERM, what a job scheduler sends before it kills a job, or SIGINT
(Ctrl-C) lets the step in progress finish, saves a checkpoint of it, and exits 5 (Stopped);
--resume continues exactly as from any checkpoint. A second Ctrl-C stops at once.

A resume is refused when the saved config differs from this run's in any key outside
RESUME_MAY_CHANGE (ZeRO shards are per rank, so world_size may not change either): the run would not
continue the same training; and when the checkpoint's metadata is corrupt or a file it recorded is
missing or cut short (copied by hand, a disk filled up). Imports zero3_utils (the rank, a max over
ranks).
"""

import json
import os
import re
import shutil
import signal

import torch.distributed as dist

from zero3_utils import all_max, process_rank, save_adapter

# keys that only change how long the run goes, how often it saves or evaluates, and where it logs;
# num_eval_prompts is NOT one of them: the held-out rows are split off the data, so it changes the
# training rows and their order.
RESUME_MAY_CHANGE = (
    "max_steps",
    "save_steps",
    "save_total_limit",
    "save_last",
    "eval_steps",
    "report_to",
    "resume",
    "run_dir",
    "save_model",
    "estimate_memory",
    "preflight",
    "overwrite",
    "max_staleness",  # how far ahead a vLLM server samples, not what the checkpoint holds
    "save_merged",
    "log_completions",
    "num_completions_to_print",
)
STEP_DIR = re.compile(r"^step(\d+)$")


EXIT_STOPPED = 5  # exits.py's table of exit codes lists it


class ResumeError(ValueError):
    """This run cannot resume; the message says why and what to change. exit_code makes exits.entry
    print it as one line (every rank finds the same files) and exit 2."""

    exit_code, everywhere = 2, True


def _barrier():
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def jsonable(config):
    """The JSON-able entries of `config`, as they read back from JSON (tuples become lists)."""
    out = {}
    for k, v in config.items():
        try:
            out[k] = json.loads(json.dumps(v))
        # functions, tensors, ...: not part of the comparable config
        except (TypeError, ValueError):
            pass
    return out


def _fsync(path, directory=False):
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def step_dirs(ckpt_dir):
    """{step: path} of the complete-looking step{N} dirs under ckpt_dir (never .tmp-*)."""
    if not os.path.isdir(ckpt_dir):
        return {}
    found = {
        int(m.group(1)): os.path.join(ckpt_dir, name)
        for name in os.listdir(ckpt_dir)
        if (m := STEP_DIR.match(name)) and os.path.isdir(os.path.join(ckpt_dir, name))
    }
    return dict(sorted(found.items()))


def latest_checkpoint(ckpt_dir):
    """The step dir that ckpt_dir/latest names, or None when there is no checkpoint."""
    path = os.path.join(ckpt_dir, "latest")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        name = f.read().strip()
    if not STEP_DIR.match(name) or not os.path.isdir(os.path.join(ckpt_dir, name)):
        return None  # not ours (an older DeepSpeed-only layout) or removed by hand
    return os.path.join(ckpt_dir, name)


def write_latest(ckpt_dir, name):
    """Replace ckpt_dir/latest atomically: a reader sees the old name or the new one, never half a
    file."""
    tmp = os.path.join(ckpt_dir, "latest.tmp")
    with open(tmp, "w") as f:
        f.write(name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(ckpt_dir, "latest"))
    _fsync(ckpt_dir, directory=True)


def prune(ckpt_dir, step, save_total_limit):
    """Keep the newest `save_total_limit` step dirs up to `step` (0: all); remove older ones, newer
    ones (left by a killed run this one replays) and leftover .tmp-* dirs."""
    steps = step_dirs(ckpt_dir)
    keep = [s for s in steps if s <= step]
    keep = set(keep[-save_total_limit:] if save_total_limit > 0 else keep)
    for s, path in steps.items():
        if s not in keep:
            shutil.rmtree(path)
    for name in os.listdir(ckpt_dir):
        if name.startswith(".tmp-"):
            shutil.rmtree(os.path.join(ckpt_dir, name), ignore_errors=True)


def run_config(args, world):
    """What a checkpoint records and a resume must match: the arguments (vars(args); values JSON
    cannot hold are dropped), the world size (ZeRO shards are per rank) and the DeepSpeed JSON's
    contents."""
    with open(args.ds_config) as f:
        ds = json.load(f)
    return {**jsonable(vars(args)), "world_size": world, "ds_config_json": ds}


def save_checkpoint(engines, ckpt_dir, step, config, save_total_limit=0, adapter=None):
    """Every rank calls this. engines: {name: DeepSpeed engine}; config: the run's config (JSON-able
    entries are kept, with world_size) that check_resume compares on resume; adapter: a LoRA run's
    peft model, whose adapter goes to step{N}/adapter as well (what
    `PeftModel.from_pretrained(base, path)` loads; resuming reads the engines' files). Returns the
    step dir."""
    rank, name = process_rank(), f"step{step}"
    tmp, final = os.path.join(ckpt_dir, f".tmp-{name}"), os.path.join(ckpt_dir, name)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a half-written save of this step by a killed run
        os.makedirs(tmp)
    _barrier()
    for engine_name, engine in engines.items():  # every rank writes its own shards
        engine.save_checkpoint(tmp, tag=engine_name, client_state={"step": step}, save_latest=False)
    if adapter is not None:  # a collective: the adapters gathered under ZeRO-3
        save_adapter(adapter, None, os.path.join(tmp, "adapter"))
    _barrier()  # all ranks' files are written
    if rank == 0:  # the config, and each file's size: check_resume finds a missing or cut shard
        paths = sorted(os.path.join(root, f) for root, _, files in os.walk(tmp) for f in files)
        files = {os.path.relpath(p, tmp): os.path.getsize(p) for p in paths}
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump({**jsonable(config), "step": step, "files": files}, f, indent=1)
        for root, _, files in os.walk(tmp):  # on disk before the rename makes them the checkpoint
            for file in files:
                _fsync(os.path.join(root, file))
        if os.path.exists(final):  # left by a killed run after its rename, before its `latest`
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync(ckpt_dir, directory=True)
        write_latest(ckpt_dir, name)
        prune(ckpt_dir, step, save_total_limit)
    _barrier()
    return final


def checkpoint_bytes(engines, stage, dtype_bytes, adapter=0):
    """Bytes one save_checkpoint writes, every rank's files together, from each engine's parameter
    counts [(trained, frozen)], as DeepSpeed 0.19.8 lays them out (measured on the built-in task's
    model, ZeRO stages 0-3 with and without LoRA: docs/checkpoints.md): 12 bytes per trained
    parameter for the optimizer (an fp32 master copy and Adam's two fp32 moments; 8 at stage 0 in
    fp32, where torch's Adam steps the weights themselves), and the weights in the training dtype:
    under ZeRO-3 the frozen ones' shards only, else the whole module's state dict. adapter: a LoRA
    adapter's parameters, saved beside them (step{N}/adapter)."""
    optimizer = 8 if stage == 0 and dtype_bytes == 4 else 12
    return (
        sum(
            optimizer * trained + dtype_bytes * (frozen if stage == 3 else trained + frozen)
            for trained, frozen in engines
        )
        + dtype_bytes * adapter
    )


def checkpoints_added(start, max_steps, save_steps, save_last, save_total_limit, existing=0):
    """The most checkpoints a run from step `start` to max_steps adds to ckpt_dir at once: one
    every save_steps steps and the last step's (save_last); with save_total_limit K > 0 at most K
    are kept, beside the one being written (prune follows its rename), the `existing` ones (a
    resumed run's) counted among the K."""
    saves = {s for s in range(start + 1, max_steps + 1) if save_steps and s % save_steps == 0}
    if save_last and max_steps > start:
        saves.add(max_steps)
    if not save_total_limit or not saves:
        return len(saves)
    return min(len(saves), max(save_total_limit + 1 - existing, 1))


def check_resume(ckpt_dir, config, may_change=()):
    """Raise ResumeError saying what to change when `config` cannot resume from ckpt_dir's latest
    checkpoint: none there, `latest` naming no step dir, a config.json that is not the saved config
    (corrupt), a file the save recorded missing or of another size, or a saved config that differs
    outside RESUME_MAY_CHANGE and `may_change` (a loop's own knobs that leave the algorithm alone,
    e.g. the memory knobs). Returns the step dir."""
    may_change = RESUME_MAY_CHANGE + tuple(may_change)
    path = latest_checkpoint(ckpt_dir)
    if path is None and os.path.isfile(os.path.join(ckpt_dir, "latest")):
        with open(os.path.join(ckpt_dir, "latest"), errors="replace") as f:
            name = f.read().strip()
        found = ", ".join(os.path.basename(p) for p in step_dirs(ckpt_dir).values()) or "none"
        raise ResumeError(
            f"--resume: {ckpt_dir}/latest names {name[:80]!r}, which is not a step "
            f"dir there (found: {found}); write the name of a complete one into it"
        )
    if path is None:
        raise ResumeError(no_checkpoint(ckpt_dir))
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ResumeError(
            f"--resume: {path} has no config.json (not saved by checkpoint.py); start a new run_dir"
        )
    try:
        with open(cfg_path) as f:
            saved = json.load(f)
        if not isinstance(saved, dict) or not isinstance(saved.get("files", {}), dict):
            raise ValueError(f"a {type(saved).__name__}, not the saved config")
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, or not an object
        raise ResumeError(
            f"--resume: {cfg_path} is corrupt ({str(e)[:120]}); resume from an "
            f"earlier step dir (write its name into {ckpt_dir}/latest) or start a "
            f"new run_dir"
        ) from None
    saved.pop("step", None)
    check_files(path, saved.pop("files", None), ckpt_dir)
    now = jsonable(config)
    diff = [
        k
        for k in sorted(set(saved) | set(now))
        if k not in may_change and saved.get(k) != now.get(k)
    ]
    if diff:

        def show(v):  # a whole DeepSpeed JSON would drown the line
            r = repr(v)
            return r if len(r) <= 120 else r[:117] + "..."

        lines = "\n".join(
            f"  {k}: {show(saved.get(k, '<unset>'))} -> {show(now.get(k, '<unset>'))}" for k in diff
        )
        world = (
            " (ZeRO shards are per rank: launch as many processes as the saved run)"
            if "world_size" in diff
            else ""
        )
        raise ResumeError(
            f"--resume: {path} was saved with another config (saved -> now){world}:\n{lines}\n"
            f"pass the saved values to resume, or start a new run_dir. May change on resume: "
            f"{', '.join(may_change)}"
        )
    return path


def check_files(path, files, ckpt_dir):
    """Every file the save recorded ({relative path: size}) is in `path` at its size; None (a
    checkpoint saved before sizes were recorded): nothing to check."""
    if files is None:
        return
    bad = []
    for name, size in files.items():
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            bad.append(f"{name} (missing)")
        elif os.path.getsize(full) != size:
            bad.append(f"{name} ({os.path.getsize(full)} bytes, saved {size})")
    if bad:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise ResumeError(
            f"--resume: {path} is incomplete: {bad[0]}{more}; resume from an "
            f"earlier step dir (write its name into {ckpt_dir}/latest) or start a "
            f"new run_dir"
        )


def load_checkpoint(engines, ckpt_dir):
    """Load every engine's weights, optimizer and LR-scheduler states from the latest checkpoint
    (every rank calls it, on freshly built engines); returns the step it was saved at, where
    training resumes."""
    path = latest_checkpoint(ckpt_dir)
    if path is None:
        raise ResumeError(no_checkpoint(ckpt_dir))
    steps = set()
    for name, engine in engines.items():
        loaded, client = engine.load_checkpoint(path, tag=name)
        if loaded is None:
            raise ResumeError(f"--resume: DeepSpeed could not load {os.path.join(path, name)}")
        steps.add(client["step"])
    if len(steps) != 1:
        raise ResumeError(
            f"--resume: the engines in {path} were saved at different steps {sorted(steps)}"
        )
    return steps.pop()


# ---- A new run never overwrites an old one ------------------------------------------------------
def previous_run(run_dir):
    """What an earlier run left in run_dir that a new run would replace or append to ([] if
    nothing)."""
    found = []
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    if os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):
        found.append(f"checkpoints/ ({', '.join(sorted(os.listdir(ckpt_dir))[:4])})")
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
        with open(metrics) as f:
            found.append(f"metrics.jsonl ({sum(1 for _ in f)} rows)")
    return found


def no_checkpoint(ckpt_dir):
    """Why --resume finds nothing to continue from, and what to run instead: never a flag that the
    next message refuses (a new run in a run_dir holding metrics is refused: check_new_run)."""
    run_dir = os.path.dirname(ckpt_dir)
    if not previous_run(run_dir):
        return (
            f"--resume: no run to continue in {run_dir or '.'} (no checkpoints, no metrics): "
            "check --run_dir (RUN_DIR with run.sh), or drop --resume True to start a run there"
        )
    return (
        f"--resume: no checkpoint under {ckpt_dir}: the run there saved none (--save_last False "
        "and no --save_steps, or it stopped before its first save). Drop --resume True and start "
        "it again with --overwrite True (its metrics go) or in another --run_dir; a run saves its "
        "last step unless --save_last False"
    )


def check_new_run(run_dir, resume, overwrite, evaluate=False):
    """Pre-flight, before anything is written: a new run may not land on an earlier run's files.
    evaluate (--max_steps 0): only another directory is offered, since it resumes nothing and
    --overwrite would delete the run's final model, the one it may be asked to score."""
    if resume and overwrite:
        raise ResumeError(
            "--resume True and --overwrite True contradict each other: resume keeps the run "
            "directory's checkpoints and metrics, overwrite deletes them; pass one"
        )
    found = [] if resume or overwrite else previous_run(run_dir)
    if not found:
        return
    if evaluate:
        raise ResumeError(
            f"--run_dir {run_dir} already holds a run: {', '.join(found)}. --max_steps 0 writes "
            "its score into a run directory of its own: give another (--run_dir, or RUN_DIR with "
            "run.sh; run.sh's default is a new runs/<algo>-<time>)"
        )
    # --resume True only where there is a checkpoint to continue from (check_resume's first test)
    resume = (
        "Continue it with --resume True (a larger --max_steps extends it), start"
        if latest_checkpoint(os.path.join(run_dir, "checkpoints"))
        else "It saved no checkpoint to continue from: start"
    )
    raise ResumeError(
        f"--run_dir {run_dir} already holds a run: {', '.join(found)}. {resume} in another "
        f"directory (--run_dir, or RUN_DIR with run.sh), or replace it with --overwrite True"
    )


CLEARED_DIRS = ("checkpoints", "final", "final_merged")  # what --overwrite True removes
CLEARED_FILES = ("metrics.jsonl", "curves.png", "completions.jsonl")


def clear_run(run_dir):
    """--overwrite True: rank 0 removes what an earlier run left (checkpoints, metrics, curves,
    final model) before this run writes anything of its own."""
    for name in CLEARED_DIRS:
        shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)
    for name in CLEARED_FILES:
        if os.path.exists(os.path.join(run_dir, name)):
            os.remove(os.path.join(run_dir, name))


# ---- Preemption: finish the step, checkpoint, exit ---------------------------------------------
class Stopped(RuntimeError):
    """The run stopped on a signal after saving a checkpoint; exits.entry prints it as one line."""

    exit_code, everywhere, label = EXIT_STOPPED, True, "stopped"


class StopOnSignal:
    """SIGTERM or SIGINT: note it, and let the loop stop at the end of the step in progress.

        stop = StopOnSignal()                      # installs the handlers
        for step in ...:
            ...                                    # the step, its metrics, its regular checkpoint
            if signum := stop.requested():         # every rank, once per step: a small all-reduce
                path = saved or save_checkpoint(engines, ckpt_dir, step + 1, config)
                raise Stopped(stop.message(signum, step + 1, path))    # exit 5

    The handler only sets a flag: a signal can land inside a collective, a forward or a save, and
    Python runs the handler between bytecodes, so nothing is cut in half. requested() is a
    collective so that every rank stops after the same step even when the signal reached one rank,
    or reached the ranks in different steps. After the first SIGINT the default handler is back: a
    second Ctrl-C raises KeyboardInterrupt at once (exits.entry_code: exit 130, no checkpoint).
    torchrun forwards SIGTERM/SIGINT to its workers and kills them after
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (torch's default 30; run.sh sets a longer default), so a
    step and a save must fit in it."""

    def __init__(self, signals=(signal.SIGTERM, signal.SIGINT)):
        self.received = 0
        for s in signals:
            signal.signal(s, self._on_signal)

    def _on_signal(self, signum, frame):
        self.received = self.received or signum
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def requested(self):
        """The signal any rank received (a number, max over ranks), or 0; every rank must call
        it."""
        return all_max(self.received)

    @staticmethod
    def message(signum, step, ckpt_path):
        return (
            f"{signal.Signals(signum).name} received; stopped after step {step} with a checkpoint "
            f"({ckpt_path}). Continue with --resume True and the same --run_dir"
        )

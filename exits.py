"""How a training process ends: one readable message and an exit code for a known failure, the
process exit without the interpreter's teardown, and a rank's wait for run.sh's pre-flight.

    from exits import RunError, entry_code, exit_process
    def main(argv=None):
        args = parse_args_quietly(Args, argv)           # arguments.py: rank 0 prints argparse's
        if args.loss_type not in LOSS_TYPES:
            raise RunError("--loss_type x: choose one of ...")  # rank 0 prints it, all exit 2
        ...
    if __name__ == "__main__":
        exit_process(entry_code(main))                   # never returns; see exit_process

Exit codes of the training script (0: the run finished) (torchrun itself exits 1 when a child fails
and prints each child's code in its summary; run.sh runs the pre-flight checks in one process, the
ranks waiting for it, so bad input gets exit 2 from run.sh and no torchrun summary):
    2  bad input or configuration: nothing was trained (checks.py, the pre-flight)
    3  training diverged: non-finite loss or gradients in `max_bad_steps` steps in a row
       (guard.StepGuard)
    4  out of memory: the message names the phase and the knob that lowers its peak
    5  stopped by SIGTERM or SIGINT after a step, with a checkpoint: continue with --resume True
       (checkpoint.StopOnSignal)
    6  the vLLM server (--vllm_mode server) was unreachable at start or died mid-run: the message
       names its address and log file (vllm_server.ServerError)
  130  a second Ctrl-C: stopped at once, no checkpoint
A failure every rank sees alike (a config error) is printed by rank 0 only; a failure of one rank
(a reward function raising on its own prompts, memory) is printed by that rank, prefixed with it,
and torchrun stops the other ranks. A known failure is any exception with an `exit_code` attribute
(RunError here, tasks.RewardError, checkpoint.ResumeError); anything else is a bug and keeps its
traceback. Imports memory.py (is_out_of_memory) and zero3_utils.py (process_rank).
"""

import contextlib
import logging
import os
import sys
import time
import traceback

import torch

from memory import is_out_of_memory
from zero3_utils import process_rank

EXIT_CONFIG, EXIT_DIVERGED, EXIT_OOM = 2, 3, 4
EXIT_SERVER = 6  # vllm_server.ServerError's exit_code (that file imports no exits.py)


class RunError(RuntimeError):
    """A failure with a message that says what to change; `everywhere`: every rank raises it
    alike."""

    def __init__(self, message, exit_code=EXIT_CONFIG, everywhere=True):
        super().__init__(message)
        self.exit_code, self.everywhere = exit_code, everywhere


def report(message, everywhere=True, label="error"):
    """One line to stderr: from rank 0 when every rank has the same message, else from this rank."""
    if everywhere and process_rank() != 0:
        return
    where = "" if everywhere else f"[rank {process_rank()}] "
    print(f"{where}{label}: {message}", file=sys.stderr, flush=True)


def entry(main, argv=None):
    """Run main(argv) and return the process exit code: 0; a known failure's own code (printed as
    one line); 4 for out of memory; 1 when a collective failed because another rank went away
    first."""
    try:
        main(argv)
        return 0
    except (torch.OutOfMemoryError, RuntimeError, ValueError) as e:
        # a RunError, or a sibling's own (RewardError, ResumeError): no traceback
        if hasattr(e, "exit_code"):
            report(str(e), getattr(e, "everywhere", False), getattr(e, "label", "error"))
            return e.exit_code
        # another rank failed first and said why; a traceback here would only bury that
        if _peer_lost(e):
            print(
                f"[rank {process_rank()}] stopped: lost the connection to another rank (its "
                "message above says why)",
                file=sys.stderr,
                flush=True,
            )
            return 1
        if not is_out_of_memory(e):
            raise
        # memory.MemoryLedger names the phase; outside any phase this is model or optimizer set-up
        msg = str(e)
        if "in phase" not in msg:
            msg = (
                "out of memory outside the training phases (loading the models or building the "
                f"optimizer): {msg.splitlines()[0][:200]}; use a ZeRO-3 config (configs/zero3.json"
                "), offload (configs/zero3_offload.json), or more GPUs; `--estimate_memory True` "
                "predicts each phase"
            )
        report(msg, everywhere=False)
        return EXIT_OOM


def wait_for_preflight():
    """run.sh starts torchrun beside the pre-flight process, so that the ranks import torch,
    transformers and DeepSpeed while it checks the inputs. A rank begins (reads its arguments,
    prints, writes) once the pre-flight has passed, which run.sh marks by creating the file
    $PREFLIGHT_PASSED. After a failure run.sh kills torchrun, and its ranks end here unheard, so
    bad input still ends with the pre-flight's one message; so they do if run.sh dies."""
    marker = os.environ.get("PREFLIGHT_PASSED")
    torchrun, run_sh = os.getppid(), os.environ.get("PREFLIGHT_PARENT")
    while marker and not os.path.exists(marker):
        if os.getppid() != torchrun or not running(int(run_sh)):
            os._exit(1)
        time.sleep(0.05)


def running(pid):
    """Whether process `pid` runs; one that ended but is not yet reaped (a zombie) does not."""
    try:
        os.kill(pid, 0)  # signal 0: only asks whether it exists
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except ProcessLookupError:
        return False
    except OSError:  # no /proc (not Linux): it exists
        return True


def entry_code(main, argv=None):
    """entry(main, argv), once the pre-flight beside it passed, and a code for what entry lets
    through: argparse's own exit (--help: 0, a bad value: 2), a second Ctrl-C (130, one line), a
    bug (1, with its traceback)."""
    wait_for_preflight()
    try:
        return entry(main, argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except KeyboardInterrupt:
        print(
            f"[rank {process_rank()}] interrupted: stopped at once, no checkpoint written",
            file=sys.stderr,
            flush=True,
        )
        return 130
    except Exception:  # a bug: keep its traceback
        traceback.print_exc()
        return 1


def exit_process(code):
    """End this process now with `code`, skipping the interpreter's teardown.

    Why: DeepSpeed keeps references to the process groups (its global `groups._WORLD_GROUP`, its
    engines and ZeRO-3 parameters), so `destroy_process_group()` cannot free them and their gloo
    threads (`gloo_tcp_loop`, `pt_gloo_runloop`) run on while Python tears the interpreter down and
    the C++ runtime destroys its static objects under them. Now and then that aborted a run whose
    work was done ("terminate called without an active exception", SIGABRT, torchrun exit 1).
    Everything a run writes is closed or fsynced before this point (metrics.jsonl, checkpoints,
    the final model, wandb.finish); stdio and logging are flushed here. multiprocessing ends its
    own child processes the same way (os._exit after the target returns)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing left to flush into
            stream.flush()
    os._exit(code)


def _peer_lost(e):
    """A collective failed because another rank's process went away (gloo or NCCL)."""
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        m in text
        for m in (
            "Connection closed by peer",
            "Connection reset by peer",
            "NCCL communicator was aborted",
        )
    )

"""How a training process ends (exits.py): exits.entry_code maps every way out of main to one exit
code (out of memory names the phase), and exits.exit_process ends the process with it, output
flushed, without the interpreter's teardown.
(Whole runs that finish exit 0: every e2e test; bench/shutdown_stress.py repeats them under load.)
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import grpo
import ppo
from conftest import ROOT, run_sh
from exits import EXIT_DIVERGED, EXIT_OOM, RunError, entry, entry_code
from fit import OOM_HINTS
from memory import MemoryLedger


def ends_with(exc):
    def main(argv):
        raise exc

    return main


@pytest.mark.parametrize(
    "exc, code, line",
    [
        (SystemExit(0), 0, None),  # --help
        (SystemExit(2), 2, None),  # argparse's own error, already printed
        (SystemExit(None), 0, None),
        (RunError("diverged", EXIT_DIVERGED), EXIT_DIVERGED, "error: diverged"),
        (KeyboardInterrupt(), 130, "[rank 0] interrupted: stopped at once, no checkpoint written"),
        (ZeroDivisionError("a bug"), 1, "ZeroDivisionError: a bug"),  # a bug keeps its traceback
    ],
)
def test_entry_code_maps_every_way_out(capsys, monkeypatch, exc, code, line):
    monkeypatch.delenv("RANK", raising=False)
    assert entry_code(ends_with(exc)) == code
    err = capsys.readouterr().err
    if line is None:
        assert err == ""
    else:
        assert line in err, err
        assert ("Traceback" in err) == isinstance(exc, ZeroDivisionError), err


def test_entry_code_of_a_run_that_finished():
    assert entry_code(lambda argv: None) == 0


def test_out_of_memory_names_the_phase_and_the_knob(capsys):
    """A real allocation failure (the CPU allocator's, 128 TiB) inside a ledger phase."""

    def main(argv):
        ledger = MemoryLedger("cpu", OOM_HINTS)
        with ledger.phase("update"):
            torch.empty(2**45)

    assert entry(main) == EXIT_OOM
    err = capsys.readouterr().err
    assert "out of memory in phase 'update'" in err and "--gradient_checkpointing True" in err, err
    # every phase the loops record has its knob
    for module in (grpo, ppo):
        src = open(module.__file__).read()
        phases = {p.split('"')[1] for p in src.split("phase(")[1:] if p.startswith('"')}
        assert phases and phases <= set(OOM_HINTS), (
            module.__name__,
            phases - set(OOM_HINTS),
        )


def test_exit_process_flushes_and_skips_teardown(tmp_path):
    """The code comes out, buffered output is flushed, and no atexit handler or finaliser runs."""
    script = tmp_path / "ends.py"
    script.write_text(
        "import atexit, sys\n"
        "from exits import exit_process\n"
        "atexit.register(lambda: print('teardown ran'))\n"
        "sys.stdout.write('unflushed stdout')\n"
        "sys.stderr.write('unflushed stderr')\n"
        "exit_process(7)\n"
    )
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert proc.returncode == 7
    # (importing exits imports DeepSpeed, which may print its accelerator line first)
    assert proc.stdout.endswith("unflushed stdout") and proc.stderr.endswith("unflushed stderr")
    assert "teardown ran" not in proc.stdout


def test_a_rank_begins_once_the_preflight_passed_and_ends_with_run_sh(tmp_path):
    """exits.wait_for_preflight, as a rank started beside run.sh's pre-flight runs it: nothing
    begins until $PREFLIGHT_PASSED exists; a rank whose run.sh ($PREFLIGHT_PARENT) is gone ends
    with exit 1 and says nothing (run.sh gave the pre-flight's message)."""
    code = "import exits; exits.wait_for_preflight(); print('began')"
    marker = tmp_path / "passed"

    def rank(parent):
        env = {"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin", "PREFLIGHT_PASSED": str(marker)}
        return subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env={**env, "PREFLIGHT_PARENT": str(parent)},
            stdout=subprocess.PIPE,
            text=True,
        )

    waiting = rank(os.getpid())
    with pytest.raises(subprocess.TimeoutExpired):  # imports, then waits for the marker
        waiting.communicate(timeout=20)
    marker.touch()
    out = waiting.communicate(timeout=60)[0]  # (after DeepSpeed's accelerator line on CPU)
    assert out.endswith("began\n") and waiting.returncode == 0, out

    marker.unlink()
    ended = subprocess.Popen(["true"])  # not reaped until wait(): a zombie, as run.sh is while
    time.sleep(1)  # its caller reads the output the ranks still hold open
    orphan = rank(ended.pid)
    out = orphan.communicate(timeout=120)[0]
    assert "began" not in out and orphan.returncode == 1, out
    ended.wait()


def test_ctrl_c_ends_with_the_projects_lines_only(tmp_path):
    """Ctrl-C to run.sh mid-run: the step finishes, its checkpoint, exit 5, and after the last
    step's line only the rank's line and run.sh's: nothing of torchrun's (no SignalException
    traceback, none of its lines about the signal it passed on)."""
    run_dir = tmp_path / "run"
    small = ["--max_steps", "50", "--num_eval_prompts", "0", "--save_model", "False"]
    proc = run_sh("grpo", *small, env={"RUN_DIR": str(run_dir)}, wait=False)
    lines = []
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if line.startswith("step 1/50"):
            proc.send_signal(signal.SIGINT)
    out = "\n".join(lines)
    assert proc.wait(timeout=300) == 5, out[-4000:]
    step = int((run_dir / "checkpoints" / "latest").read_text().removeprefix("step"))
    assert lines[-3].startswith(f"step {step}/50 "), out[-4000:]
    assert lines[-2:] == [
        f"stopped: SIGINT received; stopped after step {step} with a checkpoint "
        f"({run_dir}/checkpoints/step{step}). Continue with --resume True and the same --run_dir",
        f"run.sh: stopped by SIGINT with a checkpoint (step{step}); continue with "
        f"RUN_DIR={run_dir} bash run.sh grpo ... --resume True",
    ], out[-4000:]
    for torchrun in ("Traceback", "SignalException", "death signal", "closing signal"):
        assert torchrun not in out, out[-4000:]

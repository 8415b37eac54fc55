"""How a training process ends: checks.entry_code maps every way out of main to one exit code, and
checks.exit_process ends the process with it, output flushed, without the interpreter's teardown.
(Whole runs that finish exit 0: every e2e test; bench/shutdown_stress.py repeats them under load.)
"""

import subprocess
import sys

import pytest

from checks import EXIT_DIVERGED, RunError, entry_code
from conftest import ROOT


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


def test_exit_process_flushes_and_skips_teardown(tmp_path):
    """The code comes out, buffered output is flushed, and no atexit handler or finaliser runs."""
    script = tmp_path / "ends.py"
    script.write_text(
        "import atexit, sys\n"
        "from checks import exit_process\n"
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
    # (importing checks imports DeepSpeed, which may print its accelerator line first)
    assert proc.stdout.endswith("unflushed stdout") and proc.stderr.endswith("unflushed stderr")
    assert "teardown ran" not in proc.stdout

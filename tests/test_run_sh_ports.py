"""Two runs on one machine (issue 37): without MASTER_PORT, run.sh picks a free rendezvous port for
a one-node run, so a second `bash run.sh` beside a first one does not die on torch's default
29500 with torchrun's raw EADDRINUSE traceback; a MASTER_PORT that is taken anyway stops it with
one message and exit 2, before the pre-flight. Bad input found by the pre-flight, which runs beside
torchrun's start, leaves no rank behind."""

import os
import socket
import subprocess
import time

from conftest import ROOT, train_rows
from exits import EXIT_CONFIG


def run_sh(run_dir, *args, env=None):
    """`bash run.sh grpo args` on 2 CPU processes, MASTER_PORT unset unless `env` sets it."""
    full = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
    full.update(OMP_NUM_THREADS="1", NPROC="2", RUN_DIR=str(run_dir), **(env or {}))
    return subprocess.Popen(
        ["bash", "run.sh", "grpo", *args],
        cwd=ROOT,
        env=full,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def test_two_runs_at_once_both_finish(tmp_path):
    """Started together, their torchruns overlap (each pre-flight builds its own model first),
    neither given a port: both finish their 2 steps with exit 0."""
    small = ["--max_steps", "2", "--num_eval_prompts", "0", "--save_model", "False"]
    procs = [run_sh(tmp_path / f"run{i}", *small) for i in range(2)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    for i, (proc, out) in enumerate(zip(procs, outs)):
        assert proc.returncode == 0, out[-6000:]
        assert [r["step"] for r in train_rows(tmp_path / f"run{i}")] == [1, 2], out[-3000:]
    ports = [out.split("--master_port ", 1)[1].split()[0] for out in outs]
    assert ports[0] != ports[1] and "29500" not in ports, ports


def test_a_taken_master_port_exits_2_with_one_message(tmp_path):
    """MASTER_PORT held by another listener: one line naming the port and what to change, exit 2,
    nothing run (no pre-flight, no torchrun, no run directory)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        proc = run_sh(tmp_path / "run", "--max_steps", "1", env={"MASTER_PORT": str(port)})
        out, _ = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_CONFIG, out
    lines = [ln for ln in out.splitlines() if not ln.startswith("install.sh:")]
    assert lines == [
        f"run.sh: error: MASTER_PORT={port} is taken on this machine (another run's rendezvous?): "
        "unset MASTER_PORT to let run.sh pick a free port (one node), or set another"
    ], out
    assert not (tmp_path / "run").exists()


def test_bad_input_stops_the_ranks_started_beside_the_preflight(tmp_path):
    """torchrun starts beside the pre-flight; on bad input its ranks, still waiting for it
    (exits.wait_for_preflight), are stopped: exit 2, the pre-flight's one message, no torchrun
    summary, no run directory, and no rank left behind."""
    run_dir = tmp_path / "run"
    proc = run_sh(run_dir, "--max_steps", "1", "--loss_type", "sum")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_CONFIG, out
    errors = [ln for ln in out.splitlines() if "error" in ln.lower()]
    assert errors == ["error: --loss_type sum: must be one of grpo, bnpo, dr_grpo, cispo"], out
    assert "Traceback" not in out and not run_dir.exists(), out
    for _ in range(100):  # the ranks notice within a moment that run.sh has ended
        left = [p for p in os.listdir("/proc") if p.isdigit() and str(run_dir) in cmdline(p)]
        if not left:
            break
        time.sleep(0.1)
    assert not left, [cmdline(p) for p in left]


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:  # ended meanwhile
        return ""

"""checkpoint.py: resume checks and pruning on plain files; a kill -9 in the middle of a real ZeRO-3
save; and the issue's test: `kill -9` of a 2-process ZeRO-3 GRPO run at a random step, then
--resume, gives the same metrics for every step after the checkpoint as an uninterrupted run, each
step logged once."""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

import conftest
from checkpoint import (
    RESUME_MAY_CHANGE,
    check_resume,
    latest_checkpoint,
    save_checkpoint,
    step_dirs,
)
from conftest import ROOT, free_port, torchrun, train_rows
from runlog import RunLog

# a function: not JSON, left out of the saved config
CONFIG = {
    "seed": 0,
    "learning_rate": 1e-3,
    "max_steps": 10,
    "save_steps": 2,
    "world_size": 2,
    "run_dir": "a",
    "funcs": [print],
}


# ---- plain files, one process (engines={}: only the layout, latest, pruning and config.json) ---
def test_check_resume_missing_matching_and_differing(tmp_path):
    ckpt = str(tmp_path / "checkpoints")
    with pytest.raises(ValueError, match=r"no run to continue in .* drop --resume True to start"):
        check_resume(ckpt, CONFIG)
    save_checkpoint({}, ckpt, 2, CONFIG)
    # no engines
    assert json.load(open(os.path.join(ckpt, "step2", "config.json"))) == {
        **{k: v for k, v in CONFIG.items() if k != "funcs"},
        "step": 2,
        "files": {},
    }
    assert check_resume(ckpt, CONFIG) == os.path.join(ckpt, "step2")
    # keys that may change: how long, how often, where to log
    assert check_resume(
        ckpt, {**CONFIG, "max_steps": 20, "save_steps": 5, "run_dir": "b", "resume": True}
    ) == os.path.join(ckpt, "step2")
    assert "num_eval_prompts" not in RESUME_MAY_CHANGE  # it changes the training rows
    with pytest.raises(ValueError) as e:
        check_resume(
            ckpt, {**CONFIG, "learning_rate": 1e-4, "seed": 1, "beta": 0.1, "max_steps": 20}
        )
    msg = str(e.value)
    for line in ("  learning_rate: 0.001 -> 0.0001", "  seed: 0 -> 1", "  beta: '<unset>' -> 0.1"):
        assert line in msg, msg
    assert "  max_steps:" not in msg and "world_size" not in msg
    with pytest.raises(ValueError, match=r"(?s)ZeRO shards are per rank.*world_size: 2 -> 4"):
        check_resume(ckpt, {**CONFIG, "world_size": 4})


def test_latest_and_pruning(tmp_path):
    ckpt = str(tmp_path / "checkpoints")
    assert latest_checkpoint(ckpt) is None and step_dirs(ckpt) == {}
    for step in (2, 4, 6):
        save_checkpoint({}, ckpt, step, CONFIG, save_total_limit=2)
    assert sorted(os.listdir(ckpt)) == ["latest", "step4", "step6"]
    assert latest_checkpoint(ckpt) == os.path.join(ckpt, "step6")
    # a killed run's leftovers: a half-written save, and a newer complete one that `latest` never
    # named
    os.makedirs(os.path.join(ckpt, ".tmp-step10", "policy"))
    os.makedirs(os.path.join(ckpt, "step8"))
    # .tmp dirs and unnamed dirs do not count
    assert latest_checkpoint(ckpt) == os.path.join(ckpt, "step6")
    # the resumed run saves step 8 again: replaced
    save_checkpoint({}, ckpt, 8, CONFIG, save_total_limit=0)
    assert sorted(os.listdir(ckpt)) == ["latest", "step4", "step6", "step8"]
    assert os.listdir(os.path.join(ckpt, "step8")) == ["config.json"]
    # resumed from step 4 (say `latest` was reset by hand): saving step 6 drops the newer step 8
    save_checkpoint({}, ckpt, 6, CONFIG, save_total_limit=0)
    assert sorted(os.listdir(ckpt)) == ["latest", "step4", "step6"]
    with open(os.path.join(ckpt, "latest")) as f:
        assert f.read() == "step6"


def test_runlog_resume_drops_rows_after_the_checkpoint(tmp_path):
    rows = [
        {"step": 0, "eval/reward": 0.1},
        {"step": 1, "reward": 1},
        {"step": 2, "reward": 2},
        {"step": 2, "eval/reward": 0.2},
        {"step": 3, "reward": 3},
    ]
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "rew')  # torn by a kill
    log = RunLog(str(tmp_path), __file__, {}, rank=0, resume_step=2)
    log.record({"step": 3, "reward": 30})
    log.file.close()
    with open(tmp_path / "metrics.jsonl") as f:
        assert [json.loads(line) for line in f] == rows[:4] + [{"step": 3, "reward": 30}]


# ---- a real ZeRO-3 save cut off by kill -9 ---------------------------------------------------
def test_kill_during_save_keeps_the_previous_checkpoint(tmp_path, tiny_model):
    script = os.path.join(ROOT, "tests", "dist_ckpt_crash.py")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        script,
        "crash",
        tiny_model,
        str(tmp_path),
    ]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "not reached" not in proc.stdout + proc.stderr, proc.stderr[
        -3000:
    ]
    assert "Signals.SIGKILL" in proc.stderr or "-9" in proc.stderr, proc.stderr[-3000:]
    out = torchrun(script, "load", tiny_model, str(tmp_path)).stdout
    assert "rank 0: ok" in out and "rank 1: ok" in out


# ---- the test: kill -9 a torchrun GRPO run at a random step, resume, compare ------------
# warmup: the LR schedule must resume too
GRPO = [
    "--max_steps",
    "6",
    "--save_steps",
    "2",
    "--save_total_limit",
    "2",
    "--prompts_per_rank",
    "4",
    "--num_generations",
    "4",
    "--per_device_train_batch_size",
    "8",
    "--num_eval_prompts",
    "8",
    "--eval_steps",
    "3",
    "--warmup_steps",
    "8",
    "--save_model",
    "False",
]


def compared(key):  # wall time and memory differ between any two runs
    return not (key.endswith("_s") or key.startswith("mem/"))


def history(run_dir):
    """metrics.jsonl without the time and memory values, which no two runs share."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [{k: v for k, v in r.items() if compared(k)} for r in rows]


def descendants(pid):
    """The ids of all processes under `pid`, deepest first (from /proc, Linux)."""
    parent = {}
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError):  # not a process, or it ended meanwhile
            continue
    out = [c for c, p in parent.items() if p == pid]
    return [d for c in out for d in descendants(c)] + out if out else []


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """The uninterrupted run that the killed and the stopped runs are compared with."""
    run_dir = tmp_path_factory.mktemp("full") / "run"
    conftest.run_sh("grpo", *GRPO, env={"RUN_DIR": str(run_dir)})
    return run_dir


def start_run_sh(run_dir, log_path, *args):
    env = {
        **os.environ,
        "RUN_DIR": str(run_dir),
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
        "NPROC": "2",
    }
    with open(log_path, "w") as log:  # a file, not a pipe: nobody reads while it runs
        return subprocess.Popen(
            ["bash", "run.sh", "grpo", *GRPO, *args],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def wait_for_step(proc, run_dir, step, log_path):
    deadline = time.time() + 300
    while not any(
        r["step"] >= step
        for r in (train_rows(run_dir) if (run_dir / "metrics.jsonl").exists() else [])
    ):
        assert proc.poll() is None, log_path.read_text()[-4000:]
        assert time.time() < deadline
        time.sleep(0.05)


def assert_same_history(full, resumed):
    want, got = history(full), history(resumed)
    assert [r["step"] for r in train_rows(resumed)] == [1, 2, 3, 4, 5, 6]  # each step exactly once
    assert len(got) == len(want)
    for w, g in zip(want, got):  # every row, including the held-out evals, in the same order
        assert w.keys() == g.keys(), (w, g)
        for k in w:  # exactly: same data, same samples, same weights, optimizer and LR schedule
            assert g[k] == w[k], (g["step"], k, w[k], g[k])


def test_kill_9_and_resume_matches_an_uninterrupted_run(tmp_path, full):
    killed = tmp_path / "killed"
    kill_after = random.Random(6).randint(3, 5)  # a step past the first checkpoint (step 2)

    proc = start_run_sh(killed, tmp_path / "killed.log")
    wait_for_step(proc, killed, kill_after, tmp_path / "killed.log")
    # kill -9 the workers and torchrun at once, as a scheduler ending the job does (killing
    # torchrun's process group is not enough: torchrun starts each worker in a session of its own)
    workers = descendants(proc.pid)
    assert len(workers) >= 2
    for pid in [*workers, proc.pid]:
        os.kill(pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    saved = int(open(killed / "checkpoints" / "latest").read().removeprefix("step"))
    assert 2 <= saved <= kill_after

    out = conftest.run_sh("grpo", *GRPO, "--resume", "True", env={"RUN_DIR": str(killed)})
    assert f"at step {saved}" in out
    assert_same_history(full, killed)
    # --save_total_limit 2
    assert sorted(os.listdir(killed / "checkpoints")) == ["latest", "step4", "step6"]
    assert sorted(os.listdir(full / "checkpoints")) == ["latest", "step4", "step6"]


def test_sigterm_finishes_the_step_checkpoints_it_and_resumes_exactly(tmp_path, full):
    """A scheduler's SIGTERM to run.sh at step 3 (no regular save there): the ranks finish the step,
    save checkpoints/step3 and stop; run.sh exits 5; --resume continues as if nothing happened."""
    stopped, log = tmp_path / "stopped", tmp_path / "stopped.log"
    proc = start_run_sh(stopped, log)
    wait_for_step(proc, stopped, 2, log)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=300) == 5, log.read_text()[-4000:]
    out = log.read_text()
    step = int(open(stopped / "checkpoints" / "latest").read().removeprefix("step"))
    assert (
        step >= 2
        and f"stopped: SIGTERM received; stopped after step {step} with a checkpoint" in out
    ), out
    # the project's lines only: nothing of torchrun's about the signal, no traceback
    assert "run.sh: stopped by SIGTERM" in out and "Traceback" not in out, out
    assert "SignalException" not in out and "closing signal" not in out, out
    # the step it was in: done
    assert [r["step"] for r in train_rows(stopped)] == list(range(1, step + 1))

    out = conftest.run_sh("grpo", *GRPO, "--resume", "True", env={"RUN_DIR": str(stopped)})
    assert f"at step {step}" in out
    assert_same_history(full, stopped)


def test_a_new_run_never_lands_on_an_old_one(tmp_path, full):
    """Without --resume, run.sh refuses a run_dir holding checkpoints or metrics (exit 2, nothing
    written); --overwrite True replaces the old run."""
    run_dir = tmp_path / "again"
    shutil.copytree(full, run_dir)
    before = (run_dir / "metrics.jsonl").read_text()
    phase = run_dir / "memory_phase.rank1"  # as a rank the kernel killed in its update leaves it
    phase.write_text("update\tlower --per_device_train_batch_size\n")
    proc = conftest.run_sh("grpo", *GRPO, env={"RUN_DIR": str(run_dir)}, wait=False)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, out
    assert "already holds a run: checkpoints/ (latest, step4, step6), metrics.jsonl (" in out, out
    assert "--resume True" in out and "--overwrite True" in out and "Traceback" not in out, out
    assert (run_dir / "metrics.jsonl").read_text() == before
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["latest", "step4", "step6"]
    assert phase.read_text() == "update\tlower --per_device_train_batch_size\n"
    assert "a larger --max_steps extends it" in out, out  # it has a checkpoint to continue from

    conftest.run_sh(
        "grpo", *GRPO, "--overwrite", "True", "--max_steps", "1", env={"RUN_DIR": str(run_dir)}
    )
    rows = history(run_dir)  # one history: the old run's rows are gone
    assert [r["step"] for r in train_rows(run_dir)] == [1] and rows[0] == {"step": 0, **rows[0]}
    # at the start and at the end of this run only
    assert sum("eval/reward" in r for r in rows) == 2
    # the old run's are gone; this one saved its last step (--save_last True, the default)
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["latest", "step1"]


@pytest.mark.parametrize("loop", ["grpo", "ppo"])
def test_new_run_checks_in_the_preflight(tmp_path, monkeypatch, capsys, loop):
    """Both loops' pre-flight (in this process): metrics or checkpoints refuse a new run, and
    --resume with --overwrite contradict; an empty or model-only run_dir is fine."""
    import importlib

    from exits import entry

    main = importlib.import_module(loop).main
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    run_dir = tmp_path / "run"

    def preflight(*argv):
        return entry(
            main,
            [
                "--preflight",
                "True",
                "--run_dir",
                str(run_dir),
                "--num_eval_prompts",
                "10",
                "--ds_config",
                os.path.join(ROOT, "configs", "zero3.json"),
                *argv,
            ],
        )

    assert preflight() == 0
    assert not run_dir.exists()  # the pre-flight alone writes nothing
    run_dir.mkdir()
    assert preflight() == 0  # an empty run_dir is fine
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    capsys.readouterr()
    assert preflight() == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "already holds a run: metrics.jsonl (1 rows)" in err, err
    assert preflight("--overwrite", "True") == 0
    assert preflight("--overwrite", "True", "--resume", "True") == 2
    assert "contradict each other" in capsys.readouterr().err
    # metrics and no checkpoint (--save_last False, or stopped before its first save): neither
    # message offers --resume True, which would be refused; each names what does work
    assert preflight() == 2
    err = capsys.readouterr().err
    assert "It saved no checkpoint to continue from" in err and "--resume True" not in err, err
    assert preflight("--max_steps", "0") == 2  # evaluation only: another directory, nothing else
    err = capsys.readouterr().err
    assert "--max_steps 0 writes its score into a run directory of its own" in err, err
    assert "--resume True" not in err and "--overwrite" not in err, err
    assert preflight("--resume", "True") == 2
    err = capsys.readouterr().err
    assert "no checkpoint under" in err and "the run there saved none" in err, err
    assert "--overwrite True" in err and "--save_steps N first" not in err, err
    assert preflight("--run_dir", str(tmp_path / "nothing"), "--resume", "True") == 2
    err = capsys.readouterr().err
    assert "no run to continue in" in err and "drop --resume True" in err, err
    assert not (tmp_path / "nothing").exists()  # a refused run creates nothing


def test_run_dir_keeps_every_imported_source_and_the_git_state(tmp_path):
    """runlog.RunLog copies the entry script, and into src/ every repository module the process
    imported (here: the test, conftest, runlog, checkpoint ...), plus git's commit and diff."""
    log = RunLog(str(tmp_path), __file__, {}, rank=0)
    log.file.close()
    src = tmp_path / "src"
    assert (tmp_path / "test_checkpoint.py").exists()
    for rel in ("runlog.py", "checkpoint.py", "tests/conftest.py", "tests/test_checkpoint.py"):
        assert (src / rel).read_text() == open(os.path.join(ROOT, rel)).read(), rel
    assert not any(".venv" in str(p) or "site-packages" in str(p) for p in src.rglob("*"))
    if (src / "git_commit.txt").exists():  # a git checkout
        assert len((src / "git_commit.txt").read_text().split()[0]) == 40
        assert (src / "git.diff").exists()

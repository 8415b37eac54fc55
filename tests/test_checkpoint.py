"""checkpoint.py: resume checks and pruning on plain files; a kill -9 in the middle of a real ZeRO-3 save;
and the issue's test: `kill -9` of a 2-process ZeRO-3 GRPO run at a random step, then --resume, gives the
same metrics for every step after the checkpoint as an uninterrupted run, each step logged once."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

import conftest
from checkpoint import RESUME_MAY_CHANGE, check_resume, latest_checkpoint, save_checkpoint, step_dirs
from conftest import ROOT, free_port, torchrun, train_rows
from runlog import RunLog

CONFIG = {"seed": 0, "learning_rate": 1e-3, "max_steps": 10, "save_steps": 2, "world_size": 2, "run_dir": "a",
          "funcs": [print]}  # a function: not JSON, left out of the saved config


# ---- plain files, one process (engines={}: only the layout, latest, pruning and config.json) ---
def test_check_resume_missing_matching_and_differing(tmp_path):
    ckpt = str(tmp_path / "checkpoints")
    with pytest.raises(ValueError, match=r"no checkpoint under .*checkpoints; run with --save_steps N first"):
        check_resume(ckpt, CONFIG)
    save_checkpoint({}, ckpt, 2, CONFIG)
    assert json.load(open(os.path.join(ckpt, "step2", "config.json"))) == \
        {**{k: v for k, v in CONFIG.items() if k != "funcs"}, "step": 2, "files": {}}  # no engines
    assert check_resume(ckpt, CONFIG) == os.path.join(ckpt, "step2")
    # keys that may change: how long, how often, where to log
    assert check_resume(ckpt, {**CONFIG, "max_steps": 20, "save_steps": 5, "run_dir": "b", "resume": True}) \
        == os.path.join(ckpt, "step2")
    assert "num_eval_prompts" not in RESUME_MAY_CHANGE  # it changes the training rows
    with pytest.raises(ValueError) as e:
        check_resume(ckpt, {**CONFIG, "learning_rate": 1e-4, "seed": 1, "beta": 0.1, "max_steps": 20})
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
    # a killed run's leftovers: a half-written save, and a newer complete one that `latest` never named
    os.makedirs(os.path.join(ckpt, ".tmp-step10", "policy"))
    os.makedirs(os.path.join(ckpt, "step8"))
    assert latest_checkpoint(ckpt) == os.path.join(ckpt, "step6")  # .tmp dirs and unnamed dirs do not count
    save_checkpoint({}, ckpt, 8, CONFIG, save_total_limit=0)  # the resumed run saves step 8 again: replaced
    assert sorted(os.listdir(ckpt)) == ["latest", "step4", "step6", "step8"]
    assert os.listdir(os.path.join(ckpt, "step8")) == ["config.json"]
    # resumed from step 4 (say `latest` was reset by hand): saving step 6 drops the newer step 8
    save_checkpoint({}, ckpt, 6, CONFIG, save_total_limit=0)
    assert sorted(os.listdir(ckpt)) == ["latest", "step4", "step6"]
    with open(os.path.join(ckpt, "latest")) as f:
        assert f.read() == "step6"


def test_runlog_resume_drops_rows_after_the_checkpoint(tmp_path):
    rows = [{"step": 0, "eval/reward": 0.1}, {"step": 1, "reward": 1}, {"step": 2, "reward": 2},
            {"step": 2, "eval/reward": 0.2}, {"step": 3, "reward": 3}]
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
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           script, "crash", tiny_model, str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "not reached" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert "Signals.SIGKILL" in proc.stderr or "-9" in proc.stderr, proc.stderr[-3000:]
    out = torchrun(script, "load", tiny_model, str(tmp_path)).stdout
    assert "rank 0: ok" in out and "rank 1: ok" in out


# ---- the test: kill -9 a torchrun GRPO run at a random step, resume, compare ------------
GRPO = ["--max_steps", "6", "--save_steps", "2", "--save_total_limit", "2", "--prompts_per_rank", "4",
        "--num_generations", "4", "--per_device_train_batch_size", "8", "--num_eval_prompts", "8",
        "--eval_steps", "3", "--warmup_steps", "8", "--save_model", "False"]  # warmup: the LR schedule must resume too
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


def test_kill_9_and_resume_matches_an_uninterrupted_run(tmp_path):
    full, killed = tmp_path / "full", tmp_path / "killed"
    conftest.run_sh("grpo", *GRPO, env={"RUN_DIR": str(full)})
    kill_after = random.Random(6).randint(3, 5)  # a step past the first checkpoint (step 2)

    env = {**os.environ, "RUN_DIR": str(killed), "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
           "NPROC": "2"}
    with open(tmp_path / "killed.log", "w") as log:  # a file, not a pipe: nobody reads while it runs
        proc = subprocess.Popen(["bash", "run.sh", "grpo", *GRPO], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while not any(r["step"] >= kill_after for r in (train_rows(killed) if (killed / "metrics.jsonl").exists()
                                                     else [])):
        assert proc.poll() is None, (tmp_path / "killed.log").read_text()[-4000:]
        assert time.time() < deadline
        time.sleep(0.05)
    # kill -9 the workers and torchrun at once, as a scheduler ending the job does (killing torchrun's
    # process group is not enough: torchrun starts each worker in a session of its own)
    workers = descendants(proc.pid)
    assert len(workers) >= 2
    for pid in [*workers, proc.pid]:
        os.kill(pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    saved = int(open(killed / "checkpoints" / "latest").read().removeprefix("step"))
    assert 2 <= saved <= kill_after

    out = conftest.run_sh("grpo", *GRPO, "--resume", "True", env={"RUN_DIR": str(killed)})
    assert f"at step {saved}" in out
    want, got = history(full), history(killed)
    assert [r["step"] for r in train_rows(killed)] == [1, 2, 3, 4, 5, 6]  # each step exactly once
    assert len(got) == len(want)
    for w, g in zip(want, got):  # every row, including the held-out evals, in the same order
        assert w.keys() == g.keys(), (w, g)
        for k in w:  # exactly: same data, same samples, same weights, optimizer and LR schedule
            assert g[k] == w[k], (g["step"], k, w[k], g[k])
    assert sorted(os.listdir(killed / "checkpoints")) == ["latest", "step4", "step6"]  # --save_total_limit 2
    assert sorted(os.listdir(full / "checkpoints")) == ["latest", "step4", "step6"]

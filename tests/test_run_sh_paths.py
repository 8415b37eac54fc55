"""run.sh from the user's directory: a relative DATA and --model are read from the directory
run.sh was run from, not the repository, and the default run directory is made there; the
reward modules are found there too (TRL's dotted `module.function`, a module beside the user,
one on a relative PYTHONPATH), called in TRL's form with the row's columns and the completions'
token ids; `--model X` takes the loop's `pretrained` recipe as MODEL=X does (test_ppo.py compares
their estimates)."""

import glob
import json
import os
import subprocess
import sys

from conftest import ROOT, free_port, train_rows
from tasks import default_task, task_model

# the user's reward functions, TRL's form as TRL's docs write it (example 1.1), a dataset column
MYMOD = '''
def reward_func(completions, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of character
    count)."""
    return [float(len(completion)) for completion in completions]


def accuracy_reward(completions, solution, **kwargs):
    return [1.0 if c.strip().startswith(s) else 0.0 for c, s in zip(completions, solution)]
'''
IDSMOD = """
def token_count(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]
"""


def test_relative_paths_are_the_users_and_model_takes_the_recipe(tmp_path):
    user = tmp_path / "user"  # where the user stands: their data, model, rewards and runs
    (user / "lib").mkdir(parents=True)
    train, _ = default_task(num_eval=0)
    rows = [{**r, "solution": r["answer"]} for r in train[:40]]  # a column of their own
    (user / "arith.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (user / "mymod.py").write_text(MYMOD)  # beside the user: no PYTHONPATH needed
    (user / "lib" / "idsmod.py").write_text(IDSMOD)  # on PYTHONPATH=lib, relative to the user
    task_model("", str(user / "tiny"), rank=0, seed=0)  # the built-in task's model, saved
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("MODEL", "DATA", "RUN_DIR")},
        **{"MASTER_PORT": str(free_port()), "NPROC": "2", "OMP_NUM_THREADS": "1"},
        **{"DATA": "arith.jsonl", "PYTHONPATH": "lib"},
    }
    cmd = [
        "bash", os.path.join(ROOT, "run.sh"), "grpo", "--model=tiny/model", "--max_steps", "1",
        "--max_completion_length", "2", "--prompts_per_rank", "2", "--num_eval_prompts", "4",
        "--save_model", "False",
        "--reward_funcs", "mymod.reward_func,mymod.accuracy_reward,idsmod:token_count",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=user, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]

    (run,) = glob.glob(str(user / "runs" / "grpo-*"))  # the default run directory, the user's
    assert not os.path.exists(os.path.join(ROOT, "runs", os.path.basename(run)))
    (row,) = train_rows(run)
    assert row["step"] == 1
    # the completions' token ids as TRL passes them: their count is the completion length
    assert row["rewards/token_count/mean"] == row["completion_len"] > 0
    assert 0 <= row["rewards/reward_func/mean"] <= 2  # characters of at most 2 new tokens
    assert 0 <= row["rewards/accuracy_reward/mean"] <= 1
    saved = json.loads(open(os.path.join(run, "args.json")).read())
    assert saved["data"] == str(user / "arith.jsonl")
    assert saved["model"] == str(user / "tiny" / "model")
    assert saved["run_dir"] == run
    # --model as MODEL: the pretrained recipe under the flags given
    assert saved["recipe"] == "pretrained" and saved["learning_rate"] == 1e-6
    assert saved["max_completion_length"] == 2
    # the run's curves, compared (here with itself) from where the user stands
    assert json.loads(open(os.path.join(run, "panels.json")).read())[0][0] == "reward"
    name = os.path.relpath(run, user)
    cmd = [sys.executable, os.path.join(ROOT, "runlog.py"), name, name, "-o", "both.png"]
    done = subprocess.run(cmd, cwd=user, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and (user / "both.png").stat().st_size > 0, done.stderr

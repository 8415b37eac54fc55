"""run.sh from the user's directory: a relative DATA, --model and RUN_DIR are read from (written
under) the directory run.sh was run from, not the repository; `--model X` takes the loop's
`pretrained` recipe as MODEL=X does (test_ppo.py compares their estimates)."""

import json
import os
import subprocess
import sys

from conftest import ROOT, free_port, train_rows
from tasks import default_task, task_model


def test_relative_paths_are_the_users_and_model_takes_the_recipe(tmp_path):
    user = tmp_path / "user"  # where the user stands: their data, their model, their runs
    user.mkdir()
    train, _ = default_task(num_eval=0)
    (user / "arith.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train[:40]))
    task_model("", str(user / "tiny"), rank=0, seed=0)  # the built-in task's model, saved
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("MODEL", "DATA", "RUN_DIR")},
        **{"MASTER_PORT": str(free_port()), "NPROC": "2", "OMP_NUM_THREADS": "1"},
        **{"DATA": "arith.jsonl", "RUN_DIR": "out"},
    }
    cmd = [
        "bash", os.path.join(ROOT, "run.sh"), "grpo", "--model=tiny/model", "--max_steps", "1",
        "--max_completion_length", "2", "--prompts_per_rank", "2", "--num_eval_prompts", "4",
        "--save_model", "False",
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=user, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]

    run = user / "out"
    assert [r["step"] for r in train_rows(run)] == [1]
    saved = json.loads((run / "args.json").read_text())
    assert saved["data"] == str(user / "arith.jsonl")
    assert saved["model"] == str(user / "tiny" / "model")
    assert saved["run_dir"] == str(run)
    assert not os.path.exists(os.path.join(ROOT, "out"))
    # --model as MODEL: the pretrained recipe under the flags given
    assert saved["recipe"] == "pretrained" and saved["learning_rate"] == 1e-6
    assert saved["max_completion_length"] == 2
    # the run's curves, compared (here with itself) from where the user stands
    assert json.loads((run / "panels.json").read_text())[0][0] == "reward"
    cmd = [sys.executable, os.path.join(ROOT, "runlog.py"), "out", "out", "-o", "both.png"]
    done = subprocess.run(cmd, cwd=user, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and (user / "both.png").stat().st_size > 0, done.stderr

"""End to end through `bash run.sh` on 2 CPU processes, tiny sizes, one run shared per loop:

- `--max_steps 0` scores a model as given on the held-out prompts (reward, accuracy, pass@k with
  --eval_samples > 1), in metrics.jsonl and printed, and trains and saves nothing: a run's final
  model scores what the run's own last held-out score said; --data held out whole.
- A finished run leaves a checkpoint of its last step (--save_last True, the default), so
  `--max_steps N --resume True` extends it; both loops.
"""

import json
import os

import conftest
from conftest import SMALL, train_rows


def rows(run_dir):
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def evals(run_dir):
    return [r for r in rows(run_dir) if "eval/reward" in r]


def assert_evaluation_only(run_dir, out):
    """What --max_steps 0 leaves: one held-out row at step 0, printed; no step, no checkpoint, no
    final model."""
    (row,) = rows(run_dir)
    assert row["step"] == 0 and "eval/reward" in row and "eval/accuracy" in row, row
    assert "as given (--max_steps 0)" in out and "--max_steps 0: evaluated in" in out, out[-3000:]
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "final").exists()
    assert "step 1/" not in out
    return row


def test_grpo_evaluate_a_final_model_then_extend_the_run(tmp_path):
    a, e = tmp_path / "a", tmp_path / "e"
    out = conftest.run_sh("grpo", *SMALL, "--max_steps", "2", env={"RUN_DIR": str(a)})
    assert sorted(os.listdir(a / "checkpoints")) == ["latest", "step2"]  # no --save_steps given
    assert (a / "checkpoints" / "step2" / "policy").is_dir()
    end = evals(a)[-1]
    assert end["step"] == 2

    # the run's final model, evaluated alone on the same held-out prompts (same --data, --seed and
    # --num_eval_prompts: the same split; --recipe '': the run's defaults, where --model alone
    # takes the pretrained recipe), scores what the run's end-of-run evaluation did
    out = conftest.run_sh(
        "grpo",
        *SMALL,
        *("--max_steps", "0", "--recipe", "", "--model", a / "final"),
        env={"RUN_DIR": str(e)},
    )
    row = assert_evaluation_only(e, out)
    assert row["eval/reward"] == end["eval/reward"], (row, end)
    assert row["eval/accuracy"] == end["eval/accuracy"], (row, end)
    assert f"held-out reward at step 0, {a / 'final'} as given (--max_steps 0): " in out
    assert "8 prompts)" in out

    # extend the finished run by one step from the checkpoint of its last one
    out = conftest.run_sh(
        "grpo", *SMALL, "--max_steps", "3", "--resume", "True", env={"RUN_DIR": str(a)}
    )
    assert "resumed from" in out and "at step 2" in out, out[-3000:]
    assert [r["step"] for r in train_rows(a)] == [1, 2, 3]  # each step once
    assert [r["step"] for r in evals(a)] == [0, 2, 3]
    assert sorted(os.listdir(a / "checkpoints")) == ["latest", "step2", "step3"]


def test_ppo_extend_a_finished_run_then_evaluate_on_data_with_pass_at_k(tmp_path):
    a, e = tmp_path / "a", tmp_path / "e"
    conftest.run_sh("ppo", *SMALL, "--max_steps", "1", env={"RUN_DIR": str(a)})
    assert (a / "checkpoints" / "step1" / "actor").is_dir()  # no --save_steps given
    assert (a / "checkpoints" / "step1" / "critic").is_dir()
    out = conftest.run_sh(
        "ppo", *SMALL, "--max_steps", "2", "--resume", "True", env={"RUN_DIR": str(a)}
    )
    assert "resumed from" in out and "at step 1" in out, out[-3000:]
    assert [r["step"] for r in train_rows(a)] == [1, 2]
    assert sorted(os.listdir(a / "checkpoints")) == ["latest", "step1", "step2"]

    # a data file of its own, every row held out (allowed with nothing to train), 2 samples each
    digits = [f"{i:03d}" for i in range(100, 1000, 83)]  # 11 prompts
    data = tmp_path / "eval.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": d + "=", "answer": max(d)}) + "\n" for d in digits)
    )
    flags = ["--data", data, "--num_eval_prompts", len(digits), "--eval_samples", 2]
    out = conftest.run_sh(
        "ppo", *SMALL, "--max_steps", 0, "--model", a / "final", *flags, env={"RUN_DIR": str(e)}
    )
    row = assert_evaluation_only(e, out)
    assert 0 <= row["eval/pass@1"] <= row["eval/pass@2"] <= 1, row
    assert row["eval/pass@1"] == row["eval/accuracy"], row  # the mean over prompts and samples
    assert f"{len(digits)} prompts, pass@2 " in out, out[-3000:]

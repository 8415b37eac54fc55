"""The two-command pipeline at a small size: `bash run.sh rm` on the built-in task's pairs (stopped
after a checkpoint and resumed), then `bash run.sh ppo --reward_model <its final/>`, whose
held-out rows keep the task's own accuracy beside the reward model's score."""

import json
import os

from conftest import run_sh


def rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_rm_then_ppo_on_its_reward_model(tmp_path):
    rm_dir, ppo_dir = str(tmp_path / "rm"), str(tmp_path / "ppo")
    small = ["--num_eval_prompts", "20", "--prompts_per_rank", "8"]
    run_sh("rm", "--run_dir", rm_dir, "--max_steps", "2", "--save_steps", "2", *small)
    run_sh("rm", "--run_dir", rm_dir, "--max_steps", "3", "--resume", "True", *small)
    got = rows(rm_dir)
    steps = [r for r in got if "accuracy" in r and "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]  # resumed at step 2
    for r in steps:
        assert 0 <= r["accuracy"] <= 1 and r["pairs"] == 16 and r["loss"] > 0
    held = [r for r in got if "eval/accuracy" in r]
    assert held and 0 <= held[-1]["eval/accuracy"] <= 1
    final = os.path.join(rm_dir, "final")
    with open(os.path.join(final, "config.json")) as f:
        config = json.load(f)
    assert config["architectures"][0].endswith("ForSequenceClassification")
    assert config["num_labels"] == 1 if "num_labels" in config else len(config["id2label"]) == 1
    assert os.path.isfile(os.path.join(final, "tokenizer_config.json"))

    out = run_sh(
        "ppo",
        "--run_dir",
        ppo_dir,
        "--reward_model",
        final,
        "--max_steps",
        "2",
        "--num_eval_prompts",
        "20",
        "--prompts_per_rank",
        "4",
        "--eval_steps",
        "0",
    )
    assert "held-out reward at end" in out
    held = [r for r in rows(ppo_dir) if "eval/accuracy" in r]
    assert len(held) == 2  # start and end: the task's rule judges the completions
    assert all(0 <= r["eval/accuracy"] <= 1 and r["eval/reward"] == r["eval/reward"] for r in held)

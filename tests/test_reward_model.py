"""reward_model.py builds what `ppo.py --reward_model` takes: the pre-flight's own check accepts it
(one label, the policy's tokenizer), its body is the policy's, it names the run's pad token so a
padded row scores as the row alone; docs/ppo.md's worked example, `python reward_model.py --policy
P` then `bash run.sh ppo --model P --reward_model ...`, runs a step scored by it."""

import os
import subprocess
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

import conftest
from checks import check_beside, load_tokenizer
from conftest import ROOT, train_rows
from reward_model import build_reward_model
from tasks import task_model


def test_builds_what_the_preflight_accepts(tmp_path, tiny_model):
    # a policy whose config names no pad token (as many do): the reward model must name the run's
    policy = str(tmp_path / "policy")
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    model.config.pad_token_id = None
    model.save_pretrained(policy)
    load_tokenizer(tiny_model).save_pretrained(policy)
    tokenizer = load_tokenizer(policy)

    rm = build_reward_model(str(tmp_path / "rm"), policy, seed=1)
    check_beside(rm, "--reward_model", tokenizer, "")  # the pre-flight's check: no RunError
    assert AutoConfig.from_pretrained(rm).num_labels == 1
    reward = AutoModelForSequenceClassification.from_pretrained(rm).eval()
    assert torch.equal(reward.model.embed_tokens.weight, model.model.embed_tokens.weight)
    # a right-padded batch as ppo.score passes it: each row's score is the row's alone
    ids = [tokenizer("12=3")["input_ids"], tokenizer("4=")["input_ids"]]
    pad = tokenizer.pad_token_id
    batch = torch.tensor([ids[0], ids[1] + [pad] * (len(ids[0]) - len(ids[1]))])  # (2, T)
    with torch.no_grad():
        both = reward(input_ids=batch, attention_mask=(batch != pad).long()).logits  # (2, 1)
        alone = [reward(input_ids=torch.tensor([i])).logits[0, 0] for i in ids]
    assert torch.allclose(both[:, 0], torch.stack(alone), atol=1e-5)

    # without --policy: a tiny one in the built-in task's vocabulary
    task = task_model("", str(tmp_path / "task"), rank=0, seed=0)
    rm_task = build_reward_model(str(tmp_path / "rm_task"))
    check_beside(rm_task, "--reward_model", load_tokenizer(task), "")


def test_worked_example_runs_ppo(tmp_path, tiny_model):
    rm, run_dir = str(tmp_path / "rm"), tmp_path / "run"
    cmd = [sys.executable, "reward_model.py", "--policy", tiny_model, "--path", rm]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env=os.environ)
    conftest.run_sh(
        "ppo",
        *("--model", tiny_model, "--reward_model", rm, "--max_steps", "1", "--recipe", ""),
        *("--prompts_per_rank", "4", "--num_generations", "2", "--num_eval_prompts", "0"),
        *("--per_device_train_batch_size", "4", "--save_model", "False"),
        env={"RUN_DIR": str(run_dir)},
    )
    (row,) = train_rows(run_dir)
    assert "accuracy" not in row and row["reward_std"] > 0  # the model's scores, not the rules'
    assert row["value_mean"] == 0.0  # the critic starts as the actor, with a zero value head

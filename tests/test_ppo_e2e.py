"""End to end: `bash run.sh ppo` on 2 CPU processes, ZeRO-3, 2-3 steps each, on the default task.

- Rule-based reward, checkpoint, and resume: the resumed step reproduces the uninterrupted run's
  step (same data, same samples, same actor and critic weights).
- A tiny reward model (which also initialises the critic), with packing, token-budget
  micro-batches, middle-mode generation, gradient checkpointing, frozen models offloaded to CPU,
  eager attention, two mini-batches per pass, one held-out prompt for two ranks, top_k 6 and
  top_p 0.9.
- LoRA on actor and critic (the reference is the actor with adapters off), when peft is installed.
"""

import json
import shutil
import signal

import pytest

import conftest
import ppo
from conftest import train_rows
from tasks import TASK_CHARS
from tiny_models import build_tiny

SMALL = [
    "--prompts_per_rank",
    "4",
    "--num_generations",
    "2",
    "--num_eval_prompts",
    "8",
    "--per_device_train_batch_size",
    "4",
    "--eval_steps",
    "0",
]


def run_sh(*args, **kw):
    return conftest.run_sh("ppo", *SMALL, *args, **kw)  # the test's args last: they win over SMALL


def test_zero3_rule_reward_checkpoint_and_resume(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    out = run_sh("--max_steps", "3", "--save_steps", "2", env={"RUN_DIR": str(a)})
    assert "held-out reward: start" in out
    full = train_rows(a)
    assert [r["step"] for r in full] == [1, 2, 3]
    for name in (
        "final/config.json",
        "final/tokenizer.json",
        "curves.png",
        "args.json",
        "ppo.py",
        "checkpoints/latest",
        "checkpoints/step2/actor",
        "checkpoints/step2/critic",
        "checkpoints/step2/config.json",
        "checkpoints/step3/actor",  # the last step's (--save_last True, the default)
    ):
        assert (a / name).exists(), name
    assert json.load(open(a / "args.json"))["ds_config_resolved"]["zero_optimization"]["stage"] == 3
    r = full[0]
    assert r["mem/update"] > 0 and r["value_loss"] > 0 and 0 < r["entropy"]
    # the per-model profile: every pass timed, together within the step's no-grad + update time
    passes = ("old_logps", "values", "ref_logps", "actor_forward", "actor_backward")
    passes += ("critic_forward", "critic_backward", "optimizer")
    assert all(r[f"time/{k}"] > 0 for k in passes), r
    assert sum(r[f"time/{k}"] for k in passes) <= r["step_s"] - r["rollout_s"]
    assert r["kl"] == 0.0  # the first rollout comes from the reference weights themselves
    assert r["value_mean"] == 0.0  # a critic from the actor starts with a zero value head
    assert full[1]["kl"] != 0.0 and full[1]["value_mean"] != 0.0  # both models moved after one step

    # resume a copy of the run from its step-2 checkpoint: step 3 must come out the same
    b.mkdir()
    shutil.copytree(a / "model", b / "model")
    shutil.copytree(a / "checkpoints", b / "checkpoints")
    (b / "checkpoints" / "latest").write_text("step2")  # not the last step's, step3
    out = run_sh(
        "--max_steps", "3", "--resume", "True", "--save_model", "False", env={"RUN_DIR": str(b)}
    )
    assert "resumed from" in out and "at step 2" in out
    resumed = train_rows(b)
    assert [r["step"] for r in resumed] == [3]
    for key in ("reward", "accuracy", "completion_len", "rewards/correct_reward/mean"):
        assert resumed[0][key] == full[2][key], key  # same prompts, same samples
    # same actor, critic, optimizers
    for key in ("entropy", "kl", "value_mean", "value_loss", "policy_loss"):
        assert resumed[0][key] == pytest.approx(full[2][key], rel=1e-5, abs=1e-7), key
    assert abs(resumed[0]["value_mean"] - full[0]["value_mean"]) > 1e-4  # not an untrained critic

    # another config cannot resume: the message names what differs (before any step runs)
    proc = run_sh(
        "--max_steps",
        "4",
        "--resume",
        "True",
        "--critic_learning_rate",
        "0.5",
        env={"RUN_DIR": str(b)},
        wait=False,
    )
    out, _ = proc.communicate(timeout=600)
    # pre-flight
    assert proc.returncode == 2 and "critic_learning_rate: " in out and "-> 0.5" in out, out[-3000:]
    assert [r["step"] for r in train_rows(b)] == [3]

    # Ctrl-C (SIGINT to run.sh) once step 1 is logged: the ranks finish the step in progress, save
    # it, stop (exit 5); --resume then ends the run with the uninterrupted run's numbers. The run
    # is far longer than the signal takes to arrive (max_steps only sets how long it goes: the
    # same steps as the 3-step run's, checkpoint.RESUME_MAY_CHANGE), so it stops on the signal,
    # never by reaching its end first (a 3-step run did, on a slower machine)
    c = tmp_path / "c"
    proc = run_sh("--max_steps", "50", env={"RUN_DIR": str(c)}, wait=False)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("step 1/50"):
            proc.send_signal(signal.SIGINT)
    out = "".join(lines)
    assert proc.wait(timeout=300) == 5, out[-3000:]
    step = int(open(c / "checkpoints" / "latest").read().removeprefix("step"))
    assert 1 <= step < 50 and f"stopped: SIGINT received; stopped after step {step}" in out, out[
        -3000:
    ]
    if step < 3:
        resume = ["--max_steps", "3", "--resume", "True", "--save_model", "False"]
        run_sh(*resume, env={"RUN_DIR": str(c)})
    rows = train_rows(c)[:3]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("reward", "completion_len", "entropy", "kl", "value_loss"):
        assert rows[2][key] == pytest.approx(full[2][key], rel=1e-5, abs=1e-7), key


def test_zero3_reward_model_packing_offload(tmp_path):
    # the actor's vocabulary
    rm = build_tiny(str(tmp_path / "rm"), reward_model=True, chars=TASK_CHARS, seed=3)
    out = run_sh(
        "--max_steps",
        "2",
        "--reward_model",
        rm,
        "--critic_from_reward_model",
        "True",
        "--packing",
        "True",
        "--gradient_checkpointing",
        "True",
        "--frozen_offload",
        "True",
        "--attn_implementation",
        "eager",
        "--num_mini_batches",
        "2",
        "--per_device_train_batch_size",
        "2",
        "--max_tokens_per_microbatch",
        "24",
        "--gather_for_generation",
        "False",
        "--generation_resident_gb",
        "0.0001",
        "--save_model",
        "False",
        "--num_eval_prompts",  # fewer than ranks: one rank scores nothing, yet joins in
        "1",
        "--top_p",  # HF's nucleus after its top-k (the whole tie at the k-th value); the old
        "0.9",  # pass's cut kept, packed, for both mini-batches
        "--top_k",
        "6",
        env={"RUN_DIR": str(tmp_path / "r")},
    )
    rows = train_rows(tmp_path / "r")
    assert [r["step"] for r in rows] == [1, 2]
    assert "held-out reward: start" in out and "1 prompts)" in out
    for r in rows:
        assert "accuracy" not in r and r["reward_std"] > 0  # model scores, not rule-based
        assert r["value_loss"] > 0 and r["entropy"] > 0
    # --critic_from_reward_model: the critic starts as the reward model (body and score head),
    # its values not all zero
    assert rows[0]["value_mean"] != 0.0
    saved = json.load(open(tmp_path / "r" / "args.json"))
    assert saved["packing"] is True and saved["max_tokens_per_microbatch"] == 24
    assert saved["generation_resident_gb"] == 0.0001 and saved["top_k"] == 6


def test_zero3_lora(tmp_path):
    pytest.importorskip("peft")
    out = run_sh(
        "--max_steps",
        "2",
        "--lora_r",
        "8",
        "--learning_rate",
        "1e-2",
        "--log_completions",
        "True",
        env={"RUN_DIR": str(tmp_path / "r")},
    )
    rows = train_rows(tmp_path / "r")
    assert [r["step"] for r in rows] == [1, 2]
    with open(tmp_path / "r" / "completions.jsonl") as f:  # rank 0's samples and their scores
        samples = [json.loads(line) for line in f]
    assert [r["step"] for r in samples] == [1] * 8 + [2] * 8
    assert {"prompt", "completion", "reward", "rewards/correct_reward"} <= set(samples[0])
    # adapters start at zero: actor == reference
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert rows[1]["kl"] != 0.0  # the reference (adapters off) stays put while the adapters move
    # the pre-flight's disk estimate: actor, critic and adapter per checkpoint; adapter, merged
    argv = [*SMALL, "--max_steps", "2", "--lora_r", "8", "--learning_rate", "1e-2"]
    conftest.assert_writes_as_estimated(tmp_path / "r", ppo, argv, 2)
    # the actor's adapter in final/ and in the last checkpoint, its merged model beside it
    conftest.assert_adapter_is_the_merged_model(
        tmp_path / "r", tmp_path / "r" / "checkpoints" / "step2" / "adapter"
    )
    assert "held-out reward: start" in out

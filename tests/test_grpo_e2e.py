"""End to end: `bash run.sh grpo` on 2 CPU processes, 2-3 steps each, on the default task.

- ZeRO-3, HF generation (gathered): what a run leaves (final model, curves, args, checkpoint,
  per-phase memory); resume after kill -9 is tests/test_checkpoint.py's; then a teacher, with one
  held-out prompt for two ranks.
- ZeRO-2, vLLM generation with weight sync, reference model (beta > 0), num_iterations 2,
  truncated importance sampling, loss_type grpo, top-k and nucleus sampling (top_k 5, top_p 0.8);
  then HF generation with top_k 5 alone over two iterations.
- Two nodes on loopback (two launches with NNODES=2), ZeRO-3 sharded generation, token-budget
  micro-batches packed into rows (--packing), loss_type dr_grpo, JSONL data with reward functions
  given as module:function.
"""

import json
import math

import pytest

import conftest
import grpo
from conftest import SMALL, finish, free_port, train_rows


def run_sh(*args, **kw):
    return conftest.run_sh("grpo", *args, *SMALL, **kw)  # SMALL last: it wins over the test's args


def test_zero3_hf_outputs_and_checkpoint(tmp_path):
    a = tmp_path / "a"
    log = ["--log_completions", "True", "--num_completions_to_print", "2", "--report_to", "wandb"]
    out = run_sh("--max_steps", "3", "--save_steps", "2", *log, env={"RUN_DIR": str(a)})
    assert "held-out reward: start" in out
    # the reward and disk lines once: from run.sh's pre-flight, not again from rank 0
    assert out.count("\nreward: ") == 1 and out.count("\ndisk: the run writes") == 1, out
    full = train_rows(a)
    assert [r["step"] for r in full] == [1, 2, 3]
    for name in (
        "final/config.json",
        "final/tokenizer.json",
        "curves.png",
        "args.json",
        "grpo.py",
        "checkpoints/latest",
        "checkpoints/step2/config.json",
        "checkpoints/step2/policy",
        "checkpoints/step3/policy",  # the last step's (--save_last True, the default)
    ):
        assert (a / name).exists(), name
    assert json.load(open(a / "args.json"))["ds_config_resolved"]["zero_optimization"]["stage"] == 3
    assert full[0]["mem/update"] > 0 and full[0]["tokens_per_s"] > 0
    assert {"mem/rollout", "mem/optimizer_step"} <= set(
        full[0]
    ) and "peak memory (peak RSS" in out  # ledger

    # the pre-flight's disk estimate against the files: a checkpoint, the final model
    conftest.assert_writes_as_estimated(
        a, grpo, [*SMALL, "--max_steps", "3", "--save_steps", "2"], 2
    )

    # --log_completions: rank 0's 2 prompts x 4 completions each step, their rewards (the total
    # the task's weighted sum), advantages (each group's sum 0), printed and in wandb's table
    samples = [json.loads(line) for line in open(a / "completions.jsonl")]
    assert [r["step"] for r in samples] == [s for s in (1, 2, 3) for _ in range(8)]
    for r in samples:
        assert r["prompt"].endswith("=") and isinstance(r["completion"], str)
        parts = 0.25 * r["rewards/format_reward"] + 0.75 * r["rewards/correct_reward"]
        assert r["reward"] == pytest.approx(parts)
    for group in zip(*[iter(samples)] * 4):
        assert sum(r["advantage"] for r in group) == pytest.approx(0.0, abs=1e-4)
    assert f"  {samples[0]['prompt']!r} -> {samples[0]['completion']!r}: reward" in out
    tables = list((a / "wandb").glob("offline-run-*/files/media/table/completions_*.table.json"))
    assert len(tables) == 3, tables  # one per step
    table = json.load(open(sorted(tables)[0]))
    assert table["columns"][:4] == ["step", "prompt", "completion", "reward"]
    assert len(table["data"]) == 8

    # kill -9 and --resume, compared step by step with an uninterrupted run:
    # tests/test_checkpoint.py

    # on-policy distillation from that run's final model (the same start, 3 steps on): the
    # teacher is built partitioned like a reference and its reverse KL is the advantage
    # one held-out prompt on two ranks: the rank without one joins the gathered generation and
    # the score's all-reduce with nothing to add
    d = tmp_path / "d"
    out = conftest.run_sh("grpo", *SMALL, "--max_steps", "1", "--teacher_model", str(a / "final"),
                          "--distill_only", "True", "--save_model", "False",
                          "--num_eval_prompts", "1", env={"RUN_DIR": str(d)})  # fmt: skip
    (row,) = train_rows(d)
    assert row["distill/reverse_kl"] != 0 and row["mem/teacher_logprobs"] > 0
    assert row["ratio"] == 1.0  # one iteration: on-policy, as without a teacher
    assert "(accuracy" in out and "1 prompts)" in out and "held-out reward: start" in out


def test_zero2_vllm_reference_iterations(tmp_path):
    out = run_sh(
        "--max_steps",
        "2",
        "--use_vllm",
        "True",
        "--beta",
        "0.04",
        "--num_iterations",
        "2",
        "--vllm_importance_cap",
        "2.0",
        "--vllm_importance_mode",
        "sequence_mask",
        "--vllm_importance_min",
        "0.5",
        "--loss_type",
        "grpo",
        "--top_p",  # nucleus sampling: the trainer scores under the nucleus vLLM sampled from
        "0.8",
        "--top_k",  # after a top-k cut, with vLLM's CPU rule (the whole tie at the k-th value)
        "5",
        "--save_model",
        "False",
        env={"RUN_DIR": str(tmp_path / "r"), "DS_CONFIG": "configs/zero2.json"},
    )
    rows = train_rows(tmp_path / "r")
    assert [r["step"] for r in rows] == [1, 2]
    assert {
        f"mem/{p}" for p in ("weight_sync", "rollout", "old_logprobs", "ref_logprobs", "update")
    } <= set(rows[0])
    for r in rows:
        assert r["kl"] > 0  # the second iteration has moved away from the reference
        assert r["ratio"] != 1.0  # ... and from the old policy
        # weights synced into vLLM: its log-probs of its own samples match the trainer's (both
        # under the top-k and nucleus cut: the full softmax puts the gap near -log 0.8 = 0.22)
        assert r["vllm_is_ratio"] == pytest.approx(1.0, abs=1e-3)
        assert r["vllm_is_outside_seqs"] == r["vllm_is_outside_tokens"] == 0.0  # none masked
    conftest.assert_vllm_holds_trainer_weights(rows)
    assert "held-out reward: start" in out


def test_top_k_hf_generation_iterations(tmp_path):
    """--top_k 5 with HF generation (transformers' top-k warper, the whole tie at the k-th value):
    the old pass finds each token's cut and both iterations score under it."""
    args = ["--max_steps", "2", "--top_k", "5", "--num_iterations", "2", "--save_model", "False"]
    run_sh(*args, env={"RUN_DIR": str(tmp_path / "r")})
    rows = train_rows(tmp_path / "r")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["mem/old_logprobs"] > 0  # the old pass ran (num_iterations 2)
        assert math.isfinite(r["loss"]) and math.isfinite(r["ratio"])
        assert r["ratio"] != 1.0  # the second iteration's: the policy moved
    with open(tmp_path / "r" / "args.json") as f:
        assert json.load(f)["top_k"] == 5


def test_two_nodes_loopback_sharded_token_budget_jsonl(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"{i:02d}=", "answer": str(i % 10)}) + "\n" for i in range(40)
        )
    )
    env = {
        "RUN_DIR": str(tmp_path / "r"),
        "NNODES": "2",
        "NPROC": "1",
        "MASTER_PORT": str(free_port()),
    }
    args = [
        "--max_steps",
        "2",
        "--gather_for_generation",
        "False",
        "--max_tokens_per_microbatch",
        "20",
        "--packing",
        "True",
        "--loss_type",
        "dr_grpo",
        "--save_model",
        "False",
        "--data",
        str(data),
        "--reward_funcs",
        "tasks:correct_reward,tasks:format_reward",
        "--reward_weights",
        "1,0.5",
    ]
    procs = [run_sh(*args, env={**env, "NODE_RANK": str(n)}, wait=False) for n in (0, 1)]
    outs = [finish(p) for p in procs]
    rows = train_rows(tmp_path / "r")
    assert [r["step"] for r in rows] == [1, 2]
    assert "held-out reward: start" in outs[0]
    assert json.load(open(tmp_path / "r" / "args.json"))["world_size"] == 2
    assert {"rewards/correct_reward/mean", "rewards/format_reward/mean"} <= set(rows[0])
    assert 0 <= rows[0]["reward"] <= 1.5


def test_zero3_lora_vllm_sync_adapter_and_merged_final_model(tmp_path):
    """LoRA: 2 steps on ZeRO-3 with vLLM generating from the merged weights (its log-probs of its
    own samples match the trainer's at step 2, after the adapters moved), the reference is the
    policy with adapters off (KL > 0 once they moved), and only the adapted linear layers
    changed. The adapter is in final/ and in the last checkpoint as peft saves it: peft's
    `PeftModel.from_pretrained(base, path)` on the base model gives the merged model's logits."""
    pytest.importorskip("peft")
    import torch
    from safetensors.torch import load_file

    run = tmp_path / "r"
    run_sh(
        "--max_steps",
        "2",
        "--use_vllm",
        "True",
        "--lora_r",
        "8",
        "--learning_rate",
        "5e-2",
        "--beta",
        "0.04",
        "--num_iterations",
        "2",
        "--vllm_importance_cap",
        "2.0",
        env={"RUN_DIR": str(run)},
    )
    rows = train_rows(run)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[1]["kl"] > 0  # adapters on vs off
    for r in rows:
        assert r["vllm_is_ratio"] == pytest.approx(1.0, abs=1e-3)  # vLLM holds the merged weights
    before, after = (
        load_file(run / "model" / "model.safetensors"),
        load_file(run / "final_merged" / "model.safetensors"),
    )
    assert set(after) == set(before)  # the merged model is a plain model: base-model names
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.endswith(("_proj.weight",)) for k in changed), sorted(changed)
    assert not any("embed" in k or "norm" in k or "lm_head" in k for k in changed)
    conftest.assert_adapter_is_the_merged_model(run, run / "checkpoints" / "step2" / "adapter")

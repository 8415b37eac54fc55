"""The pre-flight refuses a stop id that is ordinary text to the tokenizer (checks.check_stop_ids):
a Llama saved with Qwen2.5's tokenizer but LlamaConfig's eos_token_id 2, which is "#" there, would
cut every `#### 72` answer at its first "#"."""

import json
import os

import pytest

import grpo
from conftest import ROOT
from exits import EXIT_CONFIG, entry
from tiny_models import build_family

TOKENIZER = os.path.join(ROOT, "..", "shared", "assets", "qwen2.5-tokenizer")
pytestmark = pytest.mark.skipif(
    not os.path.isdir(TOKENIZER), reason=f"needs the Qwen2.5 tokenizer in {TOKENIZER}"
)


def test_a_stop_id_that_is_text_is_refused_with_the_token_and_the_fix(tmp_path, capsys):
    model = build_family(str(tmp_path / "m"), "llama", tokenizer_dir=TOKENIZER, hidden_size=64)
    data = tmp_path / "math.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "answer": "#### 1"}) + "\n" for i in range(30))
    )
    argv = [
        "--preflight", "True", "--model", model, "--data", str(data), "--num_eval_prompts", "5",
        "--run_dir", str(tmp_path / "run"),
        "--ds_config", os.path.join(ROOT, "configs", "zero3.json"),
        "--reward_funcs", "rewards:math_reward",
    ]  # fmt: skip
    assert entry(grpo.main, argv) == 0  # as built: eos ids <|im_end|> and <|endoftext|>, special
    capsys.readouterr()

    gen = os.path.join(model, "generation_config.json")
    with open(gen) as f:
        config = json.load(f)
    config["eos_token_id"] = 2  # LlamaConfig's default: "#" in Qwen2.5's vocabulary
    with open(gen, "w") as f:
        json.dump(config, f)
    assert entry(grpo.main, argv) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.count("error:") == 1, err
    for said in (
        "stop token id 2 is '#', ordinary text",
        f"eos_token_id in {gen}",
        "'<|im_end|>', id 151645",  # the tokenizer's eos
    ):
        assert said in err, (said, err)

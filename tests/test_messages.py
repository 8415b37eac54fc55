"""What the user reads: a missing field named as the user mapped it, --help's words (the group,
the run directory's real default), the KL coefficient under either loop's name, and the chat
template's own system turn as docs/data.md describes it."""

import json
import os
import re

import pytest

import grpo
import ppo
from arguments import _parser
from batching import encode_prompts
from conftest import ROOT
from exits import EXIT_CONFIG, entry
from preflight import default_run_dir

TOKENIZER = os.path.join(ROOT, "..", "shared", "assets", "qwen2.5-tokenizer")


def test_a_missing_answer_is_named_by_the_users_field(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    rows = [{"question": f"{i}=", "solution": str(i)} for i in range(12)]
    rows[3] = {"question": "3="}  # no solution
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = [
        "--preflight", "True", "--data", str(data), "--prompt_field", "question",
        "--answer_field", "solution", "--num_eval_prompts", "2", "--run_dir", str(tmp_path / "r"),
        "--ds_config", os.path.join(ROOT, "configs", "zero3.json"),
    ]  # fmt: skip
    assert entry(grpo.main, argv) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert f"--data {data} line 4 (prompt '3=') has no \"solution\" (1 of 12 rows" in err, err
    assert '"answer"' not in err


@pytest.mark.parametrize("loop", [grpo, ppo], ids=["grpo", "ppo"])
def test_help_says_group_and_the_run_dirs_real_default(loop):
    text = " ".join(_parser(loop.Args).format_help().split())  # argparse's wrapping undone
    assert "--num-generations NUM_GENERATIONS G, the group size: completions per prompt" in text
    said = "final model (default: runs/<algo>-<start time>, e.g. runs/grpo-20250101-120000) --"
    assert said in text and "(default: runs/grpo)" not in text
    name = loop.__name__
    assert re.fullmatch(rf"runs/{name}-\d{{8}}-\d{{6}}", default_run_dir(loop.parse_args([])))


def test_the_kl_coefficient_under_either_name_in_both_loops():
    for flag in ("--beta", "--kl_coef"):  # the old command of each loop, and the other's name
        assert grpo.parse_args([flag, "0.04"]).beta == 0.04
        assert ppo.parse_args([flag, "0.2"]).kl_coef == 0.2
    for loop in (grpo, ppo):
        text = " ".join(_parser(loop.Args).format_help().split())
        assert "KL coefficient:" in text and "--kl_coef" in text and "--beta" in text


@pytest.mark.skipif(not os.path.isdir(TOKENIZER), reason=f"needs the tokenizer in {TOKENIZER}")
def test_a_template_adds_its_system_turn_and_a_tokenizer_without_one_passes_text(tmp_path):
    """docs/data.md: Qwen2.5's template adds a system turn, one of the user's replaces it, and a
    copy of the tokenizer saved without a template passes the prompt as it is."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TOKENIZER)

    def text(tokenizer, prompt):
        return tokenizer.decode(encode_prompts(tokenizer, [{"prompt": prompt}], 512)[0])

    assert text(tok, "2+2=") == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n"
    )
    own = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}]
    assert text(tok, own).startswith("<|im_start|>system\nBe brief.<|im_end|>")
    tok.chat_template = None
    tok.save_pretrained(tmp_path / "raw")
    assert text(AutoTokenizer.from_pretrained(tmp_path / "raw"), "2+2=") == "2+2="

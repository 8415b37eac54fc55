"""The real chat path: the real Qwen2.5 tokenizer and its chat template (../shared/assets) with a
tiny random Qwen2 model of its vocabulary (151,665): string and conversational prompts through the
template, --chat_template_kwargs, the stop ids (eos ids + the template's end of turn), HF
generation stopping at <|im_end|>, and `bash run.sh` GRPO (vLLM) and PPO (HF generation) runs on
conversational data whose completions reach the rewards without special tokens and whose final
model keeps its tokenizer and template."""

import json
import os
import shutil

import pytest
import torch

from batching import encode_prompts, stop_token_ids, template_kwargs
from conftest import ROOT, run_sh, train_rows

TOKENIZER = os.path.join(ROOT, "..", "shared", "assets", "qwen2.5-tokenizer")
pytestmark = pytest.mark.skipif(
    not os.path.isdir(TOKENIZER),
    reason=f"needs the Qwen2.5 tokenizer at {TOKENIZER} (../shared/assets beside the checkout)",
)
IM_END, ENDOFTEXT = 151645, 151643
SYSTEM = [{"role": "system", "content": "Answer with a number."}]
# Written for the tests: the Qwen2.5 template as it renders these (its default system prompt when
# the conversation has none).
QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny random Qwen2 (hidden 64, 2 layers, untied lm_head) with the real tokenizer, whose
    <|im_end|> row of lm_head makes greedy decoding of the conversational prompt below end its turn
    after exactly 2 ordinary tokens: the row is the hidden state that predicts the third token,
    made orthogonal to the two before it (so their logits of <|im_end|> are 0) and scaled 5 above
    that position's largest logit. Returns (path, the 2 tokens)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tiny_models import build_family

    path = str(tmp_path_factory.mktemp("chat") / "model")
    build_family(path, "qwen2", tokenizer_dir=TOKENIZER, hidden_size=64)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    ids = torch.tensor(encode_prompts(tok, [{"prompt": SYSTEM + [USER]}], 10**6))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=2, do_sample=False, eos_token_id=None)
        h = model(out, output_hidden_states=True).hidden_states[-1][0, -3:]  # (3, 64) normed
        logits = model.lm_head(h)  # (3, V)
        w = h[2] - sum((h[2] @ u) / (u @ u) * u for u in _basis(h[:2]))  # (64,)
        model.lm_head.weight[IM_END] = (logits[2].max() + 5) * w / (w @ h[2])
    model.save_pretrained(path)
    return path, out[0, ids.shape[1] :].tolist()


def _basis(vectors):
    """Orthogonal vectors spanning `vectors` (Gram-Schmidt)."""
    out = []
    for v in vectors:
        out.append(v - sum((v @ u) / (u @ u) * u for u in out))
    return out


USER = {"role": "user", "content": "What is 2 + 3?"}


def test_prompts_through_the_template(tokenizer):
    """A string is one user turn (the template adds its default system prompt); a conversation is
    rendered as it is, its system turn included; both end with the assistant's generation prompt;
    the text is tokenized without extra special tokens; the left end is cut."""
    rows = [{"prompt": "What is 2 + 3?"}, {"prompt": SYSTEM + [USER]}]
    texts = [tokenizer.decode(i) for i in encode_prompts(tokenizer, rows, 10**6)]
    turn = "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert texts[0] == f"<|im_start|>system\n{QWEN_DEFAULT_SYSTEM}<|im_end|>\n" + turn
    assert texts[1] == "<|im_start|>system\nAnswer with a number.<|im_end|>\n" + turn
    ids = encode_prompts(tokenizer, rows, 10**6)[1]
    assert ids == tokenizer(texts[1], add_special_tokens=False)["input_ids"]
    assert encode_prompts(tokenizer, rows, 5)[1] == ids[-5:]


def test_chat_template_kwargs_reach_the_template(tokenizer):
    """--chat_template_kwargs is parsed as JSON and passed to apply_chat_template: the Qwen2.5
    template's `tools` argument writes the tools into the system turn; a template that reads
    enable_thinking (as Qwen3's does) sees it."""
    tools = template_kwargs('{"tools": [{"type": "function", "function": {"name": "add"}}]}')
    text = tokenizer.decode(encode_prompts(tokenizer, [{"prompt": [USER]}], 10**6, tools)[0])
    assert '<tools>\n{"type": "function", "function": {"name": "add"}}\n</tools>' in text
    assert template_kwargs("") == {}
    tok = tokenizer.__class__.from_pretrained(TOKENIZER)
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    )
    off = template_kwargs('{"enable_thinking": false}')
    assert tok.decode(encode_prompts(tok, [{"prompt": "q"}], 99, off)[0]) == "q<think></think>"
    assert tok.decode(encode_prompts(tok, [{"prompt": "q"}], 99)[0]) == "q"
    for bad, msg in (("{enable_thinking: false}", "is not JSON"), ("[1]", "is a JSON list")):
        with pytest.raises(ValueError, match=msg):
            template_kwargs(bad)


def test_stop_ids_come_from_tokenizer_config_and_template(tokenizer, tmp_path):
    """The tokenizer's eos, every id of generation_config's eos list, and the template's end of
    turn: a base-model set-up (eos and config both <|endoftext|>) still stops at <|im_end|>."""
    from transformers import AutoTokenizer, GenerationConfig

    GenerationConfig(eos_token_id=[IM_END, ENDOFTEXT]).save_pretrained(tmp_path / "instruct")
    assert stop_token_ids(tokenizer, str(tmp_path / "instruct")) == [ENDOFTEXT, IM_END]
    base = AutoTokenizer.from_pretrained(TOKENIZER)
    base.eos_token = "<|endoftext|>"
    GenerationConfig(eos_token_id=ENDOFTEXT).save_pretrained(tmp_path / "base")
    assert stop_token_ids(base, str(tmp_path / "base")) == [ENDOFTEXT, IM_END]
    base.chat_template = None  # no template: only the eos ids
    assert stop_token_ids(base, str(tmp_path / "base")) == [ENDOFTEXT]


def test_hf_generation_stops_at_im_end(chat_model):
    """HF generation with the run's stop ids ends the turn at <|im_end|> (kept, masked in) and the
    decoded completion has no special tokens; with only <|endoftext|> as eos it runs on."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from generation import generate_hf

    path, first_two = chat_model
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompt = encode_prompts(tok, [{"prompt": SYSTEM + [USER]}], 10**6)
    kw = dict(max_new_tokens=6, greedy=True, pad_token_id=tok.pad_token_id)
    gens = generate_hf(model, prompt, eos_token_id=stop_token_ids(tok, path), **kw)
    assert gens.completion_ids[0].tolist() == first_two + [IM_END]
    assert gens.completion_mask[0].tolist() == [1, 1, 1]
    text = tok.batch_decode(gens.completion_ids, skip_special_tokens=True)[0]
    assert text == tok.decode(first_two) and "<|" not in text
    runs_on = generate_hf(model, prompt, eos_token_id=[ENDOFTEXT], **kw)
    assert runs_on.completion_ids[0, :3].tolist() == first_two + [IM_END]
    assert runs_on.completion_mask[0].sum() == 6


REWARDS = """import json, os
def record(prompts, completions, answers):
    with open(os.environ["CHAT_LOG"], "a") as f:
        f.write(json.dumps({"prompts": prompts, "completions": completions}) + "\\n")
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answers)]
"""


@pytest.mark.parametrize("loop", ["grpo", "ppo"])
def test_run_sh_on_conversations(chat_model, tmp_path, loop):
    """`bash run.sh` on 2 processes, conversational JSONL with system turns, low temperature (so
    greedy-like): GRPO generates with vLLM, PPO with HF. Every completion ends its turn at
    <|im_end|> after the model's 2 tokens (length 3 of --max_completion_length 8, in both
    generators), reaches the reward as text without special tokens beside its prompt, a list of
    messages; the final model has the tokenizer and the chat template. GRPO's model is made
    base-like (tokenizer and generation_config eos both <|endoftext|>), so vLLM stops at
    <|im_end|> only through the stop ids the run found in the template."""
    from transformers import AutoTokenizer, GenerationConfig

    path, first_two = chat_model
    if loop == "grpo":
        shutil.copytree(path, tmp_path / "base")
        path = str(tmp_path / "base")
        tok = AutoTokenizer.from_pretrained(path)
        tok.eos_token = "<|endoftext|>"
        tok.save_pretrained(path)
        gen = GenerationConfig.from_pretrained(path)
        gen.eos_token_id = ENDOFTEXT
        gen.save_pretrained(path)
    rows = [{"prompt": SYSTEM + [USER], "answer": "5"}] * 6
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "chatrewards.py").write_text(REWARDS)
    log, run_dir = tmp_path / "completions.jsonl", tmp_path / "run"
    # PREFLIGHT=0: each rank runs the same checks (check_inputs) before it loads a model
    env = {"PYTHONPATH": str(tmp_path), "CHAT_LOG": str(log), "PREFLIGHT": "0"}
    args = [
        "--model", path, "--recipe", "", "--data", data, "--run_dir", run_dir, "--max_steps", "1",
        "--num_eval_prompts", "2", "--prompts_per_rank", "1", "--num_generations", "2",
        "--max_completion_length", "8", "--temperature", "0.01",
        "--reward_funcs", "chatrewards:record", "--chat_template_kwargs", '{"tools": null}',
    ]  # fmt: skip
    if loop == "grpo":
        args += ["--use_vllm", "True"]
    run_sh(loop, *args, env=env)
    (row,) = train_rows(run_dir)
    assert row["completion_len"] == 3, row
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    completions = {c for s in seen for c in s["completions"]}
    # the pre-flight's probe scores the answer and "" too
    assert completions == {"5", "", AutoTokenizer.from_pretrained(path).decode(first_two)}
    assert all(p == SYSTEM + [USER] for s in seen[-2:] for p in s["prompts"])
    final = run_dir / "final"
    saved = AutoTokenizer.from_pretrained(final)
    assert saved.chat_template == AutoTokenizer.from_pretrained(TOKENIZER).chat_template
    eos = json.loads((final / "generation_config.json").read_text())["eos_token_id"]
    assert eos == (ENDOFTEXT if loop == "grpo" else [IM_END, ENDOFTEXT])

"""Multi-turn rollouts (envs.py, grpo.py --env) with the real Qwen2.5 tokenizer and its chat
template (../shared/assets).

- Three assistant turns with the calculator: a scripted sampler (a plain function standing for
  vLLM or HF: it returns the ids it was given, so the test knows them) feeds envs.rollout; the
  batch the trainer scores holds those ids token for token where the loss mask is 1, the tool
  turns as the template renders them where it is 0, and the whole row decodes to the template's
  rendering of the conversation. The rewards get the messages after the prompt.
- A tiny random Qwen2 model on that batch: the trainer's log-probs (padded and packed) equal a
  naive forward of each conversation's prefix, token by token; the GRPO loss equals a naive loop
  over the sampled tokens; the environment's tokens get exactly zero gradient.
- Bad environments and a template that rewrites earlier turns: one EnvError message each.
- `bash run.sh grpo --env ...` for 2 steps on 2 ranks, HF generation and colocated vLLM.
"""

import json
import os

import pytest
import torch

import envs
from batching import forward_logps, make_batch, micro_slice
from conftest import ROOT, run_sh, train_rows
from generation import Generations

TOKENIZER = os.path.join(ROOT, "..", "shared", "assets", "qwen2.5-tokenizer")
pytestmark = pytest.mark.skipif(
    not os.path.isdir(TOKENIZER),
    reason=f"needs the Qwen2.5 tokenizer at {TOKENIZER} (../shared/assets beside the checkout)",
)
IM_END = 151645
TURNS = ["Let me compute. calc: 3*4", "Now add one. calc: 12+1", "answer: 13"]
ROWS = [{"prompt": "Tom has 3 bags of 4 apples and finds 1 more. How many?", "answer": "13"}]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)


def scripted(tokenizer, log):
    """A sampler that answers the k-th call with TURNS[k] and <|im_end|>, and logs what it got."""

    def generate(prompts, max_new_tokens):
        turn = TURNS[len(log)]
        log.append(prompts)
        ids = tokenizer(turn, add_special_tokens=False)["input_ids"] + [IM_END]
        ids = ids[:max_new_tokens]
        B = len(prompts)
        lp = -torch.rand(B, len(ids))  # (B, C) the "sampler's" log-probs
        return Generations(torch.tensor([ids] * B), torch.ones(B, len(ids), dtype=torch.long), lp)

    return generate


def three_turns(tokenizer, C=300):
    log = []
    ep = envs.rollout(scripted(tokenizer, log), tokenizer, ROWS, envs.calculator, 2, 4, C, [IM_END])
    return ep, log


def test_three_turns_keep_the_sampled_ids(tokenizer):
    ep, log = three_turns(tokenizer)
    assert len(log) == 3 and ep.stats["env/turns"] == 3.0 and ep.stats["env/cut"] == 0
    sampled = [tokenizer(t, add_special_tokens=False)["input_ids"] + [IM_END] for t in TURNS]
    batch = make_batch(ep.prompt_ids, Generations(ep.completion_ids, ep.completion_mask), 0)
    P = batch["input_ids"].shape[1] - ep.completion_ids.shape[1]
    for row in range(2):
        scored = batch["input_ids"][row, P:]  # (C,) what the trainer reads
        assert scored[ep.loss_mask[row].bool()].tolist() == sum(sampled, [])
        # every generate call got the kept ids back as its prompt: never re-encoded
        assert log[2][row] == ep.prompt_ids[0] + scored[: len(log[2][row]) - P].tolist()
        env_text = tokenizer.decode(scored[(ep.completion_mask[row] - ep.loss_mask[row]).bool()])
        assert "<tool_response>\n12\n</tool_response>" in env_text and "13" in env_text
        messages = envs.Calculator().reset(ROWS[0]) + ep.completions[row]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
        whole = tokenizer.decode(ep.prompt_ids[0] + scored[ep.completion_mask[row].bool()].tolist())
        assert rendered == whole + "\n"  # the template's own rendering, to the last <|im_end|>
    assert [m["role"] for m in ep.completions[0]] == ["assistant", "tool"] * 2 + ["assistant"]
    assert envs.calculator_reward(None, ep.completions, ["13", "14"]) == [1.0, 0.0]
    assert torch.equal(ep.logprobs[ep.loss_mask == 0], torch.zeros(int((ep.loss_mask == 0).sum())))


def test_the_length_limit_cuts_and_counts(tokenizer):
    first = len(tokenizer(TURNS[0], add_special_tokens=False)["input_ids"]) + 1
    ep, log = three_turns(tokenizer, C=first + 5)  # no room for the tool turn after turn 1
    assert len(log) == 1 and ep.stats["env/cut"] == 2
    assert ep.completion_ids.shape[1] <= first + 5 and int(ep.loss_mask.sum()) == 2 * first


@pytest.mark.slow  # a model with the real 151k vocabulary, token by token: ~1 min under load
def test_trainer_logps_loss_and_gradient(tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    from batching import loss_inputs
    from grpo import grpo_loss, loss_normalizer, loss_tokens, parse_args
    from tiny_models import build_family

    path = build_family(str(tmp_path / "m"), "qwen2", tokenizer_dir=TOKENIZER, hidden_size=64)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ep, _ = three_turns(tokenizer)
    gens = Generations(ep.completion_ids, ep.completion_mask)
    batch = make_batch(ep.prompt_ids, gens, tokenizer.pad_token_id)
    batch["loss_mask"] = ep.loss_mask
    mb = micro_slice(batch, torch.arange(2))
    padded = forward_logps(model, mb, 1.0, False, "cpu")  # (2, C)
    packed = forward_logps(model, mb, 1.0, True, "cpu")  # (2, C)
    mask = loss_tokens(mb)  # (2, C)
    torch.testing.assert_close(packed * mb["completion_mask"], padded * mb["completion_mask"])
    P = mb["input_ids"].shape[1] - mask.shape[1]
    advantages = torch.tensor([1.0, -0.5])  # (2,)
    naive_sum, count = 0.0, 0
    for row in range(2):
        seq = mb["input_ids"][row][mb["attention_mask"][row].bool()]
        start = len(seq) - int(mb["completion_mask"][row].sum())
        for t in mask[row].nonzero().flatten().tolist():
            with torch.no_grad():
                logits = model(seq[None, : start + t]).logits[0, -1]  # (V,) the prefix's next
            want = torch.log_softmax(logits, -1)[seq[start + t]]
            torch.testing.assert_close(padded[row, t], want, rtol=1e-5, atol=1e-5)
            naive_sum += -float(advantages[row])  # ratio 1, no KL: -A per sampled token
            count += 1
    assert P > 0 and count == int(mask.sum())
    logps = padded.detach().requires_grad_()
    t = loss_inputs({**mb, "advantages": advantages}, logps, torch.zeros_like(logps), "cpu", mask)
    stats = {"normalizer": loss_normalizer(mask, "bnpo", 300)}
    loss, _ = grpo_loss(t, parse_args(["--loss_type", "bnpo"]), stats)
    torch.testing.assert_close(loss, torch.tensor(naive_sum / count))
    loss.backward()
    env = (mb["completion_mask"] - mask).bool()  # (2, C)
    assert env.any() and torch.equal(logps.grad[env], torch.zeros(int(env.sum())))
    assert (logps.grad[mask.bool()] != 0).all()


class Raises:
    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, text):
        raise KeyError("no tool named 'calc'")


class WrongType(Raises):
    def step(self, text):
        return "12"


REWRITES = (
    "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}"
    "<|im_start|>assistant\n[earlier]<|im_end|>\n{% else %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_bad_environments_and_templates(tokenizer):
    def run(factory, tok=tokenizer):
        return envs.rollout(scripted(tok, []), tok, ROWS, factory, 1, 4, 300, [IM_END])

    with pytest.raises(envs.EnvError, match=r"Raises.step raised KeyError: .no tool named"):
        run(Raises)
    with pytest.raises(envs.EnvError, match=r"WrongType.step returned 12; return"):
        run(WrongType)
    with pytest.raises(envs.EnvError, match="renders earlier turns differently"):
        tok = tokenizer.__class__.from_pretrained(TOKENIZER)
        tok.chat_template = REWRITES
        run(envs.calculator, tok)
    with pytest.raises(envs.EnvError, match="module:factory"):
        envs.load_env("calculator")
    with pytest.raises(envs.EnvError, match="No module named"):
        envs.load_env("no_such_module:f")
    from exits import RunError
    from grpo import parse_args

    assert parse_args(["--env", "envs:calculator"]).env == "envs:calculator"  # as given
    assert envs.load_env("envs:calculator") is envs.calculator  # grpo.main's factory
    with pytest.raises(
        RunError, match="--env, --dynamic_sampling and --max_staleness > 0: one at a time"
    ):
        parse_args(["--env", "envs:calculator", "--dynamic_sampling", "True"])


ECHO = """class Echo:
    '''Answers every assistant turn with its length, until max_turns.'''

    def reset(self, row):
        return [{"role": "system", "content": "Talk."}, {"role": "user", "content": row["prompt"]}]

    def step(self, text):
        return [{"role": "user", "content": str(len(text))}], False


def echo():
    return Echo()


def turns(prompts, completions, answers):
    assert all(isinstance(c, list) and c[0]["role"] == "assistant" for c in completions)
    return [float(len(c)) for c in completions]
"""


@pytest.mark.parametrize("generator", ["hf", "vllm"])
def test_run_sh_with_an_environment(tokenizer, tmp_path, generator):
    """2 GRPO steps on 2 ranks with an environment that answers every turn: the run finishes and
    logs its turns; the rewards get message lists."""
    from tiny_models import build_family

    path = build_family(str(tmp_path / "m"), "qwen2", tokenizer_dir=TOKENIZER, hidden_size=64)
    (tmp_path / "echoenv.py").write_text(ECHO)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {i}."}) + "\n" for i in range(8)))
    run_dir = tmp_path / "run"
    args = [
        "--model", path, "--recipe", "", "--data", data, "--max_steps", "2",
        "--num_eval_prompts", "0",
        "--prompts_per_rank", "1", "--num_generations", "2", "--max_completion_length", "24",
        "--env", "echoenv:echo", "--max_turns", "3", "--reward_funcs", "echoenv:turns",
        "--save_model", "False",
    ]  # fmt: skip
    if generator == "vllm":
        args += ["--use_vllm", "True"]
    env = {"PYTHONPATH": str(tmp_path), "RUN_DIR": str(run_dir)}
    run_sh("grpo", *args, env=env, timeout=900)
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["env/turns"] >= 1 and "env/cut" in r for r in rows), rows

"""Multi-turn rollouts: an environment answers each assistant turn (a tool's output, a simulated
user) until it is done. The sampled token ids are kept exactly as sampled (never decoded and
encoded again); only the environment's turns are tokenized, as the chat template's text between
the end of the assistant turn and the next assistant prompt. The loss mask is 1 on sampled
tokens and 0 on the environment's. Imports batching.py (the prompts, a sum over ranks),
generation.py (Generations), arguments.py (grpo.py's --env and --max_turns: EnvArgs), tasks.py
(import_user_module: the module --env names) and zero3_utils.py (a max over ranks).

An environment is a plain object that `--env module:factory` names; factory() makes one per
conversation:
    env.reset(row) -> messages          the prompt, a list of {"role", "content"} (a system turn
                                        included), rendered by the chat template
    env.step(assistant_text) -> (messages to append, or None, done)
Rewards are the usual functions; each completion reaches them as the list of messages after the
prompt (assistant and environment turns), as TRL passes conversational completions.

Public API
    load_env(spec) -> factory                   "module:factory", checked
    rollout(generate, tokenizer, rows, factory, G, max_turns, max_completion_length, stop_ids,
            template_kwargs=None) -> Episodes
        generate(prompts, max_new_tokens) -> generation.Generations (one completion per prompt,
        stop id kept); every rank must call rollout (generate may be a collective: a rank with
        no conversation left generates for a placeholder and drops it)
    template_delta(tokenizer, messages, new, stop_text, template_kwargs=None) -> token ids
    calculator()                                the example: a calculator tool for arithmetic
    calculator_reward(prompts, completions, answers)   1 when the last assistant turn's last
                                                number is the answer
    problems(n, seed=0) -> rows                 its data: arithmetic word problems
    problems_file(path="", n=2000, seed=0) -> path   writes them once as JSONL (`python envs.py
                                                FILE [n]`; grpo.py's smollm2-calculator recipe)
    EnvError                                    a failing environment; exit code 2

Letters: N prompts on this rank, G completions each, B = N * G conversations, C =
max_completion_length (all turns of a conversation together).
"""

import json
import os
import random
import re
import sys
from dataclasses import dataclass

import torch

from arguments import arg
from batching import all_sum, encode_prompts
from generation import Generations
from tasks import import_user_module
from zero3_utils import all_max


@dataclass
class EnvArgs:  # grpo.py's flags for multi-turn rollouts
    env: str = arg(
        "",
        "module:factory: multi-turn rollouts, an environment answering each assistant turn "
        "(a tool, a simulated user; docs/envs.md); empty: one assistant turn",
    )
    max_turns: int = arg(4, "with --env: assistant turns per conversation at most", ">= 1")


class EnvError(RuntimeError):
    """An environment failed (raised, returned the wrong type) or a chat template cannot carry a
    multi-turn conversation; the message names it. Exit code 2 (exits.entry)."""

    exit_code, everywhere = 2, False


@dataclass
class Episodes:
    prompt_ids: list  # N lists of ids: each group's prompt
    completion_ids: torch.Tensor  # (B, C) sampled and environment tokens, padding after
    completion_mask: torch.Tensor  # (B, C) 1 on every real token (attention)
    loss_mask: torch.Tensor  # (B, C) 1 on sampled tokens only
    logprobs: torch.Tensor | None  # (B, C) the sampler's, 0 on environment tokens
    completions: list  # B lists of messages after the prompt, for the rewards
    stats: dict  # env/turns (mean), env/cut (conversations cut at C), env/max_turns_reached


def load_env(spec):
    """The factory named by "module:factory"; an EnvError says what is wrong with the name."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise EnvError(f"--env {spec!r}: write module:factory (e.g. envs:calculator)")
    try:
        factory = getattr(import_user_module(module), name)  # also where run.sh was run from
    except (ImportError, AttributeError) as e:
        raise EnvError(f"--env {spec}: {type(e).__name__}: {e}") from None
    if not callable(factory):
        raise EnvError(f"--env {spec}: {name} is not callable")
    return factory


def template_delta(tokenizer, messages, new, stop_text, template_kwargs=None):
    """Token ids of the environment's `new` messages as the chat template renders them after
    `messages` (which end with an assistant turn that ended with `stop_text`), through the next
    assistant prompt. The text after the assistant turn's stop is tokenized on its own: special
    tokens are whole tokens, so this is how the full rendering tokenizes too. A template that
    renders the earlier turns differently once more follow (one that drops earlier reasoning, say)
    is refused: the kept ids would not be a prefix of the conversation."""
    kw = template_kwargs or {}
    before = tokenizer.apply_chat_template(messages, tokenize=False, **kw)
    after = tokenizer.apply_chat_template(
        messages + new, tokenize=False, add_generation_prompt=True, **kw
    )
    end = before.rfind(stop_text)
    if end < 0 or not after.startswith(before[: end + len(stop_text)]):
        raise EnvError(
            "the chat template renders earlier turns differently once a new turn follows (or "
            "does not end an assistant turn with its stop token), so the sampled ids would not be "
            "a prefix of the conversation; use a template that keeps earlier turns as they are"
        )
    return tokenizer(after[end + len(stop_text) :], add_special_tokens=False)["input_ids"]


def _step(env, text):
    try:
        out = env.step(text)
    except Exception as e:  # the user's code: say whose it is
        name = type(env).__name__
        raise EnvError(f"environment {name}.step raised {type(e).__name__}: {e}") from e
    ok = isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], bool)
    if ok and out[0] is not None:
        ok = isinstance(out[0], list) and all(
            isinstance(m, dict) and "role" in m and "content" in m for m in out[0]
        )
    if not ok:
        raise EnvError(
            f"environment {type(env).__name__}.step returned {str(out)[:120]}; return (a list of "
            f'{{"role", "content"}} messages or None, done: bool)'
        )
    return out


def _reset(env, row):
    try:
        messages = env.reset(row)
    except Exception as e:
        name = type(env).__name__
        raise EnvError(f"environment {name}.reset raised {type(e).__name__}: {e}") from e
    if not (isinstance(messages, list) and all(isinstance(m, dict) for m in messages) and messages):
        raise EnvError(
            f"environment {type(env).__name__}.reset returned {str(messages)[:120]}; return the "
            "prompt as a list of {'role', 'content'} messages"
        )
    return messages


def rollout(
    generate,
    tokenizer,
    rows,
    factory,
    G,
    max_turns,
    max_completion_length,
    stop_ids,
    template_kwargs=None,
):
    """G conversations per row, turn by turn, until the environment is done, max_turns assistant
    turns, or max_completion_length tokens in all (the turn that reaches it is cut there, and
    counted in env/cut). Returns Episodes; see the module docstring."""
    if not tokenizer.chat_template:
        raise EnvError("--env needs a tokenizer with a chat template: it renders the turns")
    C = max_completion_length
    envs = [factory() for _ in rows for _ in range(G)]
    prompts = [_reset(env, row) for env, row in zip(envs, [r for r in rows for _ in range(G)])]
    for g in range(0, len(prompts), G):
        if any(p != prompts[g] for p in prompts[g : g + G]):
            raise EnvError(
                f"environment {type(envs[g]).__name__}.reset gave one row different prompts; "
                "GRPO compares the completions of one prompt"
            )
    group_prompts = [{"prompt": prompts[g]} for g in range(0, len(prompts), G)]
    prompt_ids = encode_prompts(tokenizer, group_prompts, 10**9, template_kwargs)
    B = len(envs)
    ids, loss, logps = [[] for _ in range(B)], [[] for _ in range(B)], [[] for _ in range(B)]
    convo, done = [list(p) for p in prompts], [False] * B
    turns, cut, at_max = [0] * B, 0, 0
    stops = set(stop_ids)
    for turn in range(max_turns):
        live = [i for i in range(B) if not done[i]]
        if all_max(len(live)) == 0:  # a collective generate: every rank calls until all are done
            break
        batch = [prompt_ids[i // G] + ids[i] for i in live] or [prompt_ids[0]]
        budget = max((C - len(ids[i]) for i in live), default=1)
        gens = generate(batch, budget)
        for row, i in enumerate(live):
            n = int(gens.completion_mask[row].sum())
            sampled = gens.completion_ids[row, :n].tolist()[: C - len(ids[i])]
            ids[i] += sampled
            loss[i] += [1] * len(sampled)
            if gens.logprobs is not None:
                logps[i] += gens.logprobs[row, : len(sampled)].tolist()
            turns[i] += 1
            text = tokenizer.decode(sampled, skip_special_tokens=True)
            convo[i].append({"role": "assistant", "content": text})  # the rewards read it
            if not sampled or sampled[-1] not in stops:  # cut at C (or by the generator's budget)
                cut += len(ids[i]) >= C
                done[i] = True
                continue
            new, finished = _step(envs[i], text)
            if finished or new is None:
                done[i] = True
                continue
            if turn == max_turns - 1:  # its reply would never be answered: not appended
                at_max += 1
                done[i] = True
                continue
            stop_text = tokenizer.decode(sampled[-1:])
            delta = template_delta(tokenizer, convo[i], new, stop_text, template_kwargs)
            if len(ids[i]) + len(delta) >= C:  # no room left for another turn
                cut += 1
                done[i] = True
                continue
            ids[i] += delta
            loss[i] += [0] * len(delta)
            if gens.logprobs is not None:
                logps[i] += [0.0] * len(delta)
            convo[i] += new
    width = max(max(len(x) for x in ids), 1)

    def pad(rows_, value, dtype):
        return torch.tensor([r + [value] * (width - len(r)) for r in rows_], dtype=dtype)

    has_logps = any(logps)
    return Episodes(
        prompt_ids=prompt_ids,
        completion_ids=pad(ids, tokenizer.pad_token_id, torch.long),  # (B, C)
        completion_mask=pad([[1] * len(r) for r in ids], 0, torch.long),  # (B, C)
        loss_mask=pad(loss, 0, torch.long),  # (B, C)
        logprobs=pad(logps, 0.0, torch.float32) if has_logps else None,  # (B, C)
        completions=[c[len(p) :] for c, p in zip(convo, prompts)],
        stats={
            "env/turns": sum(turns) / max(B, 1),
            "env/cut": cut,
            "env/max_turns_reached": at_max,
        },
    )


def sample_episodes(run, rows, args, factory, G):
    """grpo.sample_groups with an environment: G conversations of each row in `rows`, scored, as
    {"prompt_ids", "gens", "rewards", "per_func"} plus "loss_mask" (B, C), 0 on the
    environment's turns, and "env_stats", this rank's (episode_stats: over ranks)."""
    ep = rollout(  # one turn per generate call, the sampled ids kept as sampled
        lambda prompt_ids, max_new: run.generate(prompt_ids, 1, max_new),
        run.tokenizer,
        rows,
        factory,
        G,
        args.max_turns,
        args.max_completion_length,
        run.stop_ids,
        run.template_kwargs,
    )
    gens = Generations(ep.completion_ids, ep.completion_mask, ep.logprobs)
    rewards, per_func = run.score(rows, ep.completions, G, gens)  # completions: messages
    return {
        "prompt_ids": ep.prompt_ids,
        "gens": gens,
        "rewards": rewards,
        "per_func": per_func,
        "loss_mask": ep.loss_mask,  # (B, C)
        "env_stats": ep.stats,
    }


def episode_stats(stats, world):
    """A sample's env_stats over all ranks (a collective): turns per conversation (a mean of the
    ranks' means), conversations cut, conversations that reached max_turns."""
    names = list(stats)
    out = dict(zip(names, all_sum([stats[k] for k in names])))
    out["env/turns"] /= world
    return out


# ---- The example: a calculator tool on arithmetic word problems ---------------------------------
CALCULATOR_PROMPT = (
    "Solve the problem. To compute, write one line `calc: <expression>` (numbers, + - * / and "
    "parentheses) and stop; the result comes back. Finish with `answer: <number>`."
)
# One worked exchange before the problem: a small model shown the tool once calls it (SmolLM2-135M:
# 20 of 256 sampled first turns, against 0 of 256 from the system prompt alone), which gives GRPO
# groups with a reward to learn from.
CALCULATOR_EXAMPLE = [
    {"role": "user", "content": "A bag holds 23 marbles. How many marbles are in 7 bags?"},
    {"role": "assistant", "content": "calc: 23*7"},
    {"role": "tool", "content": "161"},
    {"role": "assistant", "content": "answer: 161"},
]
_CALL = re.compile(r"calc:\s*([0-9+\-*/(). ]+)")


class Calculator:
    """reset: a system turn naming the tool, one worked exchange, the problem as the user turn.
    step: a `calc:` line gets its value back as a tool message; anything else ends the
    conversation."""

    def reset(self, row):
        question = row["prompt"] if isinstance(row["prompt"], str) else row["prompt"][-1]["content"]
        return [
            {"role": "system", "content": CALCULATOR_PROMPT},
            *CALCULATOR_EXAMPLE,
            {"role": "user", "content": question},
        ]

    def step(self, text):
        call = _CALL.search(text)
        if call is None:
            return None, True
        expression = call.group(1)
        try:
            if "**" in expression:  # a power could take forever
                raise ValueError(expression)
            value = eval(expression, {"__builtins__": {}}, {})  # digits and operators only
            result = f"{value:g}" if isinstance(value, float) else str(value)
        except (SyntaxError, ZeroDivisionError, TypeError, ValueError, OverflowError):
            result = "error"
        return [{"role": "tool", "content": result}], False


def calculator():
    return Calculator()


def problems(n, seed=0):
    """n arithmetic word problems (two-digit numbers, one or two operations) as {"prompt",
    "answer"} rows: the calculator example's data."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b, c = rng.randint(11, 99), rng.randint(2, 9), rng.randint(11, 99)
        kind = rng.randrange(3)
        if kind == 0:
            q, ans = f"A shelf holds {a} books and {c} more arrive. How many books now?", a + c
        elif kind == 1:
            q, ans = f"A crate holds {a} apples. How many apples are in {b} crates?", a * b
        else:
            q, ans = (
                f"Each of {b} boxes holds {a} pens, and {c % 10 + 1} pens are lost. How many "
                "are left?",
                a * b - c % 10 - 1,
            )
        out.append({"prompt": q, "answer": str(ans)})
    return out


def problems_file(path="", n=2000, seed=0):
    """problems(n, seed) as JSONL rows at `path`, written once (aside, then renamed into place,
    so ranks calling at the same time never read half a file); returns path. path "":
    calculator-<n>-<seed>.jsonl under $LEAN_RL_CACHE (~/.cache/lean-rl, where smollm2.py keeps
    the model)."""
    if not path:
        cache = os.path.join(os.path.expanduser("~"), ".cache", "lean-rl")
        path = os.path.join(os.environ.get("LEAN_RL_CACHE", cache), f"calculator-{n}-{seed}.jsonl")
    if not os.path.isfile(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in problems(n, seed))
        os.replace(tmp, path)
    return path


def calculator_reward(prompts, completions, answers):
    """1.0 when the last assistant turn's last number equals the answer, else 0.0."""
    out = []
    for messages, answer in zip(completions, answers):
        said = [m["content"] for m in messages if m["role"] == "assistant"]
        numbers = re.findall(r"-?\d+(?:\.\d+)?", said[-1] if said else "")
        out.append(float(bool(numbers) and float(numbers[-1]) == float(answer)))
    return out


if __name__ == "__main__":  # python envs.py problems.jsonl [n]: the calculator example's data
    path, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    print(f"{n} problems in {problems_file(path, n)}")

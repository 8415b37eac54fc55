"""Tasks and rewards for the RL loops: the built-in task and the reward functions (data.py loads
--data and orders the rows).

    from tasks import default_task, reward_functions, score_completions
    train_rows, eval_rows = default_task(num_eval=200)  # --data: data.py's load_data
    funcs, weights = reward_functions("", "", data="")  # the task's: format 0.25, correct 0.75
    total, per_func = score_completions(funcs, weights, rows, completions, num_generations=8)
    row = reward_stats(seq, list(per_func))  # the metrics of every rank's rewards and lengths

A row is a dict {"prompt": a string or a list of {"role", "content"} messages, "answer": ...}.
A reward function is a plain callable (prompts, completions, answers) -> list[float], one value per
completion; prompts are the rows' prompts as they are (a conversation stays a list of messages),
completions are decoded text without special tokens; give your own as `module:function` (the
module on PYTHONPATH); `f.needs_answer = True` makes the pre-flight refuse
data with rows that carry no answer (such a row's answer is None). Imports no sibling file except
`tiny_models` (`task_model` builds the from-scratch model of the built-in task). Rewards for
real recipes (math answers, a <think> format, a length penalty) are in rewards.py.
"""

import importlib
import itertools
import math
import os
import random
import shutil
import sys
import traceback

import torch
import torch.distributed as dist

from tiny_models import build_tiny

# ---- The built-in task: "largest digit": verifiable, tiny vocabulary, learnable on CPU ---------
TASK_CHARS = "0123456789="  # the tiny model's whole vocabulary (+ pad, bos, eos, unk): 15 tokens


def default_task(num_eval, seed=0, digits=3):
    """Prompts like "835=" whose answer is the largest digit ("8"); all 10**digits strings,
    `num_eval` of them held out. A random model emits a digit 2/3 of the time (format reward)."""
    prompts = ["".join(p) for p in itertools.product("0123456789", repeat=digits)]
    random.Random(seed).shuffle(prompts)
    rows = [{"prompt": p + "=", "answer": max(p)} for p in prompts]
    return rows[num_eval:], rows[:num_eval]


def task_model(model, run_dir, rank, seed):
    """The policy's path: `model` when given, else a tiny Llama for the built-in task (vocabulary =
    TASK_CHARS) built from scratch by rank 0 under run_dir/model. Call on every rank (it waits)."""
    if model:
        return model
    path = os.path.join(run_dir, "model")
    if rank == 0 and not os.path.exists(os.path.join(path, "config.json")):
        # built aside, then renamed into place: config.json never shows before the weights, even
        # when two nodes' pre-flights (run.sh, one process per node) build it in a shared run_dir
        tmp = f"{path}.tmp-{os.getpid()}"
        build_tiny(tmp, hidden_size=128, num_layers=2, chars=TASK_CHARS, seed=seed)
        try:
            os.rename(tmp, path)
        except OSError:  # another process renamed the same model into place first
            shutil.rmtree(tmp)
    if dist.is_initialized():
        dist.barrier()
    return path


# ---- Reward functions ---------------------------------------------------------------------------
def format_reward(prompts, completions, answers):
    """1 for exactly one digit (then EOS), 0.5 for a digit followed by more, else 0."""
    return [
        1.0 if len(c) == 1 and c.isdigit() else 0.5 if c[:1].isdigit() else 0.0 for c in completions
    ]


def correct_reward(prompts, completions, answers):
    """1 when the completion starts with the right answer."""
    return [1.0 if c.strip().startswith(a) and a else 0.0 for c, a in zip(completions, answers)]


correct_reward.needs_answer = True  # checks.check_answers: rows with no answer could never score


def exact_match_reward(prompts, completions, answers):
    """For JSONL data: 1 when the completion's last non-empty line equals the answer."""
    lines = [[ln.strip() for ln in c.strip().splitlines() if ln.strip()] for c in completions]
    return [1.0 if ln and ln[-1] == str(a).strip() else 0.0 for ln, a in zip(lines, answers)]


exact_match_reward.needs_answer = True
BUILT_IN = ("format_reward", "correct_reward", "exact_match_reward")


def _where(e):
    """'file.py:line' where exception e was raised (a SyntaxError: where the bad line is)."""
    if isinstance(e, SyntaxError) and e.filename:
        return f"{os.path.basename(e.filename)}:{e.lineno}"
    frames = traceback.extract_tb(e.__traceback__)
    return f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else "?"


def load_reward_funcs(spec):
    """'module:function,module:function' (or a bare name of BUILT_IN) -> callables. A module that is
    not there or fails to import (any exception), a missing name, or one that is not callable is a
    ValueError naming module:function and the cause."""
    funcs = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        module, _, name = item.rpartition(":")
        flag = f"--reward_funcs {item!r}"
        if not module:
            if name not in BUILT_IN:
                raise ValueError(
                    f"{flag}: not a built-in reward ({', '.join(BUILT_IN)}); write "
                    f"module:function, with the module on PYTHONPATH"
                )
            funcs.append(getattr(sys.modules[__name__], name))
            continue
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and (module == e.name or module.startswith(e.name + ".")):  # not its import
                raise ValueError(
                    f"{flag}: no module {module!r} on PYTHONPATH; write module:function"
                ) from None
            raise ValueError(
                f"{flag}: importing {module} failed: ModuleNotFoundError: {e} (at {_where(e)})"
            ) from e
        except Exception as e:  # the user's module: a syntax error, or what its top level raises
            msg = e.msg if isinstance(e, SyntaxError) else str(e)
            raise ValueError(
                f"{flag}: importing {module} failed: {type(e).__name__}: {msg} (at {_where(e)})"
            ) from e
        if not hasattr(mod, name):
            defined = [
                k
                for k, v in vars(mod).items()
                if callable(v)
                and not k.startswith("_")
                and getattr(v, "__module__", None) == mod.__name__
            ]
            raise ValueError(
                f"{flag}: module {module} has no name {name!r} (its functions: "
                f"{', '.join(defined[:10]) or 'none'}); write module:function"
            )
        f = getattr(mod, name)
        if not callable(f):
            raise ValueError(
                f"{flag}: {module}.{name} is a {type(f).__name__}, not a function "
                f"(prompts, completions, answers) -> list[float]"
            )
        funcs.append(f)
    return funcs


def reward_functions(reward_funcs, reward_weights, data):
    """(funcs, weights) from the --reward_funcs / --reward_weights strings. Empty funcs: the task's
    own (format_reward 0.25 + correct_reward 0.75 on the built-in task, exact_match_reward on
    JSONL data); empty weights: 1 each."""
    funcs = load_reward_funcs(
        reward_funcs or ("format_reward,correct_reward" if not data else "exact_match_reward")
    )
    weights = reward_weights or ("0.25,0.75" if not (data or reward_funcs) else "")
    try:
        weights = [float(w) for w in weights.split(",")] if weights else [1.0] * len(funcs)
    except ValueError:
        raise ValueError(
            f"--reward_weights {reward_weights!r}: comma-separated numbers, one per function"
        ) from None
    if not all(math.isfinite(w) for w in weights):
        raise ValueError(f"--reward_weights {reward_weights!r}: the weights must be finite numbers")
    if len(weights) != len(funcs):
        raise ValueError(
            f"--reward_weights has {len(weights)} values for {len(funcs)} reward functions"
        )
    return funcs, weights


class RewardError(ValueError):
    """A reward function failed: raised, miscounted, or returned a non-number / NaN / inf. The
    message names it; exit_code makes exits.entry print it as one line (from the rank that hit it)
    and exit 2."""

    exit_code, everywhere = 2, False


def _name(f):
    return f"{getattr(f, '__module__', '?')}.{getattr(f, '__name__', repr(f))}"


def call_reward(f, prompts, completions, answers):
    """f's rewards as a (B,) float tensor; any failure of f is a RewardError naming f."""
    try:
        values = f(prompts, completions, answers)
    except Exception as e:  # the user's code: whatever it raises, say whose it is and where
        raise RewardError(
            f"reward function {_name(f)} raised {type(e).__name__}: {e} (at {_where(e)})"
        ) from e
    try:
        values = [float(v) for v in values]
    except (TypeError, ValueError):
        raise RewardError(
            f"reward function {_name(f)} returned {type(values).__name__} {str(values)[:80]}; "
            f"it must return a list of floats, one per completion"
        ) from None
    if len(values) != len(completions):
        raise RewardError(
            f"reward function {_name(f)} returned {len(values)} values for {len(completions)} "
            f"completions; return one per completion"
        )
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    if bad:
        raise RewardError(
            f"reward function {_name(f)} returned {values[bad[0]]} for completion {bad[0]} "
            f"({completions[bad[0]]!r}) and {len(bad) - 1} other non-finite values; return finite "
            f"numbers (e.g. 0.0 where the reward is undefined)"
        )
    return torch.tensor(values)  # (B,)


def score_completions(funcs, weights, rows, completions, num_generations):
    """Weighted sum of the reward functions, (B,), and each function's raw rewards, {name: (B,)}.
    completions are prompt-major: row i's num_generations completions are adjacent. A row with no
    "answer" passes None (checks.check_answers refuses such data if a function needs_answer)."""
    prompts = [r["prompt"] for r in rows for _ in range(num_generations)]
    answers = [r.get("answer") for r in rows for _ in range(num_generations)]
    # {name: (B,)}
    per_func = {f.__name__: call_reward(f, prompts, completions, answers) for f in funcs}
    total = sum(w * r for w, r in zip(weights, per_func.values()))  # (B,)
    return total, per_func


def reward_stats(seq, names):
    """A step's training-reward metrics from every rank's sequences, seq (B, 2 + F): the total
    reward, the completion length, each reward function's reward (`names`, F of them; none with
    a reward model: then no accuracy, which needs every function's reward >= 1)."""
    row = {"reward": seq[:, 0].mean().item(), "reward_std": seq[:, 0].std().item()}
    if names:
        row["accuracy"] = (seq[:, 2:] >= 1).all(1).float().mean().item()
    lengths = seq[:, 1]  # (B,)
    row.update(completion_len=lengths.mean().item(), completion_len_max=lengths.max().item())
    row["completion_tokens"] = lengths.sum().item()
    for j, name in enumerate(names):
        row.update(
            {f"rewards/{name}/{s}": getattr(seq[:, 2 + j], s)().item() for s in ("mean", "std")}
        )
    return row


def pass_at_k(n, c, k):
    """Chen et al. 2021's unbiased pass@k of one prompt with n samples, c of them correct (k <= n):
    1 - C(n - c, k) / C(n, k), the chance that k samples drawn from the n without replacement hold
    a correct one, as their running product (no large binomials). pass@1 is c / n; k = n: c > 0."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))

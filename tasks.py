"""Tasks and rewards for the RL loops: the built-in task and the reward functions (data.py loads
--data and orders the rows).

    from tasks import default_task, reward_functions, score_completions
    train_rows, eval_rows = default_task(num_eval=200)  # --data: data.py's load_data
    funcs, weights = reward_functions("", "", data="")  # the task's: format 0.25, correct 0.75
    total, per_func = score_completions(funcs, weights, rows, completions, num_generations=8)
    row = reward_stats(seq, list(per_func))  # the metrics of every rank's rewards and lengths

A row is a dict {"prompt": a string or a list of {"role", "content"} messages, "answer": ...,
"columns": {the source row's other fields}} (the built-in task's rows have no "columns").
A reward function is a plain callable in one of two forms, told apart by its signature
(takes_keywords):
  - positional, (prompts, completions, answers) -> list[float]: prompts are the rows' prompts as
    they are (a conversation stays a list of messages), completions are decoded text without
    special tokens;
  - TRL's, f(completions, **kwargs) -> list[float | None], called with the keywords prompts,
    completions (a conversation's as [{"role": "assistant", "content": text}]), completion_ids
    (each completion's token ids), answer and every other column of the row by its name; None
    for a completion it does not score (TRL's multi-task rewards).
One value per completion either way; give your own as `module:function` or `module.function`
(the module on PYTHONPATH, or in the directory run.sh was run from: import_user_module);
`f.needs_answer = True` makes the pre-flight refuse data with rows that carry no answer (such a
row's answer is None). Imports no sibling file except `tiny_models` (`task_model` builds the
from-scratch model of the built-in task). Rewards for real recipes (math answers, a <think>
format, a length penalty) are in rewards.py.
"""

import asyncio
import importlib
import inspect
import itertools
import math
import os
import random
import shutil
import sys
import traceback
import warnings

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


# run.sh works from the repository: it names the directory it was run from here
USER_DIR_ENV = "LEAN_RL_USER_DIR"


def import_user_module(name):
    """importlib.import_module(name), with the user's directory (the one run.sh was run from, else
    the working directory) last on sys.path: a module of theirs is found where they stand, and
    never hides one of the repository's or an installed package (as PYTHONPATH=. would)."""
    where = os.path.abspath(os.environ.get(USER_DIR_ENV) or os.getcwd())
    if where not in (os.path.abspath(p or ".") for p in sys.path):
        sys.path.append(where)
    return importlib.import_module(name)


def load_reward_funcs(spec):
    """'module:function,module.function,...' (or a bare name of BUILT_IN) -> callables. A module
    that is not there or fails to import (any exception), a missing name, or one that is not
    callable is a ValueError naming the item and the cause."""
    funcs = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        # module:function, or TRL's dotted path (pkg.module.function)
        module, _, name = item.rpartition(":") if ":" in item else item.rpartition(".")
        flag = f"--reward_funcs {item!r}"
        if not module:
            if name not in BUILT_IN:
                raise ValueError(
                    f"{flag}: not a built-in reward ({', '.join(BUILT_IN)}); write "
                    f"module:function (or module.function), with the module on PYTHONPATH or in "
                    f"the directory you run from"
                )
            funcs.append(getattr(sys.modules[__name__], name))
            continue
        try:
            mod = import_user_module(module)
        except ModuleNotFoundError as e:
            if e.name and (module == e.name or module.startswith(e.name + ".")):  # not its import
                raise ValueError(
                    f"{flag}: no module {module!r} on PYTHONPATH or in the directory you run from "
                    f"({os.environ.get(USER_DIR_ENV) or os.getcwd()}); write module:function"
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
                f"{flag}: {module}.{name} is a {type(f).__name__}, not a function; {FORMS}"
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


FORMS = (
    "a reward function is either f(prompts, completions, answers) -> list[float], called "
    "positionally with the completions as text, or TRL's f(completions, **kwargs) -> "
    "list[float | None], called with the keywords prompts, completions (messages when the prompts "
    "are conversations), completion_ids, answer and the row's columns by name; TRL's form is told "
    "by the signature: a **kwargs (and no parameter named answers), a first parameter named "
    "completions, one named completion_ids, or fewer than three positional parameters"
)


def reward_names(funcs):
    """The names the functions' rewards are logged under: each one's __name__, or module.name for
    names that two functions share (TRL's examples all call theirs reward_func)."""
    names = [getattr(f, "__name__", repr(f)) for f in funcs]
    return [_name(f) if names.count(n) > 1 else n for f, n in zip(funcs, names)]


def takes_keywords(f):
    """Whether reward function f takes TRL's keyword arguments (else the positional (prompts,
    completions, answers)), read from its signature: a **kwargs (unless it names `answers`, the
    positional form's third), a parameter named completion_ids, a first parameter named
    completions, a required keyword-only parameter, or fewer than three positional ones."""
    try:
        params = list(inspect.signature(f).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a builtin): the positional form
        return False
    names = [p.name for p in params]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return "answers" not in names
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    takes_three = len(positional) >= 3 or any(p.kind is p.VAR_POSITIONAL for p in params)
    keyword_only = any(p.kind is p.KEYWORD_ONLY and p.default is p.empty for p in params)
    return (
        not takes_three or keyword_only or names[:1] == ["completions"] or "completion_ids" in names
    )


def reward_kwargs(rows, prompts, completions, completion_ids, answers, num_generations):
    """TRL's keyword arguments for the B = rows x num_generations completions: every column of the
    rows' source by its name (None in a row without it), answer (--answer_field's, as the positional
    form's answers), prompts, completions (a conversation's text as one assistant message, as TRL
    passes them; an environment's messages as they are), completion_ids (B lists of token ids)."""
    names = dict.fromkeys(k for r in rows for k in r.get("columns", {}))
    kwargs = {
        k: [r.get("columns", {}).get(k) for r in rows for _ in range(num_generations)]
        for k in names
    }
    chat = [isinstance(r["prompt"], list) for r in rows for _ in range(num_generations)]
    completions = [
        [{"role": "assistant", "content": c}] if is_chat and isinstance(c, str) else c
        for c, is_chat in zip(completions, chat)
    ]
    kwargs.update(
        answer=answers, prompts=prompts, completions=completions, completion_ids=completion_ids
    )
    return kwargs


def call_reward(f, completions, args=(), kwargs=None):
    """f(*args) (the positional form) or f(**kwargs) (TRL's: only the keywords f names, unless it
    has **kwargs) as a (B,) float tensor, one value per completion, NaN where f returned None; any
    failure of f (it cannot take the arguments, raises, miscounts, returns a non-number, NaN or
    inf) is a RewardError naming f."""
    kwargs = kwargs or {}
    given = "prompts, completions, answers" if args else f"TRL's keywords {', '.join(kwargs)}"
    try:
        params = inspect.signature(f).parameters
    except (TypeError, ValueError):  # no signature to read: call it and see
        params = None
    if params is not None:
        if kwargs and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            kwargs = {k: v for k, v in kwargs.items() if k in params}
        try:
            inspect.signature(f).bind(*args, **kwargs)
        except TypeError as e:  # the call itself would fail: neither form as written
            trainer = [k for k in ("trainer_state", "log_extra", "log_metric") if k in str(e)]
            own = f" ({', '.join(trainer)}: TRL's trainer's own, not passed here)" * bool(trainer)
            raise RewardError(
                f"reward function {_name(f)} cannot be called with ({given}): {e}{own}; {FORMS}"
            ) from None
    try:
        values = f(*args, **kwargs)
        if inspect.iscoroutine(values):  # TRL's `async def` rewards: awaited here, one by one
            values = asyncio.run(values)
    except Exception as e:  # the user's code: whatever it raises, say whose it is and where
        form = "positionally (prompts, completions, answers)" if args else "with TRL's keywords"
        hint = f"; it was called {form}: {FORMS}" if isinstance(e, (TypeError, KeyError)) else ""
        raise RewardError(
            f"reward function {_name(f)} raised {type(e).__name__}: {e} (at {_where(e)}){hint}"
        ) from e
    try:
        values = list(values)
        unscored = [v is None for v in values]
        values = [math.nan if v is None else float(v) for v in values]
    except (TypeError, ValueError):
        raise RewardError(
            f"reward function {_name(f)} returned {type(values).__name__} {str(values)[:80]}; "
            f"it must return a list of floats (None where it does not score), one per completion"
        ) from None
    if len(values) != len(completions):
        raise RewardError(
            f"reward function {_name(f)} returned {len(values)} values for {len(completions)} "
            f"completions; return one per completion"
        )
    bad = [i for i, v in enumerate(values) if not (unscored[i] or math.isfinite(v))]
    if bad:
        raise RewardError(
            f"reward function {_name(f)} returned {values[bad[0]]} for completion {bad[0]} "
            f"({completions[bad[0]]!r}) and {len(bad) - 1} other non-finite values; return finite "
            f"numbers (e.g. 0.0 where the reward is undefined, or None where it does not apply)"
        )
    return torch.tensor(values)  # (B,)


def score_completions(funcs, weights, rows, completions, num_generations, completion_ids=None):
    """Weighted sum of the reward functions, (B,), and each function's raw rewards, {name: (B,)},
    NaN where a function returned None. completions are prompt-major: row i's num_generations
    completions are adjacent; completion_ids: their token ids (B lists), for TRL's form. A row
    with no "answer" passes None (checks.check_answers refuses such data if a function
    needs_answer). As TRL: a None adds nothing to the sum (the others' weighted rewards are it);
    a completion no function scores gets its group's mean total of the scored ones (0 if none),
    so its group-relative advantage is 0."""
    prompts = [r["prompt"] for r in rows for _ in range(num_generations)]
    answers = [r.get("answer") for r in rows for _ in range(num_generations)]
    kwargs = None
    per_func = {}  # {name: (B,)}
    for name, f in zip(reward_names(funcs), funcs):
        if takes_keywords(f):
            if kwargs is None:  # once, for every function in TRL's form
                ids = completion_ids
                kwargs = reward_kwargs(rows, prompts, completions, ids, answers, num_generations)
            per_func[name] = call_reward(f, completions, kwargs=kwargs)
        else:
            per_func[name] = call_reward(f, completions, args=(prompts, completions, answers))
    rewards = list(per_func.values())
    if not any(r.isnan().any() for r in rewards):
        return sum(w * r for w, r in zip(weights, rewards)), per_func  # (B,)
    total = sum(w * r.nan_to_num(0.0) for w, r in zip(weights, rewards))  # (B,)
    unscored = torch.stack(rewards).isnan().all(0)  # (B,)
    if unscored.any():
        warnings.warn(
            "every reward function returned None for some completions: each gets its group's "
            "mean reward (advantage 0), as TRL leaves such a completion out",
            stacklevel=2,
        )
        groups, has = total.view(-1, num_generations), ~unscored.view(-1, num_generations)
        means = (groups * has).sum(1) / has.sum(1).clamp(min=1)  # (N,)
        total = torch.where(has, groups, means[:, None]).flatten()  # (B,)
    return total, per_func


def solved_mask(per_func):
    """(B,) bool: the completions every reward function that scored them (not None: NaN) gave at
    least 1, and some function scored; per_func {name: (B,)}, at least one function. What
    `accuracy` and `eval/accuracy` count."""
    rewards = torch.stack(list(per_func.values()))  # (F, B)
    return ((rewards >= 1) | rewards.isnan()).all(0) & ~rewards.isnan().all(0)


def _finite_stat(x, stat):
    """x's mean or std over the values that are not NaN (a None reward); NaN for none (a std:
    fewer than two)."""
    if x.isnan().any():
        x = x[~x.isnan()]
        if x.numel() < (2 if stat == "std" else 1):
            return math.nan
    return getattr(x, stat)().item()


def reward_stats(seq, names):
    """A step's training-reward metrics from every rank's sequences, seq (B, 2 + F): the total
    reward, the completion length, each reward function's reward (`names`, F of them, NaN where
    it returned None; none with a reward model: then no accuracy, which needs every function
    that scored a completion to give it >= 1: `solved_mask`)."""
    row = {"reward": seq[:, 0].mean().item(), "reward_std": seq[:, 0].std().item()}
    if names:
        row["accuracy"] = solved_mask(dict(zip(names, seq[:, 2:].T))).float().mean().item()
    lengths = seq[:, 1]  # (B,)
    row.update(completion_len=lengths.mean().item(), completion_len_max=lengths.max().item())
    row["completion_tokens"] = lengths.sum().item()
    for j, name in enumerate(names):
        row.update({f"rewards/{name}/{s}": _finite_stat(seq[:, 2 + j], s) for s in ("mean", "std")})
    return row


def pass_at_k(n, c, k):
    """Chen et al. 2021's unbiased pass@k of one prompt with n samples, c of them correct (k <= n):
    1 - C(n - c, k) / C(n, k), the chance that k samples drawn from the n without replacement hold
    a correct one, as their running product (no large binomials). pass@1 is c / n; k = n: c > 0."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))

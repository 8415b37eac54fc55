"""Tasks and rewards for the RL loops: the built-in task, reward functions, data and its order.

    from tasks import default_task, load_jsonl, batch_rows, reward_functions, score_completions
    train_rows, eval_rows = default_task(num_eval=200)            # or load_jsonl(path, 200, seed)
    funcs, weights = reward_functions("", "", data="")            # the task's own: format 0.25, correct 0.75
    rows = batch_rows(train_rows, step, n=64, seed=0)             # step -> prompts, the same on resume
    total, per_func = score_completions(funcs, weights, rows, completions, num_generations=8)

A row is a dict {"prompt": str, "answer": str}. A reward function is a plain callable
(prompts, completions, answers) -> list[float], one value per completion; give your own as
`module:function` (the module on PYTHONPATH). Imports no sibling file except `tiny_models`
(only in `task_model`, for the from-scratch model of the built-in task).
"""

import importlib
import itertools
import json
import os
import random
import sys

import torch

# ---- The built-in task: "largest digit", verifiable, tiny vocabulary, learnable from scratch on CPU ----
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
    import torch.distributed as dist
    path = os.path.join(run_dir, "model")
    if rank == 0 and not os.path.exists(os.path.join(path, "config.json")):
        from tiny_models import build_tiny
        build_tiny(path, hidden_size=128, num_layers=2, chars=TASK_CHARS, seed=seed)
    if dist.is_initialized():
        dist.barrier()
    return path


# ---- Reward functions ---------------------------------------------------------------------------
def format_reward(prompts, completions, answers):
    """1 for exactly one digit (then EOS), 0.5 for a digit followed by more, else 0."""
    return [1.0 if len(c) == 1 and c.isdigit() else 0.5 if c[:1].isdigit() else 0.0 for c in completions]


def correct_reward(prompts, completions, answers):
    """1 when the completion starts with the right answer."""
    return [1.0 if c.strip().startswith(a) and a else 0.0 for c, a in zip(completions, answers)]


def exact_match_reward(prompts, completions, answers):
    """For JSONL data: 1 when the completion's last non-empty line equals the answer."""
    lines = [[ln.strip() for ln in c.strip().splitlines() if ln.strip()] for c in completions]
    return [1.0 if ln and ln[-1] == str(a).strip() else 0.0 for ln, a in zip(lines, answers)]


def load_reward_funcs(spec):
    """'module:function,module:function' (or a bare name defined in this file) -> callables."""
    funcs = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        module, _, name = item.rpartition(":")
        try:
            funcs.append(getattr(importlib.import_module(module) if module else sys.modules[__name__], name))
        except (ImportError, AttributeError) as e:
            raise ValueError(f"--reward_funcs {item!r}: cannot import ({e}); write module:function, "
                             f"with the module on PYTHONPATH") from e
    return funcs


def reward_functions(reward_funcs, reward_weights, data):
    """(funcs, weights) from the --reward_funcs / --reward_weights strings. Empty funcs: the task's
    own (format_reward 0.25 + correct_reward 0.75 on the built-in task, exact_match_reward on
    JSONL data); empty weights: 1 each."""
    funcs = load_reward_funcs(reward_funcs or ("format_reward,correct_reward" if not data else "exact_match_reward"))
    weights = reward_weights or ("0.25,0.75" if not (data or reward_funcs) else "")
    weights = [float(w) for w in weights.split(",")] if weights else [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise ValueError(f"--reward_weights has {len(weights)} values for {len(funcs)} reward functions")
    return funcs, weights


def score_completions(funcs, weights, rows, completions, num_generations):
    """Weighted sum of the reward functions, (B,), and each function's raw rewards, {name: (B,)}.
    completions are prompt-major: row i's num_generations completions are adjacent."""
    prompts = [r["prompt"] for r in rows for _ in range(num_generations)]
    answers = [r.get("answer", "") for r in rows for _ in range(num_generations)]
    per_func = {}
    for f in funcs:
        values = f(prompts, completions, answers)
        if len(values) != len(completions):
            raise ValueError(f"reward {f.__name__} returned {len(values)} values for {len(completions)} completions")
        per_func[f.__name__] = torch.tensor([float(v) for v in values])  # (B,)
    total = sum(w * r for w, r in zip(weights, per_func.values()))  # (B,)
    return total, per_func


# ---- Data: JSONL with a held-out split, and the order it is seen in -------------------------------
def load_jsonl(path, num_eval, seed):
    """{"prompt": ..., "answer": ...} per line -> (train rows, num_eval held-out rows), seeded shuffle."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    bad = [i for i, r in enumerate(rows) if "prompt" not in r]
    if bad:
        raise ValueError(f"{path}: lines {bad[:5]} have no \"prompt\" key; "
                         "each line is {\"prompt\": ..., \"answer\": ...}")
    random.Random(seed).shuffle(rows)
    if len(rows) <= num_eval:
        raise ValueError(f"{path} has {len(rows)} rows, not more than num_eval_prompts={num_eval}; lower it")
    return rows[num_eval:], rows[:num_eval]


def load_data(data, num_eval, seed):
    """(train rows, held-out rows): the JSONL file `data`, or the built-in task when it is empty."""
    return load_jsonl(data, num_eval, seed) if data else default_task(num_eval, seed)


def batch_rows(rows, step, n, seed):
    """The n prompts of global step `step`: a fixed seeded order per epoch, so resume sees the same data."""
    out, start = [], step * n
    while len(out) < n:
        epoch, offset = divmod(start + len(out), len(rows))
        order = list(range(len(rows)))
        random.Random(seed * 1000003 + epoch).shuffle(order)
        out += [rows[i] for i in order[offset:offset + n - len(out)]]
    return out

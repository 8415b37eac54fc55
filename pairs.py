"""Preference pairs for reward-model training (rm.py): --data read as rows of (prompt, chosen,
rejected[, margin]), the built-in task's pairs, each row checked, and a step's pairs as a batch.

    rows = load_pairs("prefs.jsonl", fields)          # "": the built-in task's pairs
    batch = pair_batch(tokenizer, rows, max_prompt_length, max_response_length)
    scores[0::2], scores[1::2]                        # chosen, rejected (batch rows 2i, 2i + 1)

A row of --data (JSONL, JSON, CSV, parquet, a `datasets` directory or a cached hub id: data.py
reads it) holds a chosen and a rejected response and, optionally, a prompt and a margin. Plain
text: strings; conversational (TRL's format, as Anthropic HH or UltraFeedback ship it): lists of
{"role", "content"} messages, chosen and rejected each the whole conversation ending in the
assistant's answer (the prompt is then the messages before it, the same in both) or the answer's
messages alone beside a prompt. The policy's chat template renders the prompt as the loops render
theirs (batching.encode_prompts); a response is its text's tokens and the eos token, so a pair
reads as the policy's finished completions do in `ppo.py --reward_model`. Field names are the
common ones (prompt, chosen, rejected); --prompt_field, --chosen_field, --rejected_field and
--margin_field name others. Imports batching.py, data.py, generation.py and tasks.py.
"""

import math
import os
import random
import sys

import torch
import torch.distributed as dist

from batching import encode_prompts, make_batch, stop_token_ids, template_kwargs
from checks import (
    check_data,
    check_model_path,
    check_templates,
    is_reward_model,
    load_tokenizer,
    prompt_text,
    unknown_tokens,
)
from data import _read, conversation_error, row_name
from exits import RunError
from generation import Generations
from reward_model import build_reward_model
from tasks import default_task

PAIR_SHAPE = 'each row is {"prompt": ..., "chosen": ..., "rejected": ...}'


def task_pairs(num_eval, seed=0):
    """The built-in task as pairs, ordered by the task's rule (tasks.py: format 0.25, correct 0.75)
    over the completions the policy writes (one character and eos, or two characters): for each
    character w other than the answer, the answer ("8" for "835=") preferred to w, and the answer
    followed by a character preferred to w followed by one (correct preferred to wrong, at both
    lengths: PPO's early completions are mostly two characters, and the task counts "8x" right);
    then the answer preferred to the answer followed by more, twice (the format reward).
    Held out first: one pair (a random one of these) for each of default_task's held-out prompts,
    so the loops' held-out prompts stay unseen; then every pair of each training prompt, shuffled.
    Cut to the loops' 2 completion tokens (rm.py's default), a two-character answer ends without
    eos, as the policy's truncated completions do: the reward model learns to score those too."""
    rng = random.Random(seed + 1)
    chars = "0123456789="

    def pairs(answer):
        out = []
        for w in chars.replace(answer, ""):
            out.append((answer, w))
            out.append((answer + rng.choice(chars), w + rng.choice(chars)))
        out += [(answer, answer + rng.choice(chars)) for _ in range(2)]
        return out

    train, held = default_task(num_eval, seed)
    rows = []
    for r in held:
        chosen, rejected = rng.choice(pairs(r["answer"]))
        rows.append({"prompt": r["prompt"], "chosen": chosen, "rejected": rejected})
    rest = [
        {"prompt": r["prompt"], "chosen": c, "rejected": x}
        for r in train
        for c, x in pairs(r["answer"])
    ]
    rng.shuffle(rest)
    return [{**r, "index": i} for i, r in enumerate(rows + rest)]


def split_response(value, prompt):
    """(prompt, response text) of one side of a pair, or a str saying what is wrong with it."""
    if isinstance(value, str):
        return prompt if prompt is not None else "", value
    if not isinstance(value, list):
        return f"is a {type(value).__name__}, not a string or a list of messages"
    value = [
        {k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in value
    ]
    problem = conversation_error(value)
    if problem:
        return problem
    if value[-1]["role"] != "assistant":
        return f"ends with a {value[-1]['role']} message, not the assistant's answer"
    if prompt is None:  # the whole conversation: its prompt is what comes before the answer
        prompt = value[:-1] or ""
    return prompt, value[-1]["content"]


def pair_row(r, fields):
    """{"prompt", "chosen", "rejected", "margin"} from a raw row, or a str: what is wrong."""
    pf, cf, rf, mf = fields
    prompt = r.get(pf)
    if prompt is not None and not isinstance(prompt, str):
        if not isinstance(prompt, list) or conversation_error(prompt):
            what = conversation_error(prompt) if isinstance(prompt, list) else None
            return f'its "{pf}" {what or "is not a string or a list of messages"}'
    out = {}
    for side, name in (("chosen", cf), ("rejected", rf)):
        if r.get(name) is None:
            return f'has no "{name}" field'
        got = split_response(r[name], prompt)
        if isinstance(got, str):
            return f'its "{name}" {got}'
        out[f"{side}_prompt"], out[side] = got
    if out["chosen_prompt"] != out["rejected_prompt"]:
        return f'its "{cf}" and "{rf}" conversations differ before their last message'
    margin = 0.0
    if mf:
        try:
            margin = float(r.get(mf))
        except (TypeError, ValueError):
            return f'its "{mf}" {r.get(mf)!r} is not a number'
        if not math.isfinite(margin):
            return f'its "{mf}" {margin} is not finite'
    return {
        "prompt": out["chosen_prompt"],
        "chosen": out["chosen"],
        "rejected": out["rejected"],
        "margin": margin,
    }


def load_pairs(data, fields, split="train", config="", seed=0, num_eval=0):
    """(rows, problems): every pair in the held-out split's order (the built-in task's, or --data
    after a seeded shuffle) and what is wrong with them (a list of messages, empty when fine): a
    row that is no pair (the first one named), empty responses, chosen == rejected in every row.
    fields: (prompt, chosen, rejected, margin) field names; margin "" reads none; num_eval: the
    built-in task's held-out prompts (task_pairs)."""
    if not data:
        return task_pairs(num_eval, seed), []
    raw = _read(data, split, config)
    if not raw:
        return [], [f"--data {data} has no rows; {PAIR_SHAPE}"]
    rows, problems = [], []
    for i, r in enumerate(raw):
        row = pair_row(r, fields) if isinstance(r, dict) else "is not an object"
        if isinstance(row, str):
            flags = "--prompt_field, --chosen_field, --rejected_field and --margin_field"
            problems.append(
                f"--data {data} {row_name(data, i)} {row}; {PAIR_SHAPE} ({flags} name other fields)"
            )
            break
        rows.append({**row, "index": i})
    empty = [r for r in rows if not r["chosen"].strip() or not r["rejected"].strip()]
    if empty:
        problems.append(
            f"--data {data}: {len(empty)} of {len(rows)} rows have an empty response (first: "
            f"{row_name(data, empty[0]['index'])}); drop them: an empty answer is no preference"
        )
    if rows and all(r["chosen"] == r["rejected"] for r in rows):
        problems.append(
            f"--data {data}: chosen == rejected in every row, so there is nothing to learn; are "
            f"--chosen_field and --rejected_field ({fields[1]}, {fields[2]}) two columns?"
        )
    random.Random(seed).shuffle(rows)
    return rows, problems


def pair_batch(tokenizer, rows, max_prompt_length, max_response_length, template_kwargs=None):
    """The pairs as one batch, PPO's layout (batching.make_batch: left-padded prompts, right-padded
    responses): rows 2i and 2i + 1 are pair i's chosen and rejected sequences; "margin" (2N,) the
    pair's margin on both. A response is its tokens and eos, cut to max_response_length."""
    prompt_ids = encode_prompts(tokenizer, rows, max_prompt_length, template_kwargs)
    resp = response_ids(tokenizer, rows, max_response_length)  # 2N lists
    C = max(len(x) for x in resp)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([x + [pad] * (C - len(x)) for x in resp])  # (2N, C)
    mask = torch.tensor([[1] * len(x) + [0] * (C - len(x)) for x in resp])  # (2N, C)
    batch = make_batch(prompt_ids, Generations(ids, mask), pad)
    batch["margin"] = torch.tensor([float(r.get("margin", 0.0)) for r in rows]).repeat_interleave(2)
    return batch


def response_ids(tokenizer, rows, max_response_length):
    """Each pair's chosen and rejected responses (2N lists, pair i's at 2i and 2i + 1) as the reward
    model reads them: the text's tokens and eos, cut to max_response_length."""
    texts = [r[side] for r in rows for side in ("chosen", "rejected")]
    eos = [tokenizer.eos_token_id]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    return [(x + eos)[:max_response_length] for x in ids]


def pair_texts(row):
    """{part: texts} of a pair that the tokenizer reads (checks.unknown_tokens)."""
    return {"prompts": [prompt_text(row["prompt"])], "responses": [row["chosen"], row["rejected"]]}


TIED_SHARE = 0.25  # pairs that read the same once cut: above this share refused, else a warning


def tied_pairs(tokenizer, rows, args):
    """(problem, warning), each None or a message: the pairs whose responses differ but read the
    same once tokenized and cut to --max_completion_length (pair_batch's cut), so the reward
    model scores them alike whatever it learns (loss ln 2, no gradient). Over TIED_SHARE of the
    pairs: a problem; some: a warning."""
    differ = [r for r in rows if r["chosen"] != r["rejected"]]
    resp = response_ids(tokenizer, differ, args.max_completion_length)
    tied = [r for r, c, x in zip(differ, resp[0::2], resp[1::2]) if c == x]
    if not tied:
        return None, None
    source = f"--data {args.data}" if args.data else "the built-in task"
    longest = max(len(x) for x in response_ids(tokenizer, tied, 10**9))
    what = (
        f"{source}: {len(tied)} of {len(rows)} pairs (first: "
        f"{row_name(args.data, min(r['index'] for r in tied))}) have a chosen and a rejected "
        f"response that read the same once cut to --max_completion_length "
        f"{args.max_completion_length} tokens (eos included), so the reward model scores them "
        f"alike whatever it learns"
    )
    fix = f"raise --max_completion_length (their longest response has {longest} tokens)"
    if len(tied) > TIED_SHARE * len(rows):
        return f"{what}: {fix}", None
    return None, f"warning: {what} (they add nothing to the loss); {fix}, or drop them"


def reward_model_start(args, rank, build_dir=None):
    """The reward model training starts from: --model itself when it is one (a sequence
    classifier), else one built by rank 0 in <run_dir>/init from --model (its body and tokenizer,
    a new score head: reward_model.py) or, without --model, the built-in task's tiny model's shape
    and vocabulary. build_dir: where to build it instead of run_dir (the pre-flight alone), which
    builds none from --model (a copy of the model) and returns None. Call on every rank (it
    waits)."""
    if args.model:
        if is_reward_model(check_model_path(args.model)):
            return args.model
        if build_dir:
            return None
    path = os.path.join(build_dir or args.run_dir, "init")
    if rank == 0 and not os.path.exists(os.path.join(path, "config.json")):
        tmp = f"{path}.tmp-{os.getpid()}"  # renamed into place whole, as tasks.task_model does
        build_reward_model(tmp, args.model, args.seed, args.pad_token)
        os.rename(tmp, path)
    if dist.is_initialized():
        dist.barrier()
    return path


def check_pairs(args, rank, build_dir=None):
    """rm.py's inputs, checked before any step (rm.py hands it to harness.Run as its input check,
    `check`): the pairs (every problem in one message, before anything is written), then the
    reward model to start from, its tokenizer (eos, pad) and config, the prompts through the chat
    template. build_dir: as reward_model_start's. Returns preflight.Inputs' fields: train_rows and
    eval_rows are pairs."""
    fields = (args.prompt_field, args.chosen_field, args.rejected_field, args.margin_field)
    try:
        kwargs = template_kwargs(args.chat_template_kwargs)
        rows, problems = load_pairs(
            args.data, fields, args.data_split, args.data_config, args.seed, args.num_eval_prompts
        )
    except ValueError as e:
        raise RunError(str(e)) from None
    if rows and len(rows) <= args.num_eval_prompts:
        source = f"--data {args.data}" if args.data else "the built-in task"
        problems.append(
            f"{source} has {len(rows)} pairs, not more than --num_eval_prompts "
            f"{args.num_eval_prompts} (held out); lower it (0: no evaluation) or add pairs"
        )
    check_data(problems)
    if args.model:  # the policy's tokenizer before anything is built from it
        load_tokenizer(args.model, args.pad_token)
    model_path = reward_model_start(args, rank, build_dir)
    if model_path is None:  # to be built from --model: its config and tokenizer, as the build has
        model_path, config = args.model, check_model_path(args.model)
        tokenizer = load_tokenizer(model_path, args.pad_token)
        config.num_labels, config.pad_token_id = 1, tokenizer.pad_token_id
    else:
        config = check_model_path(model_path)
        tokenizer = load_tokenizer(model_path, args.pad_token)
    if config.pad_token_id != tokenizer.pad_token_id:
        raise RunError(
            f"--model {model_path} reads its score before pad id {config.pad_token_id}, and the "
            f"run pads with {tokenizer.pad_token_id} ({tokenizer.pad_token!r}): pass --pad_token "
            f"{tokenizer.convert_ids_to_tokens(config.pad_token_id)!r}"
        )
    train_rows, eval_rows = rows[args.num_eval_prompts :], rows[: args.num_eval_prompts]
    checked = train_rows[:20000] + eval_rows
    check_templates(tokenizer, checked, args, model_path, kwargs)
    # what the reward model would read: <unk>, or a chosen and a rejected response cut alike
    unknown, unread = unknown_tokens(tokenizer, rows, args, model_path, pair_texts)
    tied, ties = tied_pairs(tokenizer, checked, args)
    check_data([unknown, tied])
    for warning in (unread, ties):
        if warning and rank == 0:
            print(warning, file=sys.stderr)
    return dict(
        train_rows=train_rows,
        eval_rows=eval_rows,
        model_path=model_path,
        config=config,
        tokenizer=tokenizer,
        stop_ids=stop_token_ids(tokenizer, model_path),
        template_kwargs=kwargs,
        funcs=[],
        weights=[],
    )

"""Data for the RL loops: `--data` through `datasets`, each row checked (a string prompt or a
conversation), the held-out split, and the order the rows are seen in.

    from data import load_data, batch_rows
    train_rows, eval_rows = load_data("math.jsonl", num_eval=200, seed=0)  # "": the built-in task
    rows = shuffled_rows("math.jsonl", seed=0)   # the same rows, unsplit; size_problem: too few
    load_data("openai/gsm8k", 200, 0, split="train", prompt_field="question", config="main")
    rows = batch_rows(train_rows, step, n=64, seed=0)   # step -> prompts, the same on resume
    eval_count(-1, len(rows))          # --num_eval_prompts' default: a fifth of the rows, <= 200

`--data` is a JSONL, JSON, CSV or parquet file, a directory written by `datasets`' save_to_disk,
another directory of data files, or a hub id (already in the local cache on an offline machine),
loaded with `datasets.load_dataset` (`load_from_disk` for a saved directory); `config` names one of
a hub dataset's (or a directory's) subsets, as gsm8k's "main". A row is a dict
{"prompt": ..., "answer": ..., "index": i, "columns": {...}}: the prompt is a string or a
conversation, a list of {"role", "content"} messages (TRL's conversational format, a system turn
included); the answer is whatever the answer field holds (None where it is missing); `index` is
the row's place in the source, for messages (`row_name`); `columns` the source row's fields but
the prompt's, which rewards in TRL's form get by name. A bad row is a ValueError naming it: its
line in a JSONL file (blank lines counted), else its 1-based row. Imports only tasks.py (the
built-in task).
"""

import json
import os
import random

from tasks import default_task

ROLES = ("system", "user", "assistant", "tool")  # the roles chat templates render
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
ROW_SHAPE = 'each row is {"prompt": ..., "answer": ...}'


def row_name(data, index):
    """'line N' of a JSONL file (blank lines counted, as an editor shows them), else 'row N'."""
    if data.endswith(".jsonl") and os.path.isfile(data):
        with open(data) as f:
            filled = [n for n, line in enumerate(f, 1) if line.strip()]
        if index < len(filled):
            return f"line {filled[index]}"
    return f"row {index + 1}"


def conversation_error(prompt):
    """None for a usable conversation, else what is wrong with it: not a list of messages, an empty
    list, a message that is not a dict, an unknown role, a missing (or non-string) content."""
    if not isinstance(prompt, list):
        return f"is a {type(prompt).__name__}, not a string or a list of messages"
    if not prompt:
        return "is an empty list of messages"
    for i, m in enumerate(prompt):
        if not isinstance(m, dict):
            return f"message {i} is a {type(m).__name__}, not {{'role': ..., 'content': ...}}"
        if m.get("role") not in ROLES:
            return f"message {i} has role {m.get('role')!r}, not one of {', '.join(ROLES)}"
        if not isinstance(m.get("content"), str):
            return f"message {i} ({m['role']}) has no string content ({m.get('content')!r})"
    return None


def _read(data, split, config=""):
    """The rows of `data` as a list of dicts, through datasets; a ValueError says why not."""
    import datasets

    datasets.disable_progress_bars()  # one bar per rank per load, in every run's log
    ext = os.path.splitext(data)[1].lower()
    saved = any(os.path.isfile(os.path.join(data, f)) for f in ("dataset_dict.json", "state.json"))
    if not os.path.exists(data) and (ext in FILE_BUILDERS or data.startswith((".", "/", "~"))):
        raise ValueError(f"--data {data}: cannot read it (No such file or directory)")
    if os.path.isfile(data) and ext not in FILE_BUILDERS:
        raise ValueError(
            f"--data {data}: a {ext or 'extensionless'} file; give a .jsonl, .json, .csv or "
            f".parquet file, a directory saved by datasets, or a hub id"
        )
    if os.path.isdir(data) and saved:
        ds = datasets.load_from_disk(data)
        if isinstance(ds, datasets.DatasetDict) and split not in ds:
            raise ValueError(
                f"--data {data} has no split {split!r} (it has {', '.join(ds)}): set --data_split"
            )
        return (ds[split] if isinstance(ds, datasets.DatasetDict) else ds).to_list()
    try:
        if os.path.isfile(data):
            ds = datasets.load_dataset(FILE_BUILDERS[ext], data_files=data, split=split)
        else:  # a directory of data files, or a hub id; config: one of its named subsets
            ds = datasets.load_dataset(data, config or None, split=split)
        return ds.to_list()
    except Exception as e:  # datasets and pyarrow raise many types; each says what it found
        if "corresponds to no data" in str(e):
            return []
        if ext in (".jsonl", ".json") and os.path.isfile(data):
            # Arrow wants one type per column: rows that mix string and conversational prompts, or
            # a malformed line, land here; plain json reads the first and names the second's line
            return _read_json(data, ext)
        hub = "; offline, a hub id must be in datasets' cache already" * (not os.path.exists(data))
        raise ValueError(
            f"--data {data}: datasets could not load it ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200] if str(e) else ''}){hub}"
        ) from None


def _read_json(path, ext):
    with open(path) as f:
        if ext == ".json":
            try:
                rows = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{path} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
                ) from None
            if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
                raise ValueError(f"{path}: a .json file holds a list of rows; {ROW_SHAPE}")
            return rows
        rows = []
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{path} line {n} is not valid JSON ({e.msg} at column {e.colno}): "
                    f"{line.strip()[:80]!r}"
                ) from None
            if not isinstance(rows[-1], dict):
                raise ValueError(f"{path} line {n} is not an object: {line.strip()[:80]!r}")
    return rows


def load_rows(data, split="train", prompt_field="prompt", answer_field="answer", config=""):
    """[{"prompt", "answer", "index", "columns"}] from --data in source order; a row whose prompt
    field is neither a string nor a well-formed conversation is a ValueError naming the row."""
    try:
        raw = _read(data, split, config)
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(
            f"--data {data}: cannot read it ({getattr(e, 'strerror', None) or e})"
        ) from None
    rows = []
    for i, r in enumerate(raw):
        prompt = r.get(prompt_field)
        if isinstance(prompt, list):  # drop the None-valued keys other messages' fields leave
            prompt = [
                {k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m
                for m in prompt
            ]
        if not isinstance(prompt, (str, list)):
            raise ValueError(
                f'{data} {row_name(data, i)} has no string "{prompt_field}" (nor a list of '
                f"messages): {json.dumps(r, default=str)[:80]!r}; {ROW_SHAPE} (--prompt_field "
                f"and --answer_field name other fields)"
            )
        if isinstance(prompt, list) and conversation_error(prompt):
            raise ValueError(
                f'{data} {row_name(data, i)}: its "{prompt_field}" {conversation_error(prompt)}: '
                f"{json.dumps(r, default=str)[:80]!r}; a conversation is a non-empty list of "
                f'{{"role": one of {", ".join(ROLES)}, "content": "..."}}'
            )
        # the other fields, for rewards in TRL's form (each column by its name: tasks.py)
        columns = {k: v for k, v in r.items() if k != prompt_field}
        rows.append(
            {"prompt": prompt, "answer": r.get(answer_field), "index": i, "columns": columns}
        )
    if not rows:
        raise ValueError(f"--data {data} has no rows; {ROW_SHAPE}")
    return rows


def load_data(
    data, num_eval, seed, split="train", prompt_field="prompt", answer_field="answer", config=""
):
    """(train rows, num_eval held-out rows): --data after a seeded shuffle, or the built-in task
    when data is empty; too few rows for both is a ValueError (size_problem)."""
    rows = shuffled_rows(data, seed, split, prompt_field, answer_field, config)
    num_eval = eval_count(num_eval, len(rows))
    problem = size_problem(data, rows, num_eval)
    if problem:
        raise ValueError(problem)
    return rows[num_eval:], rows[:num_eval]


def shuffled_rows(
    data, seed, split="train", prompt_field="prompt", answer_field="answer", config=""
):
    """Every row, in the order the held-out split takes them (the first num_eval are held out):
    --data after a seeded shuffle, or the built-in task's."""
    if not data:
        return default_task(0, seed)[0]  # the same order as default_task(num_eval, seed)'s split
    rows = load_rows(data, split, prompt_field, answer_field, config)
    random.Random(seed).shuffle(rows)
    return rows


# --num_eval_prompts -1 (the default): a fifth of the rows, at most this many. The built-in task's
# 1000 rows and any data set of 1000 rows or more: 200 held out, as when 200 was the default.
EVAL_DEFAULT_MAX = 200


def eval_count(num_eval, n_rows):
    """The held-out rows --num_eval_prompts means: as given, or for -1 a fifth of n_rows, at most
    EVAL_DEFAULT_MAX (so a small data set keeps most of its rows to train on)."""
    return min(EVAL_DEFAULT_MAX, n_rows // 5) if num_eval < 0 else num_eval


def size_problem(data, rows, num_eval, train=True):
    """None, or why `rows` leave no training prompts once num_eval are held out; train False
    (--max_steps 0, evaluation only): why they do not hold num_eval held-out prompts."""
    source = f"--data {data}" if data else "the built-in task"
    if not train:
        if num_eval == 0:
            return (
                f"--max_steps 0 evaluates on held-out prompts, and {source}'s {len(rows)} rows "
                "leave none by default (a fifth of them): pass --num_eval_prompts N"
            )
        if len(rows) >= num_eval:
            return None
        return (
            f"{source} has {len(rows)} rows, fewer than --num_eval_prompts {num_eval} to "
            f"evaluate on: pass --num_eval_prompts {len(rows)} (every row) or fewer"
        )
    if len(rows) > num_eval:
        return None
    return (
        f"{source} has {len(rows)} rows, not more than --num_eval_prompts {num_eval} (held out "
        "for evaluation; training takes the rest): lower it (0: no evaluation) or add rows"
    )


def held_out_warning(num_eval, n_rows, train=True):
    """None, or a line saying that num_eval held-out rows leave few of n_rows to train on (more
    than a quarter held out); said before training."""
    if not train or num_eval * 4 <= n_rows or num_eval >= n_rows:
        return None
    return (
        f"warning: --num_eval_prompts {num_eval} holds out {num_eval} of {n_rows} rows "
        f"({100 * num_eval / n_rows:.0f}%) for evaluation; training takes the other "
        f"{n_rows - num_eval}. Without the flag a fifth is held out (at most {EVAL_DEFAULT_MAX})"
    )


def batch_rows(rows, step, n, seed):
    """The n prompts of global step `step`: a fixed seeded order per epoch, so resume sees the same
    data."""
    out, start = [], step * n
    while len(out) < n:
        epoch, offset = divmod(start + len(out), len(rows))
        order = list(range(len(rows)))
        random.Random(seed * 1000003 + epoch).shuffle(order)
        out += [rows[i] for i in order[offset : offset + n - len(out)]]
    return out

"""data.py: --data through datasets (JSONL, JSON, CSV, parquet, save_to_disk directories, fields,
splits), conversational rows checked and named, the held-out split as before. Local files only."""

import json
import random

import datasets
import pytest

from data import (
    eval_count,
    held_out_warning,
    load_data,
    load_rows,
    shuffled_rows,
    size_problem,
)
from tasks import default_task

ROWS = [{"question": f"{i} + {i} = ?", "solution": f"n{2 * i}"} for i in range(12)]


def write_all(tmp_path):
    """ROWS in every format --data takes; returns {name: path}."""
    ds = datasets.Dataset.from_list(ROWS)
    paths = {
        "jsonl": tmp_path / "d.jsonl",
        "json": tmp_path / "d.json",
        "csv": tmp_path / "d.csv",
        "parquet": tmp_path / "d.parquet",
        "saved": tmp_path / "saved",
        "saved_dict": tmp_path / "saved_dict",
    }
    paths["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    paths["json"].write_text(json.dumps(ROWS))
    ds.to_csv(paths["csv"])
    ds.to_parquet(paths["parquet"])
    ds.save_to_disk(paths["saved"])
    other = datasets.Dataset.from_list([{"question": "held", "solution": "x"}] * 3)
    datasets.DatasetDict({"train": other, "test": ds}).save_to_disk(paths["saved_dict"])
    return {k: str(v) for k, v in paths.items()}


def test_every_format_gives_the_same_rows_and_split(tmp_path):
    """Each format, with --prompt_field / --answer_field: the rows in source order, then the same
    seeded held-out split the JSONL loader always made (random.Random(seed).shuffle)."""
    paths = write_all(tmp_path)
    expected = [
        {
            "prompt": r["question"],
            "answer": r["solution"],
            "index": i,
            "columns": {k: v for k, v in r.items() if k != "question"},
        }
        for i, r in enumerate(ROWS)
    ]
    shuffled = list(expected)
    random.Random(3).shuffle(shuffled)
    for name, path in paths.items():
        split = "test" if name == "saved_dict" else "train"
        fields = dict(split=split, prompt_field="question", answer_field="solution")
        assert load_rows(path, **fields) == expected, name
        assert load_data(path, 4, 3, **fields) == (shuffled[4:], shuffled[:4]), name
        assert shuffled_rows(path, 3, **fields) == shuffled, name  # what the pre-flight reads
    assert load_rows(paths["saved_dict"], "train", "question")[0]["prompt"] == "held"
    (tmp_path / "files").mkdir()  # a directory of data files: datasets finds the format
    (tmp_path / "files" / "train.jsonl").write_text(open(paths["jsonl"]).read())
    assert load_rows(str(tmp_path / "files"), "train", "question", "solution") == expected
    assert len(load_rows(paths["jsonl"], "train[:5]", "question")) == 5  # datasets' slices
    with pytest.raises(ValueError, match=r"no split 'validation' \(it has train, test\)"):
        load_rows(paths["saved_dict"], "validation", "question")
    with pytest.raises(ValueError, match='d.csv row 1 has no string "prompt"'):
        load_rows(paths["csv"])  # the default field names are not this file's
    with pytest.raises(ValueError, match="a .txt file; give a .jsonl"):
        (tmp_path / "d.txt").write_text("x")
        load_rows(str(tmp_path / "d.txt"))


def test_too_few_rows_for_the_held_out_prompts():
    """The built-in task and --data alike: more rows than --num_eval_prompts, or one message that
    says so (the pre-flight puts it beside the rows' other problems)."""
    assert shuffled_rows("", 0) == default_task(0, 0)[0]
    assert load_data("", 3, 0) == default_task(3, 0)
    assert size_problem("", shuffled_rows("", 0), 999) is None
    for data, rows in (("", shuffled_rows("", 0)), ("d.jsonl", ROWS)):
        message = size_problem(data, rows, len(rows))
        assert f"has {len(rows)} rows, not more than --num_eval_prompts {len(rows)}" in message
        assert "lower it (0: no evaluation)" in message
    with pytest.raises(ValueError, match="the built-in task has 1000 rows, not more than"):
        load_data("", 1000, 0)


def test_the_default_held_out_share_leaves_most_rows_to_train_on():
    """--num_eval_prompts -1 (the default): a fifth of the rows, at most 200 (the built-in task's
    1000 rows: 200, the old default, so its default runs are unchanged); a value given is kept.
    A large share given is said before training, with the rows held out and the rows left."""
    assert [eval_count(-1, n) for n in (1000, 7473, 300, 12, 4)] == [200, 200, 60, 2, 0]
    assert [eval_count(n, 300) for n in (0, 16, 200)] == [0, 16, 200]
    train, held = load_data("", -1, 0)
    assert (len(train), len(held)) == (800, 200) and (train, held) == default_task(200, 0)
    assert held_out_warning(200, 300) == (
        "warning: --num_eval_prompts 200 holds out 200 of 300 rows (67%) for evaluation; "
        "training takes the other 100. Without the flag a fifth is held out (at most 200)"
    )
    for n_eval, n_rows in ((60, 300), (75, 300), (200, 1000), (16, 1000)):
        assert held_out_warning(n_eval, n_rows) is None, (n_eval, n_rows)
    assert held_out_warning(76, 300) is not None
    assert held_out_warning(200, 300, train=False) is None  # --max_steps 0: nothing trains
    # --max_steps 0 (train=False): every row may be held out, not more; none is refused
    assert size_problem("d.jsonl", ROWS, 12, train=False) is None
    assert "has 12 rows, fewer than --num_eval_prompts 13 to evaluate on: pass " in size_problem(
        "d.jsonl", ROWS, 13, train=False
    )
    assert "leave none by default (a fifth of them): pass --num_eval_prompts N" in size_problem(
        "d.jsonl", ROWS[:4], 0, train=False
    )


CONVERSATION = [
    {"role": "system", "content": "Answer with a number."},
    {"role": "user", "content": "2 + 3?"},
]


def test_conversational_rows_load_and_bad_ones_are_named(tmp_path):
    """TRL's conversational format loads as lists of {"role", "content"} (a message's absent keys
    stay absent, though datasets fills them with None); an unknown role, a missing content, an
    empty list and a non-list are refused naming the line (blank lines counted) or the row."""
    path = tmp_path / "chat.jsonl"
    good = [
        {"prompt": CONVERSATION, "answer": "5"},
        {"prompt": [{"role": "user", "content": "1 + 1?", "name": "ann"}], "answer": "2"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in good))
    rows = load_rows(str(path))
    assert [r["prompt"] for r in rows] == [CONVERSATION, good[1]["prompt"]]
    for prompt, msg in (
        ([{"role": "robot", "content": "hi"}], "message 0 has role 'robot', not one of system"),
        ([*CONVERSATION, {"role": "user"}], r"message 2 \(user\) has no string content"),
        ([], "is an empty list of messages"),
        (["hello"], "message 0 is a str, not"),
    ):
        path.write_text(json.dumps(good[0]) + "\n\n" + json.dumps({"prompt": prompt}) + "\n")
        with pytest.raises(ValueError, match=f'chat.jsonl line 3: its "prompt" {msg}'):
            load_data(str(path), 0, 0)
    path = tmp_path / "chat.json"
    path.write_text(json.dumps([good[0], {"prompt": [{"role": "user", "content": None}]}]))
    with pytest.raises(ValueError, match=r'chat.json row 2: its "prompt" message 0 \(user\)'):
        load_data(str(path), 0, 0)


def test_a_directory_with_named_configs(tmp_path):
    """--data_config: a dataset with named subsets (the form of a hub dataset such as gsm8k, whose
    "main" and "socratic" are declared in its README.md), here a local directory: the same
    load_dataset(path, config, split) call a hub id takes."""
    for name in ("main", "other"):
        (tmp_path / name).mkdir()
        rows = [{"question": f"{name} {i}", "answer": f"#### {i}"} for i in range(3)]
        (tmp_path / name / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "README.md").write_text(
        "---\nconfigs:\n"
        + "".join(
            f"- config_name: {n}\n  data_files:\n  - split: train\n    path: {n}/train.jsonl\n"
            for n in ("main", "other")
        )
        + "---\n"
    )
    rows = load_rows(str(tmp_path), "train", "question", config="other")
    assert [r["prompt"] for r in rows] == ["other 0", "other 1", "other 2"]
    assert rows[2]["answer"] == "#### 2"
    with pytest.raises(ValueError, match="datasets could not load it"):
        load_rows(str(tmp_path), "train", "question", config="nope")


def test_a_saved_dataset_of_conversations(tmp_path):
    """A save_to_disk directory of conversations (the form a datasets pipeline leaves) loads the
    same as its JSONL."""
    rows = [{"prompt": CONVERSATION, "answer": str(i)} for i in range(5)]
    datasets.Dataset.from_list(rows).save_to_disk(tmp_path / "saved")
    assert [r["prompt"] for r in load_rows(str(tmp_path / "saved"))] == [CONVERSATION] * 5

"""rm.py, reward-model training from preference pairs: the Bradley-Terry loss and its metrics
against a naive per-pair loop; a padded batch scores each pair as it scores alone; accumulation on
real DeepSpeed (tests/dist_rm_accum.py); pairs.py's formats (JSONL, CSV, parquet, a datasets
directory; plain text and conversations through a chat template; other field names; a margin
column); bad pairs refused by the pre-flight with one message, nothing written."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from batching import micro_batches, plan_micro_batches
from conftest import ROOT, torchrun
from pairs import load_pairs, pair_batch, task_pairs
from reward_model import sequence_scores
from rm import bt_loss, parse_args, split_scores
from tasks import TASK_CHARS, correct_reward, format_reward
from tiny_models import build_tiny

HERE = os.path.dirname(os.path.abspath(__file__))
FIELDS = ("prompt", "chosen", "rejected", "")
QWEN = os.path.join(ROOT, "..", "shared", "assets", "qwen2.5-tokenizer")


@pytest.fixture(scope="module")
def task_rm(tmp_path_factory):
    """A tiny reward model in the built-in task's vocabulary, as rm.py starts from."""
    return build_tiny(
        str(tmp_path_factory.mktemp("rm") / "model"), reward_model=True, chars=TASK_CHARS
    )


def naive(chosen, rejected, margin, center_coef):
    """One pair at a time, the formula as written."""
    total, correct, n = 0.0, 0, len(chosen)
    for c, r, m in zip(chosen, rejected, margin):
        total = total + -torch.log(torch.sigmoid(c - r - m)) + center_coef * (c + r) ** 2
        correct += int(c > r)
    return total / n, correct


@pytest.mark.parametrize("center_coef", [0.0, 0.1])
def test_bt_loss_matches_a_naive_per_pair_loop(center_coef):
    g = torch.Generator().manual_seed(0)
    chosen = torch.randn(7, generator=g, requires_grad=True)
    rejected = torch.randn(7, generator=g, requires_grad=True)
    margin = torch.rand(7, generator=g)
    pairs = {"chosen": chosen, "rejected": rejected, "margin": margin}
    loss, metrics = bt_loss(pairs, normalizer=7, center_coef=center_coef)
    gc, gr = torch.autograd.grad(loss, (chosen, rejected))
    want, correct = naive(chosen, rejected, margin, center_coef)
    wc, wr = torch.autograd.grad(want, (chosen, rejected))
    assert torch.allclose(loss, want, atol=1e-6)
    assert torch.allclose(gc, wc, atol=1e-6) and torch.allclose(gr, wr, atol=1e-6)
    assert metrics["pairs"] == 7 and int(metrics["correct"]) == correct
    assert torch.isclose(metrics["margin"], (chosen - rejected).sum())
    bt_only = -F.logsigmoid(chosen - rejected - margin).sum()
    assert torch.isclose(metrics["loss"], bt_only)  # the sum, without the centring term
    # no margin: the plain Bradley-Terry loss; the sums of two halves add up to the whole
    whole, m = bt_loss({"chosen": chosen, "rejected": rejected}, normalizer=7)
    halves = [
        bt_loss({"chosen": chosen[s], "rejected": rejected[s]}, normalizer=7)
        for s in (slice(0, 3), slice(3, 7))
    ]
    assert torch.isclose(whole, halves[0][0] + halves[1][0])
    for k in m:
        assert torch.isclose(
            torch.as_tensor(m[k]), torch.as_tensor(halves[0][1][k] + halves[1][1][k])
        )


def test_padded_batch_scores_each_pair_as_alone(task_rm):
    """Pairs of different prompt and response lengths, in micro-batches of 2 pairs (left-padded
    prompts, right-padded responses, columns cut by micro_slice): each sequence's score equals its
    score alone, and it is read at the response's eos (the last non-pad token)."""
    tok = AutoTokenizer.from_pretrained(task_rm)
    model = AutoModelForSequenceClassification.from_pretrained(task_rm, dtype=torch.float32)
    rows = [
        {"prompt": "12345=", "chosen": "5", "rejected": "123"},
        {"prompt": "7=", "chosen": "7", "rejected": "0"},
        {"prompt": "908=", "chosen": "9", "rejected": "98=1"},
        {"prompt": "44=", "chosen": "4", "rejected": ""},
    ]
    batch = pair_batch(tok, rows, 64, 8)
    plan = plan_micro_batches(batch, 4)
    together = torch.zeros(8)
    with torch.no_grad():
        for idx, mb, _ in micro_batches(batch, plan):
            together[idx] = sequence_scores(model, mb, "cpu")
        for i, r in enumerate(rows):
            alone = sequence_scores(model, pair_batch(tok, [r], 64, 8), "cpu")  # (2,)
            assert torch.allclose(together[2 * i : 2 * i + 2], alone, atol=1e-5), i
            for j, side in enumerate(("chosen", "rejected")):  # read at eos, as PPO's completions
                ids = (
                    tok(r["prompt"])["input_ids"]
                    + tok(r[side], add_special_tokens=False)["input_ids"]
                )
                ids = torch.tensor([ids + [tok.eos_token_id]])
                out = model(input_ids=ids).logits[0, 0]
                assert torch.isclose(out, alone[j], atol=1e-5)


def test_accumulation_equivalence_deepspeed(task_rm):
    """Real DeepSpeed (ZeRO-2 and ZeRO-3) on 2 ranks: micro-batches of 1, 2 and 4 pairs, and
    ranks with 5 and 3 pairs, give the loss, metric sums and gradient of the whole 8-pair batch on
    one plain model (tests/dist_rm_accum.py)."""
    torchrun(os.path.join(HERE, "dist_rm_accum.py"), task_rm)


def test_task_pairs_prefer_what_the_task_rewards():
    """The built-in pairs: the task's rule (0.25 format + 0.75 correct) scores every chosen
    completion above its rejected one; per training prompt, the answer over each of the 10 other
    characters, a correct two-character completion over a wrong one for each of them, and the
    answer over the answer followed by more twice; one held-out pair per held-out prompt of the
    loops, prompts that training never sees."""
    from collections import Counter

    from tasks import default_task

    rows = task_pairs(200, 0)
    held, train = rows[:200], rows[200:]
    assert [r["prompt"] for r in held] == [r["prompt"] for r in default_task(200, 0)[1]]
    assert not {r["prompt"] for r in held} & {r["prompt"] for r in train}
    assert len(train) == 800 * 22
    answers = [max(r["prompt"][:-1]) for r in rows]
    rule = {}
    for side in ("chosen", "rejected"):
        texts = [r[side] for r in rows]
        right = correct_reward(None, texts, answers)
        fmt = format_reward(None, texts, answers)
        rule[side] = [0.25 * f + 0.75 * c for f, c in zip(fmt, right)]
    assert all(c > r for c, r in zip(rule["chosen"], rule["rejected"]))

    def kind(r, a):
        c, x = r["chosen"], r["rejected"]
        if c == a and len(x) == 1:
            return "answer over a wrong character"
        if len(c) == len(x) == 2 and c[0] == a != x[0]:
            return "correct over wrong, two characters"
        assert c == a and len(x) == 2 and x[0] == a, r
        return "answer over the answer followed by more"

    kinds = Counter(kind(r, a) for r, a in zip(train, answers[200:]))
    assert kinds == Counter(
        {
            "answer over a wrong character": 8000,
            "correct over wrong, two characters": 8000,
            "answer over the answer followed by more": 1600,
        }
    )
    firsts = Counter(
        r["rejected"][0] for r, a in zip(train, answers[200:]) if len(r["rejected"]) == 1
    )
    assert set(firsts) == set("0123456789=")  # every other character, "=" included


def write_formats(tmp_path, rows):
    """The same rows as JSONL, CSV, parquet and a datasets directory."""
    import datasets

    ds = datasets.Dataset.from_list(rows)
    paths = {
        "jsonl": tmp_path / "p.jsonl",
        "csv": tmp_path / "p.csv",
        "parquet": tmp_path / "p.parquet",
        "dir": tmp_path / "saved",
    }
    paths["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds.to_csv(str(paths["csv"]))
    ds.to_parquet(str(paths["parquet"]))
    ds.save_to_disk(str(paths["dir"]))
    return {k: str(v) for k, v in paths.items()}


def test_pair_formats_and_field_names(tmp_path):
    rows = [
        {"question": f"q{i}", "good": f"yes {i}", "bad": f"no {i}", "m": i / 10} for i in range(5)
    ]
    fields = ("question", "good", "bad", "m")
    for kind, path in write_formats(tmp_path, rows).items():
        got, problems = load_pairs(path, fields, seed=0)
        assert problems == [], kind
        got = sorted(got, key=lambda r: r["index"])
        want = [
            {"prompt": f"q{i}", "chosen": f"yes {i}", "rejected": f"no {i}", "margin": i / 10}
            for i in range(5)
        ]
        assert [{k: r[k] for k in want[0]} for r in got] == want, kind
    # without a prompt field: the whole texts, prompt ""
    (tmp_path / "np").mkdir()
    got, problems = load_pairs(
        write_formats(tmp_path / "np", rows)["jsonl"], ("prompt", "good", "bad", "")
    )
    assert problems == [] and {r["prompt"] for r in got} == {""}


def test_conversational_pairs():
    """HH / UltraFeedback's shape (whole conversations: the prompt is what precedes the answer)
    and TRL's (a prompt beside answer messages) read as the same pair."""
    import tempfile

    user = [{"role": "user", "content": "2+2?"}]
    whole = {
        "chosen": user + [{"role": "assistant", "content": "4"}],
        "rejected": user + [{"role": "assistant", "content": "5"}],
    }
    split = {
        "prompt": user,
        "chosen": [{"role": "assistant", "content": "4"}],
        "rejected": [{"role": "assistant", "content": "5"}],
    }
    with tempfile.TemporaryDirectory() as d:
        out = []
        for name, row in (("whole", whole), ("split", split)):
            path = os.path.join(d, f"{name}.jsonl")
            with open(path, "w") as f:
                f.write(json.dumps(row) + "\n")
            got, problems = load_pairs(path, FIELDS)
            assert problems == []
            out.append({k: got[0][k] for k in ("prompt", "chosen", "rejected")})
    assert out[0] == out[1] == {"prompt": user, "chosen": "4", "rejected": "5"}


@pytest.mark.skipif(not os.path.isdir(QWEN), reason=f"needs the Qwen2.5 tokenizer at {QWEN}")
def test_conversational_pairs_through_the_chat_template():
    """A conversational pair is the prompt through the chat template (as the loops render it) and
    the answer's tokens ending in <|im_end|>, as the policy's completions end."""
    tok = AutoTokenizer.from_pretrained(QWEN)
    user = [{"role": "user", "content": "2+2?"}]
    batch = pair_batch(tok, [{"prompt": user, "chosen": "4", "rejected": "five"}], 512, 16)
    text = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    want = tok(text + "4<|im_end|>", add_special_tokens=False)["input_ids"]
    row = batch["input_ids"][0][batch["attention_mask"][0] == 1].tolist()
    assert row == want


def preflight(tmp_path, data, *flags):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "rm.py",
            "--preflight",
            "True",
            "--data",
            str(data),
            "--run_dir",
            str(run_dir),
            "--num_eval_prompts",
            "1",
            *flags,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc, run_dir


def test_bad_pairs_are_refused_by_the_preflight_with_one_message(tmp_path):
    cases = {
        "missing": ([{"prompt": "a", "chosen": "b"}] * 3, 'line 1 has no "rejected" field'),
        "same": (
            [{"prompt": "a", "chosen": "b", "rejected": "b"}] * 3,
            "chosen == rejected in every row",
        ),
        "empty": ([{"prompt": "a", "chosen": "b", "rejected": " "}] * 3, "have an empty response"),
        "margin": (
            [{"prompt": "a", "chosen": "b", "rejected": "c", "m": "x"}] * 3,
            "\"m\" 'x' is not a number",
        ),
    }
    for name, (rows, message) in cases.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        flags = ("--margin_field", "m") if name == "margin" else ()
        proc, run_dir = preflight(tmp_path / name, path, *flags)
        assert proc.returncode == 2, (name, proc.stderr[-2000:])
        errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
        assert len(errors) == 1 and message in errors[0], (name, errors)
        assert not run_dir.exists(), name  # nothing written


def test_args_refuse_what_rm_does_not_do():
    from exits import RunError

    for argv, msg in (
        (["--per_device_train_batch_size", "3"], "even"),
        (["--packing", "True"], "--packing"),
        (["--num_generations", "4"], "--num_generations"),
        (["--log_completions", "True"], "--log_completions is not supported by rm.py"),
    ):
        with pytest.raises(RunError, match=msg):
            parse_args(argv)
    args = parse_args([])
    assert args.num_generations == 2 and args.run_dir == ""  # named at the start
    pairs = {"chosen": torch.zeros(1), "rejected": torch.zeros(1)}
    assert split_scores(torch.tensor([1.0, 2.0]), {"margin": None})["rejected"].item() == 2.0
    assert bt_loss(pairs, normalizer=1)[0].item() == pytest.approx(0.6931, abs=1e-4)


def test_ppo_preflight_refuses_a_reward_model_with_another_pad_token(task_rm, tmp_path):
    """A reward model reads its score at the last token that is not its pad id: a policy padding
    with another id is refused, saying which --pad_token to pass."""
    import shutil

    from checks import check_beside, load_tokenizer
    from exits import RunError

    rm = str(tmp_path / "rm")
    shutil.copytree(task_rm, rm)
    tokenizer = load_tokenizer(task_rm)
    check_beside(rm, "--reward_model", tokenizer, "")  # the same pad id: fine
    with open(os.path.join(rm, "config.json")) as f:
        config = json.load(f)
    config["pad_token_id"] = tokenizer.eos_token_id
    with open(os.path.join(rm, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(RunError, match=f"pass --pad_token '{tokenizer.eos_token}'"):
        check_beside(rm, "--reward_model", tokenizer, "")

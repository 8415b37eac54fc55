"""tasks.py: the built-in task, reward functions and their loading; data.py's JSONL loading and
the data order (its other formats and conversations: test_data.py); pass@k and the held-out
evaluation that logs it (harness.Run.held_out)."""

import itertools
import json
from types import SimpleNamespace

import pytest
import torch

from data import batch_rows, load_data
from tasks import (
    RewardError,
    correct_reward,
    default_task,
    exact_match_reward,
    format_reward,
    pass_at_k,
    reward_functions,
    score_completions,
)


def test_default_task_split_and_answers():
    train, held = default_task(200)
    assert len(train) == 800 and not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    assert all(r["answer"] == max(r["prompt"][:-1]) for r in held)
    assert default_task(200, seed=1) != (train, held)  # the seed reshuffles the split


def test_reward_functions_against_hand_written_cases():
    completions = ["8", "8\n", "85", "x8", "", " 8"]
    answers = ["8"] * 6
    assert format_reward(None, completions, answers) == [1.0, 0.5, 0.5, 0.0, 0.0, 0.0]
    assert correct_reward(None, completions, answers) == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert correct_reward(None, ["8"], [""]) == [0.0]  # an empty answer is never right
    assert exact_match_reward(None, ["work\n\n 42 \n", "42\nno", "42"], ["42", "42", 42]) == [
        1.0,
        0.0,
        1.0,
    ]


def test_reward_functions_defaults_names_and_errors():
    funcs, weights = reward_functions("", "", data="")
    assert [f.__name__ for f in funcs] == ["format_reward", "correct_reward"] and weights == [
        0.25,
        0.75,
    ]
    funcs, weights = reward_functions("", "", data="x.jsonl")
    assert [f.__name__ for f in funcs] == ["exact_match_reward"] and weights == [1.0]
    funcs, weights = reward_functions("tasks:correct_reward, format_reward", "1,0.5", data="")
    assert funcs == [correct_reward, format_reward] and weights == [1.0, 0.5]
    with pytest.raises(ValueError, match="3 values for 2 reward functions"):
        reward_functions("", "1,2,3", data="")
    for bad in ("nosuchmodule:f", "tasks:nosuchfunction"):
        with pytest.raises(ValueError, match="module:function"):
            reward_functions(bad, "", data="")


def test_score_completions_weighs_each_prompts_group():
    rows = [{"prompt": "83=", "answer": "8"}, {"prompt": "12=", "answer": "2"}]
    completions = ["8", "3", "2", "22"]  # two per prompt, prompt-major
    total, per_func = score_completions(
        [format_reward, correct_reward], [0.25, 0.75], rows, completions, 2
    )
    torch.testing.assert_close(per_func["correct_reward"], torch.tensor([1.0, 0.0, 1.0, 1.0]))
    torch.testing.assert_close(total, torch.tensor([1.0, 0.25, 1.0, 0.875]))
    with pytest.raises(ValueError, match="returned 1 values for 4 completions"):
        score_completions([lambda p, c, a: [1.0]], [1.0], rows, completions, 2)


def test_load_jsonl_split_and_bad_input(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(
        "".join(json.dumps({"prompt": f"{i}=", "answer": str(i)}) + "\n" for i in range(10)) + "\n"
    )
    train, held = load_data(str(good), 3, 0)
    assert (
        len(train) == 7
        and len(held) == 3
        and not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    )
    assert load_data("", 3, 0) == default_task(3, 0)
    with pytest.raises(ValueError, match="lower it"):
        load_data(str(good), 10, 0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1=", "answer": "1"}\n{"question": "2="}\n')
    with pytest.raises(ValueError, match='bad.jsonl line 2 has no string "prompt"'):
        load_data(str(bad), 0, 0)
    bad.write_text('{"prompt": "1=", "answer": "1"}\n\n{"prompt": "2=", "answer": 2\n')
    # blank lines still count
    with pytest.raises(ValueError, match="bad.jsonl line 3 is not valid JSON"):
        load_data(str(bad), 0, 0)
    bad.write_text("\n")
    with pytest.raises(ValueError, match="has no rows"):
        load_data(str(bad), 0, 0)
    with pytest.raises(ValueError, match="cannot read it"):
        load_data(str(tmp_path / "missing.jsonl"), 0, 0)


def test_reward_failures_name_the_function():
    rows = [{"prompt": "83=", "answer": "8"}]

    def raises(p, c, a):
        return [1.0 / 0 for _ in c]

    def nan(p, c, a):
        return [float("nan")] * len(c)

    for f, msg in (
        (
            raises,
            r"test_tasks.raises raised ZeroDivisionError: float division by zero \(at "
            r"test_tasks.py:\d+\)",
        ),
        (nan, r"test_tasks.nan returned nan for completion 0 \('8'\)"),
        (lambda p, c, a: None, "returned NoneType None; it must return a list of floats"),
    ):
        with pytest.raises(RewardError, match=msg) as e:
            score_completions([f], [1.0], rows, ["8", "3"], 2)
        assert e.value.exit_code == 2 and not e.value.everywhere


def test_batch_rows_is_a_function_of_the_step_and_covers_each_epoch():
    train, _ = default_task(200)
    assert batch_rows(train, 7, 64, 0) == batch_rows(train, 7, 64, 0)  # what resume relies on
    epoch = [r["prompt"] for s in range(25) for r in batch_rows(train, s, 32, 0)]
    assert sorted(epoch) == sorted(r["prompt"] for r in train)
    # the next epoch is reshuffled
    assert batch_rows(train, 0, 32, 0) != batch_rows(train, 25, 32, 0)
    across = batch_rows(train, 24, 48, 0)  # a step that straddles two epochs still has n rows
    assert len(across) == 48


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_matches_counting_subsets(n):
    """Chen et al.'s estimator against its definition: the share of the C(n, k) k-subsets of the
    n samples that hold at least one correct sample."""
    for c in range(n + 1):
        samples = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(samples, k))
            want = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(want, rel=1e-12, abs=1e-15)
        assert pass_at_k(n, c, 1) == pytest.approx(c / n) and pass_at_k(n, c, n) == (c > 0)


@pytest.mark.parametrize("k", [1, 3])
def test_held_out_logs_pass_at_k_only_with_several_samples(k):
    """Run.held_out on one process (all_sum is this rank's own), a fake sampler: k samples per
    prompt, prompt-major. k = 1 logs the keys earlier runs logged; k > 1 adds eval/pass@1 (the
    mean of c / k) and eval/pass@k (the share of prompts with a correct sample)."""
    import harness

    correct = {1: [1, 0, 0, 1], 3: [1, 0, 0, 0, 0, 0, 1, 1, 1, 0, 1, 0]}[k]  # c = 1, 0, 3, 1
    run = object.__new__(harness.Run)
    rows, logged = [{"prompt": str(i)} for i in range(4)], []
    run.vllm, run.eval_rows, run.rank, run.world = None, rows, 0, 1
    run.data_rank, run.data_world = 0, 1
    run.args = SimpleNamespace(eval_samples=k, seed=0)
    run.log, run.say = SimpleNamespace(record=logged.append), lambda *a: None

    def sample(mine):
        assert mine == rows
        got = torch.tensor(correct, dtype=torch.float32)  # (4 * k,)
        return got * 2, {"correct": got}

    run.eval_sample = sample
    assert run.held_out(5, "step 5") == pytest.approx(2 * sum(correct) / (4 * k))
    row = logged[0]
    assert row["eval/accuracy"] == pytest.approx(sum(correct) / (4 * k))
    if k == 1:
        assert set(row) == {"step", "eval/reward", "eval/accuracy"}
    else:
        assert set(row) == {"step", "eval/reward", "eval/accuracy", "eval/pass@1", "eval/pass@3"}
        assert row["eval/pass@1"] == pytest.approx((1 + 0 + 3 + 1) / 3 / 4)
        assert row["eval/pass@3"] == pytest.approx(3 / 4)


def test_reward_stats_match_naive():
    """tasks.reward_stats, both loops' training-reward metrics, against plain Python over the
    rows (B, 2 + F): the total, the length, each function's reward."""
    import statistics

    from tasks import reward_stats

    rows = [[0.25, 3, 1.0, 0.0], [1.0, 5, 1.0, 1.0], [0.5, 2, 1.0, 1.0], [0.0, 4, 0.0, 0.0]]
    got = reward_stats(torch.tensor(rows, dtype=torch.float64), ["fmt", "ok"])
    col = list(zip(*rows))
    want = {"reward": statistics.mean(col[0]), "reward_std": statistics.stdev(col[0])}
    want["accuracy"] = sum(all(v >= 1 for v in r[2:]) for r in rows) / len(rows)
    want.update(completion_len=statistics.mean(col[1]), completion_len_max=max(col[1]))
    want["completion_tokens"] = sum(col[1])
    for j, name in enumerate(["fmt", "ok"]):
        want[f"rewards/{name}/mean"] = statistics.mean(col[2 + j])
        want[f"rewards/{name}/std"] = statistics.stdev(col[2 + j])
    assert got == pytest.approx(want)
    assert "accuracy" not in reward_stats(torch.tensor(rows)[:, :2], [])  # a reward model

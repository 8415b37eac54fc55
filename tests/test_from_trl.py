"""A TRL project's habits here (docs/from-trl.md): TRL's reward functions exactly as TRL's
documentation writes them, called through score_completions beside this project's positional
form (keywords, conversational completions, completion_ids, dataset columns, None), the
signature that tells the forms apart, one message with both forms when a call fails on its
arguments, reward modules from the user's directory, and TRL's flag names refused with what does
their job here (arguments.TRL_FLAGS, and the docs' table of it)."""

import dataclasses
import json
import os
import re
import sys

import pytest
import torch

import grpo
import ppo
import rm
from arguments import TRL_FLAGS
from conftest import ROOT
from data import load_rows
from exits import RunError
from tasks import (
    USER_DIR_ENV,
    RewardError,
    exact_match_reward,
    load_reward_funcs,
    reward_stats,
    score_completions,
    solved_mask,
    takes_keywords,
)

# ---- TRL's documented reward functions, verbatim (docs/source/grpo_trainer.md, "Using a custom
# reward function", examples 1, 1.1, 2 and 3; trl/rewards/format_rewards.py's think_format_reward)


def trl_example_1(completion_ids, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of token count)."""  # noqa: E501
    return [float(len(ids)) for ids in completion_ids]


def trl_example_1_1(completions, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of character count)."""  # noqa: E501
    return [float(len(completion)) for completion in completions]


def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def reward_func(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


def think_format_reward(completions: list[list[dict[str, str]]], **kwargs) -> list[float]:
    pattern = r"^<think>(?!.*<think>)(.*?)</think>.*$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content, re.DOTALL | re.MULTILINE) for content in completion_contents]  # noqa: E501 # fmt: skip
    return [1.0 if match else 0.0 for match in matches]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_trl_docs_rewards_run_as_written(tmp_path):
    """TRL's examples 1, 1.1 and 3 on TRL's own test inputs, the standard format (rows read from
    JSONL by data.load_rows, the "ground_truth" column passed by name), beside this project's
    positional exact_match_reward in the same call; each function's values are what TRL's docs
    say they return."""
    data = write_jsonl(
        tmp_path / "std.jsonl",
        [
            {"prompt": "Problem: Solve the equation $2x + 3 = 7$. Solution:", "ground_truth": "2"},
            {"prompt": "Problem: Solve the equation $3x - 5 = 10$.", "ground_truth": "5"},
        ],
    )
    rows = load_rows(data, answer_field="ground_truth")
    completions = [r" The solution is \boxed{2}.", r" The solution is \boxed{6}."]
    completion_ids = [[6303, 13], [304, 279, 12884, 13]]
    funcs = [trl_example_1, trl_example_1_1, reward_func, exact_match_reward]
    assert [takes_keywords(f) for f in funcs] == [True, True, True, False]
    total, per_func = score_completions(funcs, [1.0] * 4, rows, completions, 1, completion_ids)
    assert per_func["trl_example_1"].tolist() == [2.0, 4.0]  # TRL's docs: [2.0, 4.0]
    assert per_func["trl_example_1_1"].tolist() == [27.0, 27.0]  # characters of each
    assert per_func["reward_func"].tolist() == [1.0, 0.0]  # TRL's docs: [1.0, 0.0]
    assert per_func["exact_match_reward"].tolist() == [0.0, 0.0]  # positional, as before
    torch.testing.assert_close(total, torch.tensor([2 + 27 + 1.0, 4 + 27 + 0.0]))


def test_trl_docs_conversational_rewards_get_messages(tmp_path):
    """TRL's example 2 and its think_format_reward on conversational prompts: each completion
    reaches them as [{"role": "assistant", "content": text}] and the prompts as messages; the
    positional form still gets text (format_reward_func's own inputs, TRL's docs: [1.0, 0.0])."""
    data = write_jsonl(
        tmp_path / "chat.jsonl",
        [
            {"prompt": [{"role": "user", "content": "What is the result of (1 + 2) * 4?"}]},
            {"prompt": [{"role": "user", "content": "What is the result of (3 + 1) * 2?"}]},
        ],
    )
    rows = load_rows(data)
    completions = [
        "<think>The sum of 1 and 2 is 3, which we multiply by 4 to get 12.</think>"
        "<answer>(1 + 2) * 4 = 12</answer>",
        "The sum of 3 and 1 is 4, which we multiply by 2 to get 8. So (3 + 1) * 2 = 8.",
    ]
    seen = {}

    def positional(prompts, completions, answers):
        seen.update(prompts=prompts, completions=completions, answers=answers)
        return [0.0] * len(completions)

    funcs = [format_reward_func, think_format_reward, positional]
    _, per_func = score_completions(funcs, [1.0] * 3, rows, completions, 1, [[1], [2]])
    assert per_func["format_reward_func"].tolist() == [1.0, 0.0]
    assert per_func["think_format_reward"].tolist() == [1.0, 0.0]
    assert seen == {"prompts": [r["prompt"] for r in rows], "completions": completions,
                    "answers": [None, None]}  # fmt: skip


def test_none_skips_a_completion_as_trl_does(tmp_path):
    """TRL's example 4, multi-task rewards returning None, verbatim (its "coding" never matches the
    dataset's "code", so no function scores the code rows). A None adds nothing to the weighted
    sum and is left out of the function's metrics and of accuracy; a completion no function
    scores gets its group's mean of the scored ones (0 when none is), so GRPO's advantage of it is
    0 and the others' are those of their scored group; a warning says so."""

    def check_math_solution(prompt, completion):
        return completion == str(eval(prompt.removeprefix("What is ").rstrip("?")))

    def test_code_solution(prompt, completion):
        return "def" in completion

    # Math-specific reward function
    def math_reward_func(prompts, completions, task, **kwargs):
        rewards = []
        for prompt, completion, t in zip(prompts, completions, task):
            if t == "math":
                # Calculate math-specific reward
                correct = check_math_solution(prompt, completion)
                reward = 1.0 if correct else -1.0
                rewards.append(reward)
            else:
                # Return None for non-math tasks
                rewards.append(None)
        return rewards

    # Coding-specific reward function
    def coding_reward_func(prompts, completions, task, **kwargs):
        rewards = []
        for prompt, completion, t in zip(prompts, completions, task):
            if t == "coding":
                # Calculate coding-specific reward
                works = test_code_solution(prompt, completion)
                reward = 1.0 if works else -1.0
                rewards.append(reward)
            else:
                # Return None for non-coding tasks
                rewards.append(None)
        return rewards

    data = write_jsonl(
        tmp_path / "tasks.jsonl",
        [
            {"prompt": "What is 2+2?", "task": "math"},
            {"prompt": "Write a function that returns the sum of two numbers.", "task": "code"},
            {"prompt": "What is 3*4?", "task": "math"},
        ],
    )
    rows = load_rows(data)
    completions = ["4", "5", "def f", "no", "12", "12"]  # G = 2, prompt-major
    funcs = [math_reward_func, coding_reward_func]
    with pytest.warns(UserWarning, match="every reward function returned None"):
        total, per_func = score_completions(funcs, [1.0, 0.5], rows, completions, 2)
    nan = float("nan")
    torch.testing.assert_close(
        per_func["math_reward_func"], torch.tensor([1.0, -1.0, nan, nan, 1.0, 1.0]), equal_nan=True
    )
    assert per_func["coding_reward_func"].isnan().all()
    assert total.tolist() == [1.0, -1.0, 0.0, 0.0, 1.0, 1.0]  # the code group: none scored
    seq = torch.stack([total, torch.ones(6), *per_func.values()], 1)
    stats = reward_stats(seq, list(per_func))
    assert stats["rewards/math_reward_func/mean"] == pytest.approx(0.5)  # over the 4 it scored
    assert stats["accuracy"] == pytest.approx(3 / 6)  # unscored rows are not solved
    assert solved_mask(per_func).tolist() == [True, False, False, False, True, True]

    # one unscored completion in a group of three: its group's mean of the other two
    rows = load_rows(write_jsonl(tmp_path / "m.jsonl", [{"prompt": "What is 1+1?", "task": "m"}]))

    def some(completions, **kwargs):
        return [None if c == "?" else float(c) for c in completions]

    with pytest.warns(UserWarning):
        total, _ = score_completions([some], [2.0], rows, ["1", "?", "0"], 3)
    assert total.tolist() == [2.0, 1.0, 0.0]
    args = grpo.parse_args(["--num_generations", "3"])
    adv = grpo.estimate_advantages({"rewards": total}, args)  # grpo's: the rewards alone
    assert adv[1] == 0 and adv[0] > 0 > adv[2]


@pytest.mark.parametrize(
    "signature, keywords",
    [
        ("(prompts, completions, answers)", False),  # this project's form
        ("(p, c, a)", False),
        ("(prompts, completions, answers, **kwargs)", False),  # names answers: positional
        ("(*args)", False),
        ("(completions, **kwargs)", True),
        ("(completion_ids, **kwargs)", True),
        ("(prompts, completions, task, **kwargs)", True),
        ("(completions, prompts, answer)", True),  # first completions
        ("(prompts, completions)", True),  # fewer than three positional
        ("(prompts, completions, completion_ids)", True),
        ("(prompts, completions, answers, *, solution)", True),  # a required keyword
    ],
)
def test_the_signature_tells_the_forms_apart(signature, keywords):
    namespace = {}
    exec(f"def f{signature}: pass", namespace)
    assert takes_keywords(namespace["f"]) is keywords


def test_a_call_that_fails_on_arguments_states_both_forms(tmp_path):
    """A column the data lacks, TRL's trainer_state, and a positional function that reads messages
    (completion[0]["content"] on text): one RewardError with both forms in it."""
    rows = load_rows(write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1=", "answer": "1"}]))
    both = r"f\(prompts, completions, answers\).*TRL's f\(completions, \*\*kwargs\)"

    def accuracy_reward(completions, solution):
        return [1.0 for _ in completions]

    def needs_state(completions, trainer_state, **kwargs):
        return [float(trainer_state.global_step) for _ in completions]

    def reads_messages(prompts, completions, answers):
        return [1.0 if completion[0]["content"] else 0.0 for completion in completions]

    for f, said in (
        (accuracy_reward, r"cannot be called with \(TRL's keywords answer, prompts, "
                          r"completions, completion_ids\): missing a required argument: "
                          r"'solution'"),
        (needs_state, r"'trainer_state' \(trainer_state: TRL's trainer's own, not passed here\)"),
        (reads_messages, r"raised TypeError: string indices must be integers.*it was called "
                         r"positionally"),
    ):  # fmt: skip
        with pytest.raises(RewardError, match=said + ".*" + both) as e:
            score_completions([f], [1.0], rows, ["1"], 1, [[5]])
        assert e.value.exit_code == 2


def test_reward_modules_from_the_users_directory(tmp_path, monkeypatch):
    """`module.function` (TRL's dotted name) and `module:function` find a module in the directory
    run.sh was run from (LEAN_RL_USER_DIR), searched last: a file there named as one of the
    repository's modules does not hide it."""
    # a name no other test imports: the module stays in sys.modules after the test
    (tmp_path / "trl_user_rewards.py").write_text(
        "def longer(completions, **kwargs):\n    return [float(len(c)) for c in completions]\n"
    )
    (tmp_path / "rewards.py").write_text("math_reward = None\n")  # the repository's name
    monkeypatch.setenv(USER_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("trl_user_rewards", "rewards"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    dotted, colon, repo = load_reward_funcs(
        "trl_user_rewards.longer, trl_user_rewards:longer, rewards.math_reward"
    )
    assert dotted is colon and dotted(["ab"]) == [2.0]
    assert sys.modules["rewards"].__file__ == os.path.join(ROOT, "rewards.py")
    assert repo.__module__ == "rewards" and callable(repo)
    with pytest.raises(ValueError, match=f"no module 'nosuch' on PYTHONPATH or in .*{tmp_path}"):
        load_reward_funcs("nosuch.f")


def test_same_named_functions_log_under_their_modules():
    """TRL's examples all call theirs reward_func: two of them keep both rewards, each logged as
    module.reward_func."""
    import types

    one, two = types.ModuleType("one"), types.ModuleType("two")
    exec("def reward_func(completions, **kwargs): return [1.0] * len(completions)", vars(one))
    exec("def reward_func(completions, **kwargs): return [2.0] * len(completions)", vars(two))
    rows = [{"prompt": "1=", "answer": "1"}]
    total, per_func = score_completions([one.reward_func, two.reward_func], [1, 1], rows, ["1"], 1)
    assert list(per_func) == ["one.reward_func", "two.reward_func"] and total.tolist() == [3.0]


# ---- TRL's flag names ---------------------------------------------------------------------------
LOOPS = {"grpo.py": grpo, "ppo.py": ppo, "rm.py": rm}


def flags_of(module):
    fields = dataclasses.fields(module.Args)
    return {f"--{f.name}" for f in fields} | {
        a for f in fields for a in f.metadata.get("aliases", ())
    }


def test_trl_flags_name_what_does_their_job():
    """Each TRL name in TRL_FLAGS is a flag of no loop here, every flag its text names is a flag
    of some loop, and a loop refuses it with that text (also with a value, and as --flag=value);
    a list given TRL's way (space-separated) is told to be comma-separated."""
    ours = set().union(*(flags_of(m) for m in LOOPS.values()))
    for trl, here in TRL_FLAGS.items():
        assert trl not in ours, f"{trl} is a flag here: drop it from TRL_FLAGS"
        named = set(re.findall(r"--[a-z_0-9]+", here)) - {trl}
        assert named <= ours, f"{trl}: {named - ours} are no flags here"
    for argv, said in (
        (["--gradient_accumulation_steps", "4"], TRL_FLAGS["--gradient_accumulation_steps"]),
        (["--output_dir=out", "--use_peft"], TRL_FLAGS["--use_peft"]),
        (["--num_train_epochs", "3"], "is TRL's; here: --max_steps"),
        (["--reward_funcs", "a,b", "c"], "a list is comma-separated"),
    ):
        with pytest.raises(RunError) as e:
            grpo.parse_args(argv)
        assert said in str(e.value) and "did you mean" not in str(e.value)
    with pytest.raises(RunError, match=re.escape("--num_ppo_epochs is TRL's; here: --ppo_epochs")):
        ppo.parse_args(["--num_ppo_epochs", "2"])
    with pytest.raises(RunError) as e:
        grpo.parse_args(["--max_stpes", "3"])  # a typo: the closest flag, no word on lists
    assert "did you mean --max_steps?" in str(e.value) and "comma" not in str(e.value)
    # the flag whose name TRL shares with another meaning says so in --help
    for module in LOOPS.values():
        field = {f.name: f for f in dataclasses.fields(module.Args)}["per_device_train_batch_size"]
        assert "TRL's" in field.metadata["help"]


def test_docs_table_lists_every_trl_flag_and_names_real_flags():
    """docs/from-trl.md's table holds every TRL_FLAGS name, and every flag it names on the side of
    this project (the table's right column and the same-names paragraph) is a flag of a loop."""
    with open(os.path.join(ROOT, "docs", "from-trl.md"), encoding="utf-8") as f:
        page = f.read()
    rows = [line.split(" | ") for line in page.splitlines() if line.startswith("| `--")]
    trl_side = set(re.findall(r"--[a-z_0-9]+", " ".join(r[0] for r in rows)))
    assert set(TRL_FLAGS) <= trl_side, set(TRL_FLAGS) - trl_side
    same = page[page.index("The same names with the same job") :].split("\n\n")[0]
    here = " ".join(" | ".join(r[1:]) for r in rows) + same
    ours = set().union(*(flags_of(m) for m in LOOPS.values()))
    named = set(re.findall(r"`(--[a-z_0-9]+)", here))
    assert named <= ours, named - ours

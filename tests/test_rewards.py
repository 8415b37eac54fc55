"""rewards.py against hand-written completions: answer extraction, numeric and string matching,
the <think> format, GSM8K's answer line, the length penalty, and loading them as module:function."""

import pytest

from rewards import (
    answer_line_reward,
    answers_match,
    extract_answer,
    extract_boxed,
    length_penalty,
    make_length_penalty,
    math_reward,
    parse_number,
    think_continued_format_reward,
    think_format_reward,
)
from tasks import reward_functions, score_completions


def test_extract_boxed_nested_and_last():
    assert extract_boxed(r"so \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert extract_boxed(r"\boxed{3} then \boxed{ {a}_{b} }") == "{a}_{b}"  # the last, nested
    assert extract_boxed(r"\boxed{4} and an unclosed \boxed{5") == "4"  # the last one that closes
    assert extract_boxed(r"\fbox{7}") == "7"
    assert extract_boxed("no box {here}") is None


@pytest.mark.parametrize(
    "text,answer",
    [
        (r"First 12, then \boxed{42}. Check: 40 + 2", "42"),  # boxed wins over a later number
        ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72"),  # GSM8K
        ("#### 1,000.\nthat is all", "1,000."),  # the rest of the #### line only
        ("It costs $1,000.", "1,000"),  # the last number, commas kept, trailing period dropped
        ("So x = -7", "-7"),
        ("5-3=2", "2"),  # a minus after a digit is a subtraction, not a sign
        ("from 3 to (-4)", "-4"),
        ("half: 1/2.", "1/2"),
        ("the answer is .5", ".5"),
        ("<think>try 3, 4, 5</think> it is 6", "6"),  # numbers in the reasoning are not answers
        (r"<think>\boxed{1}</think> no number", None),
        ("no answer at all", None),
        ("#### ", None),
        ("", None),
    ],
)
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize(
    "s,value",
    [
        ("1,000", 1000.0),
        ("1000.0", 1000.0),
        ("-3.5", -3.5),
        ("1/2", 0.5),
        (r"\frac{1}{2}", 0.5),
        (r"\dfrac{3}{4}", 0.75),
        (r"-\frac{1}{4}", -0.25),
        (r"\frac{-1}{4}", -0.25),
        ("50%", 50.0),
        (r"50\%", 50.0),
        ("$12", 12.0),
        (r"\$12.50", 12.5),
        ("x = 5", 5.0),
        (r"7\text{ cm}", 7.0),
        (r"90^\circ", 90.0),
        (r"1{,}000", 1000.0),
        (r"1\,000", 1000.0),
        ("42.", 42.0),
        ("−5", -5.0),
        (".5", 0.5),
        ("1,2", None),
        ("1,0000", None),
        ("inf", None),
        ("nan", None),
        ("x^2 + 1", None),
        ("1/0", None),
        (r"\frac{1}{0}", None),
        ("", None),
        (r"\text{(A)}", None),
    ],
)
def test_parse_number(s, value):
    assert parse_number(s) == value


def test_answers_match_numbers_then_strings():
    for a, b in [
        ("1,000", "1000.0"),
        ("1/2", "0.5"),
        (r"\frac{1}{2}", ".5"),
        ("-7", "−7"),
        ("3.0", "3"),
        (r"\dfrac{\pi}{2}", r"\frac{\pi}{2}"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        ("Yes.", "yes"),
        ("{5}", "5"),
        (r"\text{(B)}", "(b)"),
    ]:
        assert answers_match(a, b) and answers_match(b, a), (a, b)
    for a, b in [
        ("0.333", "1/3"),
        ("-7", "7"),
        ("12", "1,2"),
        ("{1}+{2}", "1}+{2"),
        ("", ""),
        (None, "3"),
        ("3", None),
    ]:
        assert not answers_match(a, b), (a, b)


def test_math_reward():
    completions = [
        r"We get \boxed{\frac{1}{2}}.",
        "48 + 24 = 72\n#### 72",
        "I think it's 1,000.",
        "It is -3",
        "It is 3",
        "no idea",
        r"<think>maybe 4</think>\boxed{5}",
        r"\boxed{x^2+1}",
    ]
    answers = ["0.5", "72", "1000", "-3", "-3", "3", "4", "x^2 + 1"]
    assert math_reward(None, completions, answers) == [1, 1, 1, 1, 0, 0, 0, 1]
    # a whole GSM8K solution or a boxed reference counts by its final answer, not its first number
    references = ["16 - 3 - 4 = 9, 9 * 2 = 18\n#### 18", r"$\boxed{18}$"]
    assert math_reward(None, ["so 18", "so 18"], references) == [1, 1]


def test_think_format_reward():
    completions = [
        "<think>a</think>42",
        "  <think>\nlong\nreasoning\n</think>\n\nIt is 42.",
        "<think>a</think>",
        "<think>a</think>   ",
        "42",
        "<think>a<think>b</think>42",
        "<think>a</think>42<think>b</think>",
        "x<think>a</think>42",
        "<think>a 42",
        "</think>42",
    ]
    assert think_format_reward(None, completions, [""] * 10) == [1, 1, 0, 0, 0, 0, 0, 0, 0, 0]
    # an R1-Zero style raw prompt that opens the block: the completion continues it
    prompts = ["... Assistant: <think>\n", "plain prompt"]
    assert think_format_reward(prompts, ["reasoning</think>42"] * 2, ["", ""]) == [1, 0]
    chat = [[{"role": "user", "content": "Think first. <think>"}]] * 2  # a conversation's prompt
    assert think_format_reward(chat, ["<think>a</think>42", "a</think>42"], [None] * 2) == [1, 0]
    # a chat template that opens it (the reward sees the dataset's prompt, not the template's)
    continued = ["reasoning</think>42", "<think>a</think>42", "reasoning</think>", "42"]
    assert think_continued_format_reward(["q"] * 4, continued, [""] * 4) == [1, 0, 0, 0]


def test_answer_line_reward():
    completions = [
        "3 + 4 = 7\n#### 7",
        "#### 4,200\n",
        "so\n####  $18  \n",
        "#### -2.5",
        "It is 7 #### 7 and more",  # text after the answer line
        "#### 7\nThe answer is: 7",  # rambles on
        "#### seven",
        "7",
    ]
    assert answer_line_reward(None, completions, ["7"] * 8) == [1, 1, 1, 1, 0, 0, 0, 0]


def test_length_penalty():
    lengths = [0, 768, 896, 1024, 5000]
    assert length_penalty(None, ["a" * n for n in lengths], None) == [0, 0, -0.5, -1, -1]
    short = make_length_penalty(10, 4, name="short_penalty")
    assert short(None, ["a" * 6, "a" * 7, "a" * 9, "a" * 11], None) == [0, -0.25, -0.75, -1]
    assert short.__name__ == "short_penalty"
    with pytest.raises(ValueError, match="buffer_chars"):
        make_length_penalty(10, 0)


def test_rewards_load_as_module_functions_and_score():
    spec = "rewards:math_reward,rewards:think_format_reward,rewards:length_penalty"
    funcs, weights = reward_functions(spec, "1.0,0.2,0.5", data="x.jsonl")
    assert [f.__name__ for f in funcs] == ["math_reward", "think_format_reward", "length_penalty"]
    rows = [{"prompt": "2+2=", "answer": "4"}]
    completions = [r"<think>2+2</think>\boxed{4}", "5" * 2000]
    total, per_func = score_completions(funcs, weights, rows, completions, 2)
    assert per_func["math_reward"].tolist() == [1, 0]
    assert per_func["length_penalty"].tolist() == [0, -1]
    assert total.tolist() == pytest.approx([1.2, -0.5])

"""Reward functions that real recipes use: a math answer checker, a <think> format reward and
an overlong penalty. Imports no sibling file (copy it).

    --reward_funcs rewards:math_reward,rewards:think_format_reward,rewards:length_penalty
    --reward_weights 1.0,0.2,0.5

Each is a plain (prompts, completions, answers) -> list[float], like the rewards in tasks.py:

  math_reward          1 when the completion's answer equals the reference answer, else 0.
                       The answer is the last \\boxed{...} (nested braces allowed), else the
                       text after the last "#### " (GSM8K), else the last number; compared as
                       numbers ("1,000" = "1000.0", "1/2" = "\\frac{1}{2}" = "0.5", "50%" = "50")
                       or else as normalised strings ("\\dfrac{\\pi}{2}" = "\\frac{\\pi}{2}").
  think_format_reward  1 for "<think>reasoning</think>answer": one think block first, then a
                       non-empty answer; a prompt that ends with "<think>" (R1-Zero style
                       raw prompts) counts as the completion's start.
  think_continued_format_reward   the same for chat templates that open the block in the
                       generation prompt (DeepSeek-R1 distills): rewards see the dataset's
                       prompt, not the templated one, so this one reads every completion as
                       continuing an open block ("reasoning</think>answer").
  length_penalty       0 up to 768 characters, falling linearly to -1 at 1024 and beyond
                       (DAPO's soft overlong punishment, in characters: rewards see text).
                       make_length_penalty(max_chars, buffer_chars) makes one with other
                       limits: put `my_penalty = make_length_penalty(4000, 1000)` in your
                       module and pass `--reward_funcs mymod:my_penalty`.
"""

import math
import re

# ---- Finding the answer in a completion ----------------------------------------------------------
# A number: an optional minus that is not a subtraction (no word character or ')' before it),
# digits with optional thousands commas, optional decimals, an optional "/denominator".
_NUMBER = re.compile(
    r"(?:(?<![\w)])[-\u2212])?"  # a sign (ASCII or Unicode minus), not a subtraction
    r"(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?:/\d+)?"
)


def extract_boxed(text):
    """The contents of the last \\boxed{...} (or \\fbox{...}) in text, braces nested; else None."""
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):  # the last one that closes
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i].strip()
    return None


def extract_answer(text):
    """The answer a completion gives: after the last </think> if it has one (numbers in the
    reasoning are not answers), the last \\boxed{...}, else what follows the last "####" on its
    line, else the last number. None when there is none."""
    text = text.rpartition("</think>")[2]
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        line = text.rpartition("####")[2].strip().splitlines()
        return line[0].strip() if line and line[0].strip() else None
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _reference(answer):
    """A dataset's answer: a whole GSM8K solution ("... #### 72") or a boxed one gives its final
    answer; anything else is the answer itself (not its last number: "x^2 + 1" stays)."""
    answer = str(answer)
    if "####" in answer or extract_boxed(answer) is not None:
        return extract_answer(answer)
    return answer.strip()


# ---- Comparing answers ---------------------------------------------------------------------------
def _strip(s):
    """LaTeX and prose wrappers that do not change an answer's value."""
    s = s.strip().replace("−", "-")
    s = re.sub(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}", r"\1", s)  # \text{cm} -> cm
    s = re.sub(r"\\(?:left|right|displaystyle)|\\[!,;: ]|\\?\$", "", s)  # \left( \, $ \$ ...
    s = s.replace("{,}", ",").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s.strip())  # "x = 5" -> "5"
    return s.strip().rstrip(".").strip()


def parse_number(s):
    """A float for "1,000", "-3.5", "1/2", "\\frac{1}{2}", "50\\%", "$12", "x = 5", "7\\text{ cm}",
    "90^\\circ"; else None."""
    # a unit after a number: 7\text{ cm}
    s = re.sub(r"(?<=\d)\s*\\(?:text|mbox|mathrm)\s*\{[^{}]*\}$", "", s.strip())
    s = _strip(s)
    s = re.sub(r"\s*(?:\\?%|\^\s*\{?\\circ\}?)$", "", s)  # percent and degrees compare as numbers
    m = re.fullmatch(r"(-?)\\frac\{([^{}]+)\}\{([^{}]+)\}", s)
    if m:
        num, den = parse_number(m[2]), parse_number(m[3])
        return None if num is None or not den else (-1 if m[1] else 1) * num / den
    m = re.fullmatch(r"(-?\d+(?:\.\d+)?)\s*/\s*(\d+(?:\.\d+)?)", s)
    if m:
        return float(m[1]) / float(m[2]) if float(m[2]) else None
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):  # thousands commas; "1,2" is no number
        s = s.replace(",", "")
    return float(s) if re.fullmatch(r"-?(?:\d+(?:\.\d*)?|\.\d+)", s) else None  # no "inf", "nan"


def normalize_answer(s):
    """For answers that are not numbers: no LaTeX spacing, $, \\left/\\right, whitespace,
    outer braces or trailing period; \\dfrac = \\frac; lower case."""
    s = re.sub(r"\s+", "", _strip(s))
    while s.startswith("{") and s.endswith("}") and extract_boxed("\\boxed" + s) == s[1:-1]:
        s = s[1:-1]  # "{5}" -> "5", but not "{1}+{2}"
    return s.lower()


def answers_match(predicted, reference):
    """Numerically equal (relative 1e-6) when both are numbers, else equal once normalised."""
    if predicted is None or reference is None:
        return False
    a, b = parse_number(predicted), parse_number(reference)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    return normalize_answer(predicted) == normalize_answer(reference) != ""


# ---- The reward functions ------------------------------------------------------------------------
def math_reward(prompts, completions, answers):
    """1 when the completion's final answer (see extract_answer) matches the reference, else 0."""
    return [
        float(answers_match(extract_answer(c), _reference(a))) for c, a in zip(completions, answers)
    ]


_ANSWER_LINE = re.compile(r"(?s).*\n?####[ \t]*(\S+)\s*")


def answer_line_reward(prompts, completions, answers):
    """1 when the completion ends with its answer line, "#### <a number>", and nothing after it
    (GSM8K's format), else 0: format and stopping, whatever the number's value."""
    out = []
    for c in completions:
        m = _ANSWER_LINE.fullmatch(c)
        out.append(1.0 if m and _NUMBER.fullmatch(m[1].replace("$", "")) else 0.0)
    return out


_THINK = re.compile(r"\s*<think>((?:(?!<think>|</think>).)*)</think>\s*(\S.*)", re.DOTALL)


def _think_format(text):
    m = _THINK.fullmatch(text)
    return 1.0 if m and "<think>" not in m[2] and "</think>" not in m[2] else 0.0


def think_format_reward(prompts, completions, answers):
    """1 for "<think>...</think>answer" (one think block, then a non-empty answer outside any
    block), else 0. When the prompt ends with "<think>", the completion continues that block (a
    conversation's prompt, a list of messages, never does: its template's text is not seen)."""
    prompts = prompts or [""] * len(completions)
    return [
        _think_format("<think>" + c if isinstance(p, str) and p.rstrip().endswith("<think>") else c)
        for p, c in zip(prompts, completions)
    ]


def think_continued_format_reward(prompts, completions, answers):
    """think_format_reward for completions that continue a block the chat template opened:
    1 for "reasoning</think>answer", else 0."""
    return [_think_format("<think>" + c) for c in completions]


def make_length_penalty(max_chars, buffer_chars, name="length_penalty"):
    """A reward of 0 for completions up to max_chars - buffer_chars characters, falling linearly
    to -1 at max_chars, and -1 beyond (DAPO's soft overlong punishment, on characters)."""
    if not 0 < buffer_chars <= max_chars:
        raise ValueError(f"need 0 < buffer_chars <= max_chars, got {buffer_chars} and {max_chars}")

    def penalty(prompts, completions, answers):
        over = [max(0, len(c) - (max_chars - buffer_chars)) for c in completions]  # characters
        return [-min(1.0, o / buffer_chars) for o in over]

    penalty.__name__ = penalty.__qualname__ = name  # the name its rewards are logged under
    return penalty


length_penalty = make_length_penalty(1024, 256)

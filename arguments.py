"""Args fields in one line each, the range each value must hold, and parsing that leaves
argparse's text to rank 0.

    from arguments import arg, parse_args_quietly
    @dataclass
    class Args:
        learning_rate: float = arg(1e-3, "peak LR", "> 0")
        loss_type: str = arg("bnpo", "the normaliser", ("grpo", "bnpo", "dr_grpo", "cispo"))
    args = parse_args_quietly(Args, argv)   # unknown flags, a value outside its range: RunError

A range is "> a", ">= a" or an interval "(a, b]", "[a, b)", ...; a string field's choices are a
tuple. A value outside it, NaN or inf is refused with one message naming the flag, the value and
the range (exit 2, exits.RunError); --help shows it after the field's help text. A flag is
never abbreviated (--max_step is unknown, and the message names --max_steps, as it names the
closest flag to a typo), and a value may start with "-" and a digit ("--learning_rate -1e-4").
Imports exits.py (RunError) and zero3_utils.py (process_rank).
"""

import contextlib
import copy
import dataclasses
import difflib
import io
import math
import os
import re
import sys
import types

from exits import RunError
from zero3_utils import process_rank


def parse_args_quietly(dataclass_type, argv=None):
    """HfArgumentParser, with argparse's usage and error text printed by rank 0 only (argparse exits
    2); an argument no field takes, or a value outside its field's "range", is a RunError."""
    quiet = process_rank() != 0
    sink = io.StringIO()
    with (
        contextlib.redirect_stderr(sink) if quiet else contextlib.nullcontext(),
        contextlib.redirect_stdout(sink) if quiet else contextlib.nullcontext(),
    ):
        args, unknown = _parser(dataclass_type).parse_args_into_dataclasses(
            argv, return_remaining_strings=True
        )
    if unknown:
        raise RunError(
            f"unknown arguments {unknown}: `python {os.path.basename(sys.argv[0])} --help` lists "
            f"them{closest_flags(unknown, dataclass_type)}"
        )
    check_ranges(args)
    return args


def closest_flags(unknown, dataclass_type):
    """'; --max_stpes is not a flag; did you mean --max_steps?' for each unknown flag (argv tokens
    that start with --) with a close one among the dataclass's fields and their aliases; a prefix of
    one says that flags are never abbreviated."""
    flags = [f"--{f.name}" for f in dataclasses.fields(dataclass_type)]
    flags += [a for f in dataclasses.fields(dataclass_type) for a in f.metadata.get("aliases", ())]
    said = ""
    for token in (u.split("=")[0] for u in unknown if u.startswith("--")):
        prefix = [f for f in flags if f.startswith(token)]
        near = prefix[:3] or difflib.get_close_matches(token, flags, n=1, cutoff=0.75)
        if near:
            never = " (flags are never abbreviated)" * bool(prefix)
            one = near[0] if len(near) == 1 else f"one of {', '.join(near)}"
            said += f"; {token} is not a flag{never}; did you mean {one}?"
    return said


# ---- Argument ranges: declared once, in each Args field's metadata -------------------------------
# field(default=1.0, metadata={"help": ..., "range": "(0, 1]", "why": "optional reason"}); a range
# is "> a", ">= a" or an interval "(a, b]", "[a, b)", ...; a value outside it, NaN, inf: refused.
RANGE_KEYS = ("range", "why")


def _parser(dataclass_type):
    """HfArgumentParser that keeps "range" and "why" out of argparse (which takes no such keywords)
    and shows the range at the end of the field's --help ("...; must be > 0")."""
    from transformers import HfArgumentParser

    class Parser(HfArgumentParser):
        @staticmethod
        def _parse_dataclass_field(parser, field):
            if "range" in field.metadata:
                meta = {k: v for k, v in field.metadata.items() if k not in RANGE_KEYS}
                rule = describe_range(field.metadata["range"])
                meta["help"] = f"{meta.get('help', '')}; must be {rule}"
                field = copy.copy(field)
                field.metadata = types.MappingProxyType(meta)
            HfArgumentParser._parse_dataclass_field(parser, field)

    # allow_abbrev=False: argparse would take a prefix (--max_step) for the one flag it starts, a
    # different one as fields are added; a prefix is an unknown argument here (closest_flags)
    parser = Parser(dataclass_type, allow_abbrev=False)
    # a token that starts with "-" and a digit ("-1e-4", "-.5", "-0.5,1") is a value, never a flag
    # (no flag here looks so): argparse before Python 3.14 matched only ^-\d+$|^-\d*\.\d+$, and
    # took "--learning_rate -1e-4" for a flag with no value; this is 3.14's own pattern
    parser._negative_number_matcher = re.compile(r"-\.?\d")
    return parser


def _bounds(rule):
    """(low, low open, high, high open): "> 0" -> (0, True, inf, False), "[0, 1)" -> (0, False, 1,
    True)."""
    rule = rule.strip()
    if rule.startswith(">"):
        return float(rule.lstrip(">=").strip()), not rule.startswith(">="), math.inf, False
    low, high = rule[1:-1].split(",")
    return float(low), rule[0] == "(", float(high), rule[-1] == ")"


def describe_range(rule):
    """ "> 0" stays as it is; an interval reads "in [0, 1)"; choices "one of a, b"."""
    if isinstance(rule, tuple):
        return f"one of {', '.join(rule)}"
    return rule if rule.startswith(">") else f"in {rule}"


def in_range(value, rule):
    if isinstance(rule, tuple):  # the field's choices
        return value in rule
    low, low_open, high, high_open = _bounds(rule)
    if not math.isfinite(value):
        return False
    above = value > low if low_open else value >= low
    return above and (value < high if high_open else value <= high)


def arg(default, help, range=None, why=None, aliases=None):
    """An Args field in one line: its default, its --help text, the range check_ranges enforces
    (">= 0", "(0, 1]", ...; a string's choices as a tuple) with an optional reason for the
    message; aliases: an older flag name still accepted ("--old_name")."""
    metadata = {"help": help}
    if range is not None:
        metadata["range"] = range
    if why is not None:
        metadata["why"] = why
    if aliases is not None:
        metadata["aliases"] = [aliases]
    return dataclasses.field(default=default, metadata=metadata)


def check_ranges(args):
    """Every field of the Args dataclass `args` whose metadata has a "range" holds a finite value in
    it; else a RunError naming the flag, the value and the range."""
    for f in dataclasses.fields(args):
        rule, value = f.metadata.get("range"), getattr(args, f.name)
        if rule is not None and not in_range(value, rule):
            why = f" ({f.metadata['why']})" if "why" in f.metadata else ""
            raise RunError(f"--{f.name} {value}: must be {describe_range(rule)}{why}")

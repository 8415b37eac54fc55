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
closest flag to a typo; for one of TRL's names, TRL_FLAGS, what does its job here), and a value
may start with "-" and a digit ("--learning_rate -1e-4").
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


# ---- TRL's flag names that are no flag here, and what does their job (docs/from-trl.md) ----------
# GRPOConfig, PPOConfig, RewardConfig, the TrainingArguments under them and the trl CLI's
# ModelConfig and ScriptArguments. A TRL flag that is a flag here too is not listed (--beta,
# --learning_rate, --num_generations, --max_completion_length, --use_vllm, --lora_r, ...), even
# where its meaning differs (--per_device_train_batch_size: sequences per micro-batch here).
_STEP = "--prompts_per_rank prompts x --num_generations completions per rank"
_SERVER = "--vllm_server_url http://HOST:PORT (run.sh with VLLM_DEVICES=... starts one)"
_NO_HUB = "none: the final model is <run_dir>/final, a save_pretrained directory, to push yourself"
_SAMPLING = "none: sampling takes --temperature, --top_p and --top_k only"
TRL_FLAGS = {
    "--output_dir": "--run_dir (RUN_DIR with run.sh; default runs/<algo>-<time>)",
    "--overwrite_output_dir": "--overwrite True",
    "--gradient_accumulation_steps": (
        "none needed: an optimizer step takes the step's whole batch (" + _STEP + "; ppo.py: "
        "each of its --num_mini_batches), accumulated over micro-batches of "
        "--per_device_train_batch_size sequences (or --max_tokens_per_microbatch) that never "
        "change the update"
    ),
    "--num_train_epochs": (
        "--max_steps (steps, not epochs: each takes " + _STEP + "; the data is reshuffled "
        "for each pass over it)"
    ),
    "--per_device_eval_batch_size": (
        "none: held-out evaluation samples --eval_samples completions of --num_eval_prompts "
        "prompts every --eval_steps"
    ),
    "--eval_strategy": "--eval_steps N (--num_eval_prompts 0: no evaluation)",
    "--save_strategy": "--save_steps N (0: none between) and --save_last",
    "--logging_steps": (
        "none: every step is a row of <run_dir>/metrics.jsonl (and of wandb with --report_to wandb)"
    ),
    "--lr_scheduler_type": "none: linear warmup over --warmup_steps, then constant",
    "--warmup_ratio": "--warmup_steps (a number of steps)",
    "--bf16": "--dtype bf16 (the default, auto: bf16 on a GPU that has it, else fp32)",
    "--fp16": "none: --dtype bf16 or fp32",
    "--torch_dtype": "--dtype (auto, bf16 or fp32)",
    "--deepspeed": "--ds_config (DS_CONFIG with run.sh; configs/*.json)",
    "--optim": "the DeepSpeed JSON's optimizer (--ds_config; configs/*.json: AdamW)",
    "--resume_from_checkpoint": "--resume True (the latest checkpoint in --run_dir)",
    "--push_to_hub": _NO_HUB,
    "--hub_model_id": _NO_HUB,
    "--model_name_or_path": "--model (MODEL with run.sh)",
    "--use_peft": "--lora_r N: N > 0 trains LoRA adapters (TRL's default r: --lora_r 16)",
    "--lora_dropout": "none: the adapters have no dropout",
    "--load_in_4bit": "none: no quantised training",
    "--load_in_8bit": "none: no quantised training",
    "--dataset_name": "--data (a file, a datasets directory or a hub id; DATA with run.sh)",
    "--dataset_config": "--data_config",
    "--dataset_train_split": "--data_split",
    "--dataset_test_split": "none: the held-out prompts are split off --data (--num_eval_prompts)",
    "--reward_model_name_or_path": "--reward_model (ppo.py)",
    "--epsilon": "--epsilon_low (grpo.py, with --epsilon_high) or --cliprange (ppo.py)",
    "--min_p": _SAMPLING,
    "--repetition_penalty": _SAMPLING,
    "--num_generations_eval": "--eval_samples",
    "--steps_per_generation": (
        "none: each step samples one batch; grpo.py's --num_iterations N takes N optimizer steps "
        "on it"
    ),
    "--vllm_server_base_url": _SERVER,
    "--vllm_server_host": _SERVER,
    "--vllm_server_port": _SERVER,
    "--vllm_max_model_length": "none: --max_prompt_length + --max_completion_length",
    "--vllm_importance_sampling_correction": "--vllm_importance_cap C > 0 (grpo.py)",
    "--vllm_importance_sampling_mode": "--vllm_importance_mode (grpo.py; the same four modes)",
    "--vllm_importance_sampling_cap": "--vllm_importance_cap (grpo.py)",
    "--vllm_importance_sampling_clip_max": "--vllm_importance_cap (grpo.py)",
    "--vllm_importance_sampling_clip_min": "--vllm_importance_min (grpo.py)",
    "--multi_objective_aggregation": (
        "none: the rewards' weighted sum (--reward_weights), then the group's advantage (TRL's "
        "default, sum_then_normalize)"
    ),
    "--use_liger_kernel": "none needed: log-probs never build the (B, T, V) logits (logprobs.py)",
    "--center_rewards_coefficient": "--center_coef (rm.py)",
    "--max_length": "--max_prompt_length and --max_completion_length (rm.py: the response's)",
    "--num_ppo_epochs": "--ppo_epochs (ppo.py)",
    "--vf_coef": (
        "none: actor and critic are separate models, each with its own optimizer "
        "(--critic_learning_rate, ppo.py)"
    ),
    "--response_length": "--max_completion_length",
    "--total_episodes": "--max_steps (each step: " + _STEP + ")",
    "--sft_model_path": "--model",
    "--reward_model_path": "--reward_model (ppo.py)",
    "--local_rollout_forward_batch_size": (
        "--per_device_train_batch_size (ppo.py's no-grad passes take the update's micro-batches)"
    ),
}


def trl_hints(unknown):
    """'; --output_dir is TRL's: here --run_dir ...' for each unknown flag that TRL_FLAGS names,
    and a word on lists when a flag was given several values (TRL's --reward_funcs a b)."""
    said = ""
    for token in (u.split("=")[0] for u in unknown if u.startswith("--")):
        if token in TRL_FLAGS:
            said += f"; {token} is TRL's; here: {TRL_FLAGS[token]}"
    # a value that follows no unknown flag: one more value for a flag that takes one
    after = [""] + [u if u.startswith("--") and "=" not in u else "" for u in unknown]
    if any(not u.startswith("--") and not flag for u, flag in zip(unknown, after)):
        said += (
            "; a flag takes one value: a list is comma-separated (--reward_funcs a,b "
            "--reward_weights 1,0.5, not TRL's space-separated lists)"
        )
    return said


def closest_flags(unknown, dataclass_type):
    """'; --max_stpes is not a flag; did you mean --max_steps?' for each unknown flag (argv tokens
    that start with --) with a close one among the dataclass's fields and their aliases; a prefix of
    one says that flags are never abbreviated. TRL's names (TRL_FLAGS) get trl_hints instead."""
    flags = [f"--{f.name}" for f in dataclasses.fields(dataclass_type)]
    flags += [a for f in dataclasses.fields(dataclass_type) for a in f.metadata.get("aliases", ())]
    said = trl_hints(unknown)
    for token in (u.split("=")[0] for u in unknown if u.startswith("--")):
        if token in TRL_FLAGS:
            continue
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

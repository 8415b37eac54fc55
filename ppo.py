"""PPO: actor, critic, reward and reference models, one standalone loop on torchrun + DeepSpeed.

Launch (see run.sh, which wires this through torchrun and a DeepSpeed JSON):

    bash run.sh ppo                               # default task: tiny actor and critic, ZeRO-3
    bash run.sh ppo --max_steps 2 --packing True  # extra args go to Args below
    bash run.sh ppo --reward_model path/to/rm     # a sequence-classification reward model (1 label)
    bash run.sh ppo --use_vllm True               # vLLM generation (VLLM_DEVICES=...: a server)
    python -m torch.distributed.run --nproc_per_node 2 ppo.py --ds_config configs/zero3.json ...

One step: each rank takes `prompts_per_rank` prompts, samples `num_generations` completions
each, scores them (rule-based functions or the reward model), computes old log-probs, reference
log-probs and values without gradients (old log-probs only where needs_old_logps says a pass of
their own is needed), turns them into per-token rewards
-kl_coef * (logp - ref_logp) (+ the score at the last completion token), GAE advantages
(whitened over the whole batch, all ranks) and returns, then runs `ppo_epochs` passes over
micro-batches: clipped policy loss on the actor, clipped value loss on the critic, gradient
accumulation and one optimizer step per model per mini-batch.

Models: actor (trained), critic (trained: the causal-LM body + a scalar value head, initialised
from the reward model when one is given (its body and score head), else from the actor's body
with a zero value head), reward (rule-based, or a frozen model), reference (frozen copy of the
actor; with LoRA it is the actor with its adapters switched off, so no fourth model exists).
Frozen models are ZeRO-3 inference engines when training runs ZeRO-3 (optionally offloaded to
CPU), plain resident modules under ZeRO-0/1/2.

Letters in shape comments: B sequences in a (micro-)batch, P prompt tokens, C completion tokens,
T = P + C, N tokens in a packed row, M completion tokens in a packed row, H hidden size.

Departures from the paper (InstructGPT / "Fine-Tuning LMs from Human Preferences") and why:
- A fixed kl_coef (no adaptive KL controller); KL by the k1 estimator logp - ref_logp per token.
- Value of completion token t = the critic at the position that predicts it (the state before t);
  after the last token the value is 0 (the episode ends).
- Loss sums are divided by the WHOLE mini-batch's token count (all micro-batches, all ranks), so
  the update does not depend on how it is split into micro-batches (docs/accumulation.md,
  "Accumulation never changes the update").
- Packing (`--packing`) concatenates a micro-batch's sequences into one row with position ids
  restarting per sequence; transformers turns that into a block-diagonal causal mask (SDPA, eager)
  or variable-length kernels (flash attention), so no token attends across sequences.
Shared with grpo.py: tasks.py (task, rewards), data.py (--data, data order), batching.py (batches,
micro-batches, collectives), runlog.py (run files), memory.py (peak memory per phase, OOM_HINTS),
fit.py (--estimate_memory, --memory_budget_gb), checks.py (inputs checked up front, exit codes,
non-finite steps), checkpoint.py (atomic checkpoints of actor and critic, resume);
logprobs.model_logps scores padded and packed rows; generation.py and vllm_server.py (HF or vLLM
generation, colocated or a server, the same flags as grpo.py's). PPO's own: critic.py (the value
model and its forward).
Under ZeRO-3 all four models are built already partitioned, each rank reading only its own
shard of the checkpoints (zero3_load.py; --partitioned_loading False: the full load).
Limits: the reward model must share the actor's tokenizer (token ids are passed as they are).
"""

import json
import math
import os
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import deepspeed
import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
)

import smollm2
from batching import (
    all_cat,
    all_sum,
    comm_device,
    encode_prompts,
    forward_logps,
    init_distributed,
    make_batch,
    micro_batches,
    mini_batch_plans,
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
    check_model_path,
    check_partitioned_loading,
    check_sequence_classifier,
    check_vllm,
    entry_code,
    exit_process,
    load_tokenizer,
    parse_args_quietly,
    recipe_help,
    training_dtype,
)
from critic import build_critic, forward_values
from data import batch_rows
from fit import KnobAdapter, estimate_run_memory, fit_to_budget
from generation import (
    attn_implementation_for,
    generate_hf,
    sampler_logp_gap,
    unwrap_for_generation,
)
from logprobs import DEFAULT_CHUNK_SIZE, DEFAULT_VOCAB_CHUNK_SIZE, positions_from_mask
from memory import MemoryLedger
from runlog import RunLog
from tasks import RewardError, reward_functions, score_completions
from vllm_server import vllm_generator
from zero3_load import enable_gradient_checkpointing, load_model
from zero3_utils import frozen_config, frozen_engine, gathered, load_ds_config, save_hf

# --recipe NAME: a named set of defaults (--help lists them); a flag given on the command line wins
# (checks.apply_recipe, as grpo.py's). Args' own defaults fit the from-scratch tiny task; run.sh
# passes --recipe pretrained with MODEL. Sized for 2 CPU ranks of a 24 GB machine, ZeRO-3, with
# `python ppo.py --recipe NAME --estimate_memory True`: actor, critic and reference side by side.
RECIPES = {
    "pretrained": {  # small LRs, longer answers, micro-batches that fit beside three models
        "learning_rate": 1e-6,
        "critic_learning_rate": 9e-6,
        "max_completion_length": 256,
        "prompts_per_rank": 4,
        "micro_train_batch_size": 2,
        "gradient_checkpointing": True,
        "eval_steps": 100,
    },
    # SmolLM2-135M-Instruct on GSM8K word problems, as grpo.py's recipe of the same name (the same
    # model and data functions, called only when --model / --data are not given; the same
    # completions per rank), with PPO's two learning rates and micro-batches of 2 (the default 64
    # was killed for memory in the first update). On-policy and without KL, as grpo.py's (one
    # iteration, beta 0): one epoch, kl_coef 0, so no reference model is built and the update's
    # own forward gives the old log-probs (needs_old_logps): 9 forward equivalents per sequence
    # against GRPO's 4, where two epochs with KL take 19 (docs/ppo.md, "Step profile").
    "smollm2-gsm8k": {
        "model": smollm2.model_dir,
        "data": smollm2.gsm8k_train_file,
        "reward_funcs": "rewards:math_reward",
        "use_vllm": True,
        "max_prompt_length": 320,
        "max_completion_length": 256,
        "prompts_per_rank": 4,
        "num_generations": 8,
        "micro_train_batch_size": 2,
        "gradient_checkpointing": True,
        "learning_rate": 1e-6,
        "critic_learning_rate": 9e-6,
        "ppo_epochs": 1,
        "kl_coef": 0.0,
        "temperature": 0.8,
        "max_steps": 40,
        "eval_steps": 10,
        "num_eval_prompts": 200,
    },
}
# grpo.py's smollm2-addition for PPO: the same data, completions and steps, both LRs 1e-5
RECIPES["smollm2-addition"] = {
    **RECIPES["smollm2-gsm8k"],
    "data": smollm2.addition_file,
    "max_completion_length": 32,
    "micro_train_batch_size": 8,
    "learning_rate": 1e-5,
    "critic_learning_rate": 1e-5,
    "max_steps": 15,
    "eval_steps": 5,
}
# phase -> the knobs that lower its peak, for the out-of-memory message (docs/troubleshooting.md,
# "Out of memory")
OOM_HINTS = {
    "rollout": "lower --generation_batch_size, or --gather_for_generation False (layer by layer; "
    "--generation_resident_gb between the two), or a shorter --max_completion_length; vLLM: lower "
    "--vllm_batch_size or --vllm_gpu_memory_utilization, or --vllm_mode server (vLLM on devices "
    "of its own)",
    "weight_sync": "lower --vllm_gpu_memory_utilization (vLLM's pool shares the GPU with the "
    "trainer), or --vllm_mode server",
    "logprobs": "lower --micro_train_batch_size or set --max_tokens_per_microbatch; lower "
    "--logprob_chunk_size (tokens per log-prob tile); --frozen_offload True keeps the reference "
    "and reward shards in CPU memory; --packing True",
    "update": "--gradient_checkpointing True, lower --micro_train_batch_size or set "
    "--max_tokens_per_microbatch, lower --logprob_chunk_size, --packing True; for the optimizer "
    "states: "
    "configs/zero3_offload.json, --lora_r 16",
}


# ---- The algorithm: rewards, advantages, losses (pure functions, tested against naive loops) ---
def token_rewards(logps, ref_logps, mask, scores, kl_coef):
    """Per-token reward (B, C): -kl_coef * (logp - ref_logp) at every completion token, plus the
    sequence's score at its last one. logps, ref_logps (B, C) (ref None: no KL); mask (B, C), 1 on
    a contiguous prefix of completion tokens; scores (B,). Without ref_logps, logps is unused
    (None allowed)."""
    mask = mask.float()  # (B, C)
    kl = (logps - ref_logps) * mask if ref_logps is not None else torch.zeros_like(mask)  # (B, C)
    rewards = -kl_coef * kl  # (B, C)
    last = (mask.sum(1).long() - 1).clamp(min=0)  # (B,) index of the last completion token
    # (B, C)
    rewards[torch.arange(len(scores)), last] += scores.to(rewards.dtype) * (mask.sum(1) > 0)
    return rewards, kl


def gae(rewards, values, mask, gamma, lam):
    """Generalised advantage estimation -> (advantages, returns), both (B, C), 0 where mask is 0.

    rewards, values, mask: (B, C). Masked positions are skipped (a sequence is its unmasked tokens
    in order); the value after a sequence's last token is 0. returns = advantages + values.
    """
    mask = mask.to(values.dtype)  # (B, C)
    B, C = values.shape
    advantages = torch.zeros_like(values)  # (B, C)
    last_gae = torch.zeros(B, dtype=values.dtype, device=values.device)  # (B,)
    next_value = torch.zeros_like(last_gae)  # (B,)
    for t in reversed(range(C)):
        m = mask[:, t]  # (B,)
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # (B,)
        gae_t = delta + gamma * lam * last_gae  # (B,)
        # (B,) masked steps leave the recursion untouched
        last_gae = torch.where(m > 0, gae_t, last_gae)
        next_value = torch.where(m > 0, values[:, t], next_value)  # (B,)
        advantages[:, t] = gae_t * m
    return advantages, (advantages + values) * mask


def masked_whiten(x, mask, shift_mean=True, eps=1e-8):
    """(x - mean) / std over the entries where mask is 1, mean and (unbiased) variance pooled over
    all ranks when torch.distributed is initialised. x, mask (B, C) -> (B, C), 0 where mask is 0."""
    reduce = dist.all_reduce if dist.is_initialized() else (lambda t: t)
    m = mask.to(torch.float64)  # (B, C)
    xd = x.to(torch.float64)  # (B, C)
    sums = torch.stack([(xd * m).sum(), m.sum()])  # (2,)
    reduce(sums)
    if sums[1] < 2:
        raise ValueError(
            f"masked_whiten needs at least 2 unmasked entries over all ranks, got {int(sums[1])}"
        )
    mean = sums[0] / sums[1]
    sq = ((xd - mean) ** 2 * m).sum()
    reduce(sq)
    var = sq / (sums[1] - 1)
    out = (xd - mean) * torch.rsqrt(var + eps)  # (B, C)
    if not shift_mean:
        out = out + mean
    return (out * m).to(x.dtype)


def policy_loss(logps, old_logps, advantages, mask, clip_eps, normalizer):
    """Clipped surrogate: sum of max(-A r, -A clip(r, 1 - eps, 1 + eps)) over tokens / normalizer.

    logps (B, C) with grad, old_logps and advantages (B, C), mask (B, C). normalizer: the WHOLE
    mini-batch's token count (all micro-batches, all ranks). Returns (loss, token-level metric
    sums).
    """
    mask = mask.to(logps.dtype)  # (B, C)
    log_ratio = logps - old_logps  # (B, C)
    ratio = torch.exp(log_ratio)  # (B, C)
    unclipped = -advantages * ratio  # (B, C)
    clipped = -advantages * ratio.clamp(1 - clip_eps, 1 + clip_eps)  # (B, C)
    loss = (torch.max(unclipped, clipped) * mask).sum() / normalizer
    with torch.no_grad():
        metrics = {
            "tokens": mask.sum(),
            "clip": ((clipped > unclipped) * mask).sum(),
            "ratio": (ratio * mask).sum(),
            "approx_kl": ((ratio - 1 - log_ratio) * mask).sum(),
        }
    return loss, metrics


def value_loss(values, old_values, returns, mask, clip_range_value, normalizer):
    """0.5 max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2) summed over tokens / normalizer.

    values (B, C) with grad; old_values, returns, mask (B, C). Returns (loss, metric sums).
    """
    mask = mask.to(values.dtype)  # (B, C)
    # (B, C)
    v_clipped = old_values + (values - old_values).clamp(-clip_range_value, clip_range_value)
    loss_unclipped = (values - returns) ** 2  # (B, C)
    loss_clipped = (v_clipped - returns) ** 2  # (B, C)
    loss = 0.5 * (torch.max(loss_unclipped, loss_clipped) * mask).sum() / normalizer
    with torch.no_grad():
        metrics = {
            "vf_clip": ((loss_clipped > loss_unclipped) * mask).sum(),
            "value": (values * mask).sum(),
        }
    return loss, metrics


# ---- Configuration -------------------------------------------------------------------------------
# Glue kept parallel with grpo.py's on purpose (docs/layout.md): change both together.
@dataclass
class Args:
    model: str = arg("", "actor hub id or path; empty: tiny model from scratch")
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
    reward_model: str = arg(
        "",
        "sequence-classification reward model (1 label, the actor's tokenizer); empty: "
        "rule-based reward_funcs",
    )
    reward_funcs: str = arg(
        "",
        "module:function,... each (prompts, completions, answers) -> list[float]; empty: the "
        "task's own",
    )
    reward_weights: str = arg("", "one weight per reward; empty: 0.25,0.75 (task) or 1s")
    run_dir: str = arg("runs/ppo", "metrics.jsonl, args, checkpoints, final model")
    ds_config: str = arg("configs/zero3.json", "DeepSpeed JSON for actor and critic")
    seed: int = arg(0, "data order, sampling and (default task) model init", ">= 0")
    # rollout
    prompts_per_rank: int = arg(32, "prompts per rank per step", ">= 1")
    num_generations: int = arg(4, "completions per prompt", ">= 1")
    max_prompt_length: int = arg(512, "prompt tokens kept (from the left end)", ">= 1")
    max_completion_length: int = arg(2, "C: new tokens per completion", ">= 1")
    temperature: float = arg(1.0, "sampling temperature (log-probs use it too)", "> 0")
    top_p: float = arg(1.0, "nucleus sampling", "(0, 1]")
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
    use_vllm: bool = arg(False, "generate with vLLM (--vllm_mode: colocated, or a server)")
    vllm_mode: str = arg(
        "colocate",
        "colocate: a vLLM engine per rank (or TP group); server: one vLLM server (run.sh "
        "VLLM_DEVICES=...)",
    )
    vllm_server_url: str = arg("http://127.0.0.1:8000", "server mode: the vLLM server's address")
    vllm_batch_size: int = arg(0, "vLLM: prompts per call, 0 = all at once", ">= 0")
    vllm_gpu_memory_utilization: float = arg(0.3, "vLLM's share of GPU memory", "(0, 1]")
    vllm_tensor_parallel_size: int = arg(1, "ranks sharing one vLLM engine", ">= 1")
    # rewards, advantages, losses and the update
    kl_coef: float = arg(
        0.01,
        "per-token KL penalty in the reward; 0 builds no reference model",
        ">= 0",
    )
    gamma: float = arg(1.0, "discount", "[0, 1]")
    lam: float = arg(0.95, "GAE lambda", "[0, 1]")
    cliprange: float = arg(0.2, "policy ratio clipped to [1 - c, 1 + c]", "(0, 1)")
    cliprange_value: float = arg(0.2, "value clipped to old value +- this", "> 0")
    ppo_epochs: int = arg(2, "passes over each rollout batch", ">= 1")
    num_mini_batches: int = arg(1, "optimizer steps per pass (per model)", ">= 1")
    learning_rate: float = arg(2e-3, "actor LR (from scratch; ~1e-6 pretrained)", "> 0")
    critic_learning_rate: float = arg(2e-3, "critic LR (~9e-6 pretrained)", "> 0")
    weight_decay: float = arg(0.0, "AdamW weight decay", ">= 0")
    max_grad_norm: float = arg(1.0, "gradient clipping", ">= 0")
    max_bad_steps: int = arg(
        3,
        "stop after this many steps in a row skipped for non-finite loss or gradients",
        ">= 1",
    )
    micro_train_batch_size: int = arg(64, "sequences per micro-batch (forward/backward)", ">= 1")
    max_tokens_per_microbatch: int = arg(
        0,
        "> 0: micro-batches by padded-token budget (length-sorted), not by count",
        ">= 0",
    )
    # memory
    gradient_checkpointing: bool = arg(False, "recompute activations in backward")
    logprob_chunk_size: int = arg(
        0,
        f"tokens per fused log-prob tile (x {DEFAULT_VOCAB_CHUNK_SIZE} vocab columns, "
        f"fp32); 0: logprobs.py's {DEFAULT_CHUNK_SIZE}",
        ">= 0",
    )
    attn_implementation: str = arg(
        "sdpa", "sdpa, eager or flash_attention_2 (needs flash-attn and a CUDA GPU)"
    )
    partitioned_loading: bool = arg(
        True,
        "ZeRO-3: build every model already partitioned, each rank reading only its shard of the "
        "checkpoint (zero3_load.py); False: every rank loads the full checkpoint first",
    )
    frozen_offload: bool = arg(
        False,
        "ZeRO-3: reference and reward model shards live in CPU memory",
    )
    packing: bool = arg(False, "micro-batches as one row, no padding")
    lora_r: int = arg(0, "> 0: LoRA adapters of this rank on actor and critic (peft)", ">= 0")
    lora_alpha: float = arg(32.0, "LoRA scaling numerator", "> 0")
    lora_target_modules: str = arg("all-linear", "peft target_modules")
    dtype: str = arg("auto", "auto (bf16 on a GPU with bf16, else fp32), bf16 or fp32")
    pad_token: str = arg(
        "",
        "the pad token for a tokenizer that has none (its eos token is fine); empty: the "
        "tokenizer must have one",
    )
    max_steps: int = arg(60, "training steps (one rollout batch each)", ">= 1")
    # evaluation, logging, saving
    eval_steps: int = arg(20, "held-out reward every this many steps (and at start/end)", ">= 0")
    num_eval_prompts: int = arg(200, "held-out prompts, one sample each; 0: no eval", ">= 0")
    save_steps: int = arg(0, "DeepSpeed checkpoints every this many steps; 0: none", ">= 0")
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
    save_model: bool = arg(True, "write the final HF actor to <run_dir>/final")
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
        "check data, models, tokenizer, rewards, DeepSpeed JSON and resume (WORLD_SIZE from "
        "env), then exit; run.sh does this before torchrun",
    )


def parse_args(argv=None):
    """Args, checked on their own (no file read yet); derived: funcs, weights, batch_size, micro."""
    args = parse_args_quietly(Args, argv)  # argparse's errors: exit 2; then each field's "range"
    apply_recipe(args, RECIPES, argv)  # a flag given on the command line wins
    if args.dtype not in ("auto", "bf16", "fp32"):
        raise RunError("--dtype: auto, bf16 or fp32")
    check_attn_implementation(args.attn_implementation, args.dtype)  # flash attention
    if args.report_to not in ("none", "wandb"):
        raise RunError("--report_to: none or wandb")
    if args.reward_model and args.reward_funcs:
        raise RunError("give --reward_model or --reward_funcs, not both")
    if args.lora_r:
        try:
            import peft  # noqa: F401  (optional: only LoRA runs need it)
        except ImportError:
            raise RunError("--lora_r needs peft: pip install peft") from None
    if args.reward_model and args.reward_weights:
        raise RunError(
            "--reward_weights weighs reward functions; a --reward_model's score has none"
        )
    try:
        args.funcs, args.weights = (
            ([], [])
            if args.reward_model
            else reward_functions(args.reward_funcs, args.reward_weights, args.data)
        )
    except ValueError as e:
        raise RunError(str(e)) from None
    args.batch_size = args.prompts_per_rank * args.num_generations  # completions per rank per step
    args.micro = min(args.micro_train_batch_size, args.batch_size)  # sequences per micro-batch
    return args


def deepspeed_config(args, world, hidden_size, dtype, lr):
    """The DeepSpeed JSON for one trained model (only the learning rate differs) with its "auto"
    values filled from the arguments (a concrete value that contradicts them: zero3_utils'
    ValueError)."""
    with open(args.ds_config) as f:
        raw = json.load(f)
    check_global_batch(raw, args.ds_config, world * args.num_mini_batches, args.num_generations)
    fill = {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": math.ceil(
            args.batch_size / args.micro / args.num_mini_batches
        ),
        "gradient_clipping": args.max_grad_norm,
        "bf16.enabled": dtype == torch.bfloat16,
        "optimizer.params.lr": lr,
        "optimizer.params.weight_decay": args.weight_decay,
    }
    # only sections the JSON has
    fill = {k: v for k, v in fill.items() if "." not in k or k.split(".")[0] in raw}
    return load_ds_config(raw, world_size=world, hidden_size=hidden_size, **fill)


# Knobs that change memory, not the update (micro-batching never changes it: docs/accumulation.md,
# "Accumulation never changes the update"),
# so a run that ran out of memory can be resumed with one of them turned.
MEMORY_KNOBS = (
    "micro_train_batch_size",
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
    if args.reward_model:
        rm_config = check_model_path(args.reward_model, "--reward_model")
        check_sequence_classifier(rm_config, args.reward_model)
        rm_tokenizer = load_tokenizer(args.reward_model, args.pad_token, need_eos=False)
        if rm_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise RunError(
                f"--reward_model {args.reward_model} has another tokenizer than the actor; this "
                "loop "
                "passes token ids as they are: use a reward model trained on the actor's tokenizer"
            )
    # --memory_budget_gb: the knobs set on args before the DeepSpeed JSON reads args.micro
    fit_to_budget(args, "ppo", world, print if rank == 0 else lambda *a, **k: None)
    dtype = training_dtype(args.dtype)
    ds = check_ds_config(
        lambda: deepspeed_config(args, world, config.hidden_size, dtype, args.learning_rate),
        args.ds_config,
        f"{world} ranks x {args.prompts_per_rank} prompts x {args.num_generations} "
        f"completions in {args.num_mini_batches} optimizer step(s) per pass, micro-batches of "
        f"{args.micro}",
    )
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    if args.frozen_offload and stage != 3:
        raise RunError(f"--frozen_offload needs ZeRO-3 ({args.ds_config} has stage {stage})")
    if args.partitioned_loading and stage == 3:  # safetensors
        models = [("--model", model_path), ("--reward_model", args.reward_model)]
        check_partitioned_loading([(flag, path) for flag, path in models if path])
    if args.resume:  # before any model loads: a checkpoint exists and was saved with this config
        check_resume(
            os.path.join(args.run_dir, "checkpoints"), run_config(args, world), MEMORY_KNOBS
        )
    return model_path, tokenizer, train_rows, eval_rows, dtype, stage


# ---- Rollout: generate, score (batching.py encodes and pads, tasks.py has the rule rewards) ------
def generate(engine, vllm, tokenizer, prompt_ids, args, num_generations):
    """G completions of each prompt, prompt-major, from the actor (HF generate) or vLLM."""
    if vllm is not None:
        return vllm.generate(
            prompt_ids,
            stop_token_ids=args.stop_ids,  # eos ids and the chat template's end of turn
            num_generations=num_generations,
            max_new_tokens=args.max_completion_length,
            temperature=args.temperature,
            top_p=args.top_p,
        )
    with unwrap_for_generation(
        engine,
        gather=args.gather_for_generation,
        resident_bytes=int(args.generation_resident_gb * 2**30),
    ) as model:
        return generate_hf(
            model,
            prompt_ids,
            num_generations=num_generations,
            batch_size=args.generation_batch_size,
            max_new_tokens=args.max_completion_length,
            temperature=args.temperature,
            top_p=args.top_p,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=args.stop_ids,  # eos ids and the chat template's end of turn
        )


def score(args, rows, completions, num_generations, batch, plan, reward_model, device):
    """Scores (B,) and, for rule-based rewards, each function's raw rewards {name: (B,)}."""
    if reward_model is not None:
        out = torch.zeros(batch["input_ids"].shape[0])  # (B,)
        with torch.no_grad():
            # the reward model reads the rightmost non-pad token (the EOS or the last one)
            for idx, mb, weight in micro_batches(batch, plan):
                am = mb["attention_mask"].to(device)  # (b, t)
                logits = reward_model(
                    input_ids=mb["input_ids"].to(device),
                    attention_mask=am,
                    position_ids=positions_from_mask(am),
                    use_cache=False,
                ).logits  # (b, 1)
                if weight:
                    out[idx] = logits[:, 0].float().cpu()
        if not torch.isfinite(out).all():
            bad = ~torch.isfinite(out)  # (B,)
            raise RewardError(
                f"--reward_model {args.reward_model} gave {int(bad.sum())} non-finite scores "
                f"(first: {completions[int(bad.nonzero()[0])]!r}); check the model in fp32 "
                "(--dtype fp32) or its checkpoint"
            )
        return out, {}
    return score_completions(args.funcs, args.weights, rows, completions, num_generations)


# ---- LoRA, engines, and the forwards that score a micro-batch (critic.py: the value model) ----
def add_lora(model, critic, args):
    """LoRA adapters (peft) on the actor and on the critic's body (the value head stays fully
    trained); returns the actor, the critic is changed in place."""
    from peft import LoraConfig, get_peft_model  # optional: only LoRA runs need peft

    def lora(task):
        return LoraConfig(
            r=args.lora_r,
            lora_alpha=args.lora_alpha,
            task_type=task,
            target_modules=args.lora_target_modules,
        )

    # frozen embeddings: checkpointed layers still need a grad input
    if args.gradient_checkpointing:
        model.enable_input_require_grads()
        critic.body.enable_input_require_grads()
    model = get_peft_model(model, lora("CAUSAL_LM"))
    critic.body = get_peft_model(critic.body, lora("FEATURE_EXTRACTION"))
    return model


def trained_engine(module, ds_config):
    """A DeepSpeed training engine over the module's trainable parameters (all, or LoRA's)."""
    engine, *_ = deepspeed.initialize(
        model=module,
        config=ds_config,
        model_parameters=[p for p in module.parameters() if p.requires_grad],
    )
    return engine


def frozen_model(module, ds_config, stage, offload, device):
    """A frozen model (reference, reward): sharded like the trained models under ZeRO-3 (the
    module of a ZeRO-3 inference engine, its shards in CPU memory with offload), else resident on
    the device."""
    if stage == 3:
        return frozen_engine(module, ds_config, offload=offload).module
    return module.to(device).eval().requires_grad_(False)


def needs_old_logps(args):
    """Whether the rollout policy's log-probs need a no-grad pass of their own before the update.
    The KL reward reads them before GAE, and after the first optimizer step (a second epoch or
    mini-batch) the actor is no longer the policy that sampled. One epoch of one mini-batch without
    KL is on-policy: every micro-batch's forward runs on the sampling weights, so the update's own
    forward gives them (the ratio is 1, as in GRPO with one iteration): one actor pass fewer."""
    return args.kl_coef > 0 or args.ppo_epochs > 1 or args.num_mini_batches > 1


def rollout_scorers(actor, critic, ref, args, device):
    """{name: fn(micro-batch) -> (b, c)} for rollout_forwards: the critic's values, the actor's
    old log-probs where needs_old_logps and, with kl_coef > 0, the reference log-probs (the frozen
    reference, or the actor itself with its LoRA adapters switched off)."""

    def logps(model, mb):
        kw = dict(chunk_size=args.logprob_chunk_size)
        return forward_logps(model, mb, args.temperature, args.packing, device, **kw)

    def ref_logps(mb):
        if ref is not None:
            return logps(ref, mb)
        with actor.module.disable_adapter():
            return logps(actor.module, mb)

    scorers = {"values": lambda mb: forward_values(critic.module, mb, args.packing, device)}
    if needs_old_logps(args):
        scorers["old_logps"] = lambda mb: logps(actor.module, mb)
    if args.kl_coef > 0:
        scorers["ref_logps"] = ref_logps
    return scorers


# ---- Micro-batches, rollout scoring and the update -----------------------------------------------
@contextmanager
def timed(times, name):
    """Adds the block's wall seconds to times[name] (the per-model profile, time/* in metrics)."""
    t = time.perf_counter()
    try:
        yield
    finally:
        times[name] = times.get(name, 0.0) + time.perf_counter() - t


@torch.no_grad()
def rollout_forwards(scorers, batch, plan, times):
    """{name: (B, C)} from each scorer fn(micro-batch) -> (b, c), micro-batch by micro-batch with
    the update's slicing (same numerics). Zero-weight repeats keep ZeRO-3's collectives in step.
    Each scorer's seconds are added to times[name]."""
    out = {
        name: torch.zeros(batch["completion_mask"].shape, dtype=torch.float32) for name in scorers
    }  # (B, C)
    for idx, mb, weight in micro_batches(batch, plan):
        for name, fn in scorers.items():
            with timed(times, name):
                v = fn(mb)  # (b, c)
            if weight:
                out[name][idx, : mb["logits_to_keep"]] = v.float().cpu()
    return out


# what update() returns summed over ranks: the same keys on every rank, whatever it trained on (a
# key missing on one rank would make the ranks' all-reduces disagree and hang them)
UPDATE_METRICS = (
    "policy_loss",
    "value_loss",
    "tokens",
    "entropy",
    "clip",
    "ratio",
    "approx_kl",
    "vf_clip",
    "value",
    "skipped",
)


def mini_batch_normalizer(batch, group):
    """A mini-batch's loss denominator: its completion tokens over the real micro-batches of every
    rank (zero-weight repeats add nothing), at least 1. The one place it is computed."""
    tokens = sum(w * float(mb["completion_mask"].sum()) for _, mb, w in micro_batches(batch, group))
    (total,) = all_sum([tokens])
    return max(total, 1.0)


def update(actor, critic, batch, args, device, times, ledger=None, logps_out=None):
    """The actor and critic update for one step's batch, on every rank alike; returns its metrics
    summed over ranks (UPDATE_METRICS, the same keys on every rank). In order:

    1. every row is kept (no PPO feature drops rows);
    2. the plan: num_mini_batches groups of micro-batches (batching.mini_batch_plans: the rows of
       a mini-batch depend only on num_mini_batches, never on the micro-batch knobs), ranks
       agreeing on every count, zero-weight repeats where a rank has fewer;
    3. per mini-batch, its normaliser over all ranks (mini_batch_normalizer): each micro-batch
       loss is divided by it, not by its own token count, so the micro-batch losses add up to the
       mini-batch loss however it is split. DeepSpeed divides each loss by
       gradient_accumulation_steps and averages gradients over ranks: we turn off the first and
       multiply by the world size, so each step applies exactly the mini-batch loss's gradient
       (the same scheme as grpo.update);
    4. ppo_epochs passes, each: every mini-batch's micro-batches forward/backward (actor: clipped
       policy loss, critic: clipped value loss), then ONE optimizer step per model;
    5. the metrics summed over ranks: the losses as the mean over mini-batch updates, token
       sums, and "skipped" (> 0: DeepSpeed refused a non-finite optimizer step).
    With a MemoryLedger, the whole of it is its "update" phase. Seconds per model and pass are
    added to times (actor_forward, actor_backward, critic_forward, critic_backward, optimizer).
    Without batch["old_logps"] (on-policy: needs_old_logps), each forward's own log-probs,
    detached, are the old ones. logps_out (B, C): filled with the first epoch's log-probs
    (detached) on the real rows, e.g. for the sampler check.
    """
    world = actor.dp_world_size
    groups = mini_batch_plans(
        batch, args.num_mini_batches, args.micro, args.max_tokens_per_microbatch
    )  # the same number of groups and micro-batches on every rank
    sums, n_updates = dict.fromkeys(UPDATE_METRICS, 0.0), args.ppo_epochs * len(groups)
    phase = ledger.phase if ledger else lambda name: nullcontext()
    with phase("update"):
        for epoch in range(args.ppo_epochs):
            for group in groups:
                normalizer = mini_batch_normalizer(batch, group)
                for i, (idx, mb, weight) in enumerate(micro_batches(batch, group)):
                    metrics, logps = train_micro_batch(
                        actor,
                        critic,
                        mb,
                        weight * world,
                        i == len(group) - 1,
                        normalizer,
                        args,
                        device,
                        times,
                    )
                    if weight:
                        if logps_out is not None and epoch == 0:
                            logps_out[idx, : mb["logits_to_keep"]] = logps.float().cpu()
                        metrics["policy_loss"] /= n_updates  # summed: the mean mini-batch loss
                        metrics["value_loss"] /= n_updates
                        for k, v in metrics.items():
                            sums[k] += float(v)
                with timed(times, "optimizer"):
                    actor.step()
                    critic.step()
                # DeepSpeed refused a non-finite step (alike on every rank): counted once per rank
                sums["skipped"] += (not actor.was_step_applied()) + (not critic.was_step_applied())
    return dict(zip(UPDATE_METRICS, all_sum([sums[k] for k in UPDATE_METRICS])))


def train_micro_batch(actor, critic, mb, scale, boundary, normalizer, args, device, times):
    """One micro-batch's forward and backward through both engines, its losses scaled by `scale`
    (the world size, or 0 for a zero-weight repeat); `boundary`: the mini-batch's last, where the
    optimizer step follows. Returns its metric sums and the actor's log-probs (b, c), detached."""
    mask = mb["completion_mask"].to(device)  # (b, c)
    # through the engines' forward: ZeRO-3 counts micro-steps there (see grpo.py)
    actor.set_gradient_accumulation_boundary(boundary)
    with timed(times, "actor_forward"):
        logps, entropy = forward_logps(
            actor,
            mb,
            args.temperature,
            args.packing,
            device,
            return_entropy=True,
            chunk_size=args.logprob_chunk_size,
        )  # (b, c)
        # on-policy (no old_logps): this forward is the sampling policy's, the ratio is 1
        old = mb.get("old_logps")
        old_logps = logps.detach() if old is None else old.to(device)  # (b, c)
        advantages = mb["advantages"].to(device)  # (b, c)
        pl, pm = policy_loss(logps, old_logps, advantages, mask, args.cliprange, normalizer)
    with timed(times, "actor_backward"):
        actor.backward(pl * scale, scale_wrt_gas=False)
    critic.set_gradient_accumulation_boundary(boundary)
    with timed(times, "critic_forward"):
        values = forward_values(critic, mb, args.packing, device)  # (b, c)
        old_values, returns = mb["values"].to(device), mb["returns"].to(device)
        vl, vm = value_loss(values, old_values, returns, mask, args.cliprange_value, normalizer)
    with timed(times, "critic_backward"):
        critic.backward(vl * scale, scale_wrt_gas=False)
    entropy = (entropy.detach() * mask).sum()
    losses = {"policy_loss": pl.detach(), "value_loss": vl.detach()}
    return {**pm, **vm, "entropy": entropy, **losses}, logps.detach()


# ---- Evaluation ----------------------------------------------------------------------------------
# Glue kept parallel with grpo.py's on purpose (docs/layout.md): change both together.
def evaluate(engine, vllm, reward_model, tokenizer, rows, args, rank, world, device):
    """Held-out mean score and accuracy (0 with a reward model): one sampled completion per
    prompt."""
    if not rows:
        return float("nan"), float("nan")
    mine = rows[rank::world]
    torch.manual_seed(args.seed + 12345 + rank)  # the same eval samples at every point of a run
    prompt_ids = encode_prompts(tokenizer, mine, args.max_prompt_length, args.template_kwargs)
    gens = generate(engine, vllm, tokenizer, prompt_ids, args, 1)
    completions = tokenizer.batch_decode(gens.completion_ids, skip_special_tokens=True)
    batch = make_batch(prompt_ids, gens, tokenizer.pad_token_id)
    total, per_func = score(
        args,
        mine,
        completions,
        1,
        batch,
        plan_micro_batches(batch, args.micro_train_batch_size),
        reward_model,
        device,
    )
    solved = (
        torch.stack([r >= 1 for r in per_func.values()]).all(0)
        if per_func
        else torch.zeros(len(mine))
    )  # (B,)
    reward_sum, solved_sum, n = all_sum([total.sum().item(), solved.sum().item(), len(mine)])
    return reward_sum / n, solved_sum / n


# ---- The loop ------------------------------------------------------------------------------------
# Glue kept parallel with grpo.py's on purpose (docs/layout.md): change both together.
def main(argv=None):
    args = parse_args(argv)
    if args.estimate_memory:  # pre-flight: no process group, no weights
        return estimate_run_memory(args, "ppo")
    if args.preflight:  # run.sh: once, in one process, before torchrun starts the ranks
        preflight(args, rank=0, world=int(os.environ.get("WORLD_SIZE", 1)))
        return print(f"preflight: {args.ds_config}, data, models, tokenizer and rewards are fine")
    # 1. setup: every input checked on every rank before a model loads -----------------------
    rank, world, device = init_distributed()  # NCCL on GPUs, gloo on CPU
    say = print if rank == 0 else (lambda *a, **k: None)
    model_path, tokenizer, train_rows, eval_rows, dtype, stage = preflight(args, rank, world)
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
    # one DeepSpeed config per model: only the LR differs
    hidden = AutoConfig.from_pretrained(model_path).hidden_size
    actor_ds = deepspeed_config(args, world, hidden, dtype, args.learning_rate)
    critic_ds = deepspeed_config(args, world, hidden, dtype, args.critic_learning_rate)
    frozen_ds = deepspeed_config(args, world, hidden, dtype, 0.0)
    # ZeRO-3: every model built partitioned, each rank reading only its shard (zero3_load.py)
    part = args.partitioned_loading and stage == 3
    model = load_model(
        AutoModelForCausalLM, model_path, ds_config=actor_ds if part else None, **attn
    )
    critic = build_critic(
        args.reward_model or model_path,
        bool(args.reward_model),
        ds_config=critic_ds if part else None,
        **attn,
    )
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model)
        enable_gradient_checkpointing(critic.body)
    if args.lora_r:
        model = add_lora(model, critic, args)
    engine = trained_engine(model, actor_ds)
    critic_engine = trained_engine(critic, critic_ds)
    frozen_load = dict(ds_config=frozen_config(frozen_ds, args.frozen_offload) if part else None)
    ref = None
    # with LoRA the reference is the actor with adapters off
    if args.kl_coef > 0 and not args.lora_r:
        ref_model = load_model(AutoModelForCausalLM, model_path, **frozen_load, **attn)
        ref = frozen_model(ref_model, frozen_ds, stage, args.frozen_offload, device)
    reward_model = None
    if args.reward_model:
        rm = load_model(
            AutoModelForSequenceClassification,
            args.reward_model,
            num_labels=1,
            **frozen_load,
            **attn,
        )
        reward_model = frozen_model(rm, frozen_ds, stage, args.frozen_offload, device)
    vllm = None
    if args.use_vllm:  # the same generator and knobs as grpo.py's
        max_len = args.max_prompt_length + args.max_completion_length
        max_len = min(max_len, model.config.max_position_embeddings)
        vllm = vllm_generator(args, model_path, dtype, max_len, tokenizer.pad_token_id)

    start_step, ckpt_dir = 0, os.path.join(args.run_dir, "checkpoints")
    # one sub-dir each in checkpoints/step<N>/ (checkpoint.py)
    engines = {"actor": engine, "critic": critic_engine}
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
        extra={
            "world_size": world,
            "ds_config_resolved": deepspeed_config(args, world, hidden, dtype, args.learning_rate),
        },
    )

    def held_out(step, when):
        if vllm is not None:
            vllm.sync_weights(engine)  # wakes it after sleep()
        reward, acc = evaluate(
            engine, vllm, reward_model, tokenizer, eval_rows, args, rank, world, device
        )
        say(
            f"held-out reward at {when}: {reward:.3f} (accuracy {acc:.3f}, {len(eval_rows)} "
            "prompts)"
        )
        log.record({"step": step, "eval/reward": reward, "eval/accuracy": acc})
        return reward

    scorers = rollout_scorers(engine, critic_engine, ref, args, device)  # no grad, per micro-batch

    t_start = time.time()
    first = float("nan")  # on resume the first held-out score is already in metrics.jsonl
    if args.num_eval_prompts and not args.resume:
        first = held_out(start_step, f"step {start_step}")
    G, N = args.num_generations, args.prompts_per_rank
    bar = tqdm(
        range(start_step, args.max_steps), disable=rank != 0 or not sys.stderr.isatty(), desc="ppo"
    )
    # peak memory per phase: CUDA allocated (less a sleeping vLLM's pool), or RSS on CPU; the
    # phase running now in a file for run.sh, which names it when the kernel kills this rank
    phase_file = os.path.join(args.run_dir, f"memory_phase.rank{rank}")
    sleeping = vllm.sleeping_bytes if vllm is not None else None
    ledger = MemoryLedger(device, OOM_HINTS, sleeping, phase_file)
    # skipped non-finite steps: counted, and a stop after a few in a row
    guard = StepGuard(args.max_bad_steps)
    adapter = KnobAdapter(args, "ppo")  # --memory_budget_gb: update-neutral knobs between steps
    stop = StopOnSignal()  # SIGTERM / Ctrl-C from here on: finish the step, checkpoint it, exit 5
    for step in bar:
        t0 = time.time()
        # sampling replays exactly on resume
        torch.manual_seed(args.seed * 7919 + step * world + rank)

        # 3. rollout and scores ----------------------------------------------------------------
        rows = batch_rows(train_rows, step, N * world, args.seed)[rank * N : (rank + 1) * N]
        prompt_ids = encode_prompts(tokenizer, rows, args.max_prompt_length, args.template_kwargs)
        if vllm is not None:
            with ledger.phase("weight_sync"):
                vllm.sync_weights(engine)  # wakes it: weights, then its KV cache
        with ledger.phase("rollout"):
            gens = generate(engine, vllm, tokenizer, prompt_ids, args, G)
            if vllm is not None:
                vllm.sleep()  # colocated, GPU: its weights and KV cache freed
            completions = tokenizer.batch_decode(gens.completion_ids, skip_special_tokens=True)
            batch = make_batch(prompt_ids, gens, tokenizer.pad_token_id)
            plan = plan_micro_batches(batch, args.micro, args.max_tokens_per_microbatch)
            # (B,)
            scores, per_func = score(args, rows, completions, G, batch, plan, reward_model, device)
        t_rollout = time.time() - t0

        # 4. old log-probs, reference log-probs, values: no grad, micro-batch by micro-batch -------
        times = {}  # seconds per model and pass this step: time/* in metrics.jsonl
        with ledger.phase("logprobs"):
            batch.update(rollout_forwards(scorers, batch, plan, times))

        # 5. per-token rewards, GAE, whitened advantages ------------------------------------------
        mask = batch["completion_mask"]  # (B, C)
        rewards, kl = token_rewards(
            batch.get("old_logps"), batch.get("ref_logps"), mask, scores, args.kl_coef
        )  # (B, C)
        advantages, batch["returns"] = gae(
            rewards, batch["values"] * mask, mask, args.gamma, args.lam
        )  # (B, C)
        batch["advantages"] = masked_whiten(
            advantages.to(comm_device()), mask.to(comm_device())
        ).cpu()  # (B, C)

        # 6. update: ppo_epochs x mini-batches, micro-batches with accumulation ---------------
        # without an old log-prob pass, the update's first forward is the trainer's side of the
        # sampler check (vLLM holds the trainer's weights), at no pass of its own
        trainer = None if vllm is None or "old_logps" in batch else torch.zeros(mask.shape)
        t1 = time.time()
        totals = update(engine, critic_engine, batch, args, device, times, ledger, trainer)
        t_update = time.time() - t1
        if vllm is not None:  # a collective, alike on every rank
            sampler_gap = sampler_logp_gap(batch.get("old_logps", trainer), gens)

        # 7. logging and saving --------------------------------------------------------------
        norms = [e.get_global_grad_norm() for e in (engine, critic_engine)]
        norms = None if None in norms else max(float(n) for n in norms)  # non-finite if either is
        guard.update(
            step + 1, totals["policy_loss"] + totals["value_loss"], norms, totals["skipped"] > 0
        )
        rollout = all_sum(
            [
                (kl * mask).sum().item(),
                mask.sum().item(),
                (batch["values"] * mask).sum().item(),
                (batch["returns"] * mask).sum().item(),
            ]
        )
        # (world * B, 2 + F), every rank's sequences: score, completion length, each function
        seq_stats = all_cat(torch.stack([scores, mask.sum(1).float(), *per_func.values()], 1))
        dt = time.time() - t0
        knob_changes = adapter.after_step(
            ledger.step, step + 1
        )  # a collective; before step_metrics
        row = {
            "step": step + 1,
            "reward": seq_stats[:, 0].mean().item(),
            "reward_std": seq_stats[:, 0].std().item(),
            "kl": rollout[0] / rollout[1],
            "value_mean": rollout[2] / rollout[1],
            "return_mean": rollout[3] / rollout[1],
            "policy_loss": totals["policy_loss"],
            "value_loss": totals["value_loss"],
            **{
                k: totals[k] / totals["tokens"]
                for k in ("entropy", "ratio", "approx_kl", "clip", "vf_clip")
            },
            "completion_len": seq_stats[:, 1].mean().item(),
            "lr": engine.get_lr()[0],
            "grad_norm_max": norms,
            "skipped_steps": guard.skipped,
            "tokens_per_s": seq_stats[:, 1].sum().item() / dt,
            "step_s": dt,
            "rollout_s": t_rollout,
            "weight_sync_s": vllm.last_sync_seconds if vllm is not None else 0.0,
            "update_s": t_update,
            **{f"time/{k}": v for k, v in times.items()},
            "elapsed_s": time.time() - t_start,
            **ledger.step_metrics(),  # mem/<phase>: this step's peak GB per phase
            **{
                f"rewards/{name}/mean": seq_stats[:, 2 + j].mean().item()
                for j, name in enumerate(per_func)
            },
        }
        if per_func:
            row["accuracy"] = (seq_stats[:, 2:] >= 1).all(1).float().mean().item()
        if vllm is not None:  # vLLM sampled these tokens: does it hold the trainer's weights?
            row.update(sampler_gap)
        log.record(row)
        for change in knob_changes:  # for the next step
            log.record(change)
            say(
                f"fit: {change['fit/knob']} {change['fit/from']} -> {change['fit/to']}: "
                f"{change['fit/reason']}"
            )
        bar.set_postfix(reward=f"{row['reward']:.3f}", vf=f"{row['value_loss']:.3f}")
        if rank == 0:
            bar.write(
                f"step {step + 1}/{args.max_steps} reward {row['reward']:.3f} kl {row['kl']:.4f} "
                f"value_loss {row['value_loss']:.4f} entropy {row['entropy']:.2f} clip "
                f"{row['clip']:.3f} "
                f"{dt:.2f}s"
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
        final = os.path.join(args.run_dir, "final")
        if args.lora_r:  # the adapters only (load them onto the base model with peft)
            with gathered(engine.module):
                if rank == 0:
                    engine.module.save_pretrained(final)
                    tokenizer.save_pretrained(final)
            dist.barrier()
        else:
            save_hf(engine, tokenizer, final)
    log.close(
        panels=[
            [("reward", "train score", "-"), ("eval/reward", "held-out score", "o-")],
            [("value_loss", "value loss", "-")],
            [("kl", "KL to reference", "-")],
        ]
    )
    dist.barrier()
    # vLLM's exit handler tears down its own groups and needs the default one alive
    if vllm is None:
        dist.destroy_process_group()


if __name__ == "__main__":
    exit_process(entry_code(main))  # a known failure: one message and its exit code (checks.py)

"""PPO: actor, critic, reward and reference models, one standalone loop on torchrun + DeepSpeed.

Launch (see run.sh, which wires this through torchrun and a DeepSpeed JSON):

    bash run.sh ppo                               # default task: tiny actor + tiny critic, 2 CPU procs, ZeRO-3
    bash run.sh ppo --max_steps 2 --packing True  # extra args go to Args below
    bash run.sh ppo --reward_model path/to/rm     # a sequence-classification reward model (1 label)
    python -m torch.distributed.run --nproc_per_node 2 ppo.py --ds_config configs/zero3.json ...

One step: each rank takes `prompts_per_rank` prompts, samples `num_generations` completions
each, scores them (rule-based functions or the reward model), computes old log-probs, reference
log-probs and values without gradients, turns them into per-token rewards
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
  the update does not depend on how it is split into micro-batches (DESIGN.md problem 4).
- Packing (`--packing`) concatenates a micro-batch's sequences into one row with position ids
  restarting per sequence; transformers turns that into a block-diagonal causal mask (SDPA, eager)
  or variable-length kernels (flash attention), so no token attends across sequences.
Limits: the reward model must share the actor's tokenizer (token ids are passed as they are);
every rank loads full checkpoints before DeepSpeed partitions them; no vLLM path yet.
"""

import itertools
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field

import torch


# ----------------------------------------------------------------------------------------------
# The algorithm: rewards, advantages and losses (pure functions, unit-tested against naive loops)
# ----------------------------------------------------------------------------------------------
def token_rewards(logps, ref_logps, mask, scores, kl_coef):
    """Per-token reward (B, C): -kl_coef * (logp - ref_logp) at every completion token, plus the
    sequence's score at its last one. logps, ref_logps (B, C) (ref None: no KL); mask (B, C), 1 on
    a contiguous prefix of completion tokens; scores (B,)."""
    mask = mask.to(logps.dtype)  # (B, C)
    kl = (logps - ref_logps) * mask if ref_logps is not None else torch.zeros_like(logps)  # (B, C)
    rewards = -kl_coef * kl  # (B, C)
    last = (mask.sum(1).long() - 1).clamp(min=0)  # (B,) index of the last completion token
    rewards[torch.arange(len(scores)), last] += scores.to(rewards.dtype) * (mask.sum(1) > 0)  # (B, C)
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
        last_gae = torch.where(m > 0, gae_t, last_gae)  # (B,) masked steps leave the recursion untouched
        next_value = torch.where(m > 0, values[:, t], next_value)  # (B,)
        advantages[:, t] = gae_t * m
    return advantages, (advantages + values) * mask


def masked_whiten(x, mask, shift_mean=True, eps=1e-8):
    """(x - mean) / std over the entries where mask is 1, mean and (unbiased) variance pooled over
    all ranks when torch.distributed is initialised. x, mask (B, C) -> (B, C), 0 where mask is 0."""
    import torch.distributed as dist
    reduce = dist.all_reduce if dist.is_initialized() else (lambda t: t)
    m = mask.to(torch.float64)  # (B, C)
    xd = x.to(torch.float64)  # (B, C)
    sums = torch.stack([(xd * m).sum(), m.sum()])  # (2,)
    reduce(sums)
    if sums[1] < 2:
        raise ValueError(f"masked_whiten needs at least 2 unmasked entries over all ranks, got {int(sums[1])}")
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
    mini-batch's token count (all micro-batches, all ranks). Returns (loss, token-level metric sums).
    """
    mask = mask.to(logps.dtype)  # (B, C)
    log_ratio = logps - old_logps  # (B, C)
    ratio = torch.exp(log_ratio)  # (B, C)
    unclipped = -advantages * ratio  # (B, C)
    clipped = -advantages * ratio.clamp(1 - clip_eps, 1 + clip_eps)  # (B, C)
    loss = (torch.max(unclipped, clipped) * mask).sum() / normalizer
    with torch.no_grad():
        metrics = {"tokens": mask.sum(), "clip": ((clipped > unclipped) * mask).sum(),
                   "ratio": (ratio * mask).sum(), "approx_kl": ((ratio - 1 - log_ratio) * mask).sum()}
    return loss, metrics


def value_loss(values, old_values, returns, mask, clip_range_value, normalizer):
    """0.5 max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2) summed over tokens / normalizer.

    values (B, C) with grad; old_values, returns, mask (B, C). Returns (loss, metric sums).
    """
    mask = mask.to(values.dtype)  # (B, C)
    v_clipped = old_values + (values - old_values).clamp(-clip_range_value, clip_range_value)  # (B, C)
    loss_unclipped = (values - returns) ** 2  # (B, C)
    loss_clipped = (v_clipped - returns) ** 2  # (B, C)
    loss = 0.5 * (torch.max(loss_unclipped, loss_clipped) * mask).sum() / normalizer
    with torch.no_grad():
        metrics = {"vf_clip": ((loss_clipped > loss_unclipped) * mask).sum(), "value": (values * mask).sum()}
    return loss, metrics

"""Importance correction for vLLM's samples: the sampler and the trainer disagree.

    --use_vllm True --vllm_importance_cap 3 [--vllm_importance_mode token_mask]   (grpo.py)

vLLM samples with its own kernels (and, with --max_staleness, with weights up to K versions
old), so its log-prob of a sampled token differs from the trainer's. The update's ratio is taken
against the trainer's old log-probs; this file weighs each token by r = exp(trainer - vLLM)
(token_*) or its sequence by the product over its tokens (sequence_*, as TRL): *_truncate clamps
r to [min, cap] (truncated importance sampling), *_mask gives no loss where r is outside (IcePop;
masked importance sampling). The weights enter the loss as batching.LossInputs.weights.
Letters: B sequences, C completion tokens. Imports batching.py (a sum over ranks); remove this
file, its mixin in grpo.Args and the lines of grpo.py that name `vllm_is` to remove it.
"""

from dataclasses import dataclass

import torch

from arguments import arg
from batching import all_sum
from exits import RunError

VLLM_IMPORTANCE_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclass
class VllmIsArgs:
    vllm_importance_cap: float = arg(
        -1.0,
        "> 0: importance weights for vLLM's samples, r = exp(trainer - vLLM logp) at most cap; "
        "0: off; -1: 3.0 with --max_staleness > 0, else off",
        ">= -1",
    )
    vllm_importance_mode: str = arg(
        "token_truncate",
        f"one of {VLLM_IMPORTANCE_MODES}: r per token or per sequence (the product); truncate: "
        "r clamped to [min, cap]; mask: no loss where r is outside (docs/update.md)",
        VLLM_IMPORTANCE_MODES,
    )
    vllm_importance_min: float = arg(0.0, "the band's lower end (mask: below it, no loss)", ">= 0")


def importance_cap(args):
    """--vllm_importance_cap in effect: as given, or (-1, the default) 3.0 with --max_staleness
    (off-policy by up to K versions: correct it, bounded), else off."""
    if args.vllm_importance_cap >= 0:
        return args.vllm_importance_cap
    return 3.0 if args.max_staleness else 0.0


def check_args(args):
    moved = args.vllm_importance_mode != "token_truncate" or args.vllm_importance_min > 0
    if moved and not importance_cap(args):
        raise RunError(
            "--vllm_importance_mode / _min act on the weights: --vllm_importance_cap > 0"
        )
    if importance_cap(args) and not args.use_vllm:
        raise RunError("--vllm_importance_cap needs --use_vllm (it corrects vLLM's log-prob gaps)")


def sampler_weights(old, sampler, mask, mode, cap, low=0.0):
    """Importance weights (B, C) for tokens vLLM sampled and the trainer scores (no grad): the
    ratio r = exp(old - sampler) per token (token_*) or per sequence, the product over its tokens
    in `mask` (sequence_*, as TRL); *_truncate: r clamped to [low, cap] (truncated IS); *_mask: r
    inside [low, cap], else 0, so that token or sequence gets no loss (IcePop; MIS)."""
    log_r = (old - sampler) * mask  # (B, C)
    if mode.startswith("sequence"):
        log_r = log_r.sum(1, keepdim=True).expand_as(log_r)  # (B, C): its sequence's log-ratio
    r = torch.exp(log_r)  # (B, C); inf for a sequence far off: capped or masked below
    inside = (r >= low) & (r <= cap)  # (B, C)
    return r.clamp(low, cap) if mode.endswith("truncate") else torch.where(inside, r, 0.0)


def vllm_importance_weights(old, sampler, tokens, trained, args):
    """sampler_weights for this batch (--vllm_importance_mode) and, over the trained tokens of all
    ranks, the mean token ratio (1: vLLM scores as the trainer) and the shares of tokens and of
    sequences whose ratio lies outside [low, cap] (what truncation caps, masking drops).
    old, sampler (B, C): the trainer's and vLLM's log-probs; tokens (B, C): the loss's tokens;
    trained (B, C): those of the rows the update keeps."""
    cap, low, seqs = importance_cap(args), args.vllm_importance_min, trained.amax(1)  # seqs: (B,)
    log_r = (old - sampler) * tokens  # (B, C)
    r, r_seq = log_r.exp(), log_r.sum(1).exp()  # (B, C) per token, (B,) per sequence
    out, out_seq = ((x < low) | (x > cap) for x in (r, r_seq))  # (B, C), (B,)
    sums = [r * trained, out * trained, trained, out_seq * seqs, seqs]
    ratio, out_tokens, n, out_seqs, n_seqs = all_sum([x.sum().item() for x in sums])
    shares = (ratio / max(n, 1.0), out_tokens / max(n, 1.0), out_seqs / max(n_seqs, 1.0))
    weights = sampler_weights(old, sampler, tokens, args.vllm_importance_mode, cap, low)
    names = ("vllm_is_ratio", "vllm_is_outside_tokens", "vllm_is_outside_seqs")
    return weights, dict(zip(names, shares))

"""RLOO and REINFORCE++ advantages: other baselines than GRPO's group mean and std.

    --advantage_estimator rloo | reinforce_pp      (grpo.py; default grpo: grpo.group_advantages)

rloo (Ahmadian et al. 2024): r_i minus the mean of the group's other G - 1 rewards, unscaled: an
unbiased leave-one-out baseline (= G / (G - 1) x (r_i - group mean)).
reinforce_pp (REINFORCE++-baseline, Hu et al. 2025): r - group mean, then whitened over the kept
rows of the whole batch, every rank: one global scale instead of a std per group, which GRPO's
per-group division inflates for groups that are all-but-solved or all-but-failed.
Letters: N prompts, G num_generations. Imports batching.py (a sum over ranks); remove this file,
the line of grpo.estimate_advantages that calls it and their entries in grpo.ESTIMATOR_SCALES to
remove them.
"""

import math

import torch

from batching import all_sum


def baseline_advantages(centred, num_generations, estimator, keep=None):
    """(N * G,) advantages from `centred` (N * G,) = r - group mean (float64). rloo: rescaled to
    leave-one-out; reinforce_pp: whitened over the kept rows (keep (N * G,) bool, None: all) of
    every rank: a collective, so every rank calls it."""
    if estimator == "rloo":  # r_i - (S - r_i) / (G - 1) = G / (G - 1) * (r_i - S / G)
        return centred * num_generations / (num_generations - 1)
    if estimator != "reinforce_pp":
        raise ValueError(f"estimator={estimator!r}: choose rloo or reinforce_pp")
    w = torch.ones_like(centred) if keep is None else keep.to(centred.dtype)  # (N * G,)
    sums = [(centred * w).sum().item(), (centred * centred * w).sum().item(), w.sum().item()]
    s, sq, n = all_sum(sums)
    mean = s / max(n, 1.0)  # 0 up to rounding: every group's deviations sum to 0
    std = math.sqrt(max(sq - n * mean * mean, 0.0) / max(n - 1, 1.0))  # unbiased, all ranks
    return (centred - mean) / (std + 1e-4)  # (N * G,)

"""GSPO (Zheng et al. 2025): one importance ratio per sequence instead of one per token.

    --importance_sampling_level sequence     (grpo.py)

GRPO's token ratios exp(logp_t - old_t) are noisy, one sample each, and with long completions
(or a mixture-of-experts policy) their noise dominates the clipping. GSPO replaces them by the
sequence's length-normalised ratio, exp of the mean of logp - old over its completion tokens,
clipped as a whole and shared by its tokens; its gradient is that ratio times the mean of the
tokens' score functions. It works with every loss_type, as TRL's GRPOTrainer computes it.
Letters: B sequences, C completion tokens. Imports nothing of this project: remove this file and
the two lines of grpo.py that name it to remove the variant.
"""

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def sequence_log_ratio(log_ratio, mask):
    """(B, C): each token carries its sequence's mean log-ratio over the tokens in `mask`.
    log_ratio (B, C) = logp - old (with grad), mask (B, C) float."""
    per_seq = (log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
    return per_seq.expand_as(mask)  # (B, C)

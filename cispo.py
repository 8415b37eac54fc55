"""CISPO (MiniMax-M1, 2025): the clipped importance ratio as a constant weight of the score
function.

    --loss_type cispo      (grpo.py and ppo.py)

PPO's clipped surrogate -min(r A, clip(r) A) has zero gradient on a token whose ratio left the
band: that token stops learning. CISPO keeps every token's gradient and clips only its weight:

    loss per token = -stopgrad(min(r, 1 + eps_high)) x A x logp

Normalised like GRPO's "bnpo" (by completion tokens) in grpo.py, by tokens in ppo.py. Its
"clip" metrics count the tokens whose weight was capped (clip_high); nothing is clipped from
below. Letters: B sequences, C completion tokens. Imports nothing of this project: remove this
file, its import and the `loss_type` choice that names it in grpo.py and ppo.py to remove it.
"""


def cispo_per_token(ratio, advantages, logps, eps_high):
    """(B, C) per-token loss, and (B, C) bool: the tokens whose weight min(r, 1 + eps_high) was
    capped. ratio (B, C), advantages (B, 1) or (B, C), logps (B, C) with grad."""
    weight = ratio.clamp(max=1 + eps_high).detach()  # (B, C) a constant: no gradient through r
    return -weight * advantages * logps, ratio > 1 + eps_high  # (B, C), (B, C)

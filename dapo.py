"""DAPO's dynamic sampling and overlong filtering (Yu et al. 2025).

    --dynamic_sampling True [--max_dynamic_sampling_rounds 3]    (grpo.py's rollout)
    --mask_truncated_completions True                             (grpo.py's keep mask)

Dynamic sampling: a group whose G rewards are all equal has zero advantage: it adds nothing to
the policy gradient, yet its tokens would count in the normaliser and shrink every other group's
step. Such groups are dropped and fresh prompts sampled until the batch is full again.
Overlong filtering: a completion cut at max_completion_length (no stop token) gets no loss, so a
long, unfinished answer is neither rewarded nor punished for being cut.
Letters: N prompts, G num_generations, B = N * G sequences. Imports batching.py and
zero3_utils.py; remove this file, its mixin in grpo.Args and the lines of grpo.py that name
`dapo` to remove the variant.
"""

from dataclasses import dataclass

import torch

from arguments import arg
from batching import all_sum, cat_groups, take_groups
from zero3_utils import all_max


@dataclass
class DapoArgs:
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


def truncated(gens, stop_ids, max_completion_length):
    """(B,) bool: completions that reached max_completion_length without ending in a stop id."""
    lengths = gens.completion_mask.sum(1)  # (B,)
    last = gens.completion_ids.gather(1, (lengths - 1).clamp(min=0)[:, None])[:, 0]  # (B,)
    return (lengths >= max_completion_length) & ~torch.isin(last, torch.tensor(stop_ids))


def dynamic_sampling(first, sample_more, args, pad_id):
    """Groups without reward spread dropped, fresh prompts sampled, round after round, until this
    rank holds prompts_per_rank groups with spread or max_dynamic_sampling_rounds extra rounds are
    done.

    sample_more(round, n) -> a grpo.sample_groups() result for n new prompts. Every rank samples
    the same n in each round (the largest shortfall over ranks): generation is a collective under
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

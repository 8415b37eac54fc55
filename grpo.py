"""GRPO: group-relative policy optimisation (DeepSeekMath, Shao et al. 2024), torchrun + DeepSpeed.

    bash run.sh grpo --max_steps 2                # any field of Args below (python grpo.py --help)

One step: each rank samples `num_generations` completions for each of its prompts (a whole group
on one rank), scores them, turns rewards into group-relative advantages, computes old/reference
log-probs without gradients, then `update` trains the policy in micro-batches (docs/update.md).
harness.py runs the rest (set-up, logging, held-out evaluation, checkpoints).

Letters in shape comments: B sequences in a (micro-)batch, P prompt tokens, C completion tokens
(max_completion_length), T = P + C, G num_generations, N prompts, V vocabulary.

Departures from the paper and why (docs/grpo.md has the rest):
- loss_type "bnpo" (default) and "dr_grpo" normalise token sums by batch-wide counts, which
  removes the length bias; "grpo" is the paper's per-sequence token mean.
- k3 KL, but beta defaults to 0 (the paper: 0.04): then no reference model is built.
- Asymmetric clipping [1 - epsilon_low, 1 + epsilon_high] (DAPO).
- Truncated or masked importance weights against vLLM's log-probs (--vllm_importance_mode).
- Every micro-batch loss is divided by the WHOLE batch's normaliser and DeepSpeed's averaging is
  undone, so accumulation never changes the update.
- Optional: CISPO, RLOO / REINFORCE++ advantages, an entropy bonus, on-policy distillation
  (--teacher_model; docs/update.md), GSPO's sequence-level ratio, DAPO's dynamic sampling and
  overlong filtering, multi-turn rollouts (--env, docs/envs.md), asynchronous GRPO
  (--max_staleness, docs/async.md), LoRA (vLLM and the final model get merged weights).
"""

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

import envs
import harness
import recipes
from arguments import arg
from batching import (
    all_sum,
    cat_groups,
    forward_logps,
    make_batch,
    micro_batches,
    plan_micro_batches,
    take_groups,
)
from data import batch_rows
from exits import RunError, entry_code, exit_process
from fit import Knobs
from generation import Generations, sampler_logp_gap
from prefetch import Prefetcher
from tasks import reward_stats
from vllm_server import ServerError
from zero3_utils import all_cat, all_max

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "cispo")
ESTIMATOR_SCALES = {"grpo": True, "rloo": False, "reinforce_pp": True}  # --scale_rewards not given
ADVANTAGE_ESTIMATORS = tuple(ESTIMATOR_SCALES)
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
VLLM_IMPORTANCE_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# what update() returns summed over ranks: the same keys on every rank, whatever it trained on (a
# key missing on one rank would make the ranks' all-reduces disagree and hang them)
UPDATE_METRICS = ("loss", "tokens", "entropy", "ratio", "clip_low", "clip_high", "kl")
ON_DEVICE = ("old_logps", "ref_logps", "advantages", "is_weights")  # a micro-batch's loss inputs


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


def estimate_advantages(rewards, num_generations, estimator="grpo", scale=None, keep=None):
    """(N * G,) advantages by --advantage_estimator. grpo: group_advantages, scaled unless `scale`
    is False (None: the estimator's own, ESTIMATOR_SCALES). rloo (Ahmadian et al. 2024): r_i - mean
    of the group's other G - 1 rewards, unscaled. reinforce_pp (REINFORCE++-baseline, Hu et al.
    2025): r - group mean, then whitened over the kept rows (keep (N * G,) bool, None: all) of
    every rank: a collective, so every rank calls it."""
    if estimator == "grpo":
        scale = ESTIMATOR_SCALES[estimator] if scale is None else scale
        return group_advantages(rewards, num_generations, scale=scale)
    adv = group_advantages(rewards, num_generations, scale=False).double()  # (N * G,) r - mean
    if estimator == "rloo":  # r_i - (S - r_i) / (G - 1) = G / (G - 1) * (r_i - S / G)
        return (adv * num_generations / (num_generations - 1)).to(rewards.dtype)
    if estimator != "reinforce_pp":
        raise ValueError(f"estimator={estimator!r}: choose one of {ADVANTAGE_ESTIMATORS}")
    w = torch.ones_like(adv) if keep is None else keep.to(adv.dtype)  # (N * G,)
    s, sq, n = all_sum([(adv * w).sum().item(), (adv * adv * w).sum().item(), w.sum().item()])
    mean = s / max(n, 1.0)  # 0 up to rounding: every group's deviations sum to 0
    std = math.sqrt(max(sq - n * mean * mean, 0.0) / max(n - 1, 1.0))  # unbiased, all ranks
    return ((adv - mean) / (std + 1e-4)).to(rewards.dtype)  # (N * G,)


def distill_advantages(advantages, logps, teacher_logps, mask, coef, only=False):
    """On-policy distillation (Agarwal et al. 2024, GKD; Lu et al. 2025): (B, C) per-token
    advantages, coef x (teacher - student log-prob) of each sampled token, the negated per-token
    reverse KL of the student from the teacher, plus the reward's advantage (B,) unless `only`.
    logps, teacher_logps: (B, C) the sampling policy's and the teacher's, no grad; mask (B, C)."""
    per_token = -coef * (logps - teacher_logps) * mask  # (B, C)
    return per_token if only else advantages[:, None] + per_token  # (B, C)


def loss_normalizer(mask, loss_type, max_completion_length):
    """This micro-batch's share of the loss denominator; sum it over the whole batch and all ranks.

    grpo: number of sequences; bnpo and cispo: number of completion tokens; dr_grpo: sequences x
    max_completion_length (a constant per sequence, so long and short answers weigh the same)."""
    if loss_type == "grpo":
        return float(mask.shape[0])
    if loss_type in ("bnpo", "cispo"):
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
    entropy=None,
    entropy_coef=0.0,
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
    loss_type "cispo" (MiniMax-M1, 2025): -stopgrad(min(ratio, 1 + epsilon_high)) x A x logp per
    token: the ratio only weighs the score function, so no token loses its gradient to clipping
    (epsilon_low unused; clip_high counts the tokens whose weight was capped, clip_low stays 0).
    entropy (B, C) with grad and entropy_coef > 0: an entropy bonus, -coef x entropy per token,
    aggregated and normalised like the loss.
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
    adv = advantages[:, None] if advantages.dim() == 1 else advantages  # (B, 1) or (B, C)
    cispo = loss_type == "cispo"
    if cispo:  # the capped ratio as a constant weight of the score function
        per_token = -ratio.clamp(max=1 + epsilon_high).detach() * adv * logps  # (B, C)
    else:
        per_token = -torch.min(ratio * adv, clipped * adv)  # (B, C)
    if is_weights is not None:
        per_token = per_token * is_weights  # (B, C)
    if beta > 0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs ref_logps")
        d = ref_logps - logps  # (B, C)
        kl = torch.exp(d) - d - 1  # (B, C) k3 estimator, >= 0
        per_token = per_token + beta * kl  # (B, C)
    if entropy_coef:  # only then: an unused entropy gets no backward work
        per_token = per_token - entropy_coef * entropy  # (B, C)
    if loss_type == "grpo":
        per_seq = (per_token * mask).sum(1) / mask.sum(1).clamp(min=1)  # (B,)
        loss = per_seq.sum() / normalizer
    else:
        loss = (per_token * mask).sum() / normalizer

    with torch.no_grad():  # token-level sums, so callers can add them up across micro-batches
        is_low = (ratio < 1 - epsilon_low) & (adv < 0) & (not cispo)  # (B, C) clipped from below
        is_high = (ratio > 1 + epsilon_high) & ((adv > 0) | cispo)  # (B, C) clipped from above
        metrics = {
            "tokens": mask.sum(),
            "clip_low": (is_low * mask).sum(),
            "clip_high": (is_high * mask).sum(),
            "ratio": (ratio.detach() * mask).sum(),
        }
        if beta > 0:
            metrics["kl"] = (kl.detach() * mask).sum()
    return loss, metrics


def truncated(gens, stop_ids, max_completion_length):
    """(B,) bool: completions that reached max_completion_length without ending in a stop id."""
    lengths = gens.completion_mask.sum(1)  # (B,)
    last = gens.completion_ids.gather(1, (lengths - 1).clamp(min=0)[:, None])[:, 0]  # (B,)
    return (lengths >= max_completion_length) & ~torch.isin(last, torch.tensor(stop_ids))


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


def loss_tokens(b):
    """(rows, C): the tokens the loss, its normaliser and the sampler checks count: the
    completion's, less an environment's turns (--env: b["loss_mask"]). completion_mask itself
    stays every real token: attention, micro-batch widths and packing read it."""
    mask = b["completion_mask"]  # (rows, C)
    return mask if b.get("loss_mask") is None else mask * b["loss_mask"]


def importance_cap(args):
    """--vllm_importance_cap in effect: as given, or (-1, the default) 3.0 with --max_staleness
    (off-policy by up to K versions: correct it, bounded), else off."""
    if args.vllm_importance_cap >= 0:
        return args.vllm_importance_cap
    return 3.0 if args.max_staleness else 0.0


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


def vllm_importance_weights(batch, args):
    """sampler_weights for this batch (--vllm_importance_mode) and, over the kept tokens of all
    ranks, the mean token ratio (1: vLLM scores as the trainer) and the shares of tokens and of
    sequences whose ratio lies outside [low, cap] (what truncation caps, masking drops)."""
    tokens, old, sampler = loss_tokens(batch), batch["old_logps"], batch["sampler_logps"]
    mask = tokens * keep_mask(batch, args)[:, None]  # (B, C) the trained tokens
    cap, low, seqs = importance_cap(args), args.vllm_importance_min, mask.amax(1)  # seqs: (B,)
    log_r = (old - sampler) * tokens  # (B, C)
    r, r_seq = log_r.exp(), log_r.sum(1).exp()  # (B, C) per token, (B,) per sequence
    out, out_seq = ((x < low) | (x > cap) for x in (r, r_seq))  # (B, C), (B,)
    sums = [r * mask, out * mask, mask, out_seq * seqs, seqs]
    ratio, out_tokens, n, out_seqs, n_seqs = all_sum([x.sum().item() for x in sums])
    shares = (ratio / max(n, 1.0), out_tokens / max(n, 1.0), out_seqs / max(n_seqs, 1.0))
    weights = sampler_weights(old, sampler, tokens, args.vllm_importance_mode, cap, low)
    names = ("vllm_is_ratio", "vllm_is_outside_tokens", "vllm_is_outside_seqs")
    return weights, dict(zip(names, shares))


# ---- Configuration: GRPO's own fields (harness.RunArgs has the ones both loops share) -----------
@dataclass
class Args(harness.RunArgs):
    recipe: str = arg("", recipes.recipe_help(recipes.GRPO))
    num_generations: int = arg(
        8, "G: completions per prompt", ">= 2", why="advantages compare completions within a group"
    )
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
    loss_type: str = arg(
        "bnpo",
        f"one of {LOSS_TYPES}; cispo: -stopgrad(min(r, 1 + epsilon_high)) A logp per token",
        LOSS_TYPES,
    )
    advantage_estimator: str = arg(
        "grpo",
        f"one of {ADVANTAGE_ESTIMATORS}; grpo: r - group mean; rloo: r - the others' mean "
        "(unscaled); reinforce_pp: r - group mean, whitened over the whole batch",
        ADVANTAGE_ESTIMATORS,
    )
    entropy_coef: float = arg(0.0, "entropy bonus: loss -= coef x token entropy", ">= 0")
    importance_sampling_level: str = arg(
        "token",
        "token: a ratio per token (GRPO); sequence: one length-normalised ratio per sequence, "
        "clipped as a whole (GSPO, Zheng et al. 2025)",
        IMPORTANCE_SAMPLING_LEVELS,
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
    scale_rewards: bool | None = arg(
        None,
        "advantages / group std (grpo), / batch std (reinforce_pp: needs True); rloo: False; "
        "default: the estimator's own ("
        + ", ".join(f"{k}: {v}" for k, v in ESTIMATOR_SCALES.items())
        + ")",
    )
    num_iterations: int = arg(1, "optimizer steps per generated batch", ">= 1")
    teacher_model: str = arg(
        "", "on-policy distillation: a frozen teacher (the policy's tokenizer) scores the samples"
    )
    distill_coef: float = arg(1.0, "--teacher_model: weight of teacher - student logp", ">= 0")
    distill_only: bool = arg(False, "--teacher_model: that advantage alone, no reward advantage")


def parse_args(argv=None):
    """Args as given (argv, default sys.argv[1:]), checked on their own (no file read yet)."""
    args = harness.parse(Args, recipes.GRPO, argv)
    est, scale = args.advantage_estimator, args.scale_rewards
    if est != "grpo" and scale not in (None, ESTIMATOR_SCALES[est]):  # grpo's advantage, rescaled
        raise RunError(
            f"--advantage_estimator {est} needs --scale_rewards {not scale} (docs/update.md), its "
            f"default: leave the flag out, or use --advantage_estimator grpo --scale_rewards "
            f"{scale} for this advantage"
        )
    if args.max_staleness and not (args.use_vllm and args.vllm_mode == "server"):
        raise RunError(
            "--max_staleness > 0 needs a vLLM server (--use_vllm True --vllm_mode server, as "
            "VLLM_DEVICES=... bash run.sh sets): colocated engines and HF generation share the "
            "trainer's devices, so there is nothing to overlap"
        )
    if sum(map(bool, (args.env, args.dynamic_sampling, args.max_staleness))) > 1:  # 3 rollouts
        raise RunError("--env, --dynamic_sampling and --max_staleness > 0: one at a time")
    if args.distill_only and not args.teacher_model:
        raise RunError("--distill_only True needs --teacher_model (the teacher to distil)")
    moved = args.vllm_importance_mode != "token_truncate" or args.vllm_importance_min > 0
    if moved and not importance_cap(args):
        raise RunError(
            "--vllm_importance_mode / _min act on the weights: --vllm_importance_cap > 0"
        )
    if importance_cap(args) and not args.use_vllm:
        raise RunError("--vllm_importance_cap needs --use_vllm (it corrects vLLM's log-prob gaps)")
    return args


def memory_models(args):
    """What this loop builds beside the policy, for the pre-flight's estimate and checks."""
    reference = args.beta > 0 and not args.lora_r
    return {"reference": reference, "env": args.env, "teacher": args.teacher_model}


# ---- Rollout: whole groups on this rank, scored ------------------------------------------------
def sample_groups(run, rows, args, env=None, G=None):
    """G (default num_generations) completions of each prompt in `rows`, scored: {"prompt_ids": N
    lists, "gens": Generations (N * G rows, prompt-major), "rewards": (N * G,) the weighted total,
    "per_func": {name: (N * G,)}}; with an environment (--env) also "loss_mask" (B, C), 0 on its
    turns, and "env_stats"."""
    G = G or args.num_generations
    if env is None:
        prompt_ids = run.encode(rows)
        gens = run.generate(prompt_ids, G)
        completions = run.tokenizer.batch_decode(gens.completion_ids, skip_special_tokens=True)
        rewards, per_func = run.score(rows, completions, G)
        return {"prompt_ids": prompt_ids, "gens": gens, "rewards": rewards, "per_func": per_func}
    ep = envs.rollout(  # multi-turn: one turn per generate call, the sampled ids kept as sampled
        lambda prompt_ids, max_new: run.generate(prompt_ids, 1, max_new),
        run.tokenizer,
        rows,
        env,
        G,
        args.max_turns,
        args.max_completion_length,
        run.stop_ids,
        run.template_kwargs,
    )
    rewards, per_func = run.score(rows, ep.completions, G)  # completions: messages
    return {
        "prompt_ids": ep.prompt_ids,
        "gens": Generations(ep.completion_ids, ep.completion_mask, ep.logprobs),
        "rewards": rewards,
        "per_func": per_func,
        "loss_mask": ep.loss_mask,  # (B, C)
        "env_stats": ep.stats,
    }


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


def to_batch(sample, keep, args, run):
    """The padded batch (batching.make_batch) with group advantages (B,), the keep mask (None:
    all rows), which completions were truncated (B,), and the sampler's log-probs (vLLM, else
    None)."""
    gens = sample["gens"]
    batch = make_batch(sample["prompt_ids"], gens, run.tokenizer.pad_token_id)
    batch["keep"] = keep
    batch["truncated"] = truncated(gens, run.stop_ids, args.max_completion_length)  # (B,)
    est = (args.num_generations, args.advantage_estimator, args.scale_rewards)  # kept rows' stats
    batch["advantages"] = estimate_advantages(sample["rewards"], *est, keep_mask(batch, args))
    batch["sampler_logps"] = gens.logprobs  # (B, C) or None
    batch["loss_mask"] = sample.get("loss_mask")  # (B, C): --env, 0 on its turns; else None
    return batch


def my_rows(run, rows, k, seed):
    """This rank's prompts_per_rank rows of the k-th batch of `rows` in the data order of `seed`."""
    N = run.args.prompts_per_rank
    return batch_rows(rows, k, N * run.world, seed)[run.rank * N : (run.rank + 1) * N]


def rollout(run, step, args, env):
    """This rank's whole groups for `step`, sampled and scored (with --dynamic_sampling, groups
    without reward spread replaced), as a batch with advantages. Returns (the first round's
    sample, for the training reward in the metrics; the batch; extra metrics)."""
    rows = my_rows(run, run.train_rows, step, args.seed)
    if run.vllm is not None:
        with run.ledger.phase("weight_sync"):
            run.vllm.sync_weights(run.policy)  # wakes it: weights, then its KV cache
    with run.ledger.phase("rollout"):
        sample = first = sample_groups(run, rows, args, env)
        keep, extra = None, {}
        if "env_stats" in first:  # --env: turns per conversation, conversations cut, over ranks
            names = list(first["env_stats"])
            extra = dict(zip(names, all_sum([first["env_stats"][k] for k in names])))
            extra["env/turns"] /= run.world  # a mean of the ranks' means
        if args.dynamic_sampling:  # DAPO: groups without reward spread out, fresh ones in
            # extra round r: the first n of this rank's slot in a second fixed order (seed + 1)
            def more(round_, n):
                k = step * args.max_dynamic_sampling_rounds + round_ - 1
                return sample_groups(run, my_rows(run, run.train_rows, k, args.seed + 1)[:n], args)

            pad = run.tokenizer.pad_token_id
            sample, keep, extra = dynamic_sampling(first, more, args, pad)
        if run.vllm is not None:
            run.vllm.sleep()  # colocated, GPU: its weights and KV cache freed
        return first, to_batch(sample, keep, args, run), extra


def start_prefetch(run, args, env):
    """Asynchronous GRPO (--max_staleness K): the starting weights to the server (unless the first
    held-out score sent them), then a Prefetcher whose thread samples and scores each step's groups
    on this rank over HTTP (no collective) once step - K - 1 is trained and its weights sent. A
    failed request is retried once; after --resume the steps in flight are sampled again."""
    if not run.vllm.syncs:
        run.vllm.sync_weights(run.policy)
    return Prefetcher(
        lambda step: sample_groups(run, my_rows(run, run.train_rows, step, args.seed), args, env),
        run.start_step,
        args.max_steps,
        args.max_staleness,
        lambda: run.vllm.syncs,  # the weights the server holds now
        (ServerError,),
    )


def async_rollout(prefetch, run, step, args):
    """rollout()'s asynchronous variant: this rank's groups for `step` from the prefetcher, sampled
    with weights at most K versions older than the trainer's (older ones are sampled again)."""
    with run.ledger.phase("rollout"):
        sample, staleness, waited = prefetch.get(step, run.vllm.syncs)
    mine = [[staleness, waited, prefetch.idle_seconds(), prefetch.dropped]]
    ranks = all_cat(torch.tensor(mine, dtype=torch.float64))  # (world, 4)
    stats = {
        "async/staleness_mean": ranks[:, 0].mean().item(),
        "async/staleness_max": int(ranks[:, 0].max()),
        "async/trainer_wait_s": ranks[:, 1].max().item(),  # the trainer idle, waiting for rollouts
        "async/server_wait_s": ranks[:, 2].max().item(),  # a producer K steps ahead, idle
        "async/dropped": int(ranks[:, 3].sum()),  # over K versions old: sampled again
    }
    return sample, to_batch(sample, None, args, run), stats


# ---- Micro-batches, log-probs and the update -------------------------------------------------
def micro_plan(batch, args, knobs=None):
    """This rank's micro-batches over its kept rows; ranks agree on their number (batching.py)."""
    knobs = knobs or Knobs.given(args)
    micro, tokens = knobs.per_device_train_batch_size, knobs.max_tokens_per_microbatch
    return plan_micro_batches(batch, micro, tokens, keep_mask(batch, args))


def batch_normalizer(batch, plan, args):
    """The whole batch's loss denominator: loss_normalizer summed over the real micro-batches of
    every rank (zero-weight repeats add nothing). The one place it is computed."""
    local = sum(
        weight * loss_normalizer(loss_tokens(mb), args.loss_type, args.max_completion_length)
        for _, mb, weight in micro_batches(batch, plan)
    )
    (total,) = all_sum([local])
    return total


@torch.no_grad()
def batch_logps(model, batch, plan, args, knobs, device, policy=False):
    """(B, C) log-probs of the sampled tokens, micro-batch by micro-batch (same slices as the
    update, so the numerics match), never holding (B, T, V). Zero-weight repeats keep ranks in
    step. policy: the sampling policy's, under the distribution that sampled them (--top_p < 1:
    renormalised over the tokens nucleus sampling kept); the cut of each token, found here, goes
    to batch["sampling_thresholds"] (B, C) for the update's forwards."""
    out = torch.zeros(batch["completion_mask"].shape, dtype=torch.float32)  # (B, C)
    cut = torch.zeros_like(out) if policy and args.top_p < 1 else None  # (B, C)
    for idx, mb, weight in micro_batches(batch, plan):
        chunk = knobs.logprob_chunk_size  # 0: logprobs.py's default
        top_p = args.top_p if policy else 1.0
        lp = forward_logps(
            model, mb, args.temperature, args.packing, device, chunk_size=chunk, top_p=top_p
        )
        if weight:  # (b, c); packed (one row without padding): the same values
            out[idx, : mb["logits_to_keep"]] = lp.float().cpu()
            if cut is not None:
                cut[idx, : mb["logits_to_keep"]] = mb["sampling_thresholds"]
    if cut is not None:
        batch["sampling_thresholds"] = cut
    return out


def rollout_logps(run, engine, ref, teacher, batch, plan, args):
    """The no-grad passes of a step, on the update's micro-batches: the sampling policy's
    log-probs where a ratio, vLLM's check or distillation needs them, the reference's (beta > 0;
    with LoRA the policy with its adapters off), the teacher's (--teacher_model: its reverse KL
    joins the advantages, distill_advantages). Sets them on `batch`; returns metrics."""
    knobs, device, extra, cap = run.knobs, run.device, {}, importance_cap(args)
    batch["old_logps"] = batch["ref_logps"] = old = None
    if args.num_iterations > 1 or cap > 0 or teacher is not None:
        with run.ledger.phase("old_logprobs"):
            old = batch_logps(engine.module, batch, plan, args, knobs, device, policy=True)
        batch["old_logps"] = old if args.num_iterations > 1 or cap > 0 else None  # ratio 1 else
    if args.beta > 0:
        reference = engine.module if ref is None else ref
        adapters_off = nullcontext() if ref is not None else engine.module.disable_adapter()
        with run.ledger.phase("ref_logprobs"), adapters_off:
            batch["ref_logps"] = batch_logps(reference, batch, plan, args, knobs, device)
    if teacher is not None:
        with run.ledger.phase("teacher_logprobs"):
            teacher_logps = batch_logps(teacher, batch, plan, args, knobs, device)  # (B, C)
        mask = loss_tokens(batch) * keep_mask(batch, args)[:, None]  # (B, C) the trained tokens
        how = (mask, args.distill_coef, args.distill_only)
        batch["advantages"] = distill_advantages(batch["advantages"], old, teacher_logps, *how)
        rkl, n = all_sum([((old - teacher_logps) * mask).sum().item(), mask.sum().item()])
        extra["distill/reverse_kl"] = rkl / max(n, 1.0)  # per token, all ranks
    if cap > 0:  # vLLM sampled these tokens; the trainer scores them
        batch["is_weights"], is_metrics = vllm_importance_weights(batch, args)
        extra.update(is_metrics)
    return extra


def update(engine, batch, args, device, ledger=None, knobs=None):
    """The policy update for one step's batch, on every rank alike; returns its metrics summed over
    ranks. In order:

    1. the keep mask (keep_mask) and the micro-batch plan over the kept rows (micro_plan): every
       rank runs the same number of micro-batches, a rank with fewer or no kept rows runs
       zero-weight repeats, so ZeRO-3's collectives stay in lockstep;
    2. the whole batch's normaliser over all ranks (batch_normalizer): each micro-batch's loss is
       divided by it, so the micro-batch losses of all ranks add up to the loss of the full batch
       and the gradient does not depend on how the batch is split. No kept row on any rank: no
       update at all (an optimizer step on zero gradients would still move Adam's moments);
    3. num_iterations times: every micro-batch forward/backward, then one optimizer step;
    4. the last iteration's metrics summed over ranks (UPDATE_METRICS), plus "skipped" (optimizer
       steps DeepSpeed refused as non-finite), "updated" (1.0 or 0.0) and "rows" (kept rows);
    5. when vLLM sampled the batch, how far its log-probs are from the first iteration's
       (generation.sampler_logp_gap): the update's own forward is the trainer's side.
    """
    knobs = knobs or Knobs.given(args)
    plan = micro_plan(batch, args, knobs)
    normalizer = batch_normalizer(batch, plan, args)
    sums, skipped = dict.fromkeys(UPDATE_METRICS, 0.0), 0
    sampled = batch.get("sampler_logps")  # (B, C) or None
    trainer = None if sampled is None else torch.zeros_like(sampled)  # (B, C) filled below
    if normalizer > 0:  # alike on every rank: a sum over ranks
        for i in range(args.num_iterations):
            out = trainer if i == 0 else None  # the first iteration's log-probs
            sums = train_on_batch(engine, batch, plan, args, knobs, normalizer, device, ledger, out)
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


def train_on_batch(engine, batch, plan, args, knobs, normalizer, device, ledger, logps_out=None):
    """Forward/backward every micro-batch of `plan`, then ONE optimizer step; returns this rank's
    summed metrics (every key of UPDATE_METRICS, 0 where it had no real micro-batch). With a
    ledger, its "update" and "optimizer_step" phases. logps_out (B, C): filled with the forwards'
    log-probs (detached) where the plan has real rows.

    DeepSpeed divides each loss by gradient_accumulation_steps (scale_wrt_gas) and averages
    gradients over data-parallel ranks; we turn off the first and multiply by the world size to
    undo the second, so the step applies exactly the gradient of the full-batch loss.
    """
    world, sums = engine.dp_world_size, dict.fromkeys(UPDATE_METRICS, 0.0)
    phase = ledger.phase if ledger else lambda name: nullcontext()
    with phase("update"):
        for i, (idx, mb, weight) in enumerate(micro_batches(batch, plan)):
            engine.set_gradient_accumulation_boundary(i == len(plan) - 1)  # we decide the step
            # through engine.forward, not engine.module: ZeRO-3 counts micro-steps there, and
            # without that count every backward overwrites (not accumulates) the gradient partitions
            # --top_p < 1: under the nucleus, cut where the old pass cut (else found here)
            kw = dict(return_entropy=True, chunk_size=knobs.logprob_chunk_size, top_p=args.top_p)
            logps, entropy = forward_logps(
                engine, mb, args.temperature, args.packing, device, **kw
            )  # (b, c)
            mask = loss_tokens(mb).to(device)  # (b, c)
            on = {k: None if mb.get(k) is None else mb[k].to(device) for k in ON_DEVICE}
            loss, metrics = grpo_loss(
                logps,
                on["old_logps"],
                on["ref_logps"],
                on["advantages"],
                mask,
                beta=args.beta,
                epsilon_low=args.epsilon_low,
                epsilon_high=args.epsilon_high,
                loss_type=args.loss_type,
                normalizer=normalizer,
                is_weights=on["is_weights"],
                importance_sampling_level=args.importance_sampling_level,
                entropy=entropy,
                entropy_coef=args.entropy_coef,
            )
            engine.backward(loss * weight * world, scale_wrt_gas=False)  # weight 0: a repeat
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


# ---- The loop --------------------------------------------------------------------------------
def main(argv=None):
    args = parse_args(argv)
    env = envs.load_env(args.env) if args.env else None  # a factory of environments
    if args.estimate_memory or args.preflight:  # one process, before any rank begins
        return harness.before_torchrun(args, memory_models(args))
    run = harness.Run(args, memory_models(args))  # process group, every input checked
    policy = run.load()
    if args.lora_r:  # only the adapters train; the reference is the policy with them off
        policy = run.lora(policy)
    engine = run.train_engine(policy, args.learning_rate)
    ref = run.frozen(run.load(frozen=True)) if memory_models(args)["reference"] else None
    teacher = run.frozen(run.load(args.teacher_model, frozen=True)) if args.teacher_model else None
    vllm = run.vllm_engine()

    def eval_sample(rows):  # --eval_samples completions per held-out prompt, as in training
        sample = sample_groups(run, rows, args, env, G=args.eval_samples)
        return sample["rewards"], sample["per_func"]

    run.start(__file__, {"policy": engine}, vllm, eval_sample, sync_for_eval=not args.max_staleness)
    prefetch = start_prefetch(run, args, env) if args.max_staleness else None
    for step in run.steps():
        # 1. rollout: whole groups on this rank, scored; advantages on whole groups
        if prefetch is None:
            first, batch, extra = rollout(run, step, args, env)
        else:
            first, batch, extra = async_rollout(prefetch, run, step, args)
        t_rollout = time.time() - run.t0

        # 2. no grad: old, reference and teacher log-probs, with the update's micro-batches
        plan = micro_plan(batch, args, run.knobs)
        extra.update(rollout_logps(run, engine, ref, teacher, batch, plan, args))

        # 3. update: keep mask, micro-batches, whole-batch normaliser, optimizer steps
        t1 = time.time()
        totals = update(engine, batch, args, run.device, run.ledger, run.knobs)
        t_update = time.time() - t1
        if prefetch is not None:  # the new weights to the server; then one more step may start
            with run.ledger.phase("weight_sync"):
                vllm.sync_weights(engine)
            prefetch.step_done()

        # 4. the step's row, the held-out score when due, a checkpoint when due
        row = step_row(step + 1, first, totals, engine, args)
        row.update(extra, rollout_s=t_rollout, update_s=t_update)
        run.end_step(
            row,
            loss=totals["loss"],
            grad_norm=row.get("grad_norm"),
            skipped=totals["skipped"] > 0,
            updated=totals["updated"] > 0,
            line=step_line(row),
        )
    if prefetch is not None:
        prefetch.close()
    # curves.png: the reward, then KL to the reference (beta > 0) or else the policy's entropy
    train, held = ("reward", "train", "-"), ("eval/reward", "held-out", "o-")
    right = ("KL to reference", "kl") if args.beta > 0 else ("entropy (nats/token)", "entropy")
    panel = (right[0], [(right[1], "train", "-")])
    run.finish(panels=[("reward", [train, held]), panel])


def step_row(step, first, totals, engine, args):
    """One metrics.jsonl row of the training rewards (the step's first-round samples, all ranks:
    what the policy does, before dynamic sampling picks groups) and the update's metrics (omitted
    when no row was kept: no update ran)."""
    lengths = first["gens"].completion_mask.sum(1).float()  # (B,)
    per_func = first["per_func"]
    # (world * B, 2 + F), every rank's sequences: total reward, completion length, each function
    seq = all_cat(torch.stack([first["rewards"], lengths, *per_func.values()], 1))
    row = {"step": step, **reward_stats(seq, list(per_func))}
    row.update(update_rows=totals["rows"], lr=engine.get_lr()[0])
    if totals["updated"]:
        keys = ("entropy", "ratio", "clip_low", "clip_high") + (("kl",) if args.beta > 0 else ())
        row.update({k: totals[k] / totals["tokens"] for k in keys})
        row["clip_frac"] = (totals["clip_low"] + totals["clip_high"]) / totals["tokens"]
        row["loss"] = totals["loss"]
        grad_norm = engine.get_global_grad_norm()  # a float or a 0-d tensor, by stage and offload
        row["grad_norm"] = None if grad_norm is None else float(grad_norm)
        row.update({k: v for k, v in totals.items() if k.startswith("sampling/")})  # vLLM's gap
    return row


def step_line(row):
    """What rank 0 prints after each step (harness adds the step, seconds and memory)."""
    line = f"reward {row['reward']:.3f} acc {row['accuracy']:.2f} len {row['completion_len']:.1f}"
    if "loss" not in row:
        return line + " no update (no row kept)"
    line += f" entropy {row['entropy']:.2f} clip {row['clip_frac']:.3f}"
    return line + (f" kl {row['kl']:.4f}" if "kl" in row else "")


if __name__ == "__main__":  # vLLM spawns workers: keep the entry point guarded
    exit_process(entry_code(main))  # a known failure: one message and its exit code (checks.py)

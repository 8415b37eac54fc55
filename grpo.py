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
- Every micro-batch loss is divided by the WHOLE batch's normaliser (batch_stats) and
  DeepSpeed's averaging is undone, so accumulation never changes the update.
- Optional, each a file of its own with its flags, named where it plugs in: CISPO (cispo.py),
  GSPO's sequence-level ratio (gspo.py), RLOO / REINFORCE++ advantages (rloo.py), DAPO's dynamic
  sampling and overlong filtering (dapo.py), importance weights for vLLM's samples (vllm_is.py),
  on-policy distillation (distill.py), asynchronous GRPO (async_rollouts.py, docs/async.md),
  multi-turn rollouts (envs.py, docs/envs.md); in here: an entropy bonus, LoRA (vLLM and the
  final model get merged weights). docs/changing.md: how to add your own.
"""

import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

import async_rollouts
import distill
import envs
import harness
import recipes
import vllm_is
from arguments import arg
from async_rollouts import AsyncArgs, async_sample, start_prefetch
from batching import (
    all_sum,
    all_sum_dict,
    forward_logps,
    loss_inputs,
    make_batch,
    micro_batches,
    micro_stats,
    plan_micro_batches,
)
from cispo import cispo_per_token
from dapo import DapoArgs, dynamic_sampling, truncated
from data import batch_rows
from distill import DistillArgs, teacher_advantages
from exits import RunError, entry_code, exit_process
from generation import Generations, sampler_logp_gap
from gspo import IMPORTANCE_SAMPLING_LEVELS, sequence_log_ratio
from rloo import baseline_advantages
from tasks import reward_stats
from vllm_is import VllmIsArgs, importance_cap, vllm_importance_weights
from zero3_utils import all_cat

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "cispo")
# --advantage_estimator: each one's --scale_rewards when not given (rloo.py: rloo, reinforce_pp)
ESTIMATOR_SCALES = {"grpo": True, "rloo": False, "reinforce_pp": True}
ADVANTAGE_ESTIMATORS = tuple(ESTIMATOR_SCALES)


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


def estimate_advantages(batch, args):
    """(B,) advantages of the batch's rewards by --advantage_estimator, B = N * G with each
    prompt's G completions adjacent: grpo's group_advantages, scaled unless --scale_rewards False
    (None: the estimator's own, ESTIMATOR_SCALES); rloo and reinforce_pp: rloo.py (reinforce_pp
    whitens over the kept rows of every rank, keep_mask: a collective, so every rank calls it).
    batch: to_batch's, "rewards" (B,) and all a baseline may weigh by: loss_tokens(batch) (B, C)
    (summed: each completion's length), keep_mask(batch, args)."""
    rewards, G, estimator = batch["rewards"], args.num_generations, args.advantage_estimator
    if estimator == "grpo":
        scale = ESTIMATOR_SCALES[estimator] if args.scale_rewards is None else args.scale_rewards
        return group_advantages(rewards, G, scale=scale)
    centred = group_advantages(rewards, G, scale=False).double()  # (B,)
    return baseline_advantages(centred, G, estimator, keep_mask(batch, args)).to(rewards.dtype)


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


def grpo_loss(t, args, stats):
    """Clipped surrogate + k3 KL for one micro-batch: (loss, metrics).

    t: batching.LossInputs, the per-token inputs (B, C): logps with grad, old_logps (on-policy:
    logps detached, ratio 1), ref_logps (beta > 0), advantages (B,) or (B, C), mask (1 on the
    tokens trained), weights (importance weights, or None), entropy with grad. args: the flags
    (beta, epsilon_low/high, loss_type, importance_sampling_level, entropy_coef). stats: the
    WHOLE batch's statistics (batch_stats), computed before the micro-batches: "normalizer", so
    that the losses of all micro-batches on all ranks add up to the full-batch loss; a (B,) or
    (B, C) statistic arrives as this micro-batch's rows of it (batching.micro_stats), like t.
    metrics: named SUMS over this micro-batch's tokens ("loss" the loss itself); update() adds
    them over micro-batches and ranks, step_row divides them by "tokens". A term writes its
    metric where it computes it (token_sum), and nowhere else.
    """
    if args.loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={args.loss_type!r}: choose one of {LOSS_TYPES}")
    mask, eps_low, eps_high = t.mask, args.epsilon_low, args.epsilon_high  # mask: (B, C)
    metrics = {}

    def token_sum(x):  # a metric: x (B, C) summed over the loss's tokens, no gradient
        return (x.detach() * mask).sum()

    log_ratio = t.logps - t.old_logps  # (B, C)
    if args.importance_sampling_level == "sequence":  # GSPO (gspo.py): one ratio per sequence
        log_ratio = sequence_log_ratio(log_ratio, mask)  # (B, C)
    elif args.importance_sampling_level != "token":
        raise ValueError(
            f"importance_sampling_level={args.importance_sampling_level!r}: choose one of "
            f"{IMPORTANCE_SAMPLING_LEVELS}"
        )
    ratio = torch.exp(log_ratio)  # (B, C)
    adv = t.advantages[:, None] if t.advantages.dim() == 1 else t.advantages  # (B, 1) or (B, C)
    if args.loss_type == "cispo":  # cispo.py: the capped ratio weighs the score function
        per_token, is_high = cispo_per_token(ratio, adv, t.logps, eps_high)  # (B, C), (B, C)
        is_low = torch.zeros_like(is_high)  # (B, C) nothing clipped from below
    else:
        clipped = ratio.clamp(1 - eps_low, 1 + eps_high)  # (B, C)
        per_token = -torch.min(ratio * adv, clipped * adv)  # (B, C)
        is_low = (ratio < 1 - eps_low) & (adv < 0)  # (B, C) clipped from below
        is_high = (ratio > 1 + eps_high) & (adv > 0)  # (B, C) clipped from above
    if t.weights is not None:  # importance weights for vLLM's samples (vllm_is.py)
        per_token = per_token * t.weights  # (B, C)
    if args.beta > 0:
        if t.ref_logps is None:
            raise ValueError("beta > 0 needs ref_logps")
        d = t.ref_logps - t.logps  # (B, C)
        kl = torch.exp(d) - d - 1  # (B, C) k3 estimator, >= 0
        per_token = per_token + args.beta * kl  # (B, C)
        metrics["kl"] = token_sum(kl)
    if args.entropy_coef:  # only then: an unused entropy gets no backward work
        per_token = per_token - args.entropy_coef * t.entropy  # (B, C)
    if args.loss_type == "grpo":
        per_seq = (per_token * mask).sum(1) / mask.sum(1).clamp(min=1)  # (B,)
        loss = per_seq.sum() / stats["normalizer"]
    else:
        loss = (per_token * mask).sum() / stats["normalizer"]
    metrics.update(loss=loss.detach(), tokens=mask.sum(), entropy=token_sum(t.entropy))
    metrics.update(ratio=token_sum(ratio), clip_low=token_sum(is_low), clip_high=token_sum(is_high))
    return loss, metrics


def keep_mask(batch, args):
    """(B,) bool: the rows the update trains on. All of them, but for groups that dynamic sampling
    dropped (batch["keep"] False) and, with --mask_truncated_completions, the completions cut at
    max_completion_length (batch["truncated"]; DAPO's overlong filtering, dapo.py)."""
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


# ---- Configuration: GRPO's own fields (harness.RunArgs has the ones both loops share) -----------
@dataclass
class Args(harness.RunArgs, DapoArgs, VllmIsArgs, DistillArgs, AsyncArgs, envs.EnvArgs):
    # the variants' flags come with their files (dapo, vllm_is, distill, async_rollouts, envs)
    recipe: str = arg("", recipes.recipe_help(recipes.GRPO))
    num_generations: int = arg(
        8,
        "G, the group size: completions per prompt",
        ">= 2",
        why="advantages compare completions within a group",
    )
    loss_type: str = arg(
        "bnpo",
        f"one of {LOSS_TYPES}; cispo: -stopgrad(min(r, 1 + epsilon_high)) A logp per token",
        LOSS_TYPES,
    )
    advantage_estimator: str = arg(
        "grpo",
        f"one of {ADVANTAGE_ESTIMATORS}; grpo: r - group mean; rloo: r - the others' mean "
        "(unscaled); reinforce_pp: r - group mean, whitened over the whole batch (rloo.py)",
        ADVANTAGE_ESTIMATORS,
    )
    entropy_coef: float = arg(0.0, "entropy bonus: loss -= coef x token entropy", ">= 0")
    importance_sampling_level: str = arg(
        "token",
        "token: a ratio per token (GRPO); sequence: one length-normalised ratio per sequence, "
        "clipped as a whole (GSPO, Zheng et al. 2025)",
        IMPORTANCE_SAMPLING_LEVELS,
    )
    beta: float = arg(
        0.0,
        "KL coefficient: k3 KL to a frozen reference in the loss; 0 builds no reference model",
        ">= 0",
        aliases="--kl_coef",
    )
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
    for variant in (async_rollouts, distill, vllm_is):  # each variant's checks of its flags
        variant.check_args(args)
    if sum(map(bool, (args.env, args.dynamic_sampling, args.max_staleness))) > 1:  # 3 rollouts
        raise RunError("--env, --dynamic_sampling and --max_staleness > 0: one at a time")
    return args


def memory_models(args):
    """What this loop builds beside the policy, for the pre-flight's estimate and checks."""
    reference = args.beta > 0 and not args.lora_r
    return {"reference": reference, "env": args.env, "teacher": args.teacher_model}


# ---- Rollout: whole groups on this rank, scored ------------------------------------------------
def sample_groups(run, rows, args, env=None, G=None):
    """G (default num_generations) completions of each prompt in `rows`, scored: {"prompt_ids": N
    lists, "gens": Generations (N * G rows, prompt-major), "rewards": (N * G,) the weighted total,
    "per_func": {name: (N * G,)}}; with an environment (--env, envs.sample_episodes) also
    "loss_mask" (B, C), 0 on its turns, and "env_stats"."""
    G = G or args.num_generations
    if env is not None:  # multi-turn: an environment answers each assistant turn
        return envs.sample_episodes(run, rows, args, env, G)
    prompt_ids = run.encode(rows)
    gens = run.generate(prompt_ids, G)
    completions = run.tokenizer.batch_decode(gens.completion_ids, skip_special_tokens=True)
    rewards, per_func = run.score(rows, completions, G, gens)
    return {"prompt_ids": prompt_ids, "gens": gens, "rewards": rewards, "per_func": per_func}


def to_batch(sample, keep, args, run):
    """The padded batch (batching.make_batch) with the keep mask (None: all rows), which
    completions were truncated (B,), the rewards (B,), the sampler's log-probs (vLLM, else None),
    an environment's loss mask, and then, from all of them, the advantages (B,)."""
    gens = sample["gens"]
    batch = make_batch(sample["prompt_ids"], gens, run.tokenizer.pad_token_id)
    batch["keep"] = keep
    batch["truncated"] = truncated(gens, run.stop_ids, args.max_completion_length)  # (B,)
    batch["rewards"] = sample["rewards"]  # (B,)
    batch["sampler_logps"] = gens.logprobs  # (B, C) or None
    batch["loss_mask"] = sample.get("loss_mask")  # (B, C): --env, 0 on its turns; else None
    batch["advantages"] = estimate_advantages(batch, args)  # (B,) the kept rows' statistics
    return batch


def my_rows(run, rows, k, seed):
    """This rank's prompts_per_rank rows of the k-th batch of `rows` in the data order of `seed`."""
    N, i = run.args.prompts_per_rank, run.data_rank  # sequence-parallel ranks share their rows
    return batch_rows(rows, k, N * run.data_world, seed)[i * N : (i + 1) * N]


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
        if env is not None:  # turns per conversation, conversations cut, over ranks
            extra = envs.episode_stats(first["env_stats"], run.data_world)
        if args.dynamic_sampling:  # DAPO (dapo.py): groups without reward spread out, fresh in
            # extra round r: the first n of this rank's slot in a second fixed order (seed + 1)
            def more(round_, n):
                k = step * args.max_dynamic_sampling_rounds + round_ - 1
                return sample_groups(run, my_rows(run, run.train_rows, k, args.seed + 1)[:n], args)

            pad = run.tokenizer.pad_token_id
            sample, keep, extra = dynamic_sampling(first, more, args, pad)
        if run.vllm is not None:
            run.vllm.sleep()  # colocated, GPU: its weights and KV cache freed
        return first, to_batch(sample, keep, args, run), extra


# ---- Micro-batches, log-probs and the update -------------------------------------------------
def micro_plan(batch, args, knobs):
    """This rank's micro-batches over its kept rows, at the run's knobs (run.knobs); ranks agree on
    their number (batching.py)."""
    micro, tokens = knobs.per_device_train_batch_size, knobs.max_tokens_per_microbatch
    return plan_micro_batches(batch, micro, tokens, keep_mask(batch, args))


def batch_stats(batch, plan, args, policy_logps=None):
    """Statistics over the WHOLE batch, every micro-batch of every rank (zero-weight repeats add
    nothing), computed once before the micro-batches and handed to every grpo_loss call, so a
    batch-level rule never changes with the micro-batch size. "normalizer": the loss denominator,
    loss_normalizer summed; the one place it is computed. A statistic of your own goes here: a
    number, or a (B,) or (B, C) tensor over this rank's rows, of which each grpo_loss call gets
    its micro-batch's rows (batching.micro_stats). policy_logps(): (B, C) the sampling policy's
    log-probs, one no-grad pass at the first call (none when rollout_logps made one); ask for
    them under a flag, never under a condition on the data: the pass is a collective (ZeRO-3)."""
    local = sum(
        weight * loss_normalizer(loss_tokens(mb), args.loss_type, args.max_completion_length)
        for _, mb, weight in micro_batches(batch, plan)
    )
    (total,) = all_sum([local])
    return {"normalizer": total}


@torch.no_grad()
def batch_logps(model, batch, plan, args, knobs, device, policy=False):
    """(B, C) log-probs of the sampled tokens, micro-batch by micro-batch (same slices as the
    update, so the numerics match), never holding (B, T, V). Zero-weight repeats keep ranks in
    step. policy: the sampling policy's, under the distribution that sampled them (--top_k > 0,
    --top_p < 1: renormalised over the tokens the sampler kept); the cut of each token, found
    here (unless the sampler's kept sets travel with the batch), goes to
    batch["sampling_thresholds"] (B, C, 2) for the update's forwards."""
    out = torch.zeros(batch["completion_mask"].shape, dtype=torch.float32)  # (B, C)
    how = harness.sampling_cut(args) if policy else {}
    find = how and "sampling_kept" not in batch
    cut = torch.zeros(*out.shape, 2) if find else None  # (B, C, 2)
    for idx, mb, weight in micro_batches(batch, plan):
        chunk = knobs.logprob_chunk_size  # 0: logprobs.py's default
        lp = forward_logps(
            model, mb, args.temperature, args.packing, device, chunk_size=chunk, **how
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
    with LoRA the policy with its adapters off), the teacher's (--teacher_model, distill.py: its
    reverse KL joins the advantages). Sets them on `batch`; returns metrics."""
    knobs, device, extra, cap = run.knobs, run.device, {}, importance_cap(args)
    batch["old_logps"] = batch["ref_logps"] = old = None
    if args.num_iterations > 1 or cap > 0 or teacher is not None:
        with run.ledger.phase("old_logprobs"):
            old = batch_logps(engine.module, batch, plan, args, knobs, device, policy=True)
        batch["policy_logps"] = old  # (B, C) for batch_stats too
        batch["old_logps"] = old if args.num_iterations > 1 or cap > 0 else None  # ratio 1 else
    if args.beta > 0:
        reference = engine.module if ref is None else ref
        adapters_off = nullcontext() if ref is not None else engine.module.disable_adapter()
        with run.ledger.phase("ref_logprobs"), adapters_off:
            batch["ref_logps"] = batch_logps(reference, batch, plan, args, knobs, device)
    trained = loss_tokens(batch) * keep_mask(batch, args)[:, None]  # (B, C) the trained tokens
    if teacher is not None:  # on-policy distillation (distill.py)
        with run.ledger.phase("teacher_logprobs"):
            teacher_logps = batch_logps(teacher, batch, plan, args, knobs, device)  # (B, C)
        how = (old, teacher_logps, trained, args)
        batch["advantages"], more = teacher_advantages(batch["advantages"], *how)
        extra.update(more)
    if cap > 0:  # vLLM sampled these tokens; the trainer scores them (vllm_is.py)
        how = (batch["old_logps"], batch["sampler_logps"], loss_tokens(batch), trained, args)
        batch["is_weights"], more = vllm_importance_weights(*how)
        extra.update(more)
    return extra


def update(engine, batch, args, knobs, device, ledger=None):
    """The policy update for one step's batch, on every rank alike; returns {"sums": the loss's
    metrics summed over micro-batches and ranks, "rows": kept rows, "skipped": optimizer steps
    DeepSpeed refused as non-finite, "updated": 1.0 or 0.0} and, when vLLM sampled the batch, how
    far its log-probs are from the first iteration's (generation.sampler_logp_gap). In order:

    1. the keep mask (keep_mask) and the micro-batch plan over the kept rows (micro_plan): every
       rank runs the same number of micro-batches, a rank with fewer or no kept rows runs
       zero-weight repeats, so ZeRO-3's collectives stay in lockstep;
    2. the whole batch's statistics over all ranks (batch_stats): each micro-batch's loss is
       divided by its normaliser, so the micro-batch losses of all ranks add up to the loss of
       the full batch and the gradient does not depend on how the batch is split. No kept row on
       any rank: no update at all (an optimizer step on zero gradients would still move Adam).
       A statistic that asks for the sampling policy's log-probs gets rollout_logps's, or a
       no-grad pass made then (ledger phase "old_logprobs");
    3. num_iterations times: every micro-batch forward/backward, then one optimizer step
       (train_on_batch), each loss given its micro-batch's rows of the statistics
       (batching.micro_stats); the last iteration's metrics are the step's.
    """
    plan = micro_plan(batch, args, knobs)
    phase = ledger.phase if ledger else lambda name: nullcontext()

    def policy_logps():  # (B, C) for a statistic that asks: rollout_logps's pass, or one now
        if batch.get("policy_logps") is None:
            with phase("old_logprobs"):
                how = (plan, args, knobs, device)
                batch["policy_logps"] = batch_logps(engine.module, batch, *how, policy=True)
        return batch["policy_logps"]

    stats = batch_stats(batch, plan, args, policy_logps)
    sums, skipped = {}, 0
    sampled = batch.get("sampler_logps")  # (B, C) or None
    trainer = None if sampled is None else torch.zeros_like(sampled)  # (B, C) filled below
    if stats["normalizer"] > 0:  # alike on every rank: a sum over ranks
        for i in range(args.num_iterations):
            out = trainer if i == 0 else None  # the first iteration's log-probs
            sums = train_on_batch(engine, batch, plan, args, knobs, stats, device, ledger, out)
            skipped += not engine.was_step_applied()  # alike on every rank
    keep = keep_mask(batch, args)  # (B,)
    sums = all_sum_dict({**sums, "rows": float(keep.sum())})  # one collective; the keys alike
    rows, gap = sums.pop("rows"), {}
    if trainer is not None and stats["normalizer"] > 0:  # alike on every rank: a collective
        mask = loss_tokens(batch) * keep[:, None]  # (B, C) the sampled tokens forwarded
        gap = sampler_logp_gap(trainer, Generations(None, mask, sampled))
    updated = float(stats["normalizer"] > 0)
    return {"sums": sums, "rows": rows, "skipped": float(skipped), "updated": updated, **gap}


def train_on_batch(engine, batch, plan, args, knobs, stats, device, ledger, logps_out=None):
    """Forward/backward every micro-batch of `plan`, then ONE optimizer step; returns this rank's
    sums of grpo_loss's metrics over its real micro-batches (its zero-weight repeats give the same
    keys, adding nothing). With a ledger, its "update" and "optimizer_step" phases. logps_out
    (B, C): filled with the forwards' log-probs (detached) where the plan has real rows.

    DeepSpeed divides each loss by gradient_accumulation_steps (scale_wrt_gas) and averages
    gradients over data-parallel ranks; we turn off the first and multiply by the world size to
    undo the second, so the step applies exactly the gradient of the full-batch loss.
    """
    world, sums = engine.dp_world_size, {}
    phase = ledger.phase if ledger else lambda name: nullcontext()
    with phase("update"):
        for i, (idx, mb, weight) in enumerate(micro_batches(batch, plan)):
            engine.set_gradient_accumulation_boundary(i == len(plan) - 1)  # we decide the step
            # through engine.forward, not engine.module: ZeRO-3 counts micro-steps there, and
            # without that count every backward overwrites (not accumulates) the gradient partitions
            # --top_k, --top_p: under the sampler's cut, where the old pass cut (else found here)
            kw = dict(return_entropy=True, chunk_size=knobs.logprob_chunk_size)
            kw.update(harness.sampling_cut(args))
            logps, entropy = forward_logps(
                engine, mb, args.temperature, args.packing, device, **kw
            )  # (b, c)
            t = loss_inputs(mb, logps, entropy, device, mask=loss_tokens(mb))
            loss, metrics = grpo_loss(t, args, micro_stats(stats, idx, mb, device))
            engine.backward(loss * weight * world, scale_wrt_gas=False)  # weight 0: a repeat
            if weight and logps_out is not None:
                logps_out[idx, : mb["logits_to_keep"]] = logps.detach().float().cpu()
            for k, v in metrics.items():  # a repeat's keys too: every rank returns the same ones
                sums[k] = sums.get(k, 0.0) + (float(v) if weight else 0.0)
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

    def sample_step(step):  # async GRPO's producer thread: this rank's groups, over HTTP
        return sample_groups(run, my_rows(run, run.train_rows, step, args.seed), args, env)

    run.start(__file__, {"policy": engine}, vllm, eval_sample, sync_for_eval=not args.max_staleness)
    prefetch = start_prefetch(run, args, sample_step) if args.max_staleness else None
    for step in run.steps():
        # 1. rollout: whole groups on this rank, scored; advantages on whole groups
        if prefetch is None:
            first, batch, extra = rollout(run, step, args, env)
        else:  # async_rollouts.py: sampled ahead, at most max_staleness weight versions old
            first, extra = async_sample(prefetch, run, step)
            batch = to_batch(first, None, args, run)
        t_rollout = time.time() - run.t0

        # 2. no grad: old, reference and teacher log-probs, with the update's micro-batches
        plan = micro_plan(batch, args, run.knobs)
        extra.update(rollout_logps(run, engine, ref, teacher, batch, plan, args))

        # 3. update: keep mask, micro-batches, whole-batch statistics, optimizer steps
        t1 = time.time()
        out = update(engine, batch, args, run.knobs, run.device, run.ledger)
        t_update = time.time() - t1
        if prefetch is not None:  # the new weights to the server; then one more step may start
            with run.ledger.phase("weight_sync"):
                vllm.sync_weights(engine)
            prefetch.step_done()

        # 4. the step's row (and samples), the held-out score when due, a checkpoint when due
        adv = batch["advantages"]  # the first round's rows, one advantage each, unless replaced
        adv = adv if adv.dim() == 1 and not args.dynamic_sampling else None
        run.log_completions(
            first["prompt_ids"], first["gens"], first["rewards"], first["per_func"], adv
        )
        row = step_row(step + 1, first, out, engine)
        row.update(extra, rollout_s=t_rollout, update_s=t_update)
        run.end_step(
            row,
            loss=row.get("loss", 0.0),
            grad_norm=row.get("grad_norm"),
            skipped=out["skipped"] > 0,
            updated=out["updated"] > 0,
            line=step_line(row),
        )
    if prefetch is not None:
        prefetch.close()
    # curves.png: the reward, then KL to the reference (beta > 0) or else the policy's entropy
    train, held = ("reward", "train", "-"), ("eval/reward", "held-out", "o-")
    right = ("KL to reference", "kl") if args.beta > 0 else ("entropy (nats/token)", "entropy")
    panel = (right[0], [(right[1], "train", "-")])
    run.finish(panels=[("reward", [train, held]), panel])


def step_row(step, first, out, engine):
    """One metrics.jsonl row: the training rewards (the step's first-round samples, all ranks:
    what the policy does, before dynamic sampling picks groups) and, when an update ran, the
    loss's metrics: each token sum as its mean per trained token, the loss as it is."""
    lengths = first["gens"].completion_mask.sum(1).float()  # (B,)
    per_func = first["per_func"]
    # (world * B, 2 + F), every rank's sequences: total reward, completion length, each function
    seq = all_cat(torch.stack([first["rewards"], lengths, *per_func.values()], 1))
    row = {"step": step, **reward_stats(seq, list(per_func))}
    row.update(update_rows=out["rows"], lr=engine.get_lr()[0])
    if out["updated"]:
        sums = out["sums"]
        row.update({k: v / sums["tokens"] for k, v in sums.items() if k not in ("loss", "tokens")})
        row["clip_frac"] = (sums["clip_low"] + sums["clip_high"]) / sums["tokens"]
        row["loss"] = sums["loss"]
        grad_norm = engine.get_global_grad_norm()  # a float or a 0-d tensor, by stage and offload
        row["grad_norm"] = None if grad_norm is None else float(grad_norm)
        row.update({k: v for k, v in out.items() if k.startswith("sampling/")})  # vLLM's gap
    return row


def step_line(row):
    """What rank 0 prints after each step (harness adds the step, seconds and memory)."""
    line = f"reward {row['reward']:.3f} acc {row['accuracy']:.2f} len {row['completion_len']:.1f}"
    if "loss" not in row:
        return line + " no update (no row kept)"
    line += f" entropy {row['entropy']:.2f} clip {row['clip_frac']:.3f}"
    return line + (f" kl {row['kl']:.4f}" if "kl" in row else "")


if __name__ == "__main__":  # vLLM spawns workers: keep the entry point guarded
    exit_process(entry_code(main))  # a known failure: one message and its exit code (exits.py)

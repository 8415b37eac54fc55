"""PPO: actor, critic, reward and reference models, on torchrun + DeepSpeed (InstructGPT's RLHF).

    bash run.sh ppo --max_steps 2 --packing True  # any field of Args below (python ppo.py --help)
    bash run.sh ppo --reward_model path/to/rm     # a sequence-classification reward model (1 label)

One step: each rank samples `num_generations` completions of each of its prompts, scores them
(rule-based functions or the reward model), computes old log-probs, reference log-probs and
values without gradients, turns them into per-token rewards -kl_coef * (logp - ref_logp) (+ the
score at the last completion token), GAE advantages (whitened over the whole batch, all ranks)
and returns, then runs `ppo_epochs` passes of `num_mini_batches` optimizer steps per model:
clipped policy loss on the actor, clipped value loss on the critic (docs/ppo.md). The critic is
the actor's body with a zero value head, or with --critic_from_reward_model the reward model's
body and score head (critic.py);
the reference is a frozen copy of the actor, or with LoRA the actor with its adapters off.
harness.py runs the rest (set-up, logging, held-out evaluation, checkpoints).

Letters in shape comments: B sequences in a (micro-)batch, P prompt tokens, C completion tokens,
T = P + C.

Departures from the paper and why:
- A fixed kl_coef (no adaptive KL controller); KL by the k1 estimator logp - ref_logp per token.
- Value of completion token t = the critic at the position that predicts it; after the last
  token the value is 0 (the episode ends).
- Loss sums are divided by the WHOLE mini-batch's token count (all micro-batches, all ranks), so
  the update does not depend on how it is split into micro-batches (docs/accumulation.md).
- The critic starts as the actor with a zero value head even with --reward_model (InstructGPT and
  OpenRLHF start it as the reward model: --critic_from_reward_model True): a reward model is
  trained on finished responses only, so its head's values at earlier positions are arbitrary
  (docs/reward-model.md measures what that costs).
- One epoch of one mini-batch without KL is on-policy: the update's own forward gives the old
  log-probs (needs_old_logps), one actor pass fewer.
Limits: the reward model must share the actor's tokenizer (token ids are passed as they are).
"""

import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from transformers import AutoModelForSequenceClassification

import harness
import recipes
from arguments import arg
from batching import (
    all_sum,
    all_sum_dict,
    forward_logps,
    loss_inputs,
    make_batch,
    micro_batches,
    mini_batch_plans,
    plan_micro_batches,
    token_means,
)
from cispo import cispo_per_token
from critic import build_critic, forward_values
from data import batch_rows
from exits import RunError, entry_code, exit_process
from generation import attn_implementation_for, sampler_logp_gap
from reward_model import sequence_scores
from tasks import RewardError, reward_functions, reward_stats, score_completions
from zero3_utils import all_cat


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

    rewards, values, mask: (B, C); gamma, lam: numbers, or (B,) one per sequence. Masked positions
    are skipped (a sequence is its unmasked tokens in order); the value after a sequence's last
    token is 0. returns = advantages + values.
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
    m = mask.to(torch.float64)  # (B, C)
    xd = x.to(torch.float64)  # (B, C)
    total, count = all_sum([(xd * m).sum().item(), m.sum().item()])  # float64 over ranks
    if count < 2:
        raise ValueError(
            f"masked_whiten needs at least 2 unmasked entries over all ranks, got {int(count)}"
        )
    mean = total / count
    (sq,) = all_sum([((xd - mean) ** 2 * m).sum().item()])
    var = torch.tensor(sq / (count - 1) + eps, dtype=torch.float64)
    out = (xd - mean) * torch.rsqrt(var)  # (B, C)
    if not shift_mean:
        out = out + mean
    return (out * m).to(x.dtype)


POLICY_LOSSES = ("ppo", "cispo")


def policy_loss(t, args, normalizer):
    """Clipped surrogate: sum of max(-A r, -A clip(r, 1 - eps, 1 + eps)) over tokens / normalizer.

    t: batching.LossInputs (B, C): logps with grad, old_logps, advantages (B, C), mask, entropy
    with grad. args: cliprange (eps), loss_type, entropy_coef. normalizer: the WHOLE mini-batch's
    token count (all micro-batches, all ranks). Returns (loss, metrics: named sums over tokens,
    "policy_loss" the loss itself). loss_type "cispo" (cispo.py): -stopgrad(min(r, 1 + eps)) A
    logp per token, so no token loses its gradient to clipping; "clip" then counts the tokens
    whose weight was capped. entropy_coef > 0: an entropy bonus, -coef x entropy per token.
    """
    mask, adv, eps = t.mask, t.advantages, args.cliprange  # mask, adv: (B, C)
    log_ratio = t.logps - t.old_logps  # (B, C)
    ratio = torch.exp(log_ratio)  # (B, C)
    unclipped = -adv * ratio  # (B, C)
    clipped = -adv * ratio.clamp(1 - eps, 1 + eps)  # (B, C)
    if args.loss_type == "cispo":  # the capped ratio as a constant weight of the score function
        per_token, is_clipped = cispo_per_token(ratio, adv, t.logps, eps)  # (B, C), (B, C)
    elif args.loss_type == "ppo":
        per_token, is_clipped = torch.max(unclipped, clipped), clipped > unclipped  # (B, C)
    else:
        raise ValueError(f"loss_type={args.loss_type!r}: choose one of {POLICY_LOSSES}")
    if args.entropy_coef:  # only then: an unused entropy gets no backward work
        per_token = per_token - args.entropy_coef * t.entropy  # (B, C)
    loss = (per_token * mask).sum() / normalizer
    # sums over tokens: update() adds them up, the row divides by tokens. The loss is detached:
    # no_grad does not detach a tensor made outside it, and float() of one that requires grad warns
    with torch.no_grad():
        metrics = {
            "policy_loss": loss.detach(),
            "tokens": mask.sum(),
            "entropy": (t.entropy * mask).sum(),
            "clip": (is_clipped * mask).sum(),
            "ratio": (ratio * mask).sum(),
            "approx_kl": ((ratio - 1 - log_ratio) * mask).sum(),
        }
    return loss, metrics


def value_loss(values, old_values, returns, mask, clip_range_value, normalizer):
    """0.5 max((v - R)^2, (clip(v, v_old - c, v_old + c) - R)^2) summed over tokens / normalizer.

    values (B, C) with grad; old_values, returns, mask (B, C). Returns (loss, metric sums:
    "value_loss" the loss itself).
    """
    mask = mask.to(values.dtype)  # (B, C)
    # (B, C)
    v_clipped = old_values + (values - old_values).clamp(-clip_range_value, clip_range_value)
    loss_unclipped = (values - returns) ** 2  # (B, C)
    loss_clipped = (v_clipped - returns) ** 2  # (B, C)
    loss = 0.5 * (torch.max(loss_unclipped, loss_clipped) * mask).sum() / normalizer
    with torch.no_grad():
        clipped = ((loss_clipped > loss_unclipped) * mask).sum()
        metrics = {"value_loss": loss.detach(), "vf_clip": clipped}  # detached, as policy_loss's
    return loss, metrics


def needs_old_logps(args):
    """Whether the rollout policy's log-probs need a no-grad pass of their own before the update.
    The KL reward reads them before GAE, and after the first optimizer step (a second epoch or
    mini-batch) the actor is no longer the policy that sampled. One epoch of one mini-batch without
    KL is on-policy: every micro-batch's forward runs on the sampling weights, so the update's own
    forward gives them (the ratio is 1, as in GRPO with one iteration): one actor pass fewer."""
    return args.kl_coef > 0 or args.ppo_epochs > 1 or args.num_mini_batches > 1


# ---- Configuration: PPO's own fields and defaults (harness.RunArgs: the shared ones) -----------
@dataclass
class Args(harness.RunArgs):
    recipe: str = arg("", recipes.recipe_help(recipes.PPO))
    reward_model: str = arg(
        "",
        "sequence-classification reward model (1 label, the actor's tokenizer); empty: "
        "rule-based reward_funcs",
    )
    critic_from_reward_model: bool = arg(
        False, "the critic starts as --reward_model (body, score head); False: the actor's body"
    )
    prompts_per_rank: int = arg(32, "prompts per rank per step", ">= 1")
    num_generations: int = arg(4, "G, the group size: completions per prompt", ">= 1")
    kl_coef: float = arg(
        0.01,
        "KL coefficient: per-token KL penalty in the reward; 0 builds no reference model",
        ">= 0",
        aliases="--beta",
    )
    gamma: float = arg(1.0, "discount", "[0, 1]")
    lam: float = arg(0.95, "GAE lambda", "[0, 1]")
    cliprange: float = arg(0.2, "policy ratio clipped to [1 - c, 1 + c]", "(0, 1)")
    loss_type: str = arg(
        "ppo", f"policy loss, one of {POLICY_LOSSES} (cispo: cliprange caps r)", POLICY_LOSSES
    )
    entropy_coef: float = arg(0.0, "entropy bonus: policy loss -= coef x token entropy", ">= 0")
    cliprange_value: float = arg(0.2, "value clipped to old value +- this", "> 0")
    ppo_epochs: int = arg(2, "passes over each rollout batch", ">= 1")
    num_mini_batches: int = arg(1, "optimizer steps per pass (per model)", ">= 1")
    learning_rate: float = arg(2e-3, "actor LR (from scratch; ~1e-6 pretrained)", "> 0")
    critic_learning_rate: float = arg(2e-3, "critic LR (~9e-6 pretrained)", "> 0")
    per_device_train_batch_size: int = arg(
        64,
        "sequences per micro-batch (forward/backward; not TRL's completions per device per step: "
        "that is prompts_per_rank x num_generations)",
        ">= 1",
        aliases="--micro_train_batch_size",
    )
    max_steps: int = arg(
        60, "training steps (one rollout batch each); 0: evaluate the model as given", ">= 0"
    )
    eval_steps: int = arg(20, "held-out reward every this many steps (and at start/end)", ">= 0")


def parse_args(argv=None):
    """Args as given (argv, default sys.argv[1:]), checked on their own (no file read yet)."""
    args = harness.parse(Args, recipes.PPO, argv)
    if args.reward_model and args.reward_funcs:
        raise RunError("give --reward_model or --reward_funcs, not both")
    if args.reward_model and args.reward_weights:
        raise RunError(
            "--reward_weights weighs reward functions; a --reward_model's score has none"
        )
    if args.critic_from_reward_model and not args.reward_model:
        raise RunError("--critic_from_reward_model True needs a --reward_model to start from")
    return args


# this loop's ledger: one phase for every no-grad forward, the optimizer steps inside the update
PHASES = {
    "weight_sync": ("weight_sync",),
    "rollout": ("rollout",),
    "logprobs": ("old_logprobs", "ref_logprobs"),
    "update": ("update", "optimizer_step"),
}


def memory_models(args):
    """What this loop builds beside the actor, for the pre-flight's estimate and checks."""
    return {
        "reference": args.kl_coef > 0 and not args.lora_r,
        "critic": "reward_model" if args.critic_from_reward_model else True,
        "reward_model": args.reward_model,
        "mini_batches": args.num_mini_batches,
        "phases": PHASES,
    }


# ---- Rollout: generate, score, and the no-grad forwards (critic.py: the value model) ----------
def score(run, rows, completions, gens, batch, plan, reward_model):
    """Scores (B,) and, for rule-based rewards, each function's raw rewards {name: (B,)}."""
    if reward_model is None:
        return run.score(rows, completions, gens.completion_ids.shape[0] // len(rows), gens)
    out = torch.zeros(batch["input_ids"].shape[0])  # (B,)
    with torch.no_grad():
        # the reward model reads the rightmost non-pad token (the EOS or the last one)
        for idx, mb, weight in micro_batches(batch, plan):
            scores = sequence_scores(reward_model, mb, run.device)  # (b,)
            if weight:
                out[idx] = scores.cpu()
    if not torch.isfinite(out).all():
        bad = ~torch.isfinite(out)  # (B,)
        raise RewardError(
            f"--reward_model {run.args.reward_model} gave {int(bad.sum())} non-finite scores "
            f"(first: {completions[int(bad.nonzero()[0])]!r}); check the model in fp32 "
            "(--dtype fp32) or its checkpoint"
        )
    return out, {}


def rollout_scorers(actor, critic, ref, args, knobs, device):
    """{name: fn(micro-batch) -> (b, c)} for rollout_forwards: the critic's values, the actor's
    old log-probs where needs_old_logps and, with kl_coef > 0, the reference log-probs (the frozen
    reference, or the actor itself with its LoRA adapters switched off)."""

    def logps(model, mb, cut=None):
        how = dict(chunk_size=knobs.logprob_chunk_size, **(cut or {}))
        return forward_logps(model, mb, args.temperature, args.packing, device, **how)

    def ref_logps(mb):
        if ref is not None:
            return logps(ref, mb)
        with actor.module.disable_adapter():
            return logps(actor.module, mb)

    scorers = {"values": lambda mb: forward_values(critic.module, mb, args.packing, device)}
    if needs_old_logps(args):
        # --top_k, --top_p: under the sampler's cut; the cut stays for the update
        scorers["old_logps"] = lambda mb: logps(actor.module, mb, harness.sampling_cut(args))
    if args.kl_coef > 0:
        scorers["ref_logps"] = ref_logps
    return scorers


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
        if weight and "sampling_thresholds" in mb:  # the sampler's cut (batching.forward_logps)
            shape = (*batch["completion_mask"].shape, 2)  # (B, C, 2): (tau, n) per token
            cut = out.setdefault("sampling_thresholds", torch.zeros(shape))
            cut[idx, : mb["logits_to_keep"]] = mb["sampling_thresholds"]
    return out


# ---- The update ------------------------------------------------------------------------------
def mini_batch_normalizer(batch, group):
    """A mini-batch's loss denominator: its completion tokens over the real micro-batches of every
    rank (zero-weight repeats add nothing), at least 1. The one place it is computed."""
    tokens = sum(w * float(mb["completion_mask"].sum()) for _, mb, w in micro_batches(batch, group))
    (total,) = all_sum([tokens])
    return max(total, 1.0)


def update(actor, critic, batch, args, knobs, device, times, ledger=None, logps_out=None):
    """The actor and critic update for one step's batch, on every rank alike; returns the losses'
    metrics summed over micro-batches and ranks (whatever keys they return: the same on every
    rank by construction). In order:

    1. the plan: num_mini_batches groups of micro-batches (batching.mini_batch_plans: the rows of
       a mini-batch depend only on num_mini_batches, never on the micro-batch knobs), ranks
       agreeing on every count, zero-weight repeats where a rank has fewer;
    2. per mini-batch, its normaliser over all ranks (mini_batch_normalizer): each micro-batch
       loss is divided by it, so the micro-batch losses add up to the mini-batch loss however it
       is split; DeepSpeed's division by gradient_accumulation_steps is off and its average over
       ranks undone (the world size), as in grpo.update;
    3. ppo_epochs passes, each: every mini-batch's micro-batches forward/backward (actor: clipped
       policy loss, critic: clipped value loss), then ONE optimizer step per model;
    4. the metrics summed over ranks: the losses ("*_loss") as the mean over mini-batch updates,
       token sums, and "skipped" (> 0: DeepSpeed refused a non-finite optimizer step).
    With a ledger, the whole of it is its "update" phase; seconds per model and pass are added to
    times. Without batch["old_logps"] (on-policy: needs_old_logps), each forward's own log-probs,
    detached, are the old ones. logps_out (B, C): filled with the first epoch's log-probs.
    """
    world = actor.dp_world_size
    micro, tokens = knobs.per_device_train_batch_size, knobs.max_tokens_per_microbatch
    groups = mini_batch_plans(batch, args.num_mini_batches, micro, tokens)
    sums, n_updates = {"skipped": 0.0}, args.ppo_epochs * len(groups)
    phase = ledger.phase if ledger else lambda name: nullcontext()
    with phase("update"):
        for epoch in range(args.ppo_epochs):
            for group in groups:
                normalizer = mini_batch_normalizer(batch, group)
                for i, (idx, mb, weight) in enumerate(micro_batches(batch, group)):
                    last = i == len(group) - 1
                    metrics, logps = train_micro_batch(
                        actor,
                        critic,
                        mb,
                        weight * world,
                        last,
                        normalizer,
                        args,
                        knobs,
                        device,
                        times,
                    )
                    if weight and logps_out is not None and epoch == 0:
                        logps_out[idx, : mb["logits_to_keep"]] = logps.float().cpu()
                    for k, v in metrics.items():  # a repeat's keys too, adding nothing
                        v = v / n_updates if k.endswith("_loss") else v  # the mean update's
                        sums[k] = sums.get(k, 0.0) + (float(v) if weight else 0.0)
                with timed(times, "optimizer"):
                    actor.step()
                    critic.step()
                # DeepSpeed refused a non-finite step (alike on every rank): counted once per rank
                sums["skipped"] += (not actor.was_step_applied()) + (not critic.was_step_applied())
    return all_sum_dict(sums)


def train_micro_batch(actor, critic, mb, scale, boundary, normalizer, args, knobs, device, times):
    """One micro-batch's forward and backward through both engines, its losses scaled by `scale`
    (the world size, or 0 for a zero-weight repeat); `boundary`: the mini-batch's last, where the
    optimizer step follows. Returns its metric sums and the actor's log-probs (b, c), detached."""
    mask = mb["completion_mask"].to(device)  # (b, c)
    # through the engines' forward: ZeRO-3 counts micro-steps there (see grpo.py)
    actor.set_gradient_accumulation_boundary(boundary)
    with timed(times, "actor_forward"):
        # --top_k, --top_p: under the sampler's cut, where the old pass cut (else found here)
        kw = dict(return_entropy=True, chunk_size=knobs.logprob_chunk_size)
        kw.update(harness.sampling_cut(args))
        logps, entropy = forward_logps(
            actor, mb, args.temperature, args.packing, device, **kw
        )  # (b, c)
        # on-policy (no old_logps): this forward, detached, is the old policy: the ratio is 1
        pl, pm = policy_loss(loss_inputs(mb, logps, entropy, device), args, normalizer)
    with timed(times, "actor_backward"):
        actor.backward(pl * scale, scale_wrt_gas=False)
    critic.set_gradient_accumulation_boundary(boundary)
    with timed(times, "critic_forward"):
        values = forward_values(critic, mb, args.packing, device)  # (b, c)
        old_values, returns = mb["values"].to(device), mb["returns"].to(device)
        vl, vm = value_loss(values, old_values, returns, mask, args.cliprange_value, normalizer)
    with timed(times, "critic_backward"):
        critic.backward(vl * scale, scale_wrt_gas=False)
    return {**pm, **vm}, logps.detach()


# ---- The loop --------------------------------------------------------------------------------
def main(argv=None):
    args = parse_args(argv)
    if args.estimate_memory or args.preflight:  # one process, before any rank begins
        return harness.before_torchrun(args, memory_models(args))
    run = harness.Run(args, memory_models(args))  # process group, every input checked
    actor = run.load()
    rm_path = args.reward_model
    critic_path = rm_path if args.critic_from_reward_model else run.model_path
    critic = build_critic(
        critic_path,
        args.critic_from_reward_model,
        run.dtype,
        attn_implementation_for(critic_path, args.attn_implementation),
        ds_config=run.ds_config if args.partitioned_loading and run.stage == 3 else None,
    )  # the actor's body and a zero value head, or the reward model's body and head
    run.long_sequence_knobs(critic.body)  # checkpointing, offload, tiling as the actor
    if args.lora_r:  # adapters on the actor and on the critic's body (its value head trains)
        actor = run.lora(actor)
        critic.body = run.lora(critic.body, "FEATURE_EXTRACTION")
    engine = run.train_engine(actor, args.learning_rate)
    critic_engine = run.train_engine(critic, args.critic_learning_rate)
    ref = run.frozen(run.load(frozen=True)) if memory_models(args)["reference"] else None
    reward_model = None
    if rm_path:
        rm = run.load(rm_path, AutoModelForSequenceClassification, frozen=True, num_labels=1)
        reward_model = run.frozen(rm)
    vllm = run.vllm_engine()
    answered = all(r.get("answer") is not None for r in run.eval_rows)
    rule = reward_functions("", "", args.data) if rm_path and answered else None

    def eval_sample(rows):  # --eval_samples completions per held-out prompt
        prompt_ids, k = run.encode(rows), args.eval_samples
        gens = run.generate(prompt_ids, k)
        completions = run.tokenizer.batch_decode(gens.completion_ids, skip_special_tokens=True)
        batch = make_batch(prompt_ids, gens, run.tokenizer.pad_token_id)
        plan = plan_micro_batches(batch, run.knobs.per_device_train_batch_size)
        total, per_func = score(run, rows, completions, gens, batch, plan, reward_model)
        if rule:  # eval/accuracy by the task's own rule beside the reward model's eval/reward
            per_func = score_completions(*rule, rows, completions, k)[1]
        return total, per_func

    run.start(__file__, {"actor": engine, "critic": critic_engine}, vllm, eval_sample)
    scorers = rollout_scorers(engine, critic_engine, ref, args, run.knobs, run.device)
    G, N = args.num_generations, args.prompts_per_rank
    for step in run.steps():
        # 1. rollout and scores
        rows = batch_rows(run.train_rows, step, N * run.data_world, args.seed)
        rows = rows[run.data_rank * N : (run.data_rank + 1) * N]
        prompt_ids = run.encode(rows)
        if vllm is not None:
            with run.ledger.phase("weight_sync"):
                vllm.sync_weights(engine)  # wakes it: weights, then its KV cache
        with run.ledger.phase("rollout"):
            gens = run.generate(prompt_ids, G)
            if vllm is not None:
                vllm.sleep()  # colocated, GPU: its weights and KV cache freed
            completions = run.tokenizer.batch_decode(gens.completion_ids, skip_special_tokens=True)
            batch = make_batch(prompt_ids, gens, run.tokenizer.pad_token_id)
            knobs = run.knobs
            plan = plan_micro_batches(
                batch, knobs.per_device_train_batch_size, knobs.max_tokens_per_microbatch
            )
            # scores (B,)
            scores, per_func = score(run, rows, completions, gens, batch, plan, reward_model)
        t_rollout = time.time() - run.t0

        # 2. old log-probs, reference log-probs, values: no grad, micro-batch by micro-batch
        times = {}  # seconds per model and pass this step: time/* in metrics.jsonl
        with run.ledger.phase("logprobs"):
            batch.update(rollout_forwards(scorers, batch, plan, times))

        # 3. per-token rewards, GAE, whitened advantages; their metrics, means per token
        mask = batch["completion_mask"]  # (B, C)
        rewards, kl = token_rewards(
            batch.get("old_logps"), batch.get("ref_logps"), mask, scores, args.kl_coef
        )  # (B, C)
        advantages, batch["returns"] = gae(
            rewards, batch["values"] * mask, mask, args.gamma, args.lam
        )  # (B, C)
        batch["advantages"] = masked_whiten(advantages, mask)  # (B, C)
        per_token = {"kl": kl, "value_mean": batch["values"], "return_mean": batch["returns"]}
        extra = token_means(per_token, mask)  # every rank's tokens; the row shows them

        # 4. update: ppo_epochs x mini-batches, micro-batches with accumulation; without an old
        # log-prob pass, its first forward is the trainer's side of the sampler check
        trainer = None if vllm is None or "old_logps" in batch else torch.zeros(mask.shape)
        t1 = time.time()
        totals = update(
            engine, critic_engine, batch, args, knobs, run.device, times, run.ledger, trainer
        )
        t_update = time.time() - t1

        # 5. the step's row (and samples), the held-out score when due, a checkpoint when due
        run.log_completions(prompt_ids, gens, scores, per_func)
        losses = {k: v for k, v in totals.items() if k not in ("tokens", "skipped")}
        norms = [e.get_global_grad_norm() for e in (engine, critic_engine)]
        norms = None if None in norms else max(float(n) for n in norms)  # non-finite if either is
        # (world * B, 2 + F), every rank's sequences: score, completion length, each function
        seq = all_cat(torch.stack([scores, mask.sum(1).float(), *per_func.values()], 1))
        row = {
            "step": step + 1,
            **reward_stats(seq, list(per_func)),
            **extra,
            # the losses' metrics: a loss as it is, every other sum as its mean per token
            **{k: v if k.endswith("_loss") else v / totals["tokens"] for k, v in losses.items()},
            "lr": engine.get_lr()[0],
            "grad_norm_max": norms,
            "rollout_s": t_rollout,
            "update_s": t_update,
            **{f"time/{k}": v for k, v in times.items()},
        }
        if vllm is not None:  # vLLM sampled these tokens: does it hold the trainer's weights?
            row.update(sampler_logp_gap(batch.get("old_logps", trainer), gens))
        loss = totals["policy_loss"] + totals["value_loss"]
        line = f"reward {row['reward']:.3f} kl {row['kl']:.4f} value_loss {row['value_loss']:.4f}"
        line += f" entropy {row['entropy']:.2f} clip {row['clip']:.3f}"
        run.end_step(row, loss=loss, grad_norm=norms, skipped=totals["skipped"] > 0, line=line)

    # curves.png: the score, the value loss, then KL to the reference (kl_coef > 0) or the entropy
    train, held = ("reward", "train", "-"), ("eval/reward", "held-out", "o-")
    right = ("KL to reference", "kl") if args.kl_coef > 0 else ("entropy (nats/token)", "entropy")
    panels = [("score", [train, held]), ("value loss", [("value_loss", "critic", "-")])]
    panels.append((right[0], [(right[1], "train", "-")]))
    run.finish(panels)


if __name__ == "__main__":
    exit_process(entry_code(main))  # a known failure: one message and its exit code (exits.py)

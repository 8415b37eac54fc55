"""torchrun worker (2 ranks): GRPO accumulation equivalence on real DeepSpeed (docs/accumulation.md,
"Accumulation never changes the update").

The whole batch is 8 completions, 4 per rank. For ZeRO-2 and ZeRO-3, every loss_type, and
micro-batch x accumulation = (4, 1), (2, 2), (1, 4) and a token budget (uneven micro-batch counts
across ranks), padded or packed (--packing), grpo.update's loss (with grpo.py's own Args) must
equal the full-batch loss and its SGD(lr=1) update minus the gradient of it, computed on one plain
model. With a keep mask (ZeRO-3; ranks dropping different numbers of groups, one rank all of its
own, every row), the update equals the full-batch update of the kept rows; dropping every row
changes nothing. Distillation's (B, C) advantages with masked importance weights (token and
sequence level) under ZeRO-3 equal the full-batch update too. With --entropy_coef (ZeRO-3, padded
and packed), the gradient of the fused entropy equals that of the full logits' entropy.
--advantage_estimator on 2 ranks: each rank's advantages equal the full batch's (reinforce_pp
whitens over both ranks' kept rows), and the update with them equals the full-batch update. And
dapo.dynamic_sampling on 2 ranks: ranks sample extra rounds in lockstep up to the cap, a rank left
short marks its filler groups keep False, the stats are summed over ranks.
Usage: torchrun --nproc_per_node 2 tests/dist_grpo_accum.py MODEL_DIR TMP_DIR
"""

import sys

import deepspeed
import torch
import torch.distributed as dist
from test_grpo import naive_estimate  # every estimator's naive loop, in one table
from transformers import AutoModelForCausalLM

from batching import loss_inputs
from dapo import dynamic_sampling
from exits import exit_process
from fit import Knobs
from generation import Generations
from grpo import (
    ADVANTAGE_ESTIMATORS,
    ESTIMATOR_SCALES,
    LOSS_TYPES,
    batch_stats,
    estimate_advantages,
    grpo_loss,
    loss_normalizer,
    micro_plan,
    parse_args,
    update,
)
from vllm_is import sampler_weights
from zero3_utils import all_cat, gathered

model_dir = sys.argv[1]
deepspeed.init_distributed(dist_backend="gloo")
rank, world = dist.get_rank(), dist.get_world_size()
assert world == 2
torch.manual_seed(0)

# One fixed batch: left-padded prompts of different lengths, completions of different lengths.
B, P, C, V = 8, 6, 5, 40
prompt_len = torch.tensor([3, 6, 4, 5, 6, 2, 3, 6])
comp_len = torch.tensor([5, 1, 3, 2, 5, 4, 1, 3])
ids = torch.randint(4, V, (B, P + C))
am = torch.cat(
    [(torch.arange(P)[None] >= P - prompt_len[:, None]), torch.arange(C)[None] < comp_len[:, None]],
    1,
).long()
ids = ids.masked_fill(am == 0, 0)
cmask = am[:, P:]


def plain_logps(model, entropy=False):
    pos = (am.cumsum(1) - 1).clamp(min=0)
    logits = (
        model(input_ids=ids, attention_mask=am, position_ids=pos).logits[:, P - 1 : -1].float()
    )  # (B, C, V)
    lsm = logits.log_softmax(-1)  # (B, C, V)
    logps = lsm.gather(-1, ids[:, P:, None]).squeeze(-1)  # (B, C)
    return (logps, -(lsm.exp() * lsm).sum(-1)) if entropy else logps  # entropy (B, C)


ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
with torch.no_grad():
    base = plain_logps(ref_model)
# a previous iteration's policy: ratios leave 1, clipping acts
old_logps = base + 0.3 * torch.randn(B, C)
ref_logps = base + 0.3 * torch.randn(B, C)
advantages = torch.randn(B)


def grpo_args(loss_type, micro, budget, packing, extra=()):
    """grpo.py's own Args: 2 prompts x 2 completions = 4 rows per rank; extra: more flags."""
    argv = ["--prompts_per_rank", "2", "--num_generations", "2", "--loss_type", loss_type]
    argv += ["--beta", "0.04", "--epsilon_high", "0.28", "--max_completion_length", str(C)]
    argv += ["--per_device_train_batch_size", str(micro), "--packing", str(packing)]
    return parse_args(argv + ["--max_tokens_per_microbatch", str(budget), *extra])


def reference(loss_type, kept, coef=0.0, adv=None, is_w=None):
    """Loss, normaliser and gradient of the full batch's kept rows on one plain model; coef > 0:
    with an entropy bonus, the entropy of the full logits; adv: other advantages ((B,) or (B, C));
    is_w: (B, C) importance weights."""
    adv = advantages if adv is None else adv
    ref_model.zero_grad()
    norm = loss_normalizer(cmask[kept], loss_type, C)
    logps, entropy = plain_logps(ref_model, entropy=True)
    mb = {"completion_mask": cmask, "old_logps": old_logps, "ref_logps": ref_logps}
    mb.update(advantages=adv, is_weights=is_w)
    mb = {k: None if v is None else v[kept] for k, v in mb.items()}
    t = loss_inputs(mb, logps[kept], entropy[kept], "cpu")
    args = grpo_args(loss_type, 1, 0, False, ["--entropy_coef", str(coef)])
    loss, _ = grpo_loss(t, args, {"normalizer": norm})
    loss.backward()
    return loss.detach(), norm, {n: p.grad.clone() for n, p in ref_model.named_parameters()}


def check(label, stage, args, keep, want_loss, want_norm, want, atol=1e-7, inputs=None):
    """grpo.update on 2 ranks (rows 4 * rank ... + 3 each) against the reference; inputs: (B, ...)
    tensors that replace or join the batch's (advantages, is_weights)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = {
        "train_micro_batch_size_per_gpu": Knobs.given(args).per_device_train_batch_size,
        "gradient_accumulation_steps": 4 // Knobs.given(args).per_device_train_batch_size,
        "train_batch_size": 8,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config=config
    )
    mine = slice(4 * rank, 4 * rank + 4)
    batch = {
        "input_ids": ids[mine],
        "attention_mask": am[mine],
        "completion_mask": cmask[mine],
        "advantages": advantages[mine],
        "old_logps": old_logps[mine],
        "ref_logps": ref_logps[mine],
        "keep": None if keep is None else keep[mine],
        **{k: v[mine] for k, v in (inputs or {}).items()},
    }
    label = f"{args.loss_type} zero{stage} {label}"
    plan = micro_plan(batch, args, Knobs.given(args))
    got_norm = batch_stats(batch, plan, args)["normalizer"]
    if got_norm != want_norm:
        failures.append(f"{label}: normaliser {got_norm} != {want_norm}")
    totals = update(engine, batch, args, Knobs.given(args), torch.device("cpu"))
    kept = 8 if keep is None else int(keep.sum())
    if totals["rows"] != kept or totals["updated"] != float(kept > 0):
        failures.append(f"{label}: rows {totals['rows']} updated {totals['updated']}")
    got_loss = torch.tensor(totals["sums"].get("loss", 0.0))  # over ranks: the full-batch loss
    if not torch.allclose(got_loss, want_loss, rtol=1e-5, atol=1e-7):
        failures.append(f"{label}: loss {got_loss.item():.8g} != {want_loss.item():.8g}")
    with gathered(engine.module):
        for n, p in engine.module.named_parameters():
            got = before[n] - p.detach()  # SGD(lr=1): the applied gradient
            if not torch.allclose(got, want[n], rtol=1e-4, atol=atol):
                failures.append(
                    f"{label} {n}: max err {(got - want[n]).abs().max():.3g} (grad max "
                    f"{want[n].abs().max():.3g})"
                )
    if args.max_tokens_per_microbatch and rank == 0:
        print(f"{label}: micro-batch sizes {[None if i is None else len(i) for i in plan]}")
    engine.destroy()


# (micro-batch size, token budget, packing): packed micro-batches (one row, positions restarting
# per sequence, batching.pack) give the same loss and update as padded ones
CONFIGS = ((4, 0, False), (2, 0, False), (1, 0, False), (4, 22, False), (2, 0, True), (4, 22, True))
# rows kept (groups of 2; rank 0 holds rows 0-3, rank 1 rows 4-7): ranks dropping different
# numbers of groups, all of rank 1's, and every row (then no update happens at all)
KEEPS = {
    "rank 1 drops 1 group": [1, 1, 1, 1, 1, 1, 0, 0],
    "rank 0 drops 1, rank 1 all": [0, 0, 1, 1, 0, 0, 0, 0],
    "all dropped": [0] * 8,
}

failures = []
for loss_type in LOSS_TYPES:
    # the reference: full batch, one plain model, one backward
    loss, norm, want = reference(loss_type, torch.ones(B, dtype=torch.bool))
    for stage in (2, 3):
        for micro, budget, packing in CONFIGS:
            args = grpo_args(loss_type, micro, budget, packing)
            check(
                f"micro={micro} budget={budget} packing={packing}",
                stage,
                args,
                None,
                loss,
                norm,
                want,
            )
    for name, keep in KEEPS.items():
        keep = torch.tensor(keep, dtype=torch.bool)
        if keep.any():
            loss, norm, want = reference(loss_type, keep)
        else:  # no update: the weights stay as they are
            loss, norm = torch.tensor(0.0), 0.0
            want = {n: torch.zeros_like(p) for n, p in ref_model.named_parameters()}
        for micro, budget in ((1, 0), (4, 22)):
            args = grpo_args(loss_type, micro, budget, False)
            # atol 1e-6: the kept rows' embedding gradients add up in another order than in the
            # reference (3e-7 measured against a largest entry of 0.5); a wrong keep mask or
            # normaliser is off by the size of the gradient itself
            label = f"{name} micro={micro} budget={budget}"
            check(label, 3, args, keep, loss, norm, want, atol=1e-6)

# --entropy_coef: the fused entropy's gradient (logprobs.py) under ZeRO-3 with accumulation, padded
# or packed, equals the full logits' entropy gradient
loss, norm, want = reference("bnpo", torch.ones(B, dtype=torch.bool), coef=0.05)
for micro, budget, packing in ((1, 0, False), (4, 22, True)):
    args = grpo_args("bnpo", micro, budget, packing, ["--entropy_coef", "0.05"])
    check(
        f"entropy micro={micro} budget={budget} packing={packing}", 3, args, None, loss, norm, want
    )

# Per-token inputs: on-policy distillation's (B, C) advantages and masked importance weights
# (vllm_is.sampler_weights: tokens and whole sequences outside the band weigh 0), ZeRO-3, padded and
# packed, one micro-batch per row or a token budget: the update equals the full-batch update
gen = torch.Generator().manual_seed(5)
per_token = advantages[:, None] + 0.5 * torch.randn(B, C, generator=gen)  # (B, C)
sampler = old_logps - 0.4 * torch.randn(B, C, generator=gen)  # (B, C)
for mode in ("token_mask", "sequence_mask"):
    is_w = sampler_weights(old_logps, sampler, cmask, mode, 1.5, 0.6)  # (B, C)
    assert (is_w * cmask == 0).sum() > (cmask == 0).sum() and (is_w > 0).any()  # some masked
    loss, norm, want = reference("bnpo", torch.ones(B, dtype=torch.bool), adv=per_token, is_w=is_w)
    for micro, budget, packing in ((1, 0, False), (4, 22, True)):
        args = grpo_args("bnpo", micro, budget, packing)
        inputs = {"advantages": per_token, "is_weights": is_w}
        label = f"(B, C) advantages, {mode} micro={micro} budget={budget} packing={packing}"
        check(label, 3, args, None, loss, norm, want, inputs=inputs)

# --advantage_estimator on 2 ranks, groups of 2, rank 1 dropping a group, completions of different
# lengths: each estimator at its own --scale_rewards against its naive loop over the full batch
# (test_grpo.naive_estimate: reinforce_pp whitens over the kept rows of both ranks, a collective,
# so each rank's half equals the full batch's whitening); the update with them equals the
# full-batch update
mine = slice(4 * rank, 4 * rank + 4)
rewards = torch.rand(B, generator=torch.Generator().manual_seed(3))
keep = torch.tensor(KEEPS["rank 1 drops 1 group"], dtype=torch.bool)
for est in ADVANTAGE_ESTIMATORS:
    args = grpo_args("bnpo", 1, 0, False, ["--advantage_estimator", est])
    half = {"input_ids": ids[mine], "completion_mask": cmask[mine], "rewards": rewards[mine]}
    got = estimate_advantages({**half, "keep": keep[mine]}, args)  # (4,)
    how = (keep.tolist(), 2, est, ESTIMATOR_SCALES[est])
    want_adv = torch.tensor(naive_estimate(rewards.tolist(), comp_len.tolist(), *how))  # (B,)
    if not torch.allclose(got.double(), want_adv[mine].double(), atol=1e-6):
        failures.append(f"{est}: advantages {got.tolist()} != {want_adv[mine].tolist()}")
    if est != "grpo":  # every rank's advantages, as computed on 2 ranks
        advantages = all_cat(got[:, None])[:, 0]  # (B,)
        loss, norm, want = reference("bnpo", keep)
        check(f"{est} micro=1", 3, args, keep, loss, norm, want)


def synthetic(group_rewards):
    """A sample_groups() result without a model: groups of 2 completions with these rewards."""
    n = len(group_rewards)
    ids = torch.arange(n * 2 * 3).view(n * 2, 3) % 7 + 4  # (n * G, 3)
    rewards = torch.tensor([r for g in group_rewards for r in g], dtype=torch.float32)
    gens = Generations(ids, torch.ones_like(ids))
    return {
        "prompt_ids": [[5, g] for g in range(n)],
        "gens": gens,
        "rewards": rewards,
        "per_func": {},
    }


# dynamic sampling on 2 ranks: rank 0 keeps 1 of its 2 first groups and finds spread in every
# extra round, rank 1 never does; both ranks sample in lockstep until the cap
args = parse_args(
    ["--prompts_per_rank", "2", "--num_generations", "2", "--dynamic_sampling", "True"]
    + ["--max_dynamic_sampling_rounds", "2"]
)
calls = []


def sample_more(round_, n):
    calls.append((round_, n))
    return synthetic([[0.0, 1.0] if rank == 0 else [0.5, 0.5]] * n)


first = synthetic([[0.0, 1.0], [1.0, 1.0]] if rank == 0 else [[1.0, 1.0], [0.0, 0.0]])
sample, keep, stats = dynamic_sampling(first, sample_more, args, 0)
want_keep = [True] * 4 if rank == 0 else [False] * 4
if calls != [(1, 2), (2, 2)] or keep.tolist() != want_keep or len(sample["prompt_ids"]) != 2:
    failures.append(f"dynamic sampling rank {rank}: calls {calls}, keep {keep.tolist()}")
want_stats = {"dynamic/groups_dropped": 7.0, "dynamic/extra_rounds": 2, "dynamic/groups_short": 2.0}
if stats != want_stats:
    failures.append(f"dynamic sampling rank {rank}: {stats} != {want_stats}")
if rank == 0 and sample["rewards"].view(2, 2).std(1).min() == 0:
    failures.append("dynamic sampling kept a group without reward spread")

if failures:
    print("\n".join(failures[:20]))
    sys.exit(1)
print(f"rank {rank}: accumulation equivalence OK")
dist.destroy_process_group()
# Skip the interpreter's teardown, as the loops do: DeepSpeed's leftover gloo threads can abort a
# finished rank there (exits.exit_process).
exit_process(0)

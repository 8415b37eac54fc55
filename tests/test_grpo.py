"""grpo.py's pure functions against naive per-sequence loops, and accumulation equivalence."""

import dataclasses
import json
import math
import os

import pytest
import torch

import harness
from batching import loss_inputs
from conftest import torchrun
from fit import Knobs
from grpo import (
    ADVANTAGE_ESTIMATORS,
    ESTIMATOR_SCALES,
    LOSS_TYPES,
    estimate_advantages,
    group_advantages,
    grpo_loss,
    loss_normalizer,
    parse_args,
)
from vllm_is import VLLM_IMPORTANCE_MODES, sampler_weights

HERE = os.path.dirname(os.path.abspath(__file__))


def loss_of(lp, old, ref, adv, mask, flags=(), weights=None, entropy=None, normalizer=None):
    """grpo_loss as train_on_batch calls it: a micro-batch's tensors through batching.loss_inputs
    (old None: on-policy, the current log-probs detached), the coefficients from grpo.py's own
    Args (flags: its command line), the normaliser of these rows alone unless given."""
    args = parse_args([str(f) for f in flags])
    mb = {"completion_mask": mask, "old_logps": old, "ref_logps": ref, "advantages": adv}
    mb["is_weights"] = weights
    entropy = torch.zeros_like(lp) if entropy is None else entropy
    t = loss_inputs(mb, lp, entropy, torch.device("cpu"))
    if normalizer is None:
        normalizer = loss_normalizer(mask, args.loss_type, mask.shape[1])
    return grpo_loss(t, args, {"normalizer": normalizer})


def clip_flags(beta, el, eh, loss_type):
    return ["--beta", beta, "--epsilon_low", el, "--epsilon_high", eh, "--loss_type", loss_type]


def naive_advantages(rewards, G, scale, eps=1e-4):
    out = []
    for start in range(0, len(rewards), G):
        group = rewards[start : start + G]
        mean = sum(group) / G
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (G - 1)) if G > 1 else 0.0
        out += [(r - mean) / (std + eps) if scale else r - mean for r in group]
    return out


@pytest.mark.parametrize("scale", [True, False])
@pytest.mark.parametrize("G", [1, 2, 4])
def test_group_advantages(scale, G):
    torch.manual_seed(0)
    rewards = torch.rand(3 * G, dtype=torch.float64)
    rewards[:G] = 0.5  # a group with no spread gets zero advantage, not NaN
    got = group_advantages(rewards, G, scale=scale)
    want = torch.tensor(naive_advantages(rewards.tolist(), G, scale), dtype=torch.float64)
    torch.testing.assert_close(got, want)
    assert torch.all(got[:G] == 0)
    with pytest.raises(ValueError, match="num_generations"):
        group_advantages(torch.rand(5), 2, scale=scale)


def naive_estimate(rewards, lengths, keep, G, estimator, scale):
    """grpo: naive_advantages; rloo: r_i minus the mean of the group's others; reinforce_pp: r
    minus the group mean, then (x - mean) / (unbiased std + 1e-4) over the kept rows. Lists of
    the batch's rows: rewards, lengths (each completion's loss tokens), keep (bool)."""
    if estimator == "grpo":
        return naive_advantages(rewards, G, scale)
    out = []
    for start in range(0, len(rewards), G):
        group = rewards[start : start + G]
        for i, r in enumerate(group):
            others = group[:i] + group[i + 1 :]
            out.append(r - sum(others) / (G - 1) if estimator == "rloo" else r - sum(group) / G)
    if estimator == "reinforce_pp":
        kept = [a for a, k in zip(out, keep) if k]
        mean = sum(kept) / len(kept)
        std = math.sqrt(sum((a - mean) ** 2 for a in kept) / (len(kept) - 1))
        out = [(a - mean) / (std + 1e-4) for a in out]
    return out


def estimator_batch(rewards, lengths, keep, C=6):
    """What grpo.estimate_advantages reads of to_batch's batch: rewards (B,), completions of
    `lengths` tokens (completion_mask (B, C)), the keep mask (B,)."""
    mask = (torch.arange(C)[None] < torch.as_tensor(lengths)[:, None]).long()  # (B, C)
    return {"input_ids": mask, "completion_mask": mask, "rewards": rewards, "keep": keep}


@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS)
@pytest.mark.parametrize("G", [2, 4])
@pytest.mark.parametrize("dropped", [False, True])
def test_estimate_advantages_matches_naive(estimator, G, dropped):
    """--advantage_estimator, each at its own --scale_rewards against its naive loop on a batch
    with completions of different lengths; reinforce_pp's statistics count only the rows the
    update keeps (one process: all_sum is this rank's own)."""
    torch.manual_seed(1)
    rewards = torch.rand(3 * G, dtype=torch.float64) * 3
    lengths = torch.randint(1, 7, (3 * G,))
    keep = torch.ones(3 * G, dtype=torch.bool)
    if dropped:
        keep[G : 2 * G] = False
    args = parse_args(["--advantage_estimator", estimator, "--num_generations", str(G)])
    got = estimate_advantages(estimator_batch(rewards, lengths, keep), args)
    scale = ESTIMATOR_SCALES[estimator]
    want = naive_estimate(rewards.tolist(), lengths.tolist(), keep.tolist(), G, estimator, scale)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64))
    if estimator == "reinforce_pp":  # whitened: mean 0 and std 1 over the kept rows
        assert abs(got[keep].mean().item()) < 1e-9
        assert got[keep].std().item() == pytest.approx(1.0, rel=1e-3)
    past_the_choices = dataclasses.replace(args, advantage_estimator="ppo")  # its own refusal
    with pytest.raises(ValueError, match="estimator"):
        estimate_advantages(estimator_batch(rewards, lengths, keep), past_the_choices)


def clip_term(r, a, lp, el, eh):
    """The clipped surrogate of one token (grpo, bnpo, dr_grpo): ratio r, advantage a."""
    return -torch.min(r * a, r.clamp(1 - el, 1 + eh) * a)


def cispo_term(r, a, lp, el, eh):
    """CISPO (MiniMax-M1): the capped ratio, a constant, weighs the token's log-prob lp."""
    return -r.clamp(max=1 + eh).detach() * a * lp


# Each loss type's naive reference, in this one table: its per-token term, whether a sequence's
# tokens are averaged first (grpo) or summed, and the denominator from (sequences, tokens, C).
NAIVE = {
    "grpo": (clip_term, True, lambda seqs, tokens, C: seqs),
    "bnpo": (clip_term, False, lambda seqs, tokens, C: tokens),
    "dr_grpo": (clip_term, False, lambda seqs, tokens, C: seqs * C),
    "cispo": (cispo_term, False, lambda seqs, tokens, C: tokens),
}


def test_every_loss_type_has_a_naive_reference():
    assert set(NAIVE) == set(LOSS_TYPES)


def naive_loss(logps, old, ref, adv, mask, beta, el, eh, loss_type, C, **kw):
    """Token by token, sequence by sequence, on 0-d tensors (so gradients compare too). kw:
    is_w (B, C) importance weights, ent (B, C) entropies with coef, level "sequence" (GSPO,
    Zheng et al. 2025: s_i = exp(mean over its tokens of logp - old), shared by its tokens)."""
    term, seq_mean, denom = NAIVE[loss_type]
    is_w, ent, coef = kw.get("is_w"), kw.get("ent"), kw.get("coef", 0.0)
    total, tokens = 0.0, 0
    for i in range(len(logps)):
        toks = [t for t in range(len(logps[i])) if mask[i][t]]
        s = torch.exp(sum(logps[i][t] - old[i][t] for t in toks) / max(len(toks), 1))
        seq_sum = 0.0
        for t in toks:
            r = s if kw.get("level") == "sequence" else torch.exp(logps[i][t] - old[i][t])
            tok = term(r, adv[i], logps[i][t], el, eh)
            if is_w is not None:
                tok = tok * is_w[i][t]
            if beta > 0:
                d = ref[i][t] - logps[i][t]
                tok = tok + beta * (torch.exp(d) - d - 1)
            if coef:
                tok = tok - coef * ent[i][t]
            seq_sum = seq_sum + tok
        tokens += len(toks)
        total = total + (seq_sum / max(len(toks), 1) if seq_mean else seq_sum)
    return total / denom(len(logps), tokens, C)


def make_batch(B=6, C=5, seed=0, iterations=2):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, C, generator=g, dtype=torch.float64) * 3
    # num_iterations > 1: the old policy differs, so ratios leave 1 and clipping acts
    old = logps + (torch.rand(B, C, generator=g, dtype=torch.float64) - 0.5) * (
        0.8 if iterations > 1 else 0
    )
    ref = logps + (torch.rand(B, C, generator=g, dtype=torch.float64) - 0.5)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, C + 1, (B,), generator=g)
    mask = (torch.arange(C)[None] < lengths[:, None]).long()
    return logps, old, ref, adv, mask


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("clip", [(0.2, 0.2), (0.1, 0.3)])
@pytest.mark.parametrize("iterations", [1, 2])
@pytest.mark.parametrize("coef", [0.0, 0.05])
def test_grpo_loss_matches_naive(loss_type, beta, clip, iterations, coef):
    """Loss and gradient (through the log-probs and, with --entropy_coef, the entropies)."""
    logps, old, ref, adv, mask = make_batch(iterations=iterations)
    ent = torch.rand_like(logps) * 2
    C = logps.shape[1]
    el, eh = clip
    naive_lp, naive_ent = logps.clone().requires_grad_(True), ent.clone().requires_grad_(True)
    want = naive_loss(
        naive_lp, old, ref, adv, mask.tolist(), beta, el, eh, loss_type, C, ent=naive_ent, coef=coef
    )
    want.backward()
    lp, en = logps.clone().requires_grad_(True), ent.clone().requires_grad_(True)
    flags = clip_flags(beta, el, eh, loss_type) + ["--entropy_coef", coef]
    old_, ref_ = old if iterations > 1 else None, ref if beta else None
    loss, metrics = loss_of(lp, old_, ref_, adv, mask, flags, entropy=en)
    assert loss.item() == pytest.approx(want.item(), rel=1e-10, abs=1e-12)
    assert metrics["tokens"].item() == mask.sum().item()
    if iterations > 1:  # with these ratios some tokens clip on each side
        assert metrics["clip_low"].item() + metrics["clip_high"].item() > 0
    loss.backward()
    torch.testing.assert_close(lp.grad, naive_lp.grad, rtol=1e-9, atol=1e-12)
    assert torch.all(lp.grad[mask == 0] == 0)  # the gradient reaches only unmasked tokens
    if coef:
        torch.testing.assert_close(en.grad, naive_ent.grad, rtol=1e-9, atol=1e-12)
    else:  # no bonus: the entropies get no gradient at all (their backward is skipped)
        assert en.grad is None


def test_cispo_keeps_every_tokens_gradient():
    """CISPO's ratio only weighs the score function: with ratios outside the band every token
    still gets a gradient (the clipped loss zeroes some); clip_high counts the capped weights
    whatever the advantage's sign, clip_low stays 0 (no lower cap)."""
    logps, old, ref, adv, mask = make_batch(iterations=2)
    ratio = torch.exp(logps - old)
    grads = {}
    for loss_type in ("bnpo", "cispo"):
        lp = logps.clone().requires_grad_(True)
        flags = clip_flags(0.0, 0.2, 0.2, loss_type)
        loss, metrics = loss_of(lp, old, None, adv, mask, flags, normalizer=1.0)
        loss.backward()
        grads[loss_type] = lp.grad
    on = mask.bool()
    assert (grads["bnpo"][on] == 0).any() and (grads["cispo"][on] != 0).all()
    assert metrics["clip_low"].item() == 0
    assert metrics["clip_high"].item() == ((ratio > 1.2) & on).sum().item() > 0
    # where the ratio stays inside the band, the gradients are the clipped loss's
    inside = on & (ratio < 1.2) & (ratio > 0.8)
    torch.testing.assert_close(grads["cispo"][inside], grads["bnpo"][inside])


@pytest.mark.parametrize("mode", VLLM_IMPORTANCE_MODES)
def test_sampler_weights_match_naive(mode):
    """Each --vllm_importance_mode against a loop over tokens: r per token or the product over the
    sequence's tokens; truncate clamps r to [low, cap], mask zeroes it outside. A sequence whose
    product overflows (row 4) is capped or masked, never NaN; a masked token trains nothing."""
    g = torch.Generator().manual_seed(0)
    B, C, cap, low = 5, 6, 2.0, 0.5
    sampler = -3 * torch.rand(B, C, generator=g, dtype=torch.float64)  # (B, C)
    old = sampler + 0.5 * torch.randn(B, C, generator=g, dtype=torch.float64)  # (B, C)
    old[4] = sampler[4] + 200.0  # exp(1200) overflows
    mask = (torch.arange(C)[None] < torch.tensor([6, 3, 1, 5, 6])[:, None]).long()  # (B, C)
    got = sampler_weights(old, sampler, mask, mode, cap, low)
    assert not got.isnan().any()
    for b in range(B):
        kept = [t for t in range(C) if mask[b, t]]
        seq = sum(old[b, t].item() - sampler[b, t].item() for t in kept)
        for t in kept:
            log_r = seq if mode.startswith("sequence") else old[b, t].item() - sampler[b, t].item()
            r = math.exp(min(log_r, 700.0))  # past 700: above any cap, like inf
            if mode.endswith("truncate"):
                want = min(max(r, low), cap)
            else:
                want = r if low <= r <= cap else 0.0
            assert got[b, t].item() == pytest.approx(want, rel=1e-9), (b, t)
    logps = old.clone().requires_grad_()
    loss, _ = loss_of(logps, old, None, torch.ones(B, dtype=torch.float64), mask, weights=got)
    loss.backward()
    assert torch.equal(logps.grad != 0, (got != 0) & (mask == 1))  # masked: no gradient


def test_grpo_loss_is_weights_and_errors():
    logps, old, ref, adv, mask = make_batch()
    is_w = torch.rand_like(logps)
    want = naive_loss(logps, old, ref, adv, mask.tolist(), 0.0, 0.2, 0.2, "bnpo", 5, is_w=is_w)
    loss, _ = loss_of(logps, old, None, adv, mask, weights=is_w)
    assert loss.item() == pytest.approx(want.item(), rel=1e-10)
    args = parse_args([])
    args.loss_type = "sum"  # past the flag's own check: grpo_loss refuses it too
    t = loss_inputs({"completion_mask": mask, "advantages": adv}, logps, logps, torch.device("cpu"))
    with pytest.raises(ValueError, match="loss_type"):
        grpo_loss(t, args, {"normalizer": 1.0})
    with pytest.raises(ValueError, match="ref_logps"):
        loss_of(logps, old, None, adv, mask, ["--beta", 0.1])


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("iterations", [1, 2])
def test_gspo_sequence_level_matches_naive(loss_type, beta, iterations):
    """--importance_sampling_level sequence: loss and gradient against a naive per-sequence loop,
    with every loss_type."""
    logps, old, ref, adv, mask = make_batch(iterations=iterations)
    C = logps.shape[1]
    naive_lp = logps.clone().requires_grad_(True)
    kw = dict(level="sequence")
    want = naive_loss(naive_lp, old, ref, adv, mask.tolist(), beta, 0.1, 0.3, loss_type, C, **kw)
    want.backward()
    lp = logps.clone().requires_grad_(True)
    flags = clip_flags(beta, 0.1, 0.3, loss_type)
    old_ = old if iterations > 1 else None
    ref_ = ref if beta else None
    loss, _ = loss_of(
        lp, old_, ref_, adv, mask, flags + ["--importance_sampling_level", "sequence"]
    )
    loss.backward()
    assert loss.item() == pytest.approx(want.item(), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(lp.grad, naive_lp.grad, rtol=1e-9, atol=1e-12)
    token_lp = logps.clone().requires_grad_(True)
    token, _ = loss_of(token_lp, old_, ref_, adv, mask, flags)
    token.backward()
    if iterations > 1:  # ratios leave 1: the sequence-level loss is not the token-level one
        assert abs(token.item() - loss.item()) > 1e-6
    else:  # the old policy is the current one: both levels give the same update
        torch.testing.assert_close(token_lp.grad, lp.grad, rtol=1e-9, atol=1e-12)
    args = parse_args([str(f) for f in flags])
    args.importance_sampling_level = "seq"  # past the flag's own check: grpo_loss refuses it too
    with pytest.raises(ValueError, match="importance_sampling_level"):
        grpo_loss(
            loss_inputs({"completion_mask": mask, "advantages": adv}, lp, lp, "cpu"), args, {}
        )


def test_mask_truncated_completions_drops_rows_cut_at_the_length():
    """A completion is truncated when it fills max_completion_length without ending in a stop id;
    --mask_truncated_completions drops it from the update's plan (and so from the normaliser)."""
    from dapo import truncated
    from generation import Generations
    from grpo import keep_mask, micro_plan, parse_args

    ids = torch.tensor([[5, 6, 2], [5, 2, 0], [5, 6, 7], [7, 0, 0]])  # stop id 2, C = 3
    gens = Generations(ids, (ids != 0).long())
    cut = truncated(gens, [2], 3)
    assert cut.tolist() == [False, False, True, False]
    am = torch.cat([torch.ones(4, 2, dtype=torch.long), gens.completion_mask], 1)
    batch = {"input_ids": am, "attention_mask": am, "completion_mask": gens.completion_mask}
    batch.update(truncated=cut, keep=torch.tensor([True, False, True, True]))  # row 1: dropped
    on = parse_args(["--mask_truncated_completions", "True", "--per_device_train_batch_size", "2"])
    off = parse_args(["--per_device_train_batch_size", "2"])
    assert keep_mask(batch, on).tolist() == [True, False, False, True]
    assert keep_mask(batch, off).tolist() == [True, False, True, True]
    assert [i.tolist() for i in micro_plan(batch, on, Knobs.given(on))] == [[0, 3]]
    assert keep_mask({**batch, "keep": None}, on).tolist() == [True, True, False, True]


def test_dynamic_sampling_refills_to_the_batch_size_and_stops_at_the_cap():
    """One process: groups without reward spread out, extra rounds until N groups or the cap."""
    from dapo import dynamic_sampling
    from generation import Generations
    from grpo import parse_args

    def sample(group_rewards):
        n = len(group_rewards)
        ids = torch.arange(n * 2 * (1 + n)).view(n * 2, 1 + n) + 4  # widths differ: padded
        rewards = torch.tensor([r for g in group_rewards for r in g], dtype=torch.float64)
        gens = Generations(ids, torch.ones_like(ids))
        return {
            "prompt_ids": [[g] for g in range(n)],
            "gens": gens,
            "rewards": rewards,
            "per_func": {"f": rewards},
        }

    args = parse_args(
        [
            "--prompts_per_rank",
            "3",
            "--num_generations",
            "2",
            "--dynamic_sampling",
            "True",
            "--max_dynamic_sampling_rounds",
            "3",
        ]
    )
    rounds = iter([[[1.0, 1.0], [0.0, 1.0]], [[0.2, 0.3], [0.5, 0.6]]])
    first = sample([[0.0, 0.0], [0.0, 1.0], [1.0, 1.0]])  # 1 group with spread
    out, keep, stats = dynamic_sampling(first, lambda r, n: sample(next(rounds)), args, 0)
    assert keep.tolist() == [True] * 6  # 1 + 1 + 2 groups kept, trimmed to 3
    assert out["rewards"].tolist() == [0.0, 1.0, 0.0, 1.0, 0.2, 0.3]
    assert stats == {
        "dynamic/groups_dropped": 3.0,
        "dynamic/extra_rounds": 2,
        "dynamic/groups_short": 0.0,
    }
    assert out["gens"].completion_ids.shape == (6, 4) and out["per_func"]["f"].shape == (6,)
    args.max_dynamic_sampling_rounds = 0  # no extra round: the flat groups fill in, keep False
    out, keep, stats = dynamic_sampling(first, None, args, 0)
    assert keep.tolist() == [True, True, False, False, False, False]
    assert out["rewards"].tolist() == [0.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    assert stats["dynamic/groups_short"] == 2.0 and stats["dynamic/extra_rounds"] == 0


@pytest.mark.parametrize("loss_type", ["bnpo", "cispo"])
def test_entropy_bonus_gradient_equals_full_logits_entropy(tiny_model, loss_type):
    """--entropy_coef through the fused entropy logprobs.py computes (batching.forward_logps, as
    the update calls it): the weights' gradient equals that of the naive loss on the full logits'
    log_softmax and entropy -sum p log p, at temperature 0.7."""
    from transformers import AutoModelForCausalLM

    from batching import forward_logps, micro_slice

    torch.manual_seed(0)
    B, P, C, T, cpu = 4, 3, 4, 0.7, torch.device("cpu")
    ids = torch.randint(4, 30, (B, P + C))
    am = torch.cat(
        [torch.ones(B, P), torch.arange(C)[None] < torch.tensor([[4], [2], [3], [1]])], 1
    )
    mb = micro_slice(
        {"input_ids": ids, "attention_mask": am.long(), "completion_mask": am[:, P:].long()},
        torch.arange(B),
    )
    old = torch.randn(B, C, dtype=torch.float64) * 0.3 - 3
    adv, mask = torch.randn(B, dtype=torch.float64), mb["completion_mask"]
    flags = clip_flags(0.0, 0.2, 0.2, loss_type) + ["--entropy_coef", 0.5]
    grads = []
    for fused in (True, False):
        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float64)
        if fused:
            logps, ent = forward_logps(model, mb, T, False, cpu, return_entropy=True)
            loss, _ = loss_of(logps, old, None, adv, mask, flags, entropy=ent)
        else:  # (B, T, V) logits, one token at a time
            logits = model(input_ids=ids, attention_mask=am.long()).logits[:, P - 1 : -1] / T
            lsm = logits.log_softmax(-1)  # (B, C, V)
            logps = lsm.gather(-1, ids[:, P:, None]).squeeze(-1)  # (B, C)
            ent = -(lsm.exp() * lsm).sum(-1)  # (B, C)
            m = mask.tolist()
            loss = naive_loss(
                logps, old, None, adv, m, 0.0, 0.2, 0.2, loss_type, C, ent=ent, coef=0.5
            )
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(g, grads[1][name], rtol=1e-7, atol=1e-10, msg=name)
    assert grads[0]["lm_head.weight"].abs().max() > 0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batch_losses_sum_to_full_batch(loss_type):
    """docs/accumulation.md, "Accumulation never changes the update", on the pure function:
    the batch-wide normaliser makes the split irrelevant."""
    logps, old, ref, adv, mask = make_batch(B=8, C=6, seed=1)
    norm = loss_normalizer(mask, loss_type, 6)
    kw = dict(flags=clip_flags(0.04, 0.2, 0.28, loss_type), normalizer=norm)
    full_lp = logps.clone().requires_grad_(True)
    full, _ = loss_of(full_lp, old, ref, adv, mask, **kw)
    full.backward()
    for micro in (1, 2, 4):
        lp = logps.clone().requires_grad_(True)
        total = 0.0
        for s in range(0, 8, micro):
            part, _ = loss_of(
                lp[s : s + micro],
                old[s : s + micro],
                ref[s : s + micro],
                adv[s : s + micro],
                mask[s : s + micro],
                **kw,
            )
            part.backward()
            total += part.item()
        assert total == pytest.approx(full.item(), rel=1e-10)
        torch.testing.assert_close(lp.grad, full_lp.grad)


def test_accumulation_equivalence_deepspeed(tiny_model, tmp_path):
    """Real DeepSpeed (ZeRO-2 and ZeRO-3) on 2 ranks: (4, 1), (2, 2), (1, 4) micro-batch x
    accumulation, a token budget, padded or packed (--packing), give the loss and the gradient of
    the whole 8-sequence batch computed on one plain model, for every loss_type."""
    torchrun(os.path.join(HERE, "dist_grpo_accum.py"), tiny_model, tmp_path)


def test_bad_input_fails_with_a_message_that_says_what_to_change(tmp_path):
    from exits import RunError
    from grpo import parse_args

    for argv, msg in (
        (["--loss_type", "sum"], f"must be one of {', '.join(LOSS_TYPES)}"),
        (["--num_generations", "1"], ">= 2"),
        (["--vllm_importance_cap", "2"], "needs --use_vllm"),
        (["--importance_sampling_level", "group"], "token"),
        (["--advantage_estimator", "gae"], f"must be one of {', '.join(ADVANTAGE_ESTIMATORS)}"),
        (["--vllm_importance_mode", "seq"], "must be one of token_truncate"),
        (
            ["--use_vllm", "True", "--vllm_importance_mode", "token_mask"],
            "--vllm_importance_cap > 0",
        ),
        (["--dtype", "fp16"], "--dtype fp16: must be one of auto, bf16, fp32"),
        (["--advantage_estimator", "rloo", "--scale_rewards", "True"], "needs --scale_rewards F"),
        (["--advantage_estimator", "reinforce_pp", "--scale_rewards", "False"], "True"),
        (["--distill_only", "True"], "needs --teacher_model"),
    ):
        with pytest.raises(RunError, match=msg):
            parse_args(argv)
    # the reward functions are loaded by the pre-flight (checks.check_inputs), one message each
    for argv, msg in (
        (["--reward_weights", "1,2,3"], "3 values for 2 reward functions"),
        (["--reward_funcs", "nosuchmodule:f"], "module:function"),
    ):
        with pytest.raises(RunError, match=msg):
            harness.before_torchrun(parse_args(argv + ["--run_dir", str(tmp_path)]), {})
    # the task, rewards, JSONL data and data order: tests/test_tasks.py; bad input end to end:
    # test_checks.py


def test_estimate_memory_flag_prints_the_estimate_and_exits(capsys, monkeypatch):
    """--estimate_memory: estimate.py's table for the run's args (no process group, no weights)."""
    from conftest import ROOT
    from grpo import main
    from memory import GB

    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg = os.path.join(ROOT, "configs", "zero3_offload.json")
    est = main(
        [
            "--estimate_memory",
            "True",
            "--model",
            "qwen2.5-7b",
            "--ds_config",
            cfg,
            "--dtype",
            "bf16",
            "--max_completion_length",
            "1024",
            "--gradient_checkpointing",
            "True",
            "--beta",
            "0.04",
        ]
    )
    out = capsys.readouterr().out
    assert "update" in out and "ref_logprobs" in out and "highest phase" in out
    p = est["pieces"]  # zero3_offload.json: both offloads; 4 ranks from WORLD_SIZE
    assert p["optimizer"] == 0 and p["params"] == 0 and est["cpu"] > 0
    assert p["activations"] == p["activations_ckpt"] and p["reference"] == 2 * est["params"] // 4
    # the built-in task's tiny model
    tiny = main(["--estimate_memory", "True", "--max_prompt_length", "8"])
    # the estimate takes prompts at their longest
    assert 0 < max(tiny["phases"].values()) < 0.1 * GB


def micro(args):
    """The micro-batch size a run of these args starts with (fit.Knobs)."""
    return Knobs.given(args).per_device_train_batch_size


def test_recipe_sets_its_defaults_and_the_command_line_wins():
    """--recipe pretrained (what run.sh passes with MODEL) is RECIPES' values, one place."""
    import grpo

    plain = grpo.parse_args([])
    args = grpo.parse_args(["--recipe", "pretrained", "--eval_steps=7", "--learning_rate", "2e-6"])
    for name, value in grpo.recipes.GRPO["pretrained"].items():
        want = {"eval_steps": 7, "learning_rate": 2e-6}.get(name, value)
        assert getattr(args, name) == want != getattr(plain, name)
    assert Knobs.given(args).per_device_train_batch_size == 4
    with pytest.raises(grpo.RunError, match="--recipe nope: choose one of pretrained"):
        grpo.parse_args(["--recipe", "nope"])


def test_smollm2_recipe_calls_its_model_and_data_only_when_not_given(tmp_path):
    """--model and --data given: the recipe's functions (a download, a file written) never run."""
    import grpo

    args = grpo.parse_args(["--recipe", "smollm2-gsm8k", "--model", "m", "--data", "d.jsonl"])
    assert (args.model, args.data) == ("m", "d.jsonl")
    assert args.use_vllm and args.reward_funcs == "rewards:math_reward" and micro(args) == 2
    assert (
        "--model smollm2.model_dir()" in grpo.Args.__dataclass_fields__["recipe"].metadata["help"]
    )
    args = grpo.parse_args(["--recipe", "smollm2-addition", "--model", "m", "--data", "d.jsonl"])
    assert (args.model, args.data) == ("m", "d.jsonl") and args.max_completion_length == 32
    assert micro(args) == 8 and args.learning_rate == 1e-5 and args.max_steps == 15
    assert args.use_vllm and args.reward_funcs == "rewards:math_reward" and args.beta == 0


def test_smollm2_calculator_recipe_writes_its_problems_once(tmp_path, monkeypatch):
    """--recipe smollm2-calculator: the env, its reward and lengths; without --data its problems
    are written once under $LEAN_RL_CACHE (the rows envs.problems makes) and reused."""
    import envs
    import grpo

    monkeypatch.setenv("LEAN_RL_CACHE", str(tmp_path))
    args = grpo.parse_args(["--recipe", "smollm2-calculator", "--model", "m"])
    assert (args.env, args.reward_funcs) == ("envs:calculator", "envs:calculator_reward")
    assert (args.max_turns, args.max_completion_length, micro(args)) == (3, 64, 8)
    assert args.use_vllm and args.temperature == 1.0 and args.num_eval_prompts == 100
    assert args.data == str(tmp_path / "calculator-2000-0.jsonl")
    with open(args.data) as f:
        rows = [json.loads(line) for line in f]
    assert rows == envs.problems(2000)
    mtime = os.path.getmtime(args.data)
    assert envs.problems_file() == args.data and os.path.getmtime(args.data) == mtime


def test_distill_advantages_and_per_token_advantages_match_naive():
    """On-policy distillation: each sampled token's advantage is coef x (teacher - student
    log-prob), plus the sequence's reward advantage unless distill_only; grpo_loss weighs each
    token by its own advantage, and a row-constant (B, C) advantage is the (B,) one."""
    from distill import distill_advantages

    torch.manual_seed(0)
    B, C, coef = 3, 4, 0.5
    adv, student, teacher = torch.randn(B), torch.randn(B, C), torch.randn(B, C)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    both = distill_advantages(adv, student, teacher, mask, coef)
    alone = distill_advantages(adv, student, teacher, mask, coef, only=True)
    for i in range(B):
        for t in range(C):
            d = -coef * float(student[i, t] - teacher[i, t]) * float(mask[i, t])
            assert math.isclose(float(alone[i, t]), d, abs_tol=1e-6)
            assert math.isclose(float(both[i, t]), float(adv[i]) + d, abs_tol=1e-6)
    logps = torch.randn(B, C, requires_grad=True)
    n = float(mask.sum())
    loss, _ = loss_of(logps, None, None, both, mask, normalizer=n)
    loss.backward()
    # on-policy the ratio is 1 and unclipped: loss = -sum(A_t) / n, d loss / d logp_t = -A_t / n
    naive = -sum(float(both[i, t]) for i in range(B) for t in range(C) if mask[i, t]) / n
    assert math.isclose(loss.item(), naive, rel_tol=1e-5)
    torch.testing.assert_close(logps.grad, -both * mask / n)
    per_row, _ = loss_of(logps, None, None, adv, mask, normalizer=n)
    per_token, _ = loss_of(logps, None, None, adv[:, None].expand(B, C), mask, normalizer=n)
    torch.testing.assert_close(per_row, per_token)


def test_top_k_reaches_sampling_and_the_sampling_policys_log_probs(tiny_model):
    """--top_k goes to generation (harness.sampling_params, what Run.generate passes HF generate
    and vLLM) and to the sampling policy's log-probs with the sampler's top-k rule
    (harness.sampling_cut); grpo.batch_logps(policy=True) then scores under the cut (above the
    full softmax's log-probs: renormalised over k tokens) and keeps it for the update's forwards,
    and the reference's pass (policy=False) does not. --top_k 0: nothing passed, as before."""
    from transformers import AutoModelForCausalLM

    import grpo
    import ppo
    from batching import make_batch, plan_micro_batches
    from generation import Generations, sampler_top_k_rule

    for loop in (grpo, ppo):
        args = loop.parse_args(["--top_k", "5"])
        assert harness.sampling_params(args) == dict(temperature=1.0, top_p=1.0, top_k=5)
        rule = sampler_top_k_rule(False)  # HF generate: transformers' top-k warper
        assert harness.sampling_cut(args) == dict(top_k=5, top_p=1.0, top_k_rule=rule)
        vllm = loop.parse_args(["--top_k", "5", "--use_vllm", "True"])
        assert harness.sampling_cut(vllm)["top_k_rule"] == sampler_top_k_rule(True)
        assert harness.sampling_cut(loop.parse_args([])) == {}
        assert harness.sampling_params(loop.parse_args([]))["top_k"] == 0
    torch.manual_seed(0)
    ids = torch.randint(4, 30, (4, 3))
    gens = Generations(ids, torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]]))
    model = AutoModelForCausalLM.from_pretrained(tiny_model)  # fp32, as the loops score
    cpu, out = torch.device("cpu"), {}
    for flags in (["--top_k", "5"], []):
        args = grpo.parse_args(flags)
        batch = make_batch([[5, 6], [7, 8, 9]], gens, 0)
        plan = plan_micro_batches(batch, 2)
        knobs = Knobs.given(args)
        out[bool(flags)] = grpo.batch_logps(model, batch, plan, args, knobs, cpu, policy=True)
        assert ("sampling_thresholds" in batch) == bool(flags)
        if flags:
            ref = grpo.batch_logps(
                model, make_batch([[5, 6], [7, 8, 9]], gens, 0), plan, args, knobs, cpu
            )
    mask = gens.completion_mask.bool()
    assert (out[True][mask] > out[False][mask]).all()
    torch.testing.assert_close(ref, out[False])  # the reference: the full distribution

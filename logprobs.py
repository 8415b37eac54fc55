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
  model_logps(model, ...)                 logsumexp and gather fused per chunk of C
                                          tokens, forward and backward; the largest
                                          temporary is one (C, V) fp32 tile.

Shapes: B sequences, T tokens per sequence (prompt + completion, padded),
K = logits_to_keep completion tokens scored per sequence, N tokens (N = B * K when
flattened), H hidden size, V vocabulary size, C chunk of tokens (rows).

Log-probs come back in fp32 whatever the model's dtype (ratios exp(logp - old)
amplify bf16 rounding). Position ids follow the attention mask, as in HF
`generate`, so left-padded prompts score exactly as they were sampled.
"""

import torch

# A (C, V) fp32 tile of about 64 MiB: C = 110 rows at V = 151936. Large enough that the
# (C, H) @ (H, V) matmul runs near peak speed, small enough to sit beside a 7B model.
DEFAULT_TILE_ELEMENTS = 2**24


def _acc(dtype):
    """Accumulation dtype: fp32 for bf16/fp16/fp32, fp64 stays fp64 (for gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


def default_chunk_size(vocab_size):
    """Rows per chunk so that one (C, V) fp32 tile holds ~DEFAULT_TILE_ELEMENTS floats."""
    return max(1, DEFAULT_TILE_ELEMENTS // vocab_size)


# ----------------------------------------------------------------------------------
# Per-tile math shared by selective_log_softmax and fused_logps. A tile z is (C, V)
# fp32 logits already divided by the temperature; both helpers overwrite it in place
# so that a forward needs one tile (two with entropy) and a backward one (two).
# ----------------------------------------------------------------------------------


def _tile_forward(z, targets, return_entropy):
    """z (C, V) fp32 (overwritten), targets (C,) -> logp (C,), lse (C,), entropy (C,) or None."""
    picked = z.gather(1, targets[:, None]).squeeze(1)  # (C,) logit of the sampled token
    zmax = z.amax(1, keepdim=True)  # (C, 1)
    z.sub_(zmax)  # (C, V) z - max, so exp cannot overflow
    entropy = None
    if return_entropy:
        e = z.exp()  # (C, V) unnormalised probabilities
        s = e.sum(1)  # (C,)
        ez = torch.bmm(e[:, None, :], z[:, :, None]).view(-1)  # (C,) sum_v e * (z - max), no (C, V) temp
        entropy = s.log() - ez / s  # (C,) H = log s - E_p[z - max]
    else:
        s = z.exp_().sum(1)  # (C,)
    lse = zmax.squeeze(1) + s.log()  # (C,)
    return picked - lse, lse, entropy


def _tile_backward(z, targets, lse, g_logp, entropy=None, g_entropy=None):
    """d(loss)/dz for one tile. z (C, V) fp32 (overwritten); lse, g_logp, entropy, g_entropy (C,).

    d logp_t / dz_v = 1[v = t] - p_v;   d H / dz_v = -p_v (log p_v + H).
    """
    z.sub_(lse[:, None])  # (C, V) log p
    if g_entropy is None:
        grad = z.exp_().mul_(-g_logp[:, None])  # (C, V) -p * g_logp
    else:
        p = z.exp()  # (C, V)
        z.add_(entropy[:, None]).mul_(g_entropy[:, None]).add_(g_logp[:, None])  # (C, V) g_logp + g_H (log p + H)
        grad = p.mul_(z).neg_()  # (C, V)
    grad.scatter_add_(1, targets[:, None], g_logp[:, None])  # (C, V) + 1[v = t] g_logp
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
            z = logits[s : s + chunk_size].to(_acc(logits.dtype), copy=True)  # (C, V) the tile we overwrite
            logp[s : s + chunk_size], lse[s : s + chunk_size], _ = _tile_forward(z, index[s : s + chunk_size], False)
            del z  # free this tile before the next one is allocated: one tile at a time, not two
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
            grad[rows] = _tile_backward(z, index[rows], lse[rows], g_logp[rows])
            del z
        return grad, None, None


def selective_log_softmax(logits, index, chunk_size=None):
    """log_softmax(logits)[..., index] without a full log_softmax copy.

    logits (..., V) any float dtype; index (...) long. Returns (...) fp32.
    Computed per chunk of rows as gathered logit minus logsumexp, in fp32, so the extra
    memory is one (chunk_size, V) fp32 tile, not a (..., V) copy in any dtype.
    """
    if logits.shape[:-1] != index.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and index {tuple(index.shape)} must agree but for V")
    V = logits.shape[-1]
    flat = logits.reshape(-1, V)  # (N, V) a view for contiguous logits
    out = _SelectiveLogSoftmax.apply(flat, index.reshape(-1), chunk_size or default_chunk_size(V))  # (N,)
    return out.view(index.shape)


# ----------------------------------------------------------------------------------
# per_token_logps: the upstream fix (mini-batches, completion positions only)
# ----------------------------------------------------------------------------------


def _position_ids(attention_mask):
    """Positions that skip left padding, as HF generate assigns them. (B, T) -> (B, T)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, T)


def _check_keep(input_ids, attention_mask, logits_to_keep):
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (B, T), got {tuple(input_ids.shape)}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must match input_ids {tuple(input_ids.shape)}")
    if not 1 <= logits_to_keep < input_ids.shape[1]:
        raise ValueError(
            f"logits_to_keep={logits_to_keep} must be in [1, T - 1] = [1, {input_ids.shape[1] - 1}]: "
            "the first token of a sequence has nothing before it to be predicted from"
        )


def per_token_logps(model, input_ids, attention_mask, logits_to_keep, batch_size=None, temperature=1.0):
    """Log-probs of input_ids[:, -K:] in mini-batches of `batch_size` sequences -> (B, K) fp32.

    Each mini-batch asks the model for only K + 1 positions' logits (`logits_to_keep`),
    drops the last (it predicts past the sequence), divides by the temperature and
    gathers with selective_log_softmax. Peak memory: one (batch_size, K, V) logits block.
    batch_size=None scores all B at once.
    """
    _check_keep(input_ids, attention_mask, logits_to_keep)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    K, bs = logits_to_keep, batch_size or input_ids.shape[0]
    out = []
    for s in range(0, input_ids.shape[0], bs):
        ids, mask = input_ids[s : s + bs], attention_mask[s : s + bs]  # (b, T)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=_position_ids(mask),
                       logits_to_keep=K + 1, use_cache=False).logits  # (b, K + 1, V)
        logits = logits[:, :-1] / temperature  # (b, K, V)
        out.append(selective_log_softmax(logits, ids[:, -K:]))  # (b, K)
    return torch.cat(out)  # (B, K)


# ----------------------------------------------------------------------------------
# fused_logps: lm_head matmul + log-softmax + gather, chunked forward and backward
# ----------------------------------------------------------------------------------


def _tile_logits(h, weight, bias, temperature):
    """(C, H) hidden -> (C, V) fp32 tempered logits, a fresh tile the caller may overwrite."""
    z = h @ weight.t() if bias is None else torch.addmm(bias, h, weight.t())  # (C, V) in the model's dtype
    z = z.to(_acc(z.dtype))  # (C, V) no copy when already fp32
    return z.mul_(1.0 / temperature) if temperature != 1.0 else z


class _FusedLogps(torch.autograd.Function):
    """Forward keeps lse (N,) and entropy (N,); backward recomputes each (C, V) tile.

    The recompute costs one extra (C, H) @ (H, V) matmul per chunk; that is the price
    of never storing (N, V). Gradients: dH = d @ W (C, H) per chunk; dW += d^T @ h and
    db += d.sum(0) accumulate in fp32 in place (addmm_), so no (V, H) temporary per chunk.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, return_entropy):
        N = hidden.shape[0]
        logp = torch.empty(N, dtype=_acc(weight.dtype), device=hidden.device)  # (N,)
        lse = torch.empty_like(logp)  # (N,)
        entropy = torch.empty_like(logp) if return_entropy else None  # (N,)
        for s in range(0, N, chunk_size):
            rows = slice(s, s + chunk_size)
            z = _tile_logits(hidden[rows], weight, bias, temperature)  # (C, V)
            logp[rows], lse[rows], ent = _tile_forward(z, targets[rows], return_entropy)
            if return_entropy:
                entropy[rows] = ent
            del z  # free this tile before the next one is allocated: one tile at a time, not two
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return (logp, entropy) if return_entropy else logp

    @staticmethod
    def backward(ctx, g_logp, g_entropy=None):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        # z = raw / T, and the tile gradient is linear in (g_logp, g_entropy): fold 1/T in here.
        acc = lse.dtype
        g_logp = g_logp.to(acc) / ctx.temperature  # (N,)
        if g_entropy is not None:
            g_entropy = g_entropy.to(acc) / ctx.temperature  # (N,)
        grad_h = torch.empty_like(hidden) if need_h else None  # (N, H)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None  # (V, H)
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None  # (V,)
        for s in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(s, s + ctx.chunk_size)
            h = hidden[rows]  # (C, H)
            z = _tile_logits(h, weight, bias, ctx.temperature)  # (C, V) recomputed
            d = _tile_backward(z, targets[rows], lse[rows], g_logp[rows],
                               None if entropy is None else entropy[rows],
                               None if g_entropy is None else g_entropy[rows])  # (C, V) fp32
            if need_h:
                grad_h[rows] = d.to(weight.dtype) @ weight  # (C, H)
            if need_w:
                grad_w.addmm_(d.t(), h.to(acc))  # (V, H) += (V, C) @ (C, H)
            if need_b:
                grad_b += d.sum(0)  # (V,)
            del z, d
        grad_w = grad_w.to(weight.dtype) if need_w else None
        grad_b = grad_b.to(bias.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None, None


def fused_logps(hidden, weight, targets, bias=None, temperature=1.0, chunk_size=None, return_entropy=False):
    """log_softmax((hidden @ weight.T + bias) / temperature)[targets] without the (N, V) logits.

    hidden (N, H) (or (B, K, H), flattened and reshaped back), weight (V, H) the lm_head
    weight, targets (N,) long, bias (V,) or None. Returns logp (N,) fp32, and entropy (N,)
    fp32 of the tempered distribution when return_entropy. Exact gradients for hidden,
    weight and bias, also through the entropy. No tensor larger than (chunk_size, V)
    exists in forward or backward beyond the (V, H) fp32 weight-gradient accumulator.
    """
    lead = hidden.shape[:-1]
    if targets.shape != lead:
        raise ValueError(f"targets {tuple(targets.shape)} must match hidden {tuple(hidden.shape)} but for H")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be (V, H={hidden.shape[-1]}), got {tuple(weight.shape)}"
                         " (under ZeRO-3 an empty weight means it is not gathered: use model_logps)")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    out = _FusedLogps.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias, targets.reshape(-1), float(temperature),
                            chunk_size or default_chunk_size(weight.shape[0]), return_entropy)
    if return_entropy:
        return out[0].view(lead), out[1].view(lead)
    return out.view(lead)


# ----------------------------------------------------------------------------------
# model_logps: decoder once, then fused_logps inside lm_head's own forward
# ----------------------------------------------------------------------------------


def model_logps(model, input_ids, attention_mask, logits_to_keep, temperature=1.0, chunk_size=None,
                return_entropy=False):
    """Log-probs (B, K) fp32 of input_ids[:, -K:] (and entropies (B, K)) through fused_logps.

    The model runs its own forward (a transformers CausalLM, a DeepSpeed engine, or a
    PEFT wrapper), but for the duration of the call its lm_head's forward is replaced by
    fused_logps on the hidden states it receives. Why inside lm_head's forward: under
    DeepSpeed ZeRO-3, lm_head.weight is an empty partition outside that module's
    forward; ZeRO-3's own hooks gather it before the forward, gather it again before the
    backward of the module's output, and reduce-scatter its gradient, exactly as for an
    ordinary lm_head call. Tied embeddings and gradient checkpointing (which never
    covers lm_head) need nothing special. The lm_head is restored on every exit path.
    """
    _check_keep(input_ids, attention_mask, logits_to_keep)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    module = getattr(model, "module", model)  # DeepSpeed engine -> its module
    config = getattr(module, "config", None)
    for knob in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
        if getattr(config, knob, None) not in (None, 1.0):
            raise ValueError(f"config.{knob}={getattr(config, knob)} transforms logits after lm_head; "
                             "model_logps would skip it: use per_token_logps for this model")
    lm_head = module.get_output_embeddings()
    K = logits_to_keep
    targets = input_ids[:, -K:]  # (B, K)

    def fused_forward(hidden_states):  # (B, K + 1, H) when the model honours logits_to_keep, else (B, T, H)
        h = hidden_states[:, -K - 1 : -1]  # (B, K, H) position t predicts token t + 1
        out = fused_logps(h, lm_head.weight, targets, lm_head.bias, temperature, chunk_size, return_entropy)
        return torch.stack(out, -1) if return_entropy else out  # (B, K, 2) or (B, K): one tensor for the hooks

    saved = lm_head.__dict__.get("forward")  # an instance-level forward (e.g. a wrapper's) to put back
    lm_head.forward = fused_forward
    try:
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=_position_ids(attention_mask),
                    logits_to_keep=K + 1, use_cache=False).logits  # (B, K) or (B, K, 2)
    finally:
        if saved is None:
            del lm_head.forward
        else:
            lm_head.forward = saved
    return (out[..., 0], out[..., 1]) if return_entropy else out

"""Batch plumbing for the RL loops: prompts to ids (through the chat template), the ids that end a
completion, rollouts to a padded batch, micro-batches (padded or packed into one row), collectives.

    from batching import all_sum, encode_prompts, init_distributed, make_batch, ...
    rank, world, device = init_distributed()     # first: NCCL on GPUs, gloo on CPU
    prompt_ids = encode_prompts(tokenizer, rows, max_prompt_length)  # lists of ids, no padding
    stop_ids = stop_token_ids(tokenizer, model_path)  # eos ids + the template's end of turn
    batch = make_batch(prompt_ids, gens, tokenizer.pad_token_id)  # ids, masks (B, T)
    plan = plan_micro_batches(batch, 8)          # or by tokens: plan_micro_batches(batch, 8, 4096)
    for idx, mb, weight in micro_batches(batch, plan):  # weight 0: a repeat, ranks in step
        if weight:                               # idx: mb's rows in batch, to write results back
            out[idx, : mb["logits_to_keep"]] = ...
    ids, pos, where = pack(mb)                   # packed: (1, N) ids and positions; unpack(out, cm)
    lp = forward_logps(model, mb, 1.0, packing, device)  # (b, c) padded or packed, the same values
    groups = mini_batch_plans(batch, 2, 8)       # PPO: a plan per mini-batch (rows fixed by count)
    (total,) = all_sum([local_count])            # float64 sum over ranks, on the backend's device
    totals = all_sum_dict(sums)                  # {name: sum} over ranks: whatever keys came back
    means = token_means({"kl": kl}, mask)        # {name: mean per token of (B, C)} over ranks
    t = loss_inputs(mb, logps, entropy, device)  # LossInputs: a micro-batch's per-token loss inputs
    s = micro_stats(stats, idx, mb, device)      # the whole batch's statistics, mb's rows of them

Letters in shape comments: B sequences on this rank, b in a micro-batch, P prompt tokens, C
completion tokens, T = P + C, t <= T and c <= C after cutting all-padding columns, N tokens of a
packed row and M completion tokens in it. Prompts are left-padded, completions right-padded, so
every prompt ends and every completion starts at column P.

Collectives put their tensors where the process group's backend needs them (`comm_device`: the
current GPU under NCCL, the CPU under gloo), so the same loop runs on both. Imports zero3_utils
(comm_device, all_max: the helpers generation.py shares), logprobs (model_logps, for
forward_logps: a micro-batch scored padded or packed, shared by both loops) and generation
(Generations, the rollouts take_groups and cat_groups select and join).
"""

import json
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

import sequence_parallel
from generation import Generations
from logprobs import model_logps
from zero3_utils import all_max, all_reduce_


# ---- Rollouts to a batch ------------------------------------------------------------------------
def encode_prompts(tokenizer, rows, max_prompt_length, template_kwargs=None):
    """Token-id lists (no padding), each cut to its last max_prompt_length tokens.

    With a chat template: a string prompt is one user turn, a conversation (a list of {"role",
    "content"} messages, a system turn included) is rendered as it is, both with
    add_generation_prompt=True and template_kwargs (--chat_template_kwargs, such as
    {"enable_thinking": False}) passed to apply_chat_template; the text is then tokenized without
    adding special tokens (the template wrote them), as TRL does. Without a template a string is
    tokenized as it is (the tokenizer adds its BOS) and a conversation is a ValueError."""
    if tokenizer.chat_template:
        texts = [
            tokenizer.apply_chat_template(
                r["prompt"]
                if isinstance(r["prompt"], list)
                else [{"role": "user", "content": r["prompt"]}],
                tokenize=False,
                add_generation_prompt=True,
                **(template_kwargs or {}),
            )
            for r in rows
        ]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    else:
        if any(isinstance(r["prompt"], list) for r in rows):
            raise ValueError("a conversational prompt needs a tokenizer with a chat template")
        ids = tokenizer([r["prompt"] for r in rows])["input_ids"]
    return [i[-max_prompt_length:] for i in ids]


def template_kwargs(text):
    """--chat_template_kwargs: a JSON object -> dict ("" -> {}); anything else is a ValueError."""
    try:
        kwargs = json.loads(text) if text else {}
    except json.JSONDecodeError as e:
        raise ValueError(
            f"--chat_template_kwargs {text!r} is not JSON ({e.msg}); write a JSON object, "
            """e.g. '{"enable_thinking": false}'"""
        ) from None
    if not isinstance(kwargs, dict):
        raise ValueError(
            f"--chat_template_kwargs {text!r} is a JSON {type(kwargs).__name__}; write an object "
            """of template arguments, e.g. '{"enable_thinking": false}'"""
        )
    return kwargs


def stop_token_ids(tokenizer, model_path):
    """The ids that end a completion, sorted: the tokenizer's eos, every id of the model's
    generation_config.json eos_token_id (an int or a list: Qwen2.5-Instruct lists <|im_end|> and
    <|endoftext|>; config.json's when there is none), and the chat template's end-of-turn token,
    found by rendering one assistant turn (<|im_end|>, <|eot_id|>, <end_of_turn>): a model whose
    configs name only its pretraining eos still stops where its turn ends. HF generation and vLLM
    both stop at any of them; the stop token is part of the completion (trained on, like eos)."""
    from transformers import AutoConfig, GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json
        eos = getattr(AutoConfig.from_pretrained(model_path), "eos_token_id", None)
    ids = {tokenizer.eos_token_id} | set([eos] if isinstance(eos, int) else eos or [])
    marker = "lean-rl end-of-turn probe"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}],
            tokenize=False,
        )
    except Exception:  # no template, or one that refuses this turn (jinja raises its own types)
        text = ""
    if marker in text:
        tail = tokenizer(text[text.rindex(marker) + len(marker) :], add_special_tokens=False)
        special = set(tokenizer.all_special_ids) | {
            i for i, t in tokenizer.added_tokens_decoder.items() if t.special
        }
        ids |= set([i for i in tail["input_ids"] if i in special][:1])
    return sorted(i for i in ids if i is not None)


def take_groups(sample, groups, G):
    """The groups (prompt indices) `groups` of a rollout {"prompt_ids": N lists, "gens":
    Generations (N * G rows, prompt-major), "rewards": (N * G,), "per_func": {name: (N * G,)}}
    (grpo.sample_groups), in that order."""
    rows = torch.tensor([g * G + j for g in groups for j in range(G)], dtype=torch.long)
    gens = sample["gens"]
    return {
        "prompt_ids": [sample["prompt_ids"][g] for g in groups],
        "gens": Generations(
            gens.completion_ids[rows],
            gens.completion_mask[rows],
            None if gens.logprobs is None else gens.logprobs[rows],
        ),
        "rewards": sample["rewards"][rows],
        "per_func": {k: v[rows] for k, v in sample["per_func"].items()},
    }


def cat_groups(samples, pad_id):
    """Rollouts (take_groups' form) one after another, completions right-padded to the longest."""
    C = max(s["gens"].completion_ids.shape[1] for s in samples)

    def cat(field, value):
        parts = [getattr(s["gens"], field) for s in samples]  # (n * G, c) each, or None
        if parts[0] is None:
            return None
        return torch.cat([F.pad(t, (0, C - t.shape[1]), value=value) for t in parts])  # (., C)

    return {
        "prompt_ids": [p for s in samples for p in s["prompt_ids"]],
        "gens": Generations(
            cat("completion_ids", pad_id), cat("completion_mask", 0), cat("logprobs", 0.0)
        ),
        "rewards": torch.cat([s["rewards"] for s in samples]),
        "per_func": {
            k: torch.cat([s["per_func"][k] for s in samples]) for k in samples[0]["per_func"]
        },
    }


def make_batch(prompt_ids, gens, pad_id):
    """Left-padded prompts + right-padded completions: input_ids, attention_mask (B, P + C).

    gens.completion_ids, gens.completion_mask: (B, C) with each prompt's B / len(prompt_ids)
    completions adjacent (generation.py's layout). The sampler's kept sets, where it returned
    them (gens.sampling_kept (B, C, k)), travel with the batch as "sampling_kept"."""
    G = gens.completion_ids.shape[0] // len(prompt_ids)
    rows = [p for p in prompt_ids for _ in range(G)]
    P = max(len(p) for p in rows)
    prompt = torch.tensor([[pad_id] * (P - len(p)) + list(p) for p in rows])  # (B, P)
    prompt_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in rows])  # (B, P)
    batch = {
        "input_ids": torch.cat([prompt, gens.completion_ids], 1),  # (B, T)
        "attention_mask": torch.cat([prompt_mask, gens.completion_mask], 1),  # (B, T)
        "completion_mask": gens.completion_mask,
    }  # (B, C)
    if getattr(gens, "sampling_kept", None) is not None:
        batch["sampling_kept"] = gens.sampling_kept  # (B, C, k) int32
    return batch


# ---- Micro-batches ------------------------------------------------------------------------------
def plan_micro_batches(batch, micro_batch_size, max_tokens_per_microbatch=0, keep=None):
    """Index tensors over this rank's kept sequences, the same number on every rank (ZeRO-3 forwards
    and backwards are collectives); a rank short of micro-batches gets None (a zero-weight repeat),
    and a rank with no kept sequence gets only Nones.

    keep: optional (B,) bool, the rows to train on (None: all). By count (`micro_batch_size`
    sequences each, in order) or, with max_tokens_per_microbatch > 0, by a padded-token budget:
    sequences sorted by length, a micro-batch closed when one more sequence would make (sequences x
    longest) exceed the budget (a longer sequence goes alone)."""
    B = batch["input_ids"].shape[0]
    rows = torch.arange(B) if keep is None else keep.nonzero().flatten()  # (K,)
    plan = []
    if max_tokens_per_microbatch > 0 and len(rows):
        lengths = batch["attention_mask"].sum(1)  # (B,)
        cur, longest = [], 0
        # similar lengths together: little padding
        for i in rows[torch.argsort(lengths[rows])].tolist():
            new_longest = max(longest, int(lengths[i]))
            if cur and (len(cur) + 1) * new_longest > max_tokens_per_microbatch:
                plan.append(torch.tensor(cur))
                cur, new_longest = [], int(lengths[i])
            cur.append(i)
            longest = new_longest
        plan.append(torch.tensor(cur))
    elif len(rows):
        plan = list(rows.split(micro_batch_size))
    return plan + [None] * (all_max(len(plan)) - len(plan))


def mini_batch_plans(batch, num_mini_batches, micro_batch_size, max_tokens_per_microbatch=0):
    """PPO's mini-batches: rows split into `num_mini_batches` contiguous chunks first, then each
    chunk planned by count or token budget (plan_micro_batches, ranks agree on each). Which rows
    share an optimizer step so depends only on num_mini_batches, never on the micro-batch knobs:
    they change memory and speed, not the update."""
    B = batch["input_ids"].shape[0]
    plans = []
    for rows in torch.arange(B).chunk(num_mini_batches):
        sub = {k: batch[k][rows] for k in ("input_ids", "attention_mask")}
        plan = plan_micro_batches(sub, micro_batch_size, max_tokens_per_microbatch)
        plans.append([None if idx is None else rows[idx] for idx in plan])
    return plans


def micro_batches(batch, plan):
    """Yield (idx, micro-batch, weight) for each entry of `plan`: its rows `idx`, micro_slice(batch,
    idx) and weight 1.0. A None entry (this rank has fewer micro-batches than another) yields the
    plan's first micro-batch again (row 0 when the rank kept no row) with weight 0.0: every rank
    then runs the same number of forwards and backwards (ZeRO-3 gathers parameters in them, a
    collective), and the repeat adds nothing. Callers scale its loss by `weight` and skip writing
    its results (`if weight:`)."""
    repeat = next((idx for idx in plan if idx is not None), torch.tensor([0]))
    for idx in plan:
        rows = repeat if idx is None else idx
        yield rows, micro_slice(batch, rows), 0.0 if idx is None else 1.0


def micro_slice(batch, idx):
    """Rows `idx`, with all-padding columns cut: left prompt padding and completion tail.

    Returns input_ids, attention_mask (b, t), completion_mask (b, c), logits_to_keep = c, and every
    other entry of `batch` sliced alike: (B,) -> (b,), (B, C) -> (b, c), None stays None."""
    C = batch["completion_mask"].shape[1]
    am = batch["attention_mask"][idx]  # (b, T)
    c = max(int(batch["completion_mask"][idx].sum(1).max()), 1)
    start = int(am[:, :-C].any(0).float().argmax()) if am.shape[1] > C else 0
    end = am.shape[1] - C + c
    out = {
        "input_ids": batch["input_ids"][idx, start:end],
        "attention_mask": am[:, start:end],  # (b, t)
        "completion_mask": batch["completion_mask"][idx, :c],
        "logits_to_keep": c,
    }  # (b, c)
    for key, value in batch.items():
        if key not in out:
            out[key] = rows_of(value, idx, c)
    return out


def rows_of(value, idx, c):
    """A whole-batch value cut to rows `idx` and completion columns :c, the one way a micro-batch
    is cut: (B,) -> (b,), (B, C) -> (b, c) (and (B, C, k) -> (b, c, k)); a number, a 0-d tensor
    or None stays as it is. micro_slice cuts a batch's entries with it and micro_stats the whole
    batch's statistics."""
    if not torch.is_tensor(value) or value.dim() == 0:
        return value
    return value[idx] if value.dim() == 1 else value[idx, :c]


def micro_stats(stats, idx, mb, device):
    """Micro-batch `mb`'s (rows `idx`, a zero-weight repeat's too) share of the WHOLE batch's
    statistics {name: a number, (B,) or (B, C)} (grpo.batch_stats): tensors cut by rows_of, as mb
    itself was, and moved to `device`; numbers as they are."""
    c = mb["logits_to_keep"]
    cut = {k: rows_of(v, idx, c) for k, v in stats.items()}
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in cut.items()}


# ---- Packing: a micro-batch as one row without padding -------------------------------------------
def pack(mb):
    """One row without padding: the micro-batch's sequences back to back, positions restarting at 0
    for each (transformers then masks attention per sequence). Returns input_ids (1, N),
    position_ids (1, N) and `where` (M,): the positions whose next token is a completion token, in
    row-major order of the (b, c) completion mask."""
    ids, pos, where, offset = [], [], [], 0
    for row, am, cm in zip(mb["input_ids"], mb["attention_mask"], mb["completion_mask"]):
        seq = row[am.bool()]  # (L,) prompt + completion, no padding
        n_c, L = int(cm.sum()), len(seq)
        ids.append(seq)
        pos.append(torch.arange(L))
        # position t predicts token t + 1
        where.append(torch.arange(offset + L - n_c - 1, offset + L - 1))
        offset += L
    return torch.cat(ids)[None], torch.cat(pos)[None], torch.cat(where)


def forward_logps(
    model,
    mb,
    temperature,
    packing,
    device,
    return_entropy=False,
    chunk_size=0,
    top_k=0,
    top_p=1.0,
    top_k_rule="triton",
):
    """(b, c) log-probs (and entropies) of micro-batch mb's completion tokens, padded or packed
    (one row, positions restarting per sequence: the same values, no padded tokens computed).
    chunk_size: tokens per fused log-prob tile (0: logprobs.py's default).

    top_k > 0 or top_p < 1 (the policy sampled with them): under the distribution renormalised
    over the tokens the sampler kept (logprobs.py), cut at mb["sampling_thresholds"] (b, c, 2) when
    an earlier scoring found them, else found now and set there (on the CPU), so a later forward
    of the same rows (a micro-batch of the update, another iteration) uses the same cut.
    top_k_rule: the sampler's (generation.sampler_top_k_rule). mb["sampling_kept"] (b, c, k), the
    sets the sampler returned (Generations.sampling_kept): replayed as they are, no cut found."""
    kw = dict(temperature=temperature, return_entropy=return_entropy, chunk_size=chunk_size)
    if sequence_parallel.layout() is not None:  # this rank scores its 1/S of the row
        cut = dict(top_k=top_k, top_p=top_p, top_k_rule=top_k_rule) if top_k or top_p < 1 else {}
        return _sliced_logps(model, mb, packing, device, kw, cut)
    found = mb.get("sampling_thresholds")  # (b, c, 2) or None: (tau, n) per token
    replay = mb.get("sampling_kept")  # (b, c, k) or None: the sampler's own kept ids
    if replay is not None:
        return _replayed_logps(model, mb, replay, packing, device, kw)
    if top_k > 0 or top_p < 1:
        kw.update(top_k=top_k, top_p=top_p, return_thresholds=True, top_k_rule=top_k_rule)
    if not packing:
        if "top_p" in kw and found is not None:
            kw["thresholds"] = found.to(device)  # (b, c, 2)
        out = model_logps(
            model,
            mb["input_ids"].to(device),
            mb["attention_mask"].to(device),
            mb["logits_to_keep"],
            **kw,
        )  # (b, c) each
        if "top_p" not in kw:
            return out
        mb["sampling_thresholds"] = out[-1].cpu()  # (b, c, 2)
        return out[:-1] if return_entropy else out[0]
    ids, pos, where = pack(mb)  # (1, N), (1, N), (M,)
    cm, where = mb["completion_mask"], where.to(device)
    if "top_p" in kw and found is not None:  # the prompt's positions: no cut (-inf)
        flat = torch.full((1, ids.shape[1] - 1, 2), float("-inf"), device=device)  # (1, N - 1, 2)
        flat[0, where] = found[cm.bool()].to(device)  # row-major, as pack's `where`
        kw["thresholds"] = flat
    out = model_logps(
        model, ids.to(device), None, ids.shape[1] - 1, position_ids=pos.to(device), **kw
    )  # (1, N - 1) each: token j + 1 at j
    out = list(out) if isinstance(out, tuple) else [out]
    cut = out.pop()[0, where].detach() if "top_p" in kw else None  # (M, 2)
    out = [unpack(x[0, where], cm) for x in out]  # (b, c) each
    if cut is not None:
        mb["sampling_thresholds"] = torch.stack([unpack(c, cm) for c in cut.unbind(1)], -1).cpu()
    return tuple(out) if return_entropy else out[0]


def left_aligned(mb):
    """The micro-batch with each sequence from column 0 and its padding after it: causal attention
    then needs no mask (no real token sees padding), which sequence parallelism's attention takes
    none of. Returns input_ids, position_ids (b, L) and `where` (M,): the flat (b * L) positions
    whose next token is a completion token, in row-major order of the (b, c) completion mask."""
    rows = [row[am.bool()] for row, am in zip(mb["input_ids"], mb["attention_mask"])]
    L = max(len(r) for r in rows)
    ids = torch.stack([F.pad(r, (0, L - len(r))) for r in rows])  # (b, L): 0 after the end
    where = []
    for i, (r, n_c) in enumerate(zip(rows, mb["completion_mask"].sum(1).tolist())):
        where.append(torch.arange(len(r) - n_c - 1, len(r) - 1) + i * L)  # t predicts t + 1
    return ids, torch.arange(L).expand(len(rows), L), torch.cat(where)


def _sliced_logps(model, mb, packing, device, kw, cut):
    """forward_logps under sequence parallelism (sequence_parallel.py): the micro-batch left-
    aligned (or packed into one row, for an attention that reads packed sequences from position
    ids), each rank of the group scoring its slice of every row with the tokens its positions
    predict, gathered: (b, c). cut: forward_logps' top_k, top_p and top_k_rule when the sampler
    cut (a position's cut reads only its own logits, so each slice finds or replays its own):
    the sampler's kept sets or the thresholds found earlier travel with the positions."""
    ids, pos, where = pack(mb) if packing else left_aligned(mb)  # (b', L) twice, (M,)
    cm, where = mb["completion_mask"], where.to(device)
    replay, found = mb.get("sampling_kept"), mb.get("sampling_thresholds")
    side, fill, name = None, 0, None  # a per-position input of the forward: its fill and keyword
    if replay is not None:  # (b, c, k): the sampler's own kept ids, -1 padded
        fill, name = -1, "kept_ids"
        side = _at_positions(replay, ids, where, cm, fill)  # (b', L, k)
    elif cut:
        kw = dict(kw, **cut, return_thresholds=True)
        if found is not None:  # (b, c, 2): a position outside the completions has no cut (-inf)
            fill, name = float("-inf"), "thresholds"
            side = _at_positions(found, ids, where, cm, fill)  # (b', L, 2)

    def score(ids, pos, targets, side=None):  # (1, n) each: this rank's slice; side (1, n, ...)
        ids, pos, targets = ids.to(device), pos.to(device), targets.to(device)
        given = {} if side is None else {name: side.to(device)}
        n = ids.shape[1]
        return model_logps(model, ids, None, n, position_ids=pos, targets=targets, **kw, **given)

    out = sequence_parallel.row_forward(score, ids, pos, side=side, side_fill=fill)  # (b', L)
    out = _listed(out)  # each (b', L, ...): token j + 1 at j
    if kw.get("return_thresholds"):
        tau = out.pop().detach().flatten(0, 1)[where]  # (M, 2)
        mb["sampling_thresholds"] = torch.stack([unpack(t, cm) for t in tau.unbind(1)], -1).cpu()
    out = [unpack(x.flatten()[where], cm) for x in out]  # (b, c) each
    return tuple(out) if kw["return_entropy"] else out[0]


def _at_positions(per_token, ids, where, completion_mask, fill):
    """(b, c, ...) per completion token -> (b', L, ...) at the positions that predict them (pack's
    or left_aligned's `where`), `fill` at every other position."""
    flat = per_token.new_full((ids.numel(), *per_token.shape[2:]), fill)  # (b' L, ...)
    flat[where.cpu()] = per_token[completion_mask.bool()]  # row-major, as `where`
    return flat.view(*ids.shape, *per_token.shape[2:])


def _listed(out):
    return list(out) if isinstance(out, tuple) else [out]


def _replayed_logps(model, mb, replay, packing, device, kw):
    """forward_logps over the kept sets the sampler returned (b, c, k): the log-probs
    renormalised over exactly those (logprobs.fused_logps' kept_ids)."""
    if not packing:
        out = model_logps(
            model,
            mb["input_ids"].to(device),
            mb["attention_mask"].to(device),
            mb["logits_to_keep"],
            kept_ids=replay.to(device),
            **kw,
        )
        return out
    ids, pos, where = pack(mb)  # (1, N), (1, N), (M,)
    cm, where = mb["completion_mask"], where.to(device)
    flat = torch.full((1, ids.shape[1] - 1, replay.shape[-1]), -1, device=device)  # the prompt's
    flat[0, where] = replay[cm.bool()].to(device=device, dtype=flat.dtype)  # (1, N - 1, k)
    out = model_logps(
        model, ids.to(device), None, ids.shape[1] - 1, position_ids=pos.to(device), **kw,
        kept_ids=flat,
    )  # fmt: skip
    out = [unpack(x[0, where], cm) for x in (out if isinstance(out, tuple) else (out,))]
    return tuple(out) if kw["return_entropy"] else out[0]


def unpack(flat, completion_mask):
    """(M,) in row-major order of the mask -> (b, c), 0 where the mask is 0 (differentiable)."""
    out = flat.new_zeros(completion_mask.shape)  # (b, c)
    return out.masked_scatter(completion_mask.bool().to(flat.device), flat)


# ---- The process group and collectives on its device ---------------------------------------------
def init_distributed():
    """DeepSpeed's process group (NCCL on GPUs, gloo on CPU) -> (rank, world size, this rank's
    device)."""
    import warnings  # DeepSpeed 0.19 calls c10d APIs that torch 2.13 deprecates, every collective

    warnings.filterwarnings(
        "ignore", message=r".*is deprecated. Please use `torch.distributed", category=FutureWarning
    )
    import deepspeed

    cuda = torch.cuda.is_available()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def all_sum(values):
    """Python numbers summed over all ranks (float64), as a list (as floats without a process
    group)."""
    if not dist.is_initialized():
        return [float(v) for v in values]
    return all_reduce_(torch.tensor(values, dtype=torch.float64)).tolist()


def all_sum_dict(sums):
    """{name: number} summed over ranks, key by key, in sorted order. A loss returns the same keys
    on every rank by construction (every rank runs the same micro-batches, zero-weight repeats
    included, through the same code), so the keys never need listing anywhere."""
    keys = sorted(sums)
    return dict(zip(keys, all_sum([sums[k] for k in keys])))


def token_means(values, mask):
    """{name: the mean of values[name] (B, C) over the mask's (B, C) tokens of every rank}, in one
    collective: a loop's per-token metrics, written where they are computed (ppo.py's step 3)."""
    names = list(values)
    sums = all_sum([(values[k] * mask).sum().item() for k in names] + [mask.sum().item()])
    return {k: s / sums[-1] for k, s in zip(names, sums)}


# ---- A micro-batch's per-token loss inputs ------------------------------------------------------
@dataclass
class LossInputs:
    """What a loss reads per token, on the device; its coefficients come from the loop's Args."""

    logps: torch.Tensor  # (b, c) the policy's log-probs of the sampled tokens, with grad
    old_logps: torch.Tensor  # (b, c) the sampling policy's, no grad (on-policy: logps.detach())
    advantages: torch.Tensor  # (b,) one per sequence or (b, c) one per token
    mask: torch.Tensor  # (b, c) float, 1 on the tokens the loss counts
    ref_logps: torch.Tensor | None = None  # (b, c) a reference policy's (a KL term), no grad
    weights: torch.Tensor | None = None  # (b, c) per-token weights, no grad (importance weights)
    entropy: torch.Tensor | None = None  # (b, c) the policy's token entropy, with grad


def loss_inputs(mb, logps, entropy, device, mask=None):
    """LossInputs of micro-batch `mb` (its "old_logps", "ref_logps", "advantages", "is_weights"
    when present) around this forward's logps and entropy (b, c). Old log-probs are always there:
    without a pass of their own (on-policy) the sampling policy is this forward's, detached, so a
    term on logps - old_logps is what it says (zero, with its gradient). mask: the loss's tokens
    (default the completion's)."""

    def get(key):
        return None if mb.get(key) is None else mb[key].to(device)

    old = get("old_logps")
    return LossInputs(
        logps=logps,
        old_logps=logps.detach() if old is None else old,
        advantages=get("advantages"),
        mask=(mb["completion_mask"] if mask is None else mask).to(device).to(logps.dtype),
        ref_logps=get("ref_logps"),
        weights=get("is_weights"),
        entropy=entropy,
    )

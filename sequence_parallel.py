"""Sequence parallelism: S ranks share every sequence, each computing 1/S of its tokens, so a
sequence S times longer fits the same memory (DeepSpeed's Ulysses attention, the Arctic Long
Sequence Training pieces of `deepspeed/runtime/sequence_parallel/ulysses_sp.py`).

    sp = sequence_parallel.init(2)                       # after the process group; every rank
    sequence_parallel.install("sdpa")                    # before the first forward
    with sequence_parallel.paused(): model.generate(...) # whole sequences, one rank
    out = sequence_parallel.row_forward(fn, ids, pos)    # fn(ids, pos) on this rank's slice

Layout (DeepSpeed's): world W = D * S ranks; sequence-parallel group i is ranks [i S, (i + 1) S),
data-parallel group j is ranks {j, j + S, ...}, one rank of each sequence-parallel group. The S
ranks of a group hold the same batch (their data rank is rank // S, which picks prompts and seeds
sampling), compute the same loss from it, and each runs the model on its 1/S of every row:

  1. the row (one sequence, or several packed with position ids restarting per sequence) is padded
     at its end to a multiple of S (causal attention: no real token sees the padding), each
     position paired with the token it predicts (shifted before slicing, so a slice's last
     position predicts the next slice's first token);
  2. each rank runs the model on its slice with the slice's own position ids; in every attention
     layer Ulysses' all-to-all trades the sequence split for a head split (each rank attends over
     the whole sequence with H / S heads), and back. No attention mask travels: sdpa runs
     causal over one sequence, flash-attn's varlen kernels read packed sequences from the
     position ids, so attention never builds a (T, T) mask;
  3. the per-position outputs (log-probs, entropies, values, scores) are gathered over the group,
     whose backward keeps this rank's slice of the gradient: every rank computes the same loss
     from the gathered tensor, so the slice's share is exact, and the S ranks' parameter
     gradients add up to the whole sequence's. DeepSpeed averages gradients over all W ranks
     (its data-parallel world is the whole world here); the loops multiply by W, as they undo its
     data-parallel average without sequence parallelism.

Sums over the batch (the loss's normaliser, metrics, the keep plan) run over the data-parallel
group (zero3_utils.set_data_group): the S ranks of a group hold the same numbers, so summing over
the world would count each S times. Letters: L tokens of a row, L' = L padded to a multiple of
S, n = L' / S tokens of a slice, M positions kept.
"""

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Layout:
    """This rank's place: `size` S, `rank` within its sequence-parallel `group`; the data-parallel
    `data_group` (one rank per sequence-parallel group), `data_rank` and `data_world` (= W / S)."""

    size: int
    rank: int
    group: object
    data_group: object
    data_rank: int
    data_world: int


_LAYOUT = None  # the run's Layout (init), None without sequence parallelism
_ACTIVE = True  # attention runs Ulysses' all-to-all (once installed), but while paused()
_ULYSSES = {}  # (batch, heads, kv heads, head size) -> UlyssesSPAttentionHF


def layout():
    """The run's Layout, or None without sequence parallelism (S = 1)."""
    return _LAYOUT


def init(size):
    """The groups of S = `size` (> 1) over the whole world; every rank calls it, in the same order
    (dist.new_group is a collective). Returns this rank's Layout and makes it the run's."""
    global _LAYOUT
    world, rank = dist.get_world_size(), dist.get_rank()
    if size < 2 or world % size:
        raise ValueError(f"sequence_parallel_size={size} must be > 1 and divide the world {world}")
    group = data_group = None
    for i in range(world // size):  # sequence-parallel groups: consecutive ranks
        g = dist.new_group(list(range(i * size, (i + 1) * size)))
        group = g if rank // size == i else group
    for j in range(size):  # data-parallel groups: the j-th rank of every sequence-parallel group
        g = dist.new_group(list(range(j, world, size)))
        data_group = g if rank % size == j else data_group
    _LAYOUT = Layout(size, rank % size, group, data_group, rank // size, world // size)
    return _LAYOUT


def install(core_attn_implementation):
    """Route `core_attn_implementation` (sdpa, flash_attention_2, ...) through Ulysses: every
    forward of every model then computes a slice (row_forward), and so does the recomputation of
    a checkpointed layer in backward; generation (whole sequences, on one rank of the group)
    runs under paused(). Models keep their config's attention name, so every branch of
    transformers that reads it still runs (DeepSpeed's register_with_transformers does the same)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    core = ALL_ATTENTION_FUNCTIONS[core_attn_implementation]
    if getattr(core, "lean_rl_ulysses", False):
        return  # installed already

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        if not _ACTIVE:
            return core(module, query, key, value, attention_mask, *args, **kwargs)
        # (b, heads, n, head size) in; the mask is dropped: positions carry the structure
        return _ulysses(core, query, key)(module, query, key, value, None, *args, **kwargs)

    attention.lean_rl_ulysses = True
    ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = attention


def _ulysses(core, query, key):
    """DeepSpeed's Ulysses attention for these shapes (it checks them), built once per shape."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    b, heads, _, head_size = query.shape
    shape = (b, heads, key.shape[1], head_size)
    if shape not in _ULYSSES:
        _ULYSSES[shape] = UlyssesSPAttentionHF(
            attn=core,
            batch_size=b,
            attn_head_count=heads,
            attn_head_size=head_size,
            kv_head_count=key.shape[1],
            num_hidden_layers=1,  # read by a debug mode only
            process_group=_LAYOUT.group,
            seq_length_is_variable=True,
        )
    return _ULYSSES[shape]


def from_first(obj):
    """A picklable `obj` as the group's first rank holds it, on every rank of the group (rollouts
    and rewards: sampled once per group, the same on all its ranks)."""
    box = [obj]
    first = dist.get_global_rank(_LAYOUT.group, 0)
    dist.broadcast_object_list(box, src=first, group=_LAYOUT.group)
    return box[0]


class _Gather(torch.autograd.Function):
    """(b, n, ...) slices -> (b, L', ...) over the group; backward: this rank's slice of the
    gradient, with no collective (every rank's loss is the same function of the whole)."""

    @staticmethod
    def forward(ctx, x):
        ctx.n, ctx.rank = x.shape[1], _LAYOUT.rank
        parts = [torch.empty_like(x) for _ in range(_LAYOUT.size)]
        dist.all_gather(parts, x.contiguous(), group=_LAYOUT.group)
        return torch.cat(parts, 1)  # (b, L', ...)

    @staticmethod
    def backward(ctx, grad):
        return grad[:, ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n]  # (b, n, ...)


@contextmanager
def paused():
    """The core attention as it is inside: generation samples whole sequences on one rank."""
    global _ACTIVE
    _ACTIVE = False
    try:
        yield
    finally:
        _ACTIVE = True


def row_forward(fn, ids, pos, pad_id=0, side=None, side_fill=0):
    """fn's per-position outputs over whole rows, each rank computing its slice of every row.

    ids, pos: (b, L) rows and their position ids (each row one sequence from column 0 with padding
    only at its end, or several packed sequences with positions restarting at 0). fn(ids, pos,
    targets) -> a tensor or a tuple of tensors (b, n, ...) for this rank's slice: ids and pos
    (b, n), targets (b, n) the token each position predicts (pad_id past the row's end). Returns
    the same tensors gathered over the group, cut to the rows: (b, L, ...), position j's output
    at j. side: a per-position input (b, L, ...), sliced as ids (side_fill past the row's end)
    and passed as fn's fourth argument. Every rank of the group calls it with the same rows."""
    S, r = _LAYOUT.size, _LAYOUT.rank
    b, L = ids.shape
    n = -(-L // S)  # ceil: the slice length
    extra = n * S - L
    tail = pos[:, -1:] + torch.arange(1, extra + 1, device=pos.device)  # (b, L' - L) continuing
    ids_p = torch.cat([ids, ids.new_full((b, extra), pad_id)], 1)  # (b, L')
    pos_p = torch.cat([pos, tail], 1)  # (b, L')
    targets = torch.cat([ids_p[:, 1:], ids.new_full((b, 1), pad_id)], 1)  # (b, L') next token
    mine = slice(r * n, (r + 1) * n)
    if side is None:
        out = fn(ids_p[:, mine], pos_p[:, mine], targets[:, mine])
    else:
        fill = side.new_full((b, extra, *side.shape[2:]), side_fill)
        side = torch.cat([side, fill], 1)[:, mine]  # (b, n, ...)
        out = fn(ids_p[:, mine], pos_p[:, mine], targets[:, mine], side)
    single = not isinstance(out, tuple)
    out = [_Gather.apply(x)[:, :L] for x in ([out] if single else out)]  # (b, L, ...) each
    return out[0] if single else tuple(out)

"""Tiled MLP (--tiled_mlp): each decoder layer's MLP computed over its tokens in tiles, with
DeepSpeed's TiledMLP (deepspeed 0.19.8, runtime/sequence_parallel/ulysses_sp.py, Arctic Long
Sequence Training). Imports no sibling file.

    n = tile_mlps(model)   # every MLP module of the model, in place; n: how many

Letters: T tokens of a row, H hidden size, I MLP width, t tokens per tile.
An MLP (Llama, Qwen2, Mistral, Gemma: down(act(gate(x)) * up(x))) acts on each token alone, so
the tokens can go through it a tile at a time. Its four (T, I) temporaries (gate, up, act(gate),
their product; 4 b I bytes per token in the training dtype) are then held for one tile of t = H
tokens at a time (DeepSpeed's choice: ceil(T / H) tiles), and backward keeps only the MLP's
input: TiledMLP runs each tile's forward again in backward, under autograd, then drops it. The
values are the same as the untiled MLP's up to the order of floating-point sums (each weight's
gradient is the sum over tiles); the cost is one more MLP forward per layer in backward (a third
with gradient checkpointing). Under ZeRO-3 every rank must run as many tiles (each one gathers
the MLP's weights), so the count is the largest over the ranks (an all-reduce per MLP call, only
while the weights are partitioned: not in a generation's gather, nor for persistent ones);
TiledMLP marks the weights' gradients ready only after the last tile (ds_grad_is_ready), so
ZeRO-2/3 reduce each gradient once.
"""

import math
import types

import torch.distributed as dist
from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from zero3_utils import all_max


def _is_mlp(module):
    """A per-token MLP of a transformers decoder layer (LlamaMLP, Qwen2MLP, Phi3MLP, ...)."""
    return type(module).__name__.endswith("MLP") and any(
        hasattr(module, name) for name in ("down_proj", "fc2", "w2")
    )


def tiles_for(tokens, hidden_size):
    """How many tiles a row of `tokens` goes through the MLP in: one per hidden_size tokens, as
    DeepSpeed's TiledMLP example does (a tile's (t, I) temporaries near the (H, I) weights')"""
    return max(1, math.ceil(tokens / hidden_size))


def _gathered_per_call(param):
    # ZeRO-3 partitioned and not held whole (persistent, or inside a gather as the generation's):
    # each call of its module all-gathers it. Alike on every rank (not a measured state).
    return getattr(param, "ds_status", ZeroParamStatus.AVAILABLE) != ZeroParamStatus.AVAILABLE


def _tiled_forward(self, x):
    # x: (B, T, H) -> (B, T, H), computed in tiles of T
    shards = tiles_for(x.shape[-2], x.shape[-1])
    params = list(self.parameters())
    if dist.is_initialized() and any(_gathered_per_call(p) for p in params):
        # ZeRO-3: every tile gathers the MLP's weights, so every rank runs as many tiles
        shards = all_max(shards)
    trained = [p for p in params if p.requires_grad]
    # the class's forward (this instance's is this function), called on each tile
    return TiledMLP.apply(type(self).forward, self, x, shards, trained)


def tile_mlps(model):
    """Every MLP module of `model` (and of a model wrapped by peft) computes in tiles from now on,
    in place (its forward replaced on the instance). Returns how many; 0 raises a ValueError (a
    model without Llama-style MLPs)."""
    n = 0
    for module in model.modules():
        if _is_mlp(module):
            module.forward = types.MethodType(_tiled_forward, module)  # tiled once, if twice
            n += 1
    if not n:
        raise ValueError(
            f"--tiled_mlp: {type(model).__name__} has no per-token MLP modules (a class named "
            "*MLP with down_proj); run it without --tiled_mlp"
        )
    return n

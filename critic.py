"""PPO's critic: a causal LM's body (or a reward model's) and a scalar value head, and the forward
that scores a micro-batch's completion tokens, padded or packed (batching.pack).

    critic = build_critic(path, from_reward_model, dtype, attn_implementation, ds_config=None)
    values = forward_values(critic, mb, packing, device)   # (b, c) fp32

B, T = rows and length of any input; b = sequences in a micro-batch, t = their padded length,
c = completion tokens kept, H = hidden size, N = tokens in a packed row. Imports batching.py
(pack, unpack), logprobs.py (positions) and zero3_load.py (models built partitioned under ZeRO-3).
"""

import torch
from transformers import AutoModel, AutoModelForSequenceClassification

import sequence_parallel
from batching import left_aligned, pack, unpack
from logprobs import positions_from_mask
from zero3_load import load_model


class Critic(torch.nn.Module):
    """A causal LM's body + a scalar value head: forward -> (B, T) fp32 values, one per position."""

    def __init__(self, body, value_head):
        super().__init__()
        self.body, self.value_head = body, value_head
        self.config = body.config

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        hidden = self.body(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        ).last_hidden_state  # (B, T, H)
        return self.value_head(hidden).squeeze(-1).float()  # (B, T)


def build_critic(path, from_reward_model, dtype, attn_implementation, ds_config=None):
    """From a reward model: its body and its score head. From a causal LM: its body and a zero
    value head (values start at 0, the body's features are trained by the value loss). With a
    ZeRO-3 ds_config the body (and score head) are built partitioned (zero3_load.load_model);
    a new value head is partitioned by deepspeed.initialize."""
    kw = dict(dtype=dtype, attn_implementation=attn_implementation, ds_config=ds_config)
    if from_reward_model:
        rm = load_model(AutoModelForSequenceClassification, path, num_labels=1, **kw)
        return Critic(getattr(rm, rm.base_model_prefix), rm.score)
    body = load_model(AutoModel, path, **kw)
    head = torch.nn.Linear(body.config.hidden_size, 1, bias=False, dtype=dtype)
    torch.nn.init.zeros_(head.weight)
    return Critic(body, head)


def forward_values(critic, mb, packing, device):
    """(b, c) values of the states before each completion token, padded or packed (under
    sequence parallelism: each rank computing its slice, sequence_parallel.py)."""
    if sequence_parallel.layout() is not None:  # left-aligned (or packed), sliced
        ids, pos, where = pack(mb) if packing else left_aligned(mb)  # (b', L) twice, (M,)

        def values(ids, pos, targets):  # (b', n): this rank's slice
            return critic(input_ids=ids.to(device), position_ids=pos.to(device))

        out = sequence_parallel.row_forward(values, ids, pos)  # (b', L)
        return unpack(out.flatten()[where.to(device)], mb["completion_mask"])  # (b, c)
    if not packing:
        am = mb["attention_mask"].to(device)  # (b, t)
        values = critic(
            input_ids=mb["input_ids"].to(device),
            attention_mask=am,
            position_ids=positions_from_mask(am),
        )
        c = mb["logits_to_keep"]
        return values[:, -c - 1 : -1]  # (b, c)
    ids, pos, where = pack(mb)
    # (1, N)
    values = critic(input_ids=ids.to(device), attention_mask=None, position_ids=pos.to(device))
    return unpack(values[0, where.to(device)], mb["completion_mask"])  # (b, c)

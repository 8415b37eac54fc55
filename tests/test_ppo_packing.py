"""Packing: log-probs, entropies and values of sequences packed into one row equal those of the
padded batch and of each sequence alone (fp32, 1e-5), for SDPA and eager attention; gradients
too."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from batching import micro_slice, pack
from ppo import build_critic, forward_logps, forward_values


def ragged_batch(seed=0, B=5, C=4):
    """Left-padded prompts of 2-6 tokens + right-padded completions of 1-C tokens (vocab of
    tiny_model)."""
    g = torch.Generator().manual_seed(seed)
    p_len = torch.randint(2, 7, (B,), generator=g)
    c_len = torch.randint(1, C + 1, (B,), generator=g)
    c_len[0] = C
    P = int(p_len.max())
    ids = torch.zeros(B, P + C, dtype=torch.long)
    am = torch.zeros(B, P + C, dtype=torch.long)
    for i in range(B):
        ids[i, P - p_len[i] : P] = torch.randint(4, 60, (int(p_len[i]),), generator=g)
        ids[i, P : P + c_len[i]] = torch.randint(4, 60, (int(c_len[i]),), generator=g)
        am[i, P - p_len[i] : P + c_len[i]] = 1
    return {"input_ids": ids, "attention_mask": am, "completion_mask": am[:, P:].clone()}


def test_pack_layout():
    batch = ragged_batch()
    mb = micro_slice(batch, torch.arange(5))
    ids, pos, where = pack(mb)
    lengths = mb["attention_mask"].sum(1)
    assert ids.shape == (1, int(lengths.sum())) and pos.shape == ids.shape
    assert int((pos == 0).sum()) == 5  # positions restart at 0 for each sequence
    assert len(where) == int(mb["completion_mask"].sum())
    rows, cols = mb["completion_mask"].bool().nonzero(as_tuple=True)  # completion tokens, row-major
    P = mb["input_ids"].shape[1] - mb["completion_mask"].shape[1]
    # `where` predicts them
    torch.testing.assert_close(ids[0, where + 1], mb["input_ids"][rows, P + cols])


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_equals_padded(tiny_model, attn):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model, dtype=torch.float32, attn_implementation=attn
    )
    critic = build_critic(tiny_model, False, torch.float32, attn)
    torch.nn.init.normal_(critic.value_head.weight)  # a zero head would make every value 0
    batch = ragged_batch()
    mb = micro_slice(batch, torch.arange(5))
    cpu = torch.device("cpu")
    mask = mb["completion_mask"].bool()

    lp_pad, ent_pad = forward_logps(model, mb, 0.7, False, cpu, return_entropy=True)  # (b, c)
    lp_pack, ent_pack = forward_logps(model, mb, 0.7, True, cpu, return_entropy=True)
    torch.testing.assert_close(lp_pack[mask], lp_pad[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent_pack[mask], ent_pad[mask], atol=1e-5, rtol=1e-5)
    assert torch.all(lp_pack[~mask] == 0)
    # (b, c)
    v_pad, v_pack = (forward_values(critic, mb, False, cpu), forward_values(critic, mb, True, cpu))
    torch.testing.assert_close(v_pack[mask], v_pad[mask], atol=1e-5, rtol=1e-5)

    # each sequence alone, no padding at all: the ground truth for both
    for i in range(5):
        alone = micro_slice(batch, torch.tensor([i]))
        n = int(alone["completion_mask"].sum())
        torch.testing.assert_close(
            forward_logps(model, alone, 0.7, False, cpu)[0, :n],
            lp_pack[i, :n],
            atol=1e-5,
            rtol=1e-5,
        )
        torch.testing.assert_close(
            forward_values(critic, alone, False, cpu)[0, :n], v_pack[i, :n], atol=1e-5, rtol=1e-5
        )

    # gradients of a loss through the packed path equal the padded path's (in fp64: a gradient sums
    # many tokens, and fp32 summation order alone moves it by ~1e-4). Not for eager: in fp64 its
    # padded path turns fully masked left-padding rows into NaN gradients (transformers' mask).
    if attn == "eager":
        return
    model.double()
    critic.double()

    def grads(packing):
        model.zero_grad()
        critic.zero_grad()
        w = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        loss = (forward_logps(model, mb, 0.7, packing, cpu) * w * mask).sum() + (
            forward_values(critic, mb, packing, cpu) * w * mask
        ).sum()
        loss.backward()
        return [p.grad.clone() for p in list(model.parameters()) + list(critic.parameters())]

    for a, b in zip(grads(False), grads(True)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8)


def test_packing_without_restarted_positions_attends_across(tiny_model):
    """The check above can fail: one causal row over all sequences (no per-sequence mask)
    differs."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    mb = micro_slice(ragged_batch(), torch.arange(5))
    ids, pos, where = pack(mb)
    with torch.no_grad():
        per_seq = model(input_ids=ids, position_ids=pos).logits[
            0, where
        ]  # (M, V) positions restart
        one_row = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None]).logits[
            0, where
        ]
    first = int(mb["completion_mask"][0].sum())  # the first sequence sees nothing else either way
    torch.testing.assert_close(per_seq[:first], one_row[:first], atol=1e-5, rtol=1e-5)
    assert (per_seq[first:] - one_row[first:]).abs().max() > 1e-3

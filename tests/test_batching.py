"""batching.py: padded batches, micro-batch plans (by count, by token budget, ranks agreeing),
micro-batch slices, and the collectives (on 2 real gloo processes)."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from batching import (
    all_sum,
    encode_prompts,
    make_batch,
    micro_batches,
    micro_slice,
    micro_stats,
    plan_micro_batches,
    token_means,
)
from zero3_utils import all_cat, comm_device


def ragged(B=6, P=5, C=4, seed=0):
    """Left-padded prompts of 1-P tokens, right-padded completions of 0-C tokens, with extra
    entries."""
    g = torch.Generator().manual_seed(seed)
    p_len, c_len = (
        torch.randint(1, P + 1, (B,), generator=g),
        torch.randint(0, C + 1, (B,), generator=g),
    )
    am = torch.cat(
        [torch.arange(P)[None] >= P - p_len[:, None], torch.arange(C)[None] < c_len[:, None]], 1
    ).long()
    ids = torch.randint(4, 40, (B, P + C), generator=g) * am
    return {
        "input_ids": ids,
        "attention_mask": am,
        "completion_mask": am[:, P:].clone(),
        "advantages": torch.randn(B, generator=g),
        "old_logps": torch.randn(B, C, generator=g),
        "ref_logps": None,
    }


def test_encode_prompts_and_make_batch(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    rows = [{"prompt": "12="}, {"prompt": "3456="}]
    ids = encode_prompts(tok, rows, max_prompt_length=4)
    assert ids == [tok("12=")["input_ids"], tok("3456=")["input_ids"][-4:]]  # cut from the left end
    comp = torch.tensor([[5, 6, 2], [7, 2, 0], [8, 0, 0], [9, 9, 9]])  # 2 completions per prompt
    gens = SimpleNamespace(completion_ids=comp, completion_mask=(comp != 0).long())
    batch = make_batch(ids, gens, pad_id=0)
    P = max(map(len, ids))
    for row in range(4):
        p = ids[row // 2]  # prompt-major: completions 0, 1 belong to prompt 0
        want = [0] * (P - len(p)) + p + comp[row].tolist()
        assert batch["input_ids"][row].tolist() == want
        assert (
            batch["attention_mask"][row].tolist()
            == [0] * (P - len(p)) + [1] * len(p) + (comp[row] != 0).tolist()
        )
    assert batch["completion_mask"] is gens.completion_mask


@pytest.mark.parametrize("micro", [1, 4, 6, 8])
def test_plan_by_count(micro):
    plan = plan_micro_batches(ragged(), micro)
    assert torch.cat(plan).tolist() == list(range(6)) and all(len(i) <= micro for i in plan)
    assert len(plan) == -(-6 // micro)


@pytest.mark.parametrize("budget", [1, 10, 20, 40, 1000])
def test_plan_by_token_budget(budget):
    batch = ragged(B=12, seed=3)
    lengths = batch["attention_mask"].sum(1)
    plan = plan_micro_batches(batch, 2, budget)
    assert sorted(torch.cat(plan).tolist()) == list(range(12))  # every sequence exactly once
    for i, idx in enumerate(plan):
        padded = len(idx) * int(lengths[idx].max())
        # within budget, or one sequence too long for it alone
        assert len(idx) == 1 or padded <= budget
        if i + 1 < len(plan):  # greedy: the next sequence (by length) would not have fitted
            nxt = plan[i + 1][0]
            assert (len(idx) + 1) * max(int(lengths[idx].max()), int(lengths[nxt])) > budget
    assert torch.cat([lengths[i] for i in plan]).diff().ge(0).all()  # sorted by length


@pytest.mark.parametrize("budget", [0, 20])
def test_plan_covers_only_kept_rows(budget):
    batch = ragged(B=8, seed=2)
    keep = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1]).bool()
    plan = plan_micro_batches(batch, 2, budget, keep=keep)
    assert sorted(torch.cat(plan).tolist()) == [0, 2, 3, 6, 7]  # every kept row exactly once
    everything = plan_micro_batches(batch, 2, budget, keep=keep.new_ones(8))
    unmasked = plan_micro_batches(batch, 2, budget)
    assert [i.tolist() for i in everything] == [i.tolist() for i in unmasked]  # all kept: the same
    assert plan_micro_batches(batch, 2, budget, keep=keep.new_zeros(8)) == []  # one rank: nothing


def test_micro_slice_cuts_padding_and_slices_every_entry():
    batch = ragged(B=6, P=5, C=4, seed=1)
    C = 4
    for idx in (torch.arange(6), torch.tensor([1, 4]), torch.tensor([2])):
        mb = micro_slice(batch, idx)
        am = batch["attention_mask"][idx]
        c = max(int(batch["completion_mask"][idx].sum(1).max()), 1)
        # the first column anyone uses
        start = next(j for j in range(am.shape[1]) if am[:, j].any())
        assert mb["logits_to_keep"] == c
        assert torch.equal(mb["input_ids"], batch["input_ids"][idx][:, start : am.shape[1] - C + c])
        assert torch.equal(mb["attention_mask"], am[:, start : am.shape[1] - C + c])
        assert torch.equal(
            mb["attention_mask"].sum(1), am.sum(1) - (batch["completion_mask"][idx][:, c:]).sum(1)
        )
        assert torch.equal(mb["completion_mask"], batch["completion_mask"][idx, :c])
        assert torch.equal(mb["advantages"], batch["advantages"][idx])  # (b,)
        assert torch.equal(mb["old_logps"], batch["old_logps"][idx, :c])  # (b, c)
        assert mb["ref_logps"] is None


def test_micro_stats_cut_the_whole_batchs_statistics_as_micro_slice_cuts_the_batch():
    """A (B,) or (B, C) statistic of the whole batch reaches each micro-batch, a zero-weight
    repeat's too, as the rows (and columns) micro_slice gave that micro-batch; numbers as they are.
    Without a process group, all_cat is this rank's own rows."""
    batch = ragged(B=6, P=5, C=4, seed=1)
    keep = torch.tensor([1, 0, 1, 1, 0, 0]).bool()
    per_row, per_token = torch.arange(6.0), torch.arange(24.0).view(6, 4)  # (B,), (B, C)
    stats = {"normalizer": 7.0, "count": torch.tensor(3.0), "row": per_row, "token": per_token}
    batch.update(row=per_row, token=per_token)  # micro_slice's cut of the same values
    plan = plan_micro_batches(batch, 2, keep=keep) + [None]  # and a zero-weight repeat
    weights = []
    for idx, mb, weight in micro_batches(batch, plan):
        weights.append(weight)
        got = micro_stats(stats, idx, mb, torch.device("cpu"))
        assert got["normalizer"] == 7.0 and got["count"] is stats["count"]
        assert torch.equal(got["row"], mb["row"]) and torch.equal(got["token"], mb["token"])
        assert got["token"].shape == mb["completion_mask"].shape  # (b, c)
    assert weights == [1.0, 1.0, 0.0]  # the repeat (rows 0 and 2 again) got its rows too
    assert torch.equal(all_cat(per_token), per_token)


def _collectives_worker(rank, init_file, results):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        batch = ragged(B=5 if rank == 0 else 2, seed=rank)  # rank 1 has fewer sequences
        plan = plan_micro_batches(batch, 2)
        # rank 0 keeps rows 0, 2, 4; rank 1 none: only zero-weight repeats of its row 0
        keep = torch.arange(batch["input_ids"].shape[0]) % 2 == 0 if rank == 0 else None
        kept = plan_micro_batches(batch, 2, keep=keep if rank == 0 else torch.zeros(2).bool())
        repeats = [(idx.tolist(), w) for idx, _, w in micro_batches(batch, kept)]
        summed = all_sum([1.5 * (rank + 1), rank])
        rows = all_cat(torch.full((3, 2), float(rank)))
        uneven = all_cat(torch.arange(3 - 2 * rank, dtype=torch.long) + 10 * rank)  # 3 and 1 rows
        try:
            all_cat(torch.zeros(2, 1 + rank))  # rows of other shapes on each rank
            refused = ""
        except ValueError as e:
            refused = str(e)
        mask = torch.tensor([[1, 1, 0], [1, 0, 0]]) if rank == 0 else torch.tensor([[1, 1, 1]])
        means = token_means({"x": torch.full(mask.shape, rank + 1.0)}, mask)  # 3 tokens, then 3
        results[rank] = (
            uneven.tolist(),
            refused,
            means,
            [None if i is None else i.tolist() for i in plan],
            summed,
            rows.tolist(),
            str(comm_device()),
            rows.device.type,
            repeats,
        )
    finally:
        dist.destroy_process_group()


def test_collectives_on_two_gloo_processes(tmp_path):
    results = mp.Manager().dict()
    mp.spawn(_collectives_worker, args=(str(tmp_path / "init"), results), nprocs=2)
    uneven0, refused0, means0, plan0, sum0, rows0, dev0, where0, kept0 = results[0]
    uneven1, refused1, means1, plan1, sum1, rows1, dev1, where1, kept1 = results[1]
    assert uneven0 == uneven1 == [0, 1, 2, 10]  # unequal numbers of rows, rank by rank
    assert "differ in shape" in refused0 and refused0 == refused1
    assert means0 == means1 == {"x": 1.5}  # (3 x 1 + 3 x 2) / 6 tokens
    # a rank that kept no row runs as many zero-weight repeats as the other has micro-batches
    assert kept0 == [([0, 2], 1.0), ([4], 1.0)] and kept1 == [([0], 0.0), ([0], 0.0)]
    # ranks agree on 3 micro-batches
    assert plan0 == [[0, 1], [2, 3], [4]] and plan1 == [[0, 1], None, None]
    assert sum0 == sum1 == [4.5, 1.0]
    assert rows0 == rows1 == [[0.0, 0.0]] * 3 + [[1.0, 1.0]] * 3  # rank 0's rows first
    # gloo: the CPU (NCCL: the current GPU)
    assert dev0 == dev1 == "cpu" and where0 == where1 == "cpu"

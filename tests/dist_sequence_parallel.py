"""torchrun worker: sequence parallelism (sequence_parallel.py) against one rank's whole sequence.

    torchrun --nproc_per_node 2 tests/dist_sequence_parallel.py --model DIR

Both ranks hold the same model (no DeepSpeed here: the forward and the gradient alone). Each rank
scores its slice of one row of L tokens (L not a multiple of S, so the row is padded) through
row_forward + model_logps, and of a packed row; the gathered log-probs and entropies must equal
model_logps over the whole row on one rank, and the parameter gradients summed over the two ranks
the whole row's gradient. Prints "OK" on rank 0.
"""

import argparse

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import sequence_parallel
from exits import exit_process
from logprobs import model_logps


def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    a = p.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")  # Ulysses speaks deepspeed.comm
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(a.model, attn_implementation="sdpa")
    sp = sequence_parallel.init(dist.get_world_size())
    sequence_parallel.install("sdpa")
    L, V = 45, model.config.vocab_size
    ids = torch.randint(3, V, (1, L))  # the same on every rank (same seed)
    pos = torch.arange(L)[None]
    cases = {"one sequence": pos, "packed": torch.cat([torch.arange(20), torch.arange(25)])[None]}
    for name, pos in cases.items():
        # whole row on this rank: log-probs of tokens 1..L-1 from positions 0..L-2
        model.zero_grad()
        ref, ref_ent = model_logps(
            model, ids, None, L - 1, position_ids=pos, return_entropy=True, chunk_size=7
        )  # (1, L - 1)
        (ref * torch.linspace(-1, 1, L - 1)).sum().add(ref_ent.sum() * 0.1).backward()
        g_ref = grads(model)

        model.zero_grad()

        def fn(i, q, t):
            n = i.shape[1]
            kw = dict(position_ids=q, targets=t, return_entropy=True, chunk_size=7)
            return model_logps(model, i, None, n, **kw)  # (1, n) each

        lp, ent = sequence_parallel.row_forward(fn, ids, pos)  # (1, L) each
        lp, ent = lp[:, :-1], ent[:, :-1]  # position L-1 predicts past the row
        (lp * torch.linspace(-1, 1, L - 1)).sum().add(ent.sum() * 0.1).backward()
        g = grads(model)
        dist.all_reduce(g)
        err = (lp - ref).abs().max().item(), (ent - ref_ent).abs().max().item()
        gerr = ((g - g_ref).abs().max() / g_ref.abs().max()).item()
        if rank == 0:
            print(f"{name}: logp err {err[0]:.2e} entropy err {err[1]:.2e} grad rel {gerr:.2e}")
        assert max(err) < 1e-5 and gerr < 1e-5, (name, err, gerr)
    # outside row_forward attention is the plain one: a forward on one rank alone
    if rank == 0:
        model(input_ids=ids, use_cache=False)
    dist.barrier()
    if rank == 0:
        print(f"OK (S = {sp.size})")
    dist.destroy_process_group()


if __name__ == "__main__":
    exit_process(main())

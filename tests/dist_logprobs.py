"""torchrun worker: one optimizer step with a model_logps loss equals the same step with a
naive full-logits loss, under DeepSpeed ZeRO-2 or ZeRO-3 across processes (gloo, CPU).

    torchrun --nproc_per_node 2 tests/dist_logprobs.py --stage 3 --model DIR [--model DIR ...]

Each rank scores different sequences, so the comparison covers ZeRO's gradient reduction.
Prints "OK" on rank 0 when every model matches.
"""

import argparse
import copy

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from exits import exit_process
from logprobs import model_logps, positions_from_mask


def naive_logps(model, ids, mask, K, temperature):
    logits = model(
        input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask), use_cache=False
    ).logits
    return (
        (logits[:, -K - 1 : -1] / temperature)
        .log_softmax(-1)
        .gather(-1, ids[:, -K:, None])
        .squeeze(-1)
    )


def fused(model, ids, mask, K, temperature):
    logp, entropy = model_logps(
        model, ids, mask, K, temperature, chunk_size=7, return_entropy=True, vocab_chunk_size=32
    )
    return logp, entropy


def step(model, stage, use_fused, ids, mask, K, gc):
    base = copy.deepcopy(model)
    if gc:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    config = {
        "train_micro_batch_size_per_gpu": ids.shape[0],
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
    }
    opt = torch.optim.SGD(base.parameters(), lr=0.5)
    engine, *_ = deepspeed.initialize(model=base, optimizer=opt, config=config)
    engine.train()
    T = 0.7
    if use_fused:
        logp, entropy = fused(engine, ids, mask, K, T)
        loss = -(logp * mask[:, -K:]).sum() / mask[:, -K:].sum() - 0.1 * entropy.mean()
    else:
        logp = naive_logps(engine, ids, mask, K, T)
        logits = engine(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions_from_mask(mask),
            use_cache=False,
        ).logits
        lp_all = (logits[:, -K - 1 : -1] / T).log_softmax(-1)
        entropy = -(lp_all.exp() * lp_all).sum(-1)
        loss = -(logp * mask[:, -K:]).sum() / mask[:, -K:].sum() - 0.1 * entropy.mean()
    engine.backward(loss)
    engine.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return loss.detach(), params


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, required=True)
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--gradient_checkpointing", action="store_true")
    a = ap.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    for path in a.model:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        init = {n: p.detach().clone() for n, p in model.named_parameters()}
        g = torch.Generator().manual_seed(100 + rank)  # different data per rank
        B, T, K = 3, 14, 6
        ids = torch.randint(3, model.config.vocab_size, (B, T), generator=g)
        mask = torch.ones_like(ids)
        mask[0, :5] = 0  # left-padded prompts
        mask[1, :2] = 0
        mask[2, -2:] = 0  # a completion that ended early (right padding)
        ids[mask == 0] = 0
        loss_f, fused_params = step(model, a.stage, True, ids, mask, K, a.gradient_checkpointing)
        loss_n, naive_params = step(model, a.stage, False, ids, mask, K, a.gradient_checkpointing)
        assert torch.allclose(loss_f, loss_n, atol=1e-5), (loss_f, loss_n)
        moved = 0.0
        for n in naive_params:
            err = (fused_params[n] - naive_params[n]).abs().max().item()
            assert err < 1e-5, f"{path} stage {a.stage}: {n} differs by {err}"
            moved = max(moved, (naive_params[n] - init[n]).abs().max().item())
        head = "model.embed_tokens.weight" if model.config.tie_word_embeddings else "lm_head.weight"
        head_moved = (naive_params[head] - init[head]).abs().max().item()
        assert moved > 1e-3 and head_moved > 1e-4, (
            f"the step did not move the weights ({moved}, {head_moved})"
        )
        if rank == 0:
            print(
                f"{path} stage {a.stage}: losses {loss_f.item():.6f} {loss_n.item():.6f}, "
                f"max update {moved:.3g}, lm_head update {head_moved:.3g}",
                flush=True,
            )
    if rank == 0:
        print("OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # skip the interpreter's teardown, as the loops do: DeepSpeed's leftover gloo threads can
    # abort a finished rank there (exits.exit_process)
    exit_process(0)

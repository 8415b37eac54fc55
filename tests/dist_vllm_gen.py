"""torchrun worker (2 CPU ranks, one vLLM engine per rank): every vLLM check in one engine start-up.
Run by tests/test_generation.py; argv: model_dir out_dir. Rank 0 prints "OK <name>" per check.

The engine is started from a save_hf checkpoint of a ZeRO-3 engine (so vLLM loading it is checked
too); then vllm_batch_size batching, HF == vLLM greedy, sampler logprobs (also under top-k and
top-p, against the trainer's truncated log-probs), weight sync after a training step, seeded
sampling of more prompt tokens than one scheduler step, sleep/wake.
"""

import os
import sys

import torch
import torch.distributed as dist


def main(model_dir, out_dir):
    import deepspeed
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from generation import VLLMGenerator, generate_hf, unwrap_for_generation
    from zero3_utils import save_hf

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    ok = (lambda name: print(f"OK {name}", flush=True)) if rank == 0 else (lambda name: None)
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = [
        "hello",
        "The cat",
        "a",
        "1 + 1 =",
        "xyz abc",
        "Once upon",
        "Q:",
        "zz",
        "def f(x):",
        "42",
        "Hi",
        "abc",
        "The dog",
        "0",
        "What is",
        "ok",
        "x y z",
    ]
    # 10 prompts on rank 0 (4 batches of 3), 7 on rank 1 (3 batches): ranks must still make equal
    # calls
    mine = texts[:10] if rank == 0 else texts[10:]
    prompts = [tok(t)["input_ids"] for t in mine]

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    path = os.path.join(out_dir, "saved")
    save_hf(engine, tok, path)

    gen = VLLMGenerator(path, vllm_batch_size=3, max_model_len=128, dtype="float32")
    ok("vLLM loads the save_hf checkpoint")
    # on CPU eager by default (generation.cpu_engine_kwargs): no torch.compile at start-up
    assert gen.llm.llm_engine.vllm_config.model_config.enforce_eager

    def hf_greedy():
        with unwrap_for_generation(engine, gather=True) as m:
            return generate_hf(m, prompts, batch_size=8, max_new_tokens=10, greedy=True)

    split = gen.generate(prompts, max_new_tokens=10, greedy=True)
    gen.vllm_batch_size = 0
    whole = gen.generate(prompts, max_new_tokens=10, greedy=True)
    gen.vllm_batch_size = 3
    assert torch.equal(split.completion_ids, whole.completion_ids), "vllm_batch_size=3 != one call"
    assert split.completion_ids.shape[0] == len(prompts)
    ok("vllm_batch_size=3 == one call")

    hf_before = hf_greedy()
    assert torch.equal(hf_before.completion_ids, split.completion_ids), (
        f"HF greedy != vLLM greedy\n{hf_before.completion_ids}\n{split.completion_ids}"
    )
    ok("HF greedy == vLLM greedy")

    # sampler logprobs (temperature 1, no top-k/p: processed == model log-softmax) match HF's
    smp = gen.generate(prompts, num_generations=2, max_new_tokens=8, temperature=1.0)
    assert (
        smp.completion_ids.shape[0] == 2 * len(prompts)
        and smp.logprobs.shape == smp.completion_ids.shape
    )
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    worst = 0.0
    for i, (ids, mask, lp) in enumerate(zip(smp.completion_ids, smp.completion_mask, smp.logprobs)):
        n, p = int(mask.sum()), prompts[i // 2]
        seq = torch.tensor([p + ids[:n].tolist()])
        with torch.no_grad():
            logits = plain(seq).logits[0, len(p) - 1 : -1]  # (n, V) predicting the completion
        ref = torch.log_softmax(logits.float(), -1).gather(-1, ids[:n, None]).squeeze(-1)  # (n,)
        worst = max(worst, (ref - lp[:n]).abs().max().item())
    assert worst < 1e-3, f"vLLM logprobs differ from HF by {worst}"
    for ids, mask in zip(smp.completion_ids, smp.completion_mask):  # a short row ends with its EOS
        n = int(mask.sum())
        assert n == 8 or int(ids[n - 1]) == tok.eos_token_id, (
            f"row stopped early without EOS: {ids}"
        )
        assert (ids[n:] == tok.pad_token_id).all()
    ok(f"sampler logprobs match HF (max diff {worst:.1e})")

    # top-k and top-p: vLLM's processed log-probs are under the distribution renormalised over
    # the tokens it kept; model_logps with the same cut scores the same (fp32), the full softmax
    # is off by the kept mass
    from logprobs import model_logps

    cut = dict(temperature=0.9, top_k=20, top_p=0.8)
    smp = gen.generate(prompts, num_generations=2, max_new_tokens=8, **cut)
    worst = full_gap = 0.0
    for i, (ids, mask, lp) in enumerate(zip(smp.completion_ids, smp.completion_mask, smp.logprobs)):
        n, p = int(mask.sum()), prompts[i // 2]
        seq = torch.tensor([p + ids[:n].tolist()])
        with torch.no_grad():
            mine = model_logps(plain, seq, torch.ones_like(seq), n, **cut)[0]  # (n,)
            full = model_logps(plain, seq, torch.ones_like(seq), n, temperature=0.9)[0]  # (n,)
        worst = max(worst, (mine - lp[:n]).abs().max().item())
        full_gap = max(full_gap, (full - lp[:n]).abs().max().item())
    assert worst < 1e-4, f"trainer's truncated logprobs differ from vLLM's by {worst}"
    assert full_gap > 0.05, full_gap  # the bias the cut removes
    ok(f"top-k/top-p: trainer == vLLM (max diff {worst:.1e}; full softmax {full_gap:.2f})")

    # weight sync: train a step, stream the new weights into vLLM, greedy outputs agree again
    batch = torch.tensor([tok("hello world, hello world")["input_ids"]])
    for _ in range(2):
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
    hf_after = hf_greedy()
    assert not torch.equal(hf_after.completion_ids, hf_before.completion_ids), (
        "training step changed nothing"
    )
    stale = gen.generate(prompts, max_new_tokens=10, greedy=True)
    assert torch.equal(stale.completion_ids, split.completion_ids)
    gen.sync_weights(engine, max_numel=20000)
    synced = gen.generate(prompts, max_new_tokens=10, greedy=True)
    assert torch.equal(synced.completion_ids, hf_after.completion_ids), (
        f"vLLM after sync != HF after step\n{synced.completion_ids}\n{hf_after.completion_ids}"
    )
    ok("weight sync: vLLM == updated HF, != before")

    # more prompt tokens in one call (40 x 120) than one scheduler step takes (4096): seeded
    # requests whose prompts vLLM prefilled in chunks killed the CPU engine; whole prompts only
    # (generation.cpu_engine_kwargs)
    long = [(p * 120)[:120] for p in prompts] * 4
    drawn = gen.generate(long, max_new_tokens=4, temperature=1.0)
    assert drawn.completion_ids.shape[0] == len(long)
    ok("seeded sampling over more prompt tokens than one scheduler step")

    gen.sleep()  # GPU: level 2 (weights dropped); CPU: the same state, nothing freed
    assert gen.sleeping_bytes() == 0  # CPU: nothing freed, so the memory ledger subtracts 0
    try:
        gen.generate(prompts, max_new_tokens=10, greedy=True)
        raise AssertionError("generate while asleep did not refuse")
    except RuntimeError as e:
        assert "asleep" in str(e), e
    gen.sync_weights(engine, max_numel=20000)  # wakes: weights, load, KV cache
    again = gen.generate(prompts, max_new_tokens=10, greedy=True)
    assert torch.equal(again.completion_ids, synced.completion_ids)
    ok("sleep, then sync_weights wakes it")
    dist.barrier()
    print(f"rank {rank} DONE", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])

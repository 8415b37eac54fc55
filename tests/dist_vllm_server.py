"""torchrun worker (2 CPU ZeRO-3 ranks, one vLLM CPU server started by the test): every server-mode
check in one server start-up. Run by tests/test_vllm_server.py; argv: model_dir url. Rank 0 prints
"OK <name>" per check.

Server greedy == HF greedy == colocated vLLM greedy (one engine per rank); vllm_batch_size=3 == one
request; sampler log-probs == HF log-softmax (< 1e-3); after 2 training steps and sync_weights,
server greedy == the updated HF model's and != before.
"""

import sys

import torch
import torch.distributed as dist


def main(model_dir, url):
    import deepspeed
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from generation import VLLMGenerator, generate_hf, unwrap_for_generation
    from vllm_server import VLLMServerGenerator

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    ok = (lambda name: print(f"OK {name}", flush=True)) if rank == 0 else (lambda name: None)
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = ["hello", "The cat", "a", "1 + 1 =", "xyz abc", "Once upon", "Q:", "zz", "42", "Hi"]
    mine = texts[:6] if rank == 0 else texts[6:]  # 2 requests of 3 on rank 0, 2 (3 + 1) on rank 1
    prompts = [tok(t)["input_ids"] for t in mine]

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    gen = VLLMServerGenerator(url, vllm_batch_size=3, pad_token_id=tok.pad_token_id)

    def hf_greedy():
        with unwrap_for_generation(engine, gather=True) as m:
            return generate_hf(m, prompts, batch_size=8, max_new_tokens=8, greedy=True)

    gen.sync_weights(engine, max_numel=20000)  # the server may hold an earlier test's weights
    split = gen.generate(prompts, max_new_tokens=8, greedy=True)
    gen.vllm_batch_size = 0
    whole = gen.generate(prompts, max_new_tokens=8, greedy=True)
    gen.vllm_batch_size = 3
    assert torch.equal(split.completion_ids, whole.completion_ids), "vllm_batch_size=3 != one call"
    ok("vllm_batch_size=3 == one request, order kept")
    hf_before = hf_greedy()
    assert torch.equal(hf_before.completion_ids, split.completion_ids), (
        f"HF greedy != server greedy\n{hf_before.completion_ids}\n{split.completion_ids}"
    )
    ok("server greedy == HF greedy")
    colocated = VLLMGenerator(model_dir, max_model_len=128, dtype="float32", enforce_eager=True)
    local = colocated.generate(prompts, max_new_tokens=8, greedy=True)
    assert torch.equal(local.completion_ids, split.completion_ids), (
        f"colocated greedy != server greedy\n{local.completion_ids}\n{split.completion_ids}"
    )
    ok("server greedy == colocated greedy")

    smp = gen.generate(prompts, num_generations=2, max_new_tokens=6, temperature=1.0)
    assert smp.logprobs.shape == smp.completion_ids.shape == (2 * len(prompts), 6)
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    worst = 0.0
    for i, (ids, mask, lp) in enumerate(zip(smp.completion_ids, smp.completion_mask, smp.logprobs)):
        n, p = int(mask.sum()), prompts[i // 2]
        seq = torch.tensor([p + ids[:n].tolist()])
        with torch.no_grad():
            logits = plain(seq).logits[0, len(p) - 1 : -1]  # (n, V) predicting the completion
        ref = torch.log_softmax(logits.float(), -1).gather(-1, ids[:n, None]).squeeze(-1)  # (n,)
        worst = max(worst, (ref - lp[:n]).abs().max().item())
    assert worst < 1e-3, f"server logprobs differ from HF by {worst}"
    ok(f"sampler logprobs match HF (max diff {worst:.1e})")

    batch = torch.tensor([tok("hello world, hello world")["input_ids"]])
    for _ in range(2):
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
    hf_after = hf_greedy()
    assert not torch.equal(hf_after.completion_ids, hf_before.completion_ids), "training no-op"
    stale = gen.generate(prompts, max_new_tokens=8, greedy=True)
    assert torch.equal(stale.completion_ids, split.completion_ids), "weights changed unsynced"
    gen.sync_weights(engine, max_numel=20000)
    synced = gen.generate(prompts, max_new_tokens=8, greedy=True)
    assert torch.equal(synced.completion_ids, hf_after.completion_ids), (
        f"server after sync != HF after 2 steps\n{synced.completion_ids}\n{hf_after.completion_ids}"
    )
    ok(f"weight sync: server == updated HF, != before ({gen.last_sync_seconds:.2f} s)")
    if rank == 0:
        version = gen.weight_version()  # /weight_info: this file's second sync on this server
        assert version == "2", f"the server's weight version is {version!r}, not '2'"
        ok("the server's weight version is the count of syncs")
    dist.barrier()
    print(f"rank {rank} DONE", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])

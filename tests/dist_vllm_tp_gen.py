"""torchrun worker (2 CPU ranks, ONE vLLM engine with tensor_parallel_size=2 across them).
argv: model_dir. Each rank submits its own prompts; the TP group generates for both and hands
each rank its share back. Checks vLLM == HF greedy before and after a training step + weight sync.
"""

import sys

import torch
import torch.distributed as dist


def main(model_dir):
    import deepspeed
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from generation import VLLMGenerator, generate_hf, unwrap_for_generation

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = ["hello", "The cat", "a", "1 + 1 =", "xyz abc", "Once upon", "Q:"]
    mine = texts[:4] if rank == 0 else texts[4:]
    prompts = [tok(t)["input_ids"] for t in mine]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), config=cfg
    )
    gen = VLLMGenerator(
        model_dir,
        tensor_parallel_size=2,
        vllm_batch_size=2,
        max_model_len=128,
        dtype="float32",
        enforce_eager=True,
    )

    def hf_greedy():
        with unwrap_for_generation(engine, gather=True) as m:
            return generate_hf(m, prompts, max_new_tokens=10, greedy=True).completion_ids

    before = gen.generate(prompts, max_new_tokens=10, greedy=True).completion_ids
    assert torch.equal(before, hf_greedy()), f"TP vLLM != HF\n{before}\n{hf_greedy()}"

    def sample():  # temperature 1, each rank's torch seeded differently, as the loops do
        torch.manual_seed(1234 + 7 * rank)
        return gen.generate(prompts, num_generations=2, max_new_tokens=10, temperature=1.0)

    # Ranks of one TP group sample the same tokens: were they to differ, the TP all-reduces would
    # mix two sequences and the sampler's log-probs would not be the model's (HF's) log-probs.
    first = sample()
    with unwrap_for_generation(engine, gather=True) as m:
        for i, (ids, mask, lp) in enumerate(
            zip(first.completion_ids, first.completion_mask, first.logprobs)
        ):
            n = int(mask.sum())
            seq = torch.tensor([prompts[i // 2] + ids[:n].tolist()])
            logits = m(seq).logits[0, len(prompts[i // 2]) - 1 : -1].float()  # (n, V)
            ref = torch.log_softmax(logits, -1).gather(-1, ids[:n, None]).squeeze(-1)  # (n,)
            assert (ref - lp[:n]).abs().max() < 1e-3, (rank, i, ref, lp[:n])
    # the same seeds replay the same completions (--resume), in other batches too
    gen.vllm_batch_size = 1
    again = sample()
    assert torch.equal(again.completion_ids, first.completion_ids), (again, first)
    print(f"rank {rank} OK sampling: TP ranks agree with HF's log-probs, replayed", flush=True)
    batch = torch.tensor([tok("hello world, hello world")["input_ids"]])
    for _ in range(2):
        engine.backward(engine(input_ids=batch, labels=batch).loss)
        engine.step()
    gen.sync_weights(engine)
    after, hf_after = (
        gen.generate(prompts, max_new_tokens=10, greedy=True).completion_ids,
        hf_greedy(),
    )
    assert not torch.equal(after, before) and torch.equal(after, hf_after), (
        f"TP sync\n{after}\n{hf_after}"
    )
    dist.barrier()
    print(f"rank {rank} DONE", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])

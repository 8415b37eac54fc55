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

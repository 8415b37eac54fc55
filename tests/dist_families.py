"""torchrun worker (2 CPU ranks): every architecture family through ZeRO-3 generation, a training
step, vLLM weight sync and save_hf, in one launch (torch, DeepSpeed and vLLM imported once).
Run by tests/test_families.py; argv: out_dir family=model_dir [family=model_dir ...].

Per family, in order (rank 0 prints "OK <family> <check>" after each; the first failure stops):
  zero3     plain greedy == ZeRO-3 gathered greedy == ZeRO-3 sharded greedy
  save_hf   after a training step (model_logps at temperature 0.7 through the engine), save_hf's
            output loads in transformers with the engine's weights and logits
  vllm      a vLLM engine started from that output: greedy == HF greedy and its sampler
            log-probs == the saved model's log-softmax (< 1e-3)
  sync      after a second step vLLM is stale; after sync_weights its greedy == HF greedy and its
            log-probs match the updated model again
"""

import gc
import os
import sys

import torch
import torch.distributed as dist

TEXTS = ["12=", "907=", "hello", "The cat", "a", "1 + 1 =", "xyz abc", "Once upon", "Q:", "zz"]


def ds_config():
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 2,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }


def logp_gap(model, prompts, gens, n_gen):
    """Largest |vLLM sampler log-prob - log_softmax(model logits)| over the sampled tokens."""
    worst = 0.0
    for i, (ids, mask, lp) in enumerate(
        zip(gens.completion_ids, gens.completion_mask, gens.logprobs)
    ):
        n, p = int(mask.sum()), prompts[i // n_gen]
        with torch.no_grad():
            logits = model(torch.tensor([p + ids[:n].tolist()])).logits[
                0, len(p) - 1 : -1
            ]  # (n, V)
        ref = torch.log_softmax(logits.float(), -1).gather(-1, ids[:n, None]).squeeze(-1)  # (n,)
        worst = max(worst, (ref - lp[:n]).abs().max().item())
    return worst


def check_family(family, model_dir, out_dir, rank, ok, index):
    import deepspeed
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from generation import (
        VLLMGenerator,
        attn_implementation_for,
        generate_hf,
        unwrap_for_generation,
    )
    from logprobs import model_logps
    from zero3_utils import save_hf

    tok = AutoTokenizer.from_pretrained(model_dir)
    mine = TEXTS[:6] if rank == 0 else TEXTS[6:]  # 6 vs 4 prompts: 3 vs 2 sharded calls of 2
    prompts = [tok(t)["input_ids"] for t in mine]

    attn = dict(
        dtype=torch.float32, attn_implementation=attn_implementation_for(model_dir)
    )  # as the loops
    plain = AutoModelForCausalLM.from_pretrained(model_dir, **attn)
    ref = generate_hf(plain, prompts, batch_size=2, max_new_tokens=10, greedy=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, **attn)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config())

    def hf_greedy(gather=True):
        with unwrap_for_generation(engine, gather=gather) as m:
            return generate_hf(m, prompts, batch_size=2, max_new_tokens=10, greedy=True)

    gat, sha = hf_greedy(True), hf_greedy(False)
    assert torch.equal(gat.completion_ids, ref.completion_ids), (
        f"{family}: gathered != plain\n{gat}\n{ref}"
    )
    assert torch.equal(sha.completion_ids, ref.completion_ids), (
        f"{family}: sharded != plain\n{sha}\n{ref}"
    )
    ok(f"{family} zero3 greedy plain == gathered == sharded")

    batch = torch.tensor([tok(t)["input_ids"] for t in ("hello world, 12=2", "The cat sat, 97=9")])

    def train_step():  # the loops' path: log-probs through the engine, at temperature != 1
        logp = model_logps(engine, batch, torch.ones_like(batch), 8, temperature=0.7)
        engine.backward(-logp.mean())
        engine.step()

    train_step()
    path = os.path.join(out_dir, family, "saved")
    save_hf(engine, tok, path)
    probe = torch.tensor([tok(t)["input_ids"] for t in ("1 + 1 = 2!", "Once upon.")])
    with unwrap_for_generation(engine, gather=True) as m:
        want = m(probe).logits
        weights = {n: p.detach().clone() for n, p in m.named_parameters()}
    saved = AutoModelForCausalLM.from_pretrained(path, **attn)
    got = saved(probe).logits
    for n, p in saved.named_parameters():
        assert torch.equal(p, weights[n]), f"{family}: saved {n} differs from the engine's"
    assert (got - want).abs().max() <= 1e-6, (
        f"{family}: saved logits differ by {(got - want).abs().max()}"
    )
    assert type(saved) is type(plain)
    ok(f"{family} save_hf loads in transformers: same weights and logits")

    gen = VLLMGenerator(path, max_model_len=64, dtype="float32", enforce_eager=True)
    v = gen.generate(prompts, max_new_tokens=10, greedy=True)
    h = hf_greedy()
    assert torch.equal(v.completion_ids, h.completion_ids), (
        f"{family}: vLLM greedy != HF greedy\n{v}\n{h}"
    )
    smp = gen.generate(prompts, num_generations=2, max_new_tokens=6, temperature=1.0)
    gap = logp_gap(saved, prompts, smp, 2)
    assert gap < 1e-3, f"{family}: vLLM log-probs of the save_hf output differ from HF by {gap}"
    ok(f"{family} vllm loads save_hf output: greedy == HF, log-probs within {gap:.1e}")

    train_step()
    with unwrap_for_generation(engine, gather=True) as m:
        stale = logp_gap(m, prompts, smp, 2)
        assert stale > 1e-3, f"{family}: the second step changed no log-prob ({stale})"
    gen.sync_weights(engine, max_numel=20000)  # several groups: names split across gathers
    v, h = gen.generate(prompts, max_new_tokens=10, greedy=True), hf_greedy()
    assert torch.equal(v.completion_ids, h.completion_ids), (
        f"{family}: vLLM != HF after sync\n{v}\n{h}"
    )
    smp = gen.generate(prompts, num_generations=2, max_new_tokens=6, temperature=1.0)
    with unwrap_for_generation(engine, gather=True) as m:
        gap = logp_gap(m, prompts, smp, 2)
    assert gap < 1e-3, (
        f"{family}: after sync_weights vLLM log-probs differ from HF by {gap} (stale {stale:.3f})"
    )
    ok(
        f"{family} sync_weights after a step: greedy == HF, log-probs within {gap:.1e}"
        f" (stale {stale:.2f})"
    )

    close_vllm(gen, index)


def close_vllm(gen, index):
    """Shut this family's vLLM engine down now and give the trainer a process group again.

    vllm 0.32.0: an in-process engine's shutdown (EngineCore.shutdown, also run whenever the engine
    is garbage-collected) ends in cleanup_dist_env_and_memory, which destroys torch's default
    process group, the trainer's included. Shut it down here, on every rank at the same point,
    and build a new group under a fresh store prefix: the old group's keys are still in
    torchrun's store, and a rendezvous over them waits on the dead group's sockets. DeepSpeed
    (0.19.8) caches groups of the old world; release them as its own destroy_process_group does.
    """
    from deepspeed.utils import groups

    gen.llm.llm_engine.engine_core.shutdown()
    if not dist.is_initialized():
        groups._release_process_group_references(None)
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False
        )
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"families-{index}", store),
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
        )


def main(out_dir, *pairs):
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    ok = (lambda msg: print(f"OK {msg}", flush=True)) if rank == 0 else (lambda msg: None)
    for index, pair in enumerate(pairs):
        family, model_dir = pair.split("=", 1)
        check_family(family, model_dir, out_dir, rank, ok, index)
        gc.collect()  # this family's models and engine, before the next one's
        dist.barrier()
    print(f"rank {rank} DONE", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])

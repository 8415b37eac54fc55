"""torchrun worker (2 CPU ranks): ZeRO-3 HF generation, unwrap_for_generation, iter_full_params,
save_hf and frozen_engine. Run by tests/test_generation.py; argv: model_dir tied_model_dir out_dir.
Every check raises AssertionError with a message; rank 0 prints "OK <name>" for each.
"""

import os
import sys

import torch
import torch.distributed as dist

from exits import exit_process


class BodyError(Exception):
    pass


def ds_config():
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 2,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }


def state(engine):
    """Everything unwrap_for_generation promises to restore."""
    model = engine.module
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    status = tuple(str(p.ds_status) for p in model.parameters())
    ckpt = tuple(
        m.gradient_checkpointing for m in model.modules() if hasattr(m, "gradient_checkpointing")
    )
    return hooks, status, ckpt, tuple(m.training for m in model.modules())


def main(model_dir, tied_dir, out_dir):
    import deepspeed
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from generation import generate_hf, unwrap_for_generation
    from zero3_load import enable_gradient_checkpointing
    from zero3_utils import (
        frozen_engine,
        full_param_meta,
        is_sharded,
        is_zero3,
        iter_full_params,
        save_hf,
    )

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    ok = (lambda name: print(f"OK {name}", flush=True)) if rank == 0 else (lambda name: None)
    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = ["hello", "The cat", "a", "1 + 1 =", "xyz abc", "Once upon", "Q:", "zz"]
    # unequal prompt counts per rank: 5 vs 3 -> 3 vs 2 chunks of batch_size 2 (synced generation
    # must cope)
    mine = texts[:5] if rank == 0 else texts[5:]
    prompts = [tok(t)["input_ids"] for t in mine]

    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref = generate_hf(plain, prompts, batch_size=1, max_new_tokens=12, greedy=True)
    batched = generate_hf(plain, prompts, batch_size=4, max_new_tokens=12, greedy=True)
    assert torch.equal(ref.completion_ids, batched.completion_ids), "HF batched != unbatched greedy"
    ok("hf batched == unbatched")

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    enable_gradient_checkpointing(model)  # the decoder layers flagged training, the rest eval
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config())
    assert is_zero3(engine) and is_sharded(engine) and not is_zero3(plain)

    # --- greedy tokens: plain == gathered == sharded (rank 0 makes one call more than rank 1)
    before = state(engine)
    with unwrap_for_generation(engine, gather=True) as m:
        assert not is_sharded(m), "gather=True left parameters partitioned"
        assert not any(x.training for x in m.modules()) and not any(
            x.gradient_checkpointing for x in m.modules() if hasattr(x, "gradient_checkpointing")
        )
        with_gather_hooks = state(engine)[0]
        assert with_gather_hooks < before[0], "gather=True did not remove the ZeRO-3 hooks"
        g = generate_hf(m, prompts, batch_size=2, max_new_tokens=12, greedy=True)
    assert state(engine) == before, "state not restored after gathered generation"
    with unwrap_for_generation(engine, gather=False) as m:
        assert is_sharded(m)
        s = generate_hf(m, prompts, batch_size=2, max_new_tokens=12, greedy=True)
    assert state(engine) == before, "state not restored after sharded generation"
    budget = sum(p.ds_numel * 4 for p in engine.module.parameters()) // 2
    with unwrap_for_generation(engine, gather=False, resident_bytes=budget) as m:
        resident = sum(p.data.numel() * 4 for p in m.parameters() if p.data.numel() == p.ds_numel)
        assert 0 < resident <= budget, (
            f"middle mode keeps {resident} bytes gathered, budget {budget}"
        )
        assert before[0] > state(engine)[0] > with_gather_hooks, (
            "middle mode should remove some hooks, not all"
        )
        mid = generate_hf(m, prompts, batch_size=2, max_new_tokens=12, greedy=True)
    assert state(engine) == before, "state not restored after middle-mode generation"
    assert torch.equal(mid.completion_ids, ref.completion_ids), (
        f"middle != plain\n{mid.completion_ids}"
    )
    assert torch.equal(g.completion_ids, ref.completion_ids), (
        f"gathered != plain\n{g.completion_ids}\n{ref.completion_ids}"
    )
    assert torch.equal(s.completion_ids, ref.completion_ids), (
        f"sharded != plain\n{s.completion_ids}\n{ref.completion_ids}"
    )
    assert torch.equal(s.completion_mask, ref.completion_mask)
    ok("greedy plain == gathered == sharded == middle mode")

    # --- an exception in the body propagates unchanged and the state comes back, every path
    for gather, resident_bytes in ((True, 0), (False, 0), (False, budget)):
        err = BodyError(f"boom {gather}")
        try:
            with unwrap_for_generation(engine, gather=gather, resident_bytes=resident_bytes) as m:
                m(torch.tensor([prompts[0]]))  # some real work first
                raise err
        except BodyError as e:
            assert e is err, "a different exception came out of the context manager"
        else:
            raise AssertionError("exception swallowed")
        assert state(engine) == before, f"state not restored after exception (gather={gather})"
    try:
        with unwrap_for_generation(plain) as m:
            raise KeyError("plain")
    except KeyError as e:
        assert e.args == ("plain",)
    ok("unwrap_for_generation restores after exceptions")

    # --- sampling: G per prompt in prompt order, cut after EOS
    eos = int(ref.completion_ids[0, 3])  # a token the model does produce, so some rows stop early
    with unwrap_for_generation(engine, gather=False) as m:
        torch.manual_seed(0)
        smp = generate_hf(
            m,
            prompts,
            num_generations=3,
            batch_size=4,
            max_new_tokens=12,
            temperature=1.0,
            top_k=20,
            top_p=0.9,
            eos_token_id=eos,
        )
    assert smp.completion_ids.shape[0] == 3 * len(prompts)
    for ids, mask in zip(smp.completion_ids, smp.completion_mask):
        n = int(mask.sum())
        assert mask[:n].all() and not mask[n:].any(), "mask is not a prefix"
        assert (ids[n:] == 0).all(), "ids after the mask are not pad"
        assert (ids[: n - 1] != eos).all(), "EOS inside the kept completion"
    assert (smp.completion_ids == eos).any(), "test needs a row that stopped at EOS"
    ok("sampling G per prompt, cut after EOS")

    # --- a training step still works after all that, and changes the weights
    batch = torch.tensor([tok("hello world")["input_ids"]])
    loss = engine(input_ids=batch, labels=batch).loss
    engine.backward(loss)
    engine.step()
    assert torch.isfinite(loss)
    ok("training step after generation")

    # --- iter_full_params: bounded, complete, correct values
    bound = 20000
    largest = max(p.ds_numel for p in engine.module.parameters())
    names, peak = [], 0
    full = {}
    for name, t in iter_full_params(engine, max_numel=bound):
        live = sum(
            p.data.numel() for p in engine.module.parameters() if p.data.numel() == p.ds_numel
        )
        peak = max(peak, live)
        assert live <= max(bound, largest), (
            f"{live} elements gathered at once > bound {max(bound, largest)}"
        )
        names.append(name)
        full[name] = t.clone()
    total = sum(p.ds_numel for p in engine.module.parameters())
    assert names == [n for n, _ in engine.module.named_parameters()]
    # read without a gather (ZeRO-3's ds_shape): what vLLM's weight transfer is told first
    assert full_param_meta(engine) == [(n, t.dtype, tuple(t.shape)) for n, t in full.items()]
    assert 0 < peak < total, f"peak {peak} vs total {total}: not streamed"
    with unwrap_for_generation(engine, gather=True) as m:
        for n, p in m.named_parameters():
            assert torch.equal(p.data, full[n]), n
    ok(f"iter_full_params peak {peak} <= {max(bound, largest)} of {total}")

    # --- save_hf reloads in transformers with identical weights (vLLM load: dist_vllm_gen.py)
    path = os.path.join(out_dir, "saved")
    save_hf(engine, tok, path)
    if rank == 0:
        re = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        sd = re.state_dict()
        for n, t in full.items():
            assert torch.equal(sd[n], t), f"saved {n} differs"
        AutoTokenizer.from_pretrained(path)
    sharded_path = os.path.join(out_dir, "saved_shards")  # several files + index
    save_hf(engine, tok, sharded_path, max_shard_bytes=300_000)
    if rank == 0:
        assert os.path.exists(os.path.join(sharded_path, "model.safetensors.index.json"))
        sd = AutoModelForCausalLM.from_pretrained(sharded_path, dtype=torch.float32).state_dict()
        for n, t in full.items():
            assert torch.equal(sd[n], t), f"sharded save {n} differs"
    ok("save_hf reloads with identical weights (one file and sharded)")

    # --- frozen engines (tied embeddings, CPU offload): sharded generation == plain
    tied_plain = AutoModelForCausalLM.from_pretrained(tied_dir, dtype=torch.float32)
    tied_ref = generate_hf(tied_plain, prompts, batch_size=4, max_new_tokens=8, greedy=True)
    for offload in (False, True):
        fe = frozen_engine(
            AutoModelForCausalLM.from_pretrained(tied_dir, dtype=torch.float32),
            ds_config(),
            offload=offload,
        )
        assert is_sharded(fe) and not any(p.requires_grad for p in fe.module.parameters())
        with unwrap_for_generation(fe, gather=False) as m:
            out = generate_hf(m, prompts, batch_size=2, max_new_tokens=8, greedy=True)
        assert torch.equal(out.completion_ids, tied_ref.completion_ids), (
            f"frozen_engine(offload={offload}) differs"
        )
        with unwrap_for_generation(fe, gather=True) as m:
            out = generate_hf(m, prompts, batch_size=2, max_new_tokens=8, greedy=True)
        assert torch.equal(out.completion_ids, tied_ref.completion_ids), (
            f"frozen_engine(offload={offload}) gathered differs"
        )
    tied_path = os.path.join(out_dir, "tied_saved")
    save_hf(fe, tok, tied_path)
    if rank == 0:
        re = AutoModelForCausalLM.from_pretrained(tied_path, dtype=torch.float32)
        for (n, a), b in zip(tied_plain.state_dict().items(), re.state_dict().values()):
            assert torch.equal(a, b), f"tied save {n} differs"
        assert re.lm_head.weight.data_ptr() == re.model.embed_tokens.weight.data_ptr(), "tie lost"
    ok("frozen_engine (offload on/off, tied) + save_hf of tied model")
    dist.barrier()
    print(f"rank {rank} DONE", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
    # skip the interpreter's teardown, as the loops do: DeepSpeed's leftover gloo threads can
    # abort a finished rank there (exits.exit_process)
    exit_process(0)

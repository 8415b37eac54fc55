"""torchrun worker (2 CPU ranks): ZeRO-3 partitioned loading (zero3_load.load_model) against the
full load every rank did before (from_pretrained, then DeepSpeed partitions), in one launch.
Run by tests/test_zero3_load.py; argv: untied_lm tied_lm reward_model [family=model_dir ...].

For each case the gathered parameters (zero3_utils.iter_full_params: names and values) must be
identical, and each rank must hold only its own shard after loading. Rank 0 prints
"OK <case>" after each; the first failure stops.
  frozen_untied / frozen_tied   a reference model, frozen_engine (frozen_config)
  trained_tied                  a trained policy, deepspeed.initialize with an optimizer
  lora                          peft LoRA on the partitioned policy; merged weights equal
  critic_from_lm / critic_from_rm   ppo.build_critic: a body + zero head, a reward model's
  reward_model                  a sequence classifier, frozen
  family_<name>                 each architecture of tiny_models.FAMILIES (Qwen2's qkv bias and
                                tied embeddings, Gemma-2's norms, Phi-3's fused projections), frozen
"""

import sys

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from exits import exit_process
from ppo import build_critic
from zero3_load import load_model
from zero3_utils import frozen_config, frozen_engine, iter_full_params


def ds_config():
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 2,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }


def full(engine):
    return [(n, t.clone()) for n, t in iter_full_params(engine)]


def same(case, old, new, rank):
    assert [n for n, _ in old] == [n for n, _ in new], (case, [n for n, _ in old][:4])
    for (n, a), (_, b) in zip(old, new):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{case}: {n} differs"
    if rank == 0:
        print(f"OK {case}", flush=True)


def shard_only(case, engine, world):
    """Each rank holds about 1/world of the elements after loading, not a full copy."""
    params = list(engine.module.parameters())
    held = sum(p.ds_tensor.numel() for p in params)
    total = sum(p.ds_numel for p in params)
    assert held <= total / world + world * len(params), (case, held, total)
    assert all(p.numel() == 0 for p in params), f"{case}: a parameter left gathered"


def main():
    untied, tied, rm = sys.argv[1:4]
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    dtype, attn = torch.float32, "sdpa"
    ds = ds_config()
    kw = dict(dtype=dtype, attn_implementation=attn)

    for case, path in (("frozen_untied", untied), ("frozen_tied", tied)):
        old = frozen_engine(AutoModelForCausalLM.from_pretrained(path, **kw), ds)
        new = frozen_engine(
            load_model(AutoModelForCausalLM, path, ds_config=frozen_config(ds), **kw), ds
        )
        shard_only(case, new, world)
        if case == "frozen_tied":
            m = new.module
            assert m.lm_head.weight is m.model.embed_tokens.weight, "tied weights came apart"
        same(case, full(old), full(new), rank)

    def trained(model):
        engine, *_ = deepspeed.initialize(
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=ds,
        )
        return engine

    old = trained(AutoModelForCausalLM.from_pretrained(tied, **kw))
    new = trained(load_model(AutoModelForCausalLM, tied, ds_config=ds, **kw))
    shard_only("trained_tied", new, world)
    same("trained_tied", full(old), full(new), rank)

    from peft import LoraConfig, get_peft_model

    def lora(model):
        config = LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM", target_modules="all-linear")
        return trained(get_peft_model(model, config))

    old = lora(AutoModelForCausalLM.from_pretrained(untied, **kw))
    new = lora(load_model(AutoModelForCausalLM, untied, ds_config=ds, **kw))
    trainable = [n for n, p in new.module.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable), trainable[:4]
    same("lora", full(old), full(new), rank)

    for case, path, from_rm in (("critic_from_lm", untied, False), ("critic_from_rm", rm, True)):
        old = trained(build_critic(path, from_rm, dtype, attn))
        new = trained(build_critic(path, from_rm, dtype, attn, ds_config=ds))
        shard_only(case, new, world)
        same(case, full(old), full(new), rank)

    rm_kw = dict(num_labels=1, **kw)
    old = frozen_engine(AutoModelForSequenceClassification.from_pretrained(rm, **rm_kw), ds)
    new = load_model(AutoModelForSequenceClassification, rm, ds_config=frozen_config(ds), **rm_kw)
    new = frozen_engine(new, ds)
    same("reward_model", full(old), full(new), rank)

    for family, path in (a.split("=", 1) for a in sys.argv[4:]):
        old = frozen_engine(AutoModelForCausalLM.from_pretrained(path, **kw), ds)
        new = load_model(AutoModelForCausalLM, path, ds_config=frozen_config(ds), **kw)
        new = frozen_engine(new, ds)
        shard_only(f"family_{family}", new, world)
        same(f"family_{family}", full(old), full(new), rank)
    dist.barrier()


if __name__ == "__main__":
    main()
    # skip the interpreter's teardown, as the loops do: DeepSpeed's leftover gloo threads can
    # abort a finished rank there (exits.exit_process)
    exit_process(0)

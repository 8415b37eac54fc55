"""torchrun worker (2 CPU ranks): every way the loops build a model gives what a plain
`from_pretrained` in the same dtype gives, buffers included. Run by tests/test_parity.py;
argv: dtypes (comma-separated: float32,bfloat16) reward_model family=model_dir ...

The reference is `from_pretrained(path, dtype=...)` on one rank, no DeepSpeed. Each way of
building is compared on it in three things: the buffers (names, dtypes, values: RoPE's inv_freq
is computed in fp32 by transformers and kept so by from_pretrained: within BUFFER_ULPS fp32 ulps,
as a build under deepspeed.zero.Init computes it on the device, and CUDA's pow differs from the
CPU's in the last bit; the sampler computes its own on the device), the gathered parameters'
dtypes, and the output on 2 rows of 1,024 tokens (one left-padded by 100): log-probs through
logprobs.model_logps for a causal LM, the body's features for a critic from a causal LM (its
value head starts at zero), values for a critic from a reward model, scores for a reward model.
The DeepSpeed config is configs/zero3.json as the loops fill it (bf16 on for bfloat16).
Rank 0 prints "OK <case> <dtype> max|d| by position <0-128> <128-512> <512-1024>" per case.

  <family>/partitioned   the default policy: zero3_load.load_model under ZeRO-3, a trained engine
  <family>/reference     the reference (and teacher): partitioned, a frozen engine
  <family>/full_frozen   --partitioned_loading False: a full load, then a frozen engine
  <family>/lora          LoRA adapters (peft) on the partitioned policy, a trained engine
  <family>/critic        ppo's critic from the causal LM (its body and a zero value head)
  reward_model, critic_from_rm   a sequence classifier, frozen, and the critic built from it
"""

import sys

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from critic import build_critic
from exits import exit_process
from generation import attn_implementation_for
from logprobs import model_logps, positions_from_mask
from zero3_load import load_model
from zero3_utils import frozen_config, frozen_engine, load_ds_config

T, PAD = 1024, 100  # tokens per row; left padding of the second row
BUCKETS = ((0, 128), (128, 512), (512, T))  # position ranges reported
# float buffers (RoPE's inv_freq) may differ by this many units in the last place: torch's CPU
# pow and CUDA's disagree in the last bit of some entries (transformers issue 28685)
BUFFER_ULPS = 4


def ds_config(dtype, hidden):
    return load_ds_config(
        "configs/zero3.json",
        hidden_size=hidden,
        train_micro_batch_size_per_gpu=1,
        gradient_accumulation_steps=1,
        gradient_clipping=1.0,
        **{
            "bf16.enabled": dtype == torch.bfloat16,
            "optimizer.params.lr": 1e-4,
            "optimizer.params.weight_decay": 0.0,
        },
    )


def batch(vocab):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (2, T), generator=g)  # (B, T), past the special tokens
    mask = torch.ones(2, T, dtype=torch.long)  # (B, T)
    mask[1, :PAD] = 0
    return ids, mask


def logps(model, ids, mask):
    return model_logps(model, ids, mask, T - 1)  # (B, T-1)


def values(critic, ids, mask):
    return critic(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask))


def features(critic, ids, mask):
    """The body's last hidden states (B, T, H): a critic from a causal LM has a zero value head,
    so its values say nothing yet."""
    pos = positions_from_mask(mask)
    return critic.body(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state


def scores(rm, ids, mask):
    out = rm(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask))
    return out.logits.float()  # (B, 1)


def ulps(a, b):
    """The largest difference of a and b in units in the last place of fp32 at a's values
    (0 for equal tensors; exact comparison for integer tensors: 0 or inf)."""
    if not a.is_floating_point():
        return 0.0 if torch.equal(a, b) else float("inf")
    a, b = a.float(), b.float()
    ulp = torch.nextafter(a.abs(), torch.tensor(float("inf"), device=a.device)) - a.abs()
    return ((a - b).abs() / ulp).max().item() if a.numel() else 0.0


def compare(case, dtype, plain, built, out_plain, out_built, rank):
    """Buffers within BUFFER_ULPS fp32 ulps; parameters of the same dtypes. Returns the largest
    output difference by position (the caller bounds it: 0 on CPU, where the same weights and
    buffers give the same numbers; on a GPU what the buffers' last bits make of it) and the
    buffers' largest difference in ulps."""
    pb, bb = list(plain.named_buffers()), list(built.named_buffers())  # the same order
    assert len(pb) == len(bb), (case, [n for n, _ in pb], [n for n, _ in bb])
    worst_ulps = 0.0
    for (n, b), (m, c) in zip(pb, bb):
        assert m.endswith(n.split(".", 1)[-1]), (case, n, m)  # a wrapper adds a prefix
        assert b.dtype == c.dtype, f"{case}: buffer {m} is {c.dtype}, plain {b.dtype}"
        assert b.shape == c.shape, f"{case}: buffer {m} is {tuple(c.shape)}, plain {b.shape}"
        u = ulps(b, c.to(b.device))
        assert u <= BUFFER_ULPS, f"{case}: buffer {m} differs by {u} fp32 ulps > {BUFFER_ULPS}"
        worst_ulps = max(worst_ulps, u)
    dtypes = {p.dtype for p in plain.parameters()}
    built_dtypes = {getattr(p, "ds_tensor", p).dtype for p in built_params(built)}
    assert built_dtypes == dtypes, (case, built_dtypes, dtypes)
    d = (out_plain.float() - out_built.float()).abs()  # (B, K)
    if d.dim() >= 2 and d.shape[1] >= T - 1:  # per position: log-probs, values, features
        d = d.flatten(2).amax(-1) if d.dim() == 3 else d  # (B, T)
        d[1, : PAD - 1] = 0  # padding scores nothing
        by = [d[:, a:b].max().item() for a, b in BUCKETS]
    else:
        by = [d.max().item()]
    if rank == 0:
        shown = " ".join(f"{x:.3g}" for x in by)
        print(
            f"OK {case} {dtype} max|d| by position {shown} buffers {worst_ulps:g} ulps", flush=True
        )
    return by, worst_ulps


def built_params(model):
    return [p for n, p in model.named_parameters() if "lora_" not in n]


def main():
    dtypes = [getattr(torch, d) for d in sys.argv[1].split(",")]
    rm_path, families = sys.argv[2], [a.split("=", 1) for a in sys.argv[3:]]
    deepspeed.init_distributed(dist_backend="gloo")
    for dtype in dtypes:
        each_build(dtype, rm_path, families, dist.get_rank())
    dist.barrier()


def each_build(dtype, rm_path, families, rank):
    worst = 0.0

    def check(case, plain, built, out_plain, out_built):
        nonlocal worst
        by, _ = compare(case, str(dtype), plain, built, out_plain, out_built, rank)
        worst = max(worst, *by)

    def trained(model, ds):
        params = [p for p in model.parameters() if p.requires_grad]
        return deepspeed.initialize(model=model, model_parameters=params, config=ds)[0]

    for family, path in families:
        attn = attn_implementation_for(path)
        kw = dict(dtype=dtype, attn_implementation=attn)
        plain = AutoModelForCausalLM.from_pretrained(path, **kw).eval()
        ds = ds_config(dtype, plain.config.hidden_size)
        ids, mask = batch(plain.config.vocab_size)
        with torch.no_grad():
            ref = logps(plain, ids, mask)

            engine = trained(load_model(AutoModelForCausalLM, path, ds_config=ds, **kw), ds)
            check(f"{family}/partitioned", plain, engine.module, ref, logps(engine, ids, mask))
            del engine
            frozen = frozen_config(ds)
            m = frozen_engine(load_model(AutoModelForCausalLM, path, ds_config=frozen, **kw), ds)
            check(f"{family}/reference", plain, m.module, ref, logps(m.module, ids, mask))
            m = frozen_engine(AutoModelForCausalLM.from_pretrained(path, **kw), ds)
            check(f"{family}/full_frozen", plain, m.module, ref, logps(m.module, ids, mask))
            del m

            from peft import LoraConfig, get_peft_model

            lora = LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM", target_modules="all-linear")
            model = get_peft_model(load_model(AutoModelForCausalLM, path, ds_config=ds, **kw), lora)
            engine = trained(model, ds)
            check(f"{family}/lora", plain, engine.module, ref, logps(engine, ids, mask))
            del engine, model

            critic_plain = build_critic(path, False, dtype, attn)
            critic = trained(build_critic(path, False, dtype, attn, ds_config=ds), ds)
            out_plain, out = features(critic_plain, ids, mask), features(critic.module, ids, mask)
            check(f"{family}/critic", critic_plain, critic.module, out_plain, out)
            del critic

    kw = dict(dtype=dtype, attn_implementation="sdpa", num_labels=1)
    plain = AutoModelForSequenceClassification.from_pretrained(rm_path, **kw).eval()
    ds = ds_config(dtype, plain.config.hidden_size)
    ids, mask = batch(plain.config.vocab_size)
    with torch.no_grad():
        frozen = frozen_config(ds)
        rm = frozen_engine(
            load_model(AutoModelForSequenceClassification, rm_path, ds_config=frozen, **kw), ds
        )
        check(
            "reward_model", plain, rm.module, scores(plain, ids, mask), scores(rm.module, ids, mask)
        )
        critic_plain = build_critic(rm_path, True, dtype, "sdpa")
        critic = trained(build_critic(rm_path, True, dtype, "sdpa", ds_config=ds), ds)
        out_plain, out = values(critic_plain, ids, mask), values(critic, ids, mask)
        check("critic_from_rm", critic_plain, critic.module, out_plain, out)
    if rank == 0:
        print(f"WORST {dtype} {worst:.6g}", flush=True)


if __name__ == "__main__":
    main()
    exit_process(0)  # skip the interpreter's teardown, as the loops do (exits.exit_process)

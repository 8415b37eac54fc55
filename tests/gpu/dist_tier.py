"""torchrun worker of the GPU tier (tests/gpu/test_tier.py; one rank, CUDA or the CPU
stand-in). argv: T steps model_dir [model_dir ...]; prints one "RESULT <json>" line per figure.

parity (the first model): tests/dist_parity.py's comparison at T tokens per row on the device:
  a model built partitioned under ZeRO-3 (zero3_load.load_model, a trained engine) against a plain
  bf16 `from_pretrained`: their log-probs' max |d| by position bucket (0-128, 128-512, 512-T),
  then buffers (within dist_parity.BUFFER_ULPS fp32 ulps: under zero.Init RoPE's inv_freq is
  computed on the device, whose pow differs from the CPU's in the last bit; the largest
  difference reported) and parameter dtypes; then the trained engine's bf16 log-probs against an
  fp32 plain load's, max and mean |d| by bucket: what a run reads as sampling_logp_difference.
bench (every model): the update (model_logps over half the row, backward, optimizer step) at ZeRO
  stage 0, 2 and 3, bf16, `steps` timed steps after one warm-up: tokens per second and
  model-FLOPs utilisation (6 N FLOPs per token, attention left out) against the device's bf16
  peak; HF generation's tokens per second under ZeRO-3, gathered and sharded. Each engine is the
  loops' (harness.without_lone_allreduce: at ZeRO-0 on one rank no backward all-reduce); each row
  notes whether the all-reduce ran.
Each check runs on its own (checked()): a failure is a RESULT "<check> failed" with its message,
after whatever figures it gave, and the next check still runs; each one's wall time is a RESULT.
"""

import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

import deepspeed  # noqa: E402
import dist_parity as P  # noqa: E402
import torch  # noqa: E402
from gpu_tier import CUDA, DEVICE, bf16_peak_flops, sync  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from exits import exit_process  # noqa: E402
from generation import attn_implementation_for, generate_hf, unwrap_for_generation  # noqa: E402
from harness import without_lone_allreduce  # noqa: E402
from logprobs import model_logps  # noqa: E402
from zero3_load import load_model  # noqa: E402
from zero3_utils import load_ds_config  # noqa: E402

BF16 = torch.bfloat16


def result(check, measure, value, unit="", note=""):
    row = dict(check=check, measure=measure, value=value, unit=unit, note=note)
    print("RESULT " + json.dumps(row), flush=True)


def checked(check, name, fn, *args):
    """fn(*args) as one check: its wall time a result; an exception a result too, not the end."""
    t0 = time.perf_counter()
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - any failure is this check's, reported, then the next
        result(check, f"{name} failed", f"{type(e).__name__}: {e}"[:2000])
    gc.collect()  # what a failed check held
    if CUDA:
        torch.cuda.empty_cache()
    result(check, f"{name} wall time", time.perf_counter() - t0, "s")


def by_position(a, b):
    """max |a - b| (B, T-1) per position bucket, the left padding left out."""
    d = (a.float() - b.float()).abs()  # (B, T-1)
    d[1, : P.PAD - 1] = 0
    return [d[:, x:y].max().item() for x, y in P.BUCKETS]


def trained(model, ds):
    """A training engine as the loops build it (harness.Run.train_engine): at ZeRO-0 on one rank
    without DeepSpeed's backward all-reduce."""
    params = [p for p in model.parameters() if p.requires_grad]
    return without_lone_allreduce(
        deepspeed.initialize(model=model, model_parameters=params, config=ds)[0]
    )


def parity(path, T):
    # dist_parity's comparison at this tier's row length (its functions read these at call time)
    P.T, P.BUCKETS = T, ((0, 128), (128, 512), (512, T))
    names = "/".join(f"{a}-{b}" for a, b in P.BUCKETS)
    attn = attn_implementation_for(path)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=BF16, attn_implementation=attn)
    plain = plain.to(DEVICE).eval()
    ds = P.ds_config(BF16, plain.config.hidden_size)
    ids, mask = (t.to(DEVICE) for t in P.batch(plain.config.vocab_size))
    with torch.no_grad():
        ref = P.logps(plain, ids, mask)
        engine = trained(load_model(AutoModelForCausalLM, path, BF16, ds, attn), ds)
        trainer = P.logps(engine, ids, mask)  # (B, T-1)
        by = by_position(ref, trainer)  # before the buffers are checked: reported either way
        result("a", f"ZeRO-3 partitioned vs plain, bf16, max|d| by position {names}", by, "nats")
        _, ulps = P.compare("partitioned", str(BF16), plain, engine.module, ref, trainer, 0)
        result("a", "buffers, ZeRO-3 partitioned vs plain: largest difference", ulps, "fp32 ulps")
        del plain, ref
        kw = dict(dtype=torch.float32, attn_implementation=attn)
        fp32 = AutoModelForCausalLM.from_pretrained(path, **kw)
        ref32 = P.logps(fp32.to(DEVICE).eval(), ids, mask)  # (B, T-1)
    d = (trainer - ref32).abs()  # (B, T-1)
    valid = torch.ones_like(d, dtype=torch.bool)
    valid[1, : P.PAD - 1] = False  # the left padding scores nothing
    top = [d[:, a:b][valid[:, a:b]].max().item() for a, b in P.BUCKETS]
    mean = [d[:, a:b][valid[:, a:b]].mean().item() for a, b in P.BUCKETS]
    result("a", f"trainer bf16 vs fp32 log-probs max|d|, by position {names}", top, "nats")
    result("a", f"trainer bf16 vs fp32 log-probs mean|d|, by position {names}", mean, "nats")
    del engine, fp32


def ds_for(stage, hidden, micro):
    name = "configs/zero3.json" if stage == 3 else "configs/zero2.json"
    with open(name) as f:
        raw = json.load(f)
    raw["zero_optimization"]["stage"] = stage
    fill = {"bf16.enabled": True, "optimizer.params.lr": 1e-6, "optimizer.params.weight_decay": 0.0}
    return load_ds_config(
        raw,
        hidden_size=hidden,
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=1,
        gradient_clipping=1.0,
        **fill,
    )


def bench(path, T, steps, peak, peak_from):
    name = os.path.basename(path.rstrip("/"))
    attn = attn_implementation_for(path)
    B, config = 2, AutoConfig.from_pretrained(path)
    H, V = config.hidden_size, config.vocab_size
    for stage in (0, 2, 3):
        ds = ds_for(stage, H, B)
        model = (
            load_model(AutoModelForCausalLM, path, BF16, ds, attn)
            if stage == 3
            else AutoModelForCausalLM.from_pretrained(path, dtype=BF16, attn_implementation=attn)
        )
        n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        engine = trained(model, ds)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(4, V, (B, T), generator=g).to(DEVICE)  # (B, T)
        mask = torch.ones(B, T, dtype=torch.long, device=DEVICE)  # (B, T)
        K = T // 2  # completion tokens scored per row
        for i in range(steps + 1):
            if i == 1:  # after one warm-up step
                sync()
                t0 = time.perf_counter()
            loss = -model_logps(engine, ids, mask, K).mean()
            engine.backward(loss)
            engine.step()
        sync()
        dt = time.perf_counter() - t0
        tok_s = B * T * steps / dt
        mfu = 6 * n_params * tok_s / peak
        where = f"{name} ({n_params / 1e6:.1f}M params), B={B} T={T}"
        # the loops' engine: at ZeRO-0 on one rank no backward all-reduce (without_lone_allreduce)
        reduce = "on" if engine.enable_backward_allreduce else "off"
        result("e", f"update tokens/s, ZeRO-{stage}, {where}", tok_s, "tok/s",
               f"backward all-reduce {reduce}")  # fmt: skip
        note = f"bf16 peak: {peak_from}" + ("" if CUDA else "; CPU: the code path, not a figure")
        result("e", f"update MFU, ZeRO-{stage}, {where}", mfu, "", f"{note}; all-reduce {reduce}")
        if stage == 3:
            generation(engine, name, V)
        del engine, model
        gc.collect()  # the engine's optimizer and hooks hold the last stage's states
        if CUDA:
            torch.cuda.empty_cache()


def generation(engine, name, V):
    prompts = [[5 + i, 6 + i, 7 + i, 8 + i] for i in range(4)]
    new = 128 if CUDA else 16
    for gather in (True, False):
        with unwrap_for_generation(engine, gather=gather) as m:
            sync()
            t0 = time.perf_counter()
            gens = generate_hf(m, prompts, 2, 8, new, pad_token_id=0, eos_token_id=V + 1)
            sync()
            dt = time.perf_counter() - t0
        how = "gathered" if gather else "sharded (layer by layer)"
        n = int(gens.completion_mask.sum())
        result("e", f"HF generation tokens/s, ZeRO-3 {how}, {name}", n / dt, "tok/s", f"{n} tokens")


def main():
    T, steps, paths = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    deepspeed.init_distributed(dist_backend="nccl" if CUDA else "gloo")
    if CUDA:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    peak, peak_from = bf16_peak_flops()
    result("e", "bf16 peak", peak / 1e12, "TFLOP/s", peak_from)
    checked("a", "parity", parity, paths[0], T)
    for path in paths:
        checked(
            "e",
            f"benchmark {os.path.basename(path.rstrip('/'))}",
            bench,
            path,
            T,
            steps,
            peak,
            peak_from,
        )


if __name__ == "__main__":
    main()
    exit_process(0)  # skip the interpreter's teardown, as the loops do (exits.exit_process)

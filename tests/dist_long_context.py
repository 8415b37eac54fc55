"""torchrun worker (2 ranks): --activation_offload and --tiled_mlp leave the update as it is, on
real DeepSpeed ZeRO-2 and ZeRO-3 (docs/long-context.md).

A tiny Llama (hidden 64, so a row of T tokens goes through each MLP in ceil(T / 64) tiles) under
gradient checkpointing; the ranks hold rows of different lengths (rank 0: 2 rows of 300 tokens,
one left-padded; rank 1: 2 of 190), so under ZeRO-3 (every weight partitioned: persistence
threshold 0) rank 1 runs as many tiles as rank 0, or the weights' gathers would not pair up. For
each stage, one SGD(lr=1) step of the fused log-probs' mean through the engine with each knob
and both: the loss and the applied update (the gathered weights' change) equal those of the knobs
off, bit for bit with offload alone (the same arithmetic), to fp32 noise with tiling (each
weight's gradient a sum over tiles).
Usage: torchrun --nproc_per_node 2 tests/dist_long_context.py MODEL_DIR
"""

import sys

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from exits import exit_process
from logprobs import model_logps
from tiled_mlp import tile_mlps, tiles_for
from zero3_load import enable_gradient_checkpointing, load_model
from zero3_utils import gathered

model_dir = sys.argv[1]
deepspeed.init_distributed(dist_backend="gloo")
rank = dist.get_rank()
T, K = (300, 120) if rank == 0 else (190, 80)
torch.manual_seed(rank)
ids = torch.randint(4, 90, (2, T))
mask = torch.ones(2, T, dtype=torch.long)
mask[1, :37] = 0  # a left-padded prompt
failures, tiles_seen = [], []


def step(stage, offload, tiled):
    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "train_batch_size": 4,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
    }
    model = load_model(
        AutoModelForCausalLM, model_dir, torch.float32, ds_config=ds if stage == 3 else None
    )
    enable_gradient_checkpointing(model, offload=offload)
    if tiled:
        assert tile_mlps(model) == model.config.num_hidden_layers
        layer = model.model.layers[0].mlp
        layer.register_forward_pre_hook(lambda m, a: tiles_seen.append(a[0].shape[-2]))
    with gathered(model):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config=ds
    )
    logps = model_logps(engine, ids, mask, K)  # (2, K)
    loss = -logps.mean()
    engine.backward(loss)
    engine.step()
    with gathered(engine.module):
        update = {n: before[n] - p.detach() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return loss.detach(), update


for stage in (2, 3):
    want_loss, want = step(stage, False, False)
    for offload, tiled in ((True, False), (False, True), (True, True)):
        label = f"zero{stage} offload={offload} tiled={tiled}"
        loss, got = step(stage, offload, tiled)
        exact = not tiled
        if exact and not torch.equal(loss, want_loss) or not torch.allclose(loss, want_loss):
            failures.append(f"{label}: loss {loss.item():.8g} != {want_loss.item():.8g}")
        for n, w in want.items():
            same = (
                torch.equal(got[n], w)
                if exact
                else torch.allclose(got[n], w, rtol=1e-5, atol=1e-5 * w.abs().max())
            )
            if not same:
                err = (got[n] - w).abs().max()
                failures.append(f"{label} {n}: max err {err:.3g} (max {w.abs().max():.3g})")

# each tiled MLP call ran on whole rows of this rank's length (tiles inside TiledMLP)
assert set(tiles_seen) == {T}, tiles_seen
assert tiles_for(300, 64) == 5 and tiles_for(190, 64) == 3  # unequal counts, agreed under ZeRO-3
if failures:
    print("\n".join(failures[:20]))
    sys.exit(1)
print(f"rank {rank}: long-context knobs equivalence OK")
dist.destroy_process_group()
exit_process(0)  # skip the interpreter's teardown, as the loops do

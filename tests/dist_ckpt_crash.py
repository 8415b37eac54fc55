"""torchrun worker (2 ranks): checkpoint.save_checkpoint survives a kill -9 in the middle of a save.

crash: a tiny-model ZeRO-3 engine trains 2 steps, saves step 2 (and its gathered weights to
       DIR/want.pt), trains 2 more, and during the save of step 4 rank 0 SIGKILLs itself when it
       writes its 2nd file (torch.save wrapped): the save is cut off halfway.
load:  fresh processes, fresh engine: `latest` names step2, load_checkpoint returns 2 and the
       weights are exactly the saved ones; the engine trains on, and a new save of step 4 clears
       the leftovers.
Usage: torchrun --nproc_per_node 2 tests/dist_ckpt_crash.py crash|load MODEL_DIR DIR
"""

import os
import sys

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from zero3_utils import gathered

mode, model_dir, out = sys.argv[1:4]
ckpt_dir = os.path.join(out, "checkpoints")
deepspeed.init_distributed(dist_backend="gloo")
rank, world = dist.get_rank(), dist.get_world_size()
config = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
lr_scheduler = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / 10)  # noqa: E731
engine, *_ = deepspeed.initialize(
    model=model, model_parameters=model.parameters(), config=config, lr_scheduler=lr_scheduler
)
run_config = {"seed": 0, "world_size": world}


def train_step(step):
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(3, 20, (2, 8), generator=g)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()


def weights():
    with gathered(engine.module):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


if mode == "crash":
    for step in range(2):
        train_step(step)
    save_checkpoint({"policy": engine}, ckpt_dir, 2, run_config)
    want = weights()
    if rank == 0:
        torch.save({"weights": want, "lr": engine.get_lr()[0]}, os.path.join(out, "want.pt"))
    dist.barrier()
    for step in range(2, 4):
        train_step(step)
    real_save, calls = torch.save, []

    def dying_save(*a, **k):
        calls.append(1)
        if rank == 0 and len(calls) == 2:
            os.kill(os.getpid(), 9)  # kill -9 halfway through writing the checkpoint
        return real_save(*a, **k)

    torch.save = dying_save
    save_checkpoint({"policy": engine}, ckpt_dir, 4, run_config)
    raise SystemExit("not reached: rank 0 kills itself during the save")

# mode == "load"
assert os.path.isdir(os.path.join(ckpt_dir, ".tmp-step4")), "the killed save left its temp dir"
assert not os.path.exists(os.path.join(ckpt_dir, "step4"))
assert latest_checkpoint(ckpt_dir) == os.path.join(ckpt_dir, "step2"), latest_checkpoint(ckpt_dir)
saved = torch.load(os.path.join(out, "want.pt"))
before = weights()
# a fresh model differs
assert any(not torch.equal(before[n], w) for n, w in saved["weights"].items())
assert load_checkpoint({"policy": engine}, ckpt_dir) == 2
got = weights()
for n, w in saved["weights"].items():
    assert torch.equal(got[n], w), n  # exactly the weights that were saved
# step counter and LR schedule restored
assert engine.global_steps == 2 and engine.get_lr()[0] == saved["lr"]
for step in range(2, 4):
    train_step(step)  # the loaded optimizer state trains on
save_checkpoint({"policy": engine}, ckpt_dir, 4, run_config)
if rank == 0:
    # no .tmp-step4
    assert sorted(os.listdir(ckpt_dir)) == ["latest", "step2", "step4"], os.listdir(ckpt_dir)
    assert latest_checkpoint(ckpt_dir) == os.path.join(ckpt_dir, "step4")
dist.barrier()
print(f"rank {rank}: ok")

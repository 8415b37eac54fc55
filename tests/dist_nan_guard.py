"""torchrun worker (2 ranks): a non-finite loss on ONE rank skips the optimizer step on both, keeps
the weights AND the Adam states clean, is counted, and a streak of them stops the run
(guard.StepGuard).

For ZeRO-2 and ZeRO-3 with configs/zero3.json's AdamW (as grpo.py builds it): a clean step applies;
a step where rank 1's advantages hold a NaN (so its loss and, through the gradient all-reduce, every
gradient are NaN) leaves every parameter bit-identical and was_step_applied() False on both ranks;
the next clean step applies and stays finite; three NaN steps in a row raise RunError (exit 3).
Usage: torchrun --nproc_per_node 2 tests/dist_nan_guard.py MODEL_DIR CONFIG_DIR
"""

import json
import math
import os
import sys

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from exits import EXIT_DIVERGED, RunError, exit_process
from fit import Knobs
from grpo import parse_args, update
from guard import StepGuard
from zero3_utils import gathered, load_ds_config

model_dir, config_dir = sys.argv[1:3]
deepspeed.init_distributed(dist_backend="gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(rank)

B, P, C, V = 4, 4, 3, 15
ids = torch.randint(4, V, (B, P + C))
am = torch.ones(B, P + C, dtype=torch.long)
batch = {
    "input_ids": ids,
    "attention_mask": am,
    "completion_mask": am[:, P:],
    "advantages": torch.randn(B),
    "old_logps": None,
    "ref_logps": None,
    "is_weights": None,
}
# grpo.py's own Args: 2 prompts x 2 completions = 4 rows per rank, two micro-batches of 2
args = parse_args(
    ["--prompts_per_rank", "2", "--num_generations", "2", "--per_device_train_batch_size", "2"]
    + ["--max_completion_length", str(C)]
)


def params(engine):
    with gathered(engine.module):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def step(engine, guard, n, nan_on_rank1):
    b = dict(batch, advantages=batch["advantages"].clone())
    if nan_on_rank1 and rank == 1:
        b["advantages"][0] = float("nan")
    out = update(engine, b, args, Knobs.given(args), torch.device("cpu"))
    loss = out["sums"]["loss"]  # summed over ranks
    norm = engine.get_global_grad_norm()
    guard.update(n, loss, None if norm is None else float(norm), not engine.was_step_applied())
    return engine.was_step_applied(), loss


for stage in (2, 3):
    raw = json.load(open(os.path.join(config_dir, "zero3.json")))
    raw["zero_optimization"]["stage"] = stage
    cfg = load_ds_config(
        raw,
        world_size=world,
        hidden_size=128,
        train_micro_batch_size_per_gpu=2,
        gradient_accumulation_steps=2,
        gradient_clipping=1.0,
        **{"bf16.enabled": False},
        **{"optimizer.params.lr": 1e-2, "optimizer.params.weight_decay": 0.0},
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    guard = StepGuard(max_bad_steps=3)

    w0 = params(engine)
    applied, loss = step(engine, guard, 1, nan_on_rank1=False)
    w1 = params(engine)
    assert applied and math.isfinite(loss) and any(not torch.equal(w0[k], w1[k]) for k in w0), stage

    applied, loss = step(engine, guard, 2, nan_on_rank1=True)  # NaN on rank 1 only
    w2 = params(engine)
    assert not applied and math.isnan(loss), (stage, applied, loss)  # skipped on BOTH ranks
    assert all(torch.equal(w1[k], w2[k]) for k in w1), (
        f"ZeRO-{stage}: a skipped step changed the weights"
    )
    assert guard.skipped == 1 and guard.in_a_row == 1

    applied, loss = step(engine, guard, 3, nan_on_rank1=False)  # Adam's states were not poisoned
    w3 = params(engine)
    assert applied and guard.in_a_row == 0 and all(torch.isfinite(v).all() for v in w3.values()), (
        stage
    )
    assert any(not torch.equal(w2[k], w3[k]) for k in w2), stage

    try:
        for n in (4, 5, 6):
            step(engine, guard, n, nan_on_rank1=True)
        raise AssertionError(f"ZeRO-{stage}: three non-finite steps in a row did not stop the run")
    except RunError as e:
        assert e.exit_code == EXIT_DIVERGED and "3 steps in a row (last: step 6)" in str(e), str(e)
    assert all(torch.equal(w3[k], v) for k, v in params(engine).items()), stage
    if rank == 0:
        print(
            f"ZeRO-{stage}: non-finite steps skipped on both ranks, weights untouched, streak of 3 "
            "stops",
            flush=True,
        )
    engine.destroy()
dist.destroy_process_group()
# Skip the interpreter's teardown, as the loops do: DeepSpeed's leftover gloo threads can abort a
# finished rank there (exits.exit_process).
exit_process(0)

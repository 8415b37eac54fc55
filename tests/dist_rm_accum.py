"""torchrun worker (2 ranks): rm.py's accumulation equivalence on real DeepSpeed
(docs/accumulation.md, "Accumulation never changes the update").

The whole batch is 8 preference pairs (16 sequences), 4 pairs per rank, prompts and responses of
different lengths, with margins. For ZeRO-2 and ZeRO-3 and micro-batches of 8, 4 and 2 sequences
(1, 2 and 4 micro-batches per rank), and one rank with fewer pairs than the other (zero-weight
repeats), rm.update's loss and metric sums (with rm.py's own Args) must equal bt_loss over the full
batch on one plain model, and its SGD(lr=1) update minus the gradient of that loss.
Usage: torchrun --nproc_per_node 2 tests/dist_rm_accum.py MODEL_DIR
"""

import sys

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from exits import exit_process
from fit import Knobs
from pairs import pair_batch
from reward_model import sequence_scores
from rm import bt_loss, parse_args, split_scores, update
from zero3_utils import gathered

model_dir = sys.argv[1]
deepspeed.init_distributed(dist_backend="gloo")
rank, world = dist.get_rank(), dist.get_world_size()
assert world == 2
tokenizer = AutoTokenizer.from_pretrained(model_dir)
digits = "0123456789"
rows = [
    {
        "prompt": digits[i : i + 1 + i % 4] + "=",
        "chosen": digits[i % 10] * (1 + i % 3),
        "rejected": digits[(i + 3) % 10] * (1 + (i + 1) % 4),
        "margin": 0.1 * (i % 3),
    }
    for i in range(8)
]
failures = []


def reference(pair_rows, center_coef):
    """Loss, metric sums and gradient of the full batch on one plain model, one backward."""
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    batch = pair_batch(tokenizer, pair_rows, 64, 16)
    scores = sequence_scores(model, batch, "cpu")  # (16,)
    loss, metrics = bt_loss(
        split_scores(scores, batch), normalizer=len(pair_rows), center_coef=center_coef
    )
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), {k: float(v) for k, v in metrics.items()}, grads


def check(label, stage, micro, mine, want_loss, want_metrics, want, center_coef):
    args = parse_args(
        ["--prompts_per_rank", "4", "--per_device_train_batch_size", str(micro)]
        + ["--max_completion_length", "16", "--center_coef", str(center_coef)]
    )
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 8 // micro,
        "train_batch_size": 16,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config=config
    )
    batch = pair_batch(tokenizer, mine, 64, 16)
    totals = update(engine, batch, args, Knobs.given(args), torch.device("cpu"))
    label = f"zero{stage} micro={micro} {label}"
    got_loss = totals["loss"] / totals["pairs"]  # the summed -log sigmoid over the batch's pairs
    want_bt = want_metrics["loss"] / want_metrics["pairs"]
    if abs(got_loss - want_bt) > 1e-6 or (not center_coef and abs(got_loss - want_loss) > 1e-6):
        failures.append(f"{label}: loss {got_loss:.8g} != {want_bt:.8g}")
    for k, v in want_metrics.items():
        if abs(totals[k] - v) > 1e-5:
            failures.append(f"{label}: {k} {totals[k]} != {v}")
    with gathered(engine.module):
        for n, p in engine.module.named_parameters():
            got = before[n] - p.detach()  # SGD(lr=1): the applied gradient
            if not torch.allclose(got, want[n], rtol=1e-4, atol=1e-7):
                failures.append(
                    f"{label} {n}: max err {(got - want[n]).abs().max():.3g} (grad max "
                    f"{want[n].abs().max():.3g})"
                )
    engine.destroy()


for center_coef in (0.0, 0.05):
    loss, metrics, want = reference(rows, center_coef)
    for stage in (2, 3):
        for micro in (8, 4, 2):
            check(
                f"center {center_coef}",
                stage,
                micro,
                rows[4 * rank : 4 * rank + 4],
                loss,
                metrics,
                want,
                center_coef,
            )
# uneven: rank 0 holds 5 pairs, rank 1 3; micro-batches of 2 sequences: rank 1 runs 2 repeats
loss, metrics, want = reference(rows, 0.0)
mine = rows[:5] if rank == 0 else rows[5:]
check("uneven 5 + 3 pairs", 3, 2, mine, loss, metrics, want, 0.0)

if failures:
    print("\n".join(failures[:20]))
    sys.exit(1)
print(f"rank {rank}: rm accumulation equivalence OK")
dist.destroy_process_group()
exit_process(0)  # skip the interpreter's teardown, as the loops do (checks.exit_process)

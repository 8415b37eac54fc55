"""torchrun worker (2 ranks): GRPO accumulation equivalence on real DeepSpeed (docs/accumulation.md,
"Accumulation never changes the update").

The whole batch is 8 completions, 4 per rank. For ZeRO-2 and ZeRO-3, every loss_type, and
micro-batch x accumulation = (4, 1), (2, 2), (1, 4) and a token budget (uneven micro-batch counts
across ranks), padded or packed (--packing), grpo.train_on_batch's loss must equal the full-batch
loss and its SGD(lr=1) update minus the gradient of it, computed on one plain model.
Usage: torchrun --nproc_per_node 2 tests/dist_grpo_accum.py MODEL_DIR TMP_DIR
"""

import sys
from types import SimpleNamespace

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from batching import plan_micro_batches
from grpo import LOSS_TYPES, grpo_loss, loss_normalizer, train_on_batch
from zero3_utils import gathered

model_dir = sys.argv[1]
deepspeed.init_distributed(dist_backend="gloo")
rank, world = dist.get_rank(), dist.get_world_size()
assert world == 2
torch.manual_seed(0)

# One fixed batch: left-padded prompts of different lengths, completions of different lengths.
B, P, C, V = 8, 6, 5, 40
prompt_len = torch.tensor([3, 6, 4, 5, 6, 2, 3, 6])
comp_len = torch.tensor([5, 1, 3, 2, 5, 4, 1, 3])
ids = torch.randint(4, V, (B, P + C))
am = torch.cat(
    [(torch.arange(P)[None] >= P - prompt_len[:, None]), torch.arange(C)[None] < comp_len[:, None]],
    1,
).long()
ids = ids.masked_fill(am == 0, 0)
cmask = am[:, P:]


def plain_logps(model):
    pos = (am.cumsum(1) - 1).clamp(min=0)
    logits = (
        model(input_ids=ids, attention_mask=am, position_ids=pos).logits[:, P - 1 : -1].float()
    )  # (B, C, V)
    return logits.log_softmax(-1).gather(-1, ids[:, P:, None]).squeeze(-1)  # (B, C)


ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
with torch.no_grad():
    base = plain_logps(ref_model)
# a previous iteration's policy: ratios leave 1, clipping acts
old_logps = base + 0.3 * torch.randn(B, C)
ref_logps = base + 0.3 * torch.randn(B, C)
advantages = torch.randn(B)
args = SimpleNamespace(
    temperature=1.0, beta=0.04, epsilon_low=0.2, epsilon_high=0.28, logprob_chunk_size=0
)
# (micro-batch size, token budget, packing): packed micro-batches (one row, positions restarting
# per sequence, batching.pack) give the same loss and update as padded ones
CONFIGS = ((4, 0, False), (2, 0, False), (1, 0, False), (4, 22, False), (2, 0, True), (4, 22, True))

failures = []
for loss_type in LOSS_TYPES:
    # the reference: full batch, one plain model, one backward
    args.loss_type = loss_type
    ref_model.zero_grad()
    norm = loss_normalizer(cmask, loss_type, C)
    loss, _ = grpo_loss(
        plain_logps(ref_model),
        old_logps,
        ref_logps,
        advantages,
        cmask,
        beta=args.beta,
        epsilon_low=args.epsilon_low,
        epsilon_high=args.epsilon_high,
        loss_type=loss_type,
        normalizer=norm,
    )
    loss.backward()
    want = {n: p.grad.clone() for n, p in ref_model.named_parameters()}
    for stage in (2, 3):
        for micro, budget, packing in CONFIGS:
            args.packing = packing
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            config = {
                "train_micro_batch_size_per_gpu": micro,
                "gradient_accumulation_steps": 4 // micro,
                "train_batch_size": 8,
                "zero_optimization": {"stage": stage},
                "gradient_clipping": 0.0,
                "zero_allow_untested_optimizer": True,
            }
            engine, *_ = deepspeed.initialize(
                model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config=config
            )
            mine = slice(4 * rank, 4 * rank + 4)
            batch = {
                "input_ids": ids[mine],
                "attention_mask": am[mine],
                "completion_mask": cmask[mine],
                "advantages": advantages[mine],
                "old_logps": old_logps[mine],
                "ref_logps": ref_logps[mine],
                "is_weights": None,
            }
            plan = plan_micro_batches(batch, micro, budget)
            local = sum(
                loss_normalizer(cmask[mine][i], loss_type, C) for i in plan if i is not None
            )
            total = torch.tensor(local)
            dist.all_reduce(total)
            assert total.item() == norm, (total.item(), norm)
            sums = train_on_batch(engine, batch, plan, args, total.item(), torch.device("cpu"))
            got_loss = torch.tensor(sums["loss"])  # this rank's share of the full-batch loss
            dist.all_reduce(got_loss)
            if not torch.allclose(got_loss, loss.detach(), rtol=1e-5, atol=1e-7):
                failures.append(
                    f"{loss_type} zero{stage} micro={micro} budget={budget} packing={packing}: "
                    f"loss {got_loss.item():.8g} != {loss.item():.8g}"
                )
            with gathered(engine.module):
                for n, p in engine.module.named_parameters():
                    got = before[n] - p.detach()  # SGD(lr=1): the applied gradient
                    if not torch.allclose(got, want[n], rtol=1e-4, atol=1e-7):
                        failures.append(
                            f"{loss_type} zero{stage} micro={micro} budget={budget} "
                            f"packing={packing} {n}: "
                            f"max err {(got - want[n]).abs().max():.3g} (grad max "
                            f"{want[n].abs().max():.3g})"
                        )
            if budget and rank == 0:
                print(
                    f"token budget {budget}: micro-batch sizes "
                    f"{[None if i is None else len(i) for i in plan]}"
                )
            engine.destroy()

if failures:
    print("\n".join(failures[:20]))
    sys.exit(1)
print(f"rank {rank}: accumulation equivalence OK")
dist.destroy_process_group()

"""torchrun worker (2 ranks): GRPO accumulation equivalence in bf16 on real DeepSpeed.

The policy runs in bf16 with DeepSpeed's bf16 mode (bf16 compute, fp32 master weights and gradient
accumulation); the log-probs stay fp32 (logprobs.py). For ZeRO-2 and ZeRO-3 and micro-batch x
accumulation = (4, 1), (2, 2), (1, 4) and a token budget, the gradient DeepSpeed has accumulated
when grpo.update reaches its optimizer step (read with deepspeed.utils.safe_get_full_grad)
must equal the fp32 gradient of the full-batch loss on one plain fp32 model, within TOLERANCE in
relative L2 norm over all parameters.
Usage: torchrun --nproc_per_node 2 tests/dist_bf16_accum.py MODEL_DIR

Why TOLERANCE = 3e-2: bf16 keeps 8 significant bits (unit roundoff 2^-9 = 2e-3). The weights
themselves are rounded to bf16 once, and every matmul, norm and activation of the 2-layer forward
and backward rounds its output again, about ten roundings in series per gradient entry; each adds
up to 2e-3 relative, so about 1e-2 is expected, and 3e-2 leaves room for the worst layer. A
wrong accumulation (a micro-batch counted twice, a loss scaled by 1/accumulation steps or by the
world size) is off by 25 % to 100 %, far outside it. The largest error measured is printed.
"""

import sys

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.utils import safe_get_full_grad
from transformers import AutoModelForCausalLM

from batching import loss_inputs
from exits import exit_process
from fit import Knobs
from grpo import grpo_loss, loss_normalizer, parse_args, update

TOLERANCE = 3e-2
model_dir = sys.argv[1]
deepspeed.init_distributed(dist_backend="gloo")
rank, world = dist.get_rank(), dist.get_world_size()
assert world == 2
torch.manual_seed(0)

# One fixed batch: left-padded prompts of different lengths, completions of different lengths.
B, P, C, V = 8, 6, 5, 15
prompt_len = torch.tensor([3, 6, 4, 5, 6, 2, 3, 6])
comp_len = torch.tensor([5, 1, 3, 2, 5, 4, 1, 3])
ids = torch.randint(4, V, (B, P + C))
am = torch.cat(
    [torch.arange(P)[None] >= P - prompt_len[:, None], torch.arange(C)[None] < comp_len[:, None]], 1
).long()
ids = ids.masked_fill(am == 0, 0)
cmask = am[:, P:]


def plain_logps(model):
    pos = (am.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=am, position_ids=pos).logits[:, P - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, ids[:, P:, None]).squeeze(-1)  # (B, C)


ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
with torch.no_grad():
    base = plain_logps(ref_model)
old_logps = base + 0.3 * torch.randn(B, C)  # a previous iteration's policy: ratios leave 1
advantages = torch.randn(B)
norm = loss_normalizer(cmask, "bnpo", C)
logps = plain_logps(ref_model)
mb = {"completion_mask": cmask, "old_logps": old_logps, "advantages": advantages}
t = loss_inputs(mb, logps, torch.zeros_like(logps), "cpu")
loss, _ = grpo_loss(t, parse_args(["--epsilon_high", "0.28"]), {"normalizer": norm})
loss.backward()
want = {n: p.grad.clone() for n, p in ref_model.named_parameters()}
want_norm = torch.sqrt(sum((g.double() ** 2).sum() for g in want.values()))

failures, worst = [], 0.0
for stage in (2, 3):
    for micro, budget in ((4, 0), (2, 0), (1, 0), (4, 22)):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
        config = {
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": 4 // micro,
            "train_batch_size": 8,
            "zero_optimization": {"stage": stage},
            "gradient_clipping": 0.0,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        }
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        got = {}
        step = engine.step

        def read_grads_then_step(engine=engine, got=got, step=step):  # just before it applies them
            for n, p in engine.module.named_parameters():
                got[n] = safe_get_full_grad(p).float().clone()
            step()

        engine.step = read_grads_then_step
        mine = slice(4 * rank, 4 * rank + 4)
        batch = {
            "input_ids": ids[mine],
            "attention_mask": am[mine],
            "completion_mask": cmask[mine],
            "advantages": advantages[mine],
            "old_logps": old_logps[mine],
            "ref_logps": None,
            "is_weights": None,
        }
        # grpo.py's own Args: 2 prompts x 2 completions = 4 rows per rank, loss_type bnpo
        argv = ["--prompts_per_rank", "2", "--num_generations", "2", "--epsilon_high", "0.28"]
        argv += ["--max_completion_length", str(C), "--per_device_train_batch_size", str(micro)]
        args = parse_args(argv + ["--max_tokens_per_microbatch", str(budget)])
        update(engine, batch, args, Knobs.given(args), torch.device("cpu"))
        err = torch.sqrt(sum(((got[n].double() - want[n].double()) ** 2).sum() for n in want))
        rel = (err / want_norm).item()
        worst = max(worst, rel)
        if not rel <= TOLERANCE:
            failures.append(
                f"zero{stage} micro={micro} budget={budget}: relative L2 error {rel:.3g}"
            )
        engine.destroy()

if failures:
    print("\n".join(failures))
    sys.exit(1)
print(f"rank {rank}: bf16 accumulation equivalence OK, largest relative error {worst:.2e}")
dist.destroy_process_group()
# Skip the interpreter's teardown, as the loops do: DeepSpeed's leftover gloo threads can abort a
# finished rank there (exits.exit_process).
exit_process(0)

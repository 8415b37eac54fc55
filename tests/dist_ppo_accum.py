"""torchrun worker (2 ranks): PPO accumulation equivalence on real DeepSpeed ZeRO-3.

The mini-batch is 8 completions, 4 per rank. For micro-batch x accumulation = (4, 1), (1, 4),
packed micro-batches of 2 and token-budget micro-batches (20 padded tokens), ppo.update's SGD(lr=1)
update (with ppo.py's own Args) of the actor AND the critic must equal minus the gradient of the
full-batch policy / value loss computed on plain models; with --loss_type cispo and --entropy_coef,
the actor's update equals that of the loss on the full logits' log-probs and entropy. On-policy
(no old log-probs in the batch), the actor's update must equal the one with old log-probs from the
current policy, and logps_out must hold them.
Usage: torchrun --nproc_per_node 2 tests/dist_ppo_accum.py MODEL_DIR
"""

import sys

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from batching import loss_inputs, micro_slice
from exits import exit_process
from fit import Knobs
from ppo import (
    build_critic,
    forward_logps,
    forward_values,
    parse_args,
    policy_loss,
    update,
    value_loss,
)
from zero3_utils import gathered

model_dir = sys.argv[1]
deepspeed.init_distributed(dist_backend="gloo")
rank, world = dist.get_rank(), dist.get_world_size()
assert world == 2
torch.manual_seed(0)
cpu = torch.device("cpu")

B, P, C, V = 8, 6, 5, 40
prompt_len = torch.tensor([3, 6, 4, 5, 6, 2, 3, 6])
comp_len = torch.tensor([5, 1, 3, 2, 5, 4, 1, 3])
ids = torch.randint(4, V, (B, P + C))
am = torch.cat(
    [torch.arange(P)[None] >= P - prompt_len[:, None], torch.arange(C)[None] < comp_len[:, None]], 1
).long()
ids = ids.masked_fill(am == 0, 0)
cmask = am[:, P:]


def models():
    torch.manual_seed(1)
    actor = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    critic = build_critic(model_dir, False, torch.float32, "sdpa")
    torch.nn.init.normal_(critic.value_head.weight, std=0.1)  # seeded: the same head in every build
    return actor, critic


full = {"input_ids": ids, "attention_mask": am, "completion_mask": cmask}
actor, critic = models()
with torch.no_grad():
    base_logps = forward_logps(actor, micro_slice(full, torch.arange(B)), 1.0, False, cpu)  # (B, C)
    base_values = forward_values(critic, micro_slice(full, torch.arange(B)), False, cpu)  # (B, C)
full["old_logps"] = base_logps + 0.3 * torch.randn(B, C)  # ratios leave 1: clipping acts
full["values"] = base_values + 0.3 * torch.randn(B, C)  # old values differ: value clipping acts
full["advantages"] = torch.randn(B, C) * cmask
full["returns"] = torch.randn(B, C) * cmask


def ppo_args(micro, packing, budget, extra=()):
    """ppo.py's own Args: 2 prompts x 2 completions = 4 rows per rank, one epoch, one mini-batch;
    extra: more flags."""
    argv = ["--prompts_per_rank", "2", "--num_generations", "2", "--ppo_epochs", "1"]
    argv += ["--num_mini_batches", "1", "--cliprange", "0.2", "--cliprange_value", "0.05"]
    argv += ["--per_device_train_batch_size", str(micro), "--packing", str(packing)]
    return parse_args(argv + ["--max_tokens_per_microbatch", str(budget), *extra])


args = ppo_args(4, False, 0)

# the reference: full batch, plain models, one backward each
n = float(cmask.sum())
mb = micro_slice(full, torch.arange(B))
c = mb["logits_to_keep"]
lp = forward_logps(actor, mb, 1.0, False, cpu)
loss, _ = policy_loss(loss_inputs(mb, lp, torch.zeros_like(lp), cpu), args, n)
loss.backward()
vloss, _ = value_loss(
    forward_values(critic, mb, False, cpu),
    mb["values"],
    mb["returns"],
    mb["completion_mask"],
    args.cliprange_value,
    n,
)
vloss.backward()
want = {("actor", k): p.grad.clone() for k, p in actor.named_parameters()}
want.update({("critic", k): p.grad.clone() for k, p in critic.named_parameters()})


def sgd_engines(micro):
    """{"actor", "critic"}: fresh models as ZeRO-3 engines with SGD(lr=1), 8 rows per step."""
    engines = {}
    for name, model in zip(("actor", "critic"), models()):
        config = {
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": 4 // micro,
            "train_batch_size": 8,
            "zero_optimization": {"stage": 3},
            "gradient_clipping": 0.0,
            "zero_allow_untested_optimizer": True,
        }
        engines[name], *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config=config
        )
    return engines


def check(label, args, micro, want):
    """ppo.update on 2 ranks (rows 4 * rank ... + 3 each), SGD(lr=1), against the gradients want."""
    engines = sgd_engines(micro)
    before = {}
    for name, e in engines.items():
        with gathered(e.module):
            before.update({(name, k): p.detach().clone() for k, p in e.module.named_parameters()})
    mine = slice(4 * rank, 4 * rank + 4)
    batch = {k: v[mine] for k, v in full.items()}
    update(engines["actor"], engines["critic"], batch, args, Knobs.given(args), cpu, {})
    for name, e in engines.items():
        with gathered(e.module):
            for k, p in e.module.named_parameters():
                got = before[(name, k)] - p.detach()  # SGD(lr=1): the applied gradient
                w = want[(name, k)]
                if not torch.allclose(got, w, rtol=1e-4, atol=1e-6):
                    failures.append(
                        f"{label} {name}.{k}: max err {(got - w).abs().max():.3g}"
                        f" (grad max {w.abs().max():.3g})"
                    )
        e.destroy()


failures = []
# (micro-batch size, packing, token budget): a budget of 20 padded tokens makes micro-batches of
# 1-3 length-sorted sequences (lengths 4-11), in an order of its own
for micro, packing, budget in ((4, False, 0), (1, False, 0), (2, True, 0), (4, False, 20)):
    label = f"micro={micro} packing={packing} budget={budget}"
    check(label, ppo_args(micro, packing, budget), micro, want)

# --loss_type cispo with --entropy_coef: the actor's gradient equals that of the loss on the full
# logits' log-probs and entropy (the fused entropy's gradient, under ZeRO-3 with accumulation)
actor, critic = models()
pos = (am.cumsum(1) - 1).clamp(min=0)
logits = actor(input_ids=ids, attention_mask=am, position_ids=pos).logits  # (B, P + C, V)
lsm = logits[:, P - 1 : -1].log_softmax(-1)  # (B, C, V)
logps, entropy = lsm.gather(-1, ids[:, P:, None])[..., 0], -(lsm.exp() * lsm).sum(-1)  # (B, C)
adv, old = full["advantages"], full["old_logps"]
cispo = ppo_args(4, False, 0, ["--loss_type", "cispo", "--entropy_coef", "0.05"])
t = loss_inputs(
    {"completion_mask": cmask, "old_logps": old, "advantages": adv}, logps, entropy, cpu
)
loss, _ = policy_loss(t, cispo, n)
loss.backward()
want_cispo = {**want, **{("actor", k): p.grad.clone() for k, p in actor.named_parameters()}}
for micro, packing in ((1, False), (2, True)):
    args = ppo_args(micro, packing, 0, ["--loss_type", "cispo", "--entropy_coef", "0.05"])
    check(f"cispo entropy micro={micro} packing={packing}", args, micro, want_cispo)

# on-policy (one epoch, one mini-batch): without old log-probs the update takes its own forward's,
# so the policy gradient is the one with old = the current policy's (ratio 1), micro-batches of 1
full["old_logps"] = base_logps
actor, critic = models()
mb = micro_slice(full, torch.arange(B))
lp = forward_logps(actor, mb, 1.0, False, cpu)
loss, _ = policy_loss(loss_inputs(mb, lp, torch.zeros_like(lp), cpu), ppo_args(1, False, 0), n)
loss.backward()
want_on = {k: p.grad.clone() for k, p in actor.named_parameters()}
args = ppo_args(1, False, 0)
engines = sgd_engines(1)
with gathered(engines["actor"].module):
    before = {k: p.detach().clone() for k, p in engines["actor"].module.named_parameters()}
mine = slice(4 * rank, 4 * rank + 4)
batch = {k: v[mine] for k, v in full.items() if k != "old_logps"}
trainer = torch.zeros(4, C)  # (4, C)
update(
    engines["actor"], engines["critic"], batch, args, Knobs.given(args), cpu, {}, logps_out=trainer
)
if not torch.allclose(trainer * cmask[mine], base_logps[mine] * cmask[mine], atol=1e-5):
    failures.append(f"on-policy logps_out: max err {(trainer - base_logps[mine]).abs().max():.3g}")
with gathered(engines["actor"].module):
    for k, p in engines["actor"].module.named_parameters():
        got, w = before[k] - p.detach(), want_on[k]
        if not torch.allclose(got, w, rtol=1e-4, atol=1e-6):
            failures.append(f"on-policy actor.{k}: max err {(got - w).abs().max():.3g}")
for e in engines.values():
    e.destroy()

if failures:
    print("\n".join(failures[:20]))
    sys.exit(1)
print(f"rank {rank}: ppo accumulation equivalence OK")
dist.destroy_process_group()
# Skip the interpreter's teardown, as the loops do: DeepSpeed's leftover gloo threads can abort a
# finished rank there (exits.exit_process).
exit_process(0)

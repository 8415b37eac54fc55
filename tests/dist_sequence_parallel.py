"""torchrun worker: sequence parallelism (sequence_parallel.py) against each rank alone.

    torchrun --nproc_per_node 2 tests/dist_sequence_parallel.py --policy DIR --reward DIR

Each rank first computes, alone (its own one-rank data group), the losses of one batch with the
whole sequences and their gradients: GRPO's loss with the whole-batch normaliser (grpo.batch_stats,
micro-batches of 3 of 6 rows, left-padded prompts of different lengths), PPO's value loss through
critic.forward_values, and rm.py's Bradley-Terry loss through reward_model.sequence_scores. Then
with S = 2 (the two ranks one group, each scoring its half of every row) the same losses must come
out equal, and the parameter gradients summed over the two ranks must equal the whole rows'.
The same for the log-probs of a micro-batch under a top-k / top-p cut (found, reused, and replayed
from kept sets), each rank's slice finding or replaying its own positions' cut.
Also: several sequences packed in one row under sdpa are NOT scored exactly (attention ignores
the position ids' boundaries), which is why the pre-flight refuses --packing with sdpa.
Prints "OK" on rank 0.
"""

import argparse

import deepspeed
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import grpo
import ppo
import rm
import sequence_parallel
from batching import forward_logps, loss_inputs, make_batch, micro_batches
from critic import Critic, forward_values
from exits import exit_process
from fit import Knobs
from generation import Generations
from reward_model import sequence_scores
from zero3_load import enable_gradient_checkpointing
from zero3_utils import set_data_group


def batch(V, seed=1):
    """6 rows: 3 prompts of different lengths x 2 completions of different lengths (B = 6)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, V, (n,), generator=g).tolist() for n in (5, 9, 7)]
    lengths = [11, 4, 17, 8, 13, 6]
    ids = torch.zeros(6, 17, dtype=torch.long)
    mask = torch.zeros(6, 17, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(3, V, (n,), generator=g)
        mask[i, :n] = 1
    b = make_batch(prompts, Generations(ids, mask), 0)
    b["advantages"] = torch.linspace(-1, 1, 6)
    b["returns"] = torch.randn(6, 17, generator=g)
    return b


def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def losses(policy, critic, reward, b):
    """GRPO's, PPO's value and rm.py's losses over the batch, backward into each model."""
    for m in (policy, critic, reward):
        m.zero_grad()
    args = grpo.parse_args(["--beta", "0.0", "--per_device_train_batch_size", "3"])
    knobs = Knobs.given(args)
    plan = grpo.micro_plan(b, args, knobs)
    stats = grpo.batch_stats(b, plan, args)
    out = {"grpo": 0.0, "value": 0.0, "bt": 0.0}
    for _, mb, weight in micro_batches(b, plan):
        logps, entropy = forward_logps(policy, mb, 1.0, False, "cpu", return_entropy=True)
        t = loss_inputs(mb, logps, entropy, "cpu", mask=grpo.loss_tokens(mb))
        t.old_logps = t.old_logps + 0.05  # ratios off 1: the clip and its metrics take part
        loss, _ = grpo.grpo_loss(t, args, stats)
        (loss * weight).backward()
        out["grpo"] += float(loss) * weight
        values = forward_values(critic, mb, False, "cpu")  # (b, c)
        cm = mb["completion_mask"]
        loss, _ = ppo.value_loss(values, values.detach() * 0.5, mb["returns"], cm, 0.2, 50.0)
        (loss * weight).backward()
        out["value"] += float(loss) * weight
    pairs = rm.pair_plan(b, Knobs.given(rm.parse_args(["--per_device_train_batch_size", "2"])))
    for _, mb, weight in micro_batches(b, pairs):
        scores = sequence_scores(reward, mb, "cpu")  # (b,)
        loss, _ = rm.bt_loss(rm.split_scores(scores, mb), normalizer=3.0, center_coef=0.01)
        (loss * weight).backward()
        out["bt"] += float(loss) * weight
    return out, {k: grads(m) for k, m in zip(out, (policy, critic, reward))}


def cut_logps(policy, b):
    """Log-probs (and gradients) of one micro-batch of 3 rows under a top-k / top-p cut: found
    from the logits (the sampler's PyTorch rule), reused from mb["sampling_thresholds"], and
    replayed from kept sets built by hand (each token's set: the target and 3 others, -1 padded
    to 6, as vLLM's return_sampling_mask hands them)."""
    args = grpo.parse_args(["--per_device_train_batch_size", "3"])
    plan = grpo.micro_plan(b, args, Knobs.given(args))
    _, mb, _ = next(iter(micro_batches(b, plan)))
    mb = dict(mb)
    cut = dict(top_k=5, top_p=0.9, top_k_rule="pytorch")
    out = {}
    policy.zero_grad()
    found = forward_logps(policy, mb, 1.0, False, "cpu", **cut)  # (b, c): the cut found now
    cm = mb["completion_mask"]  # padding's log-probs: 0 when sliced, the pad token's otherwise
    (found * cm).sum().backward()
    out["cut found"] = (found.detach(), grads(policy), mb["sampling_thresholds"])
    policy.zero_grad()
    again = forward_logps(policy, mb, 1.0, False, "cpu", **cut)  # the thresholds of mb reused
    (again * cm).sum().backward()
    out["cut reused"] = (again.detach(), grads(policy), mb["sampling_thresholds"])
    g = torch.Generator().manual_seed(3)
    c = mb["completion_mask"].shape[1]
    others = torch.randint(0, policy.config.vocab_size, (3, c, 3), generator=g)
    kept = torch.cat([mb["input_ids"][:, -c:, None], others, torch.full((3, c, 2), -1)], -1)
    replay = {**mb, "sampling_kept": kept}  # (b, c, 6)
    replay.pop("sampling_thresholds")
    policy.zero_grad()
    sets = forward_logps(policy, replay, 1.0, False, "cpu", **cut)
    (sets * cm).sum().backward()
    out["kept sets"] = (sets.detach(), grads(policy), None)
    return out, mb["completion_mask"].bool()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--policy", required=True)
    p.add_argument("--reward", required=True)
    a = p.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")  # Ulysses speaks deepspeed.comm
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_pretrained(a.policy, attn_implementation="sdpa")
    enable_gradient_checkpointing(policy)  # its backward recomputes each layer's slice
    body = AutoModelForCausalLM.from_pretrained(a.policy, attn_implementation="sdpa").model
    critic = Critic(body, torch.nn.Linear(body.config.hidden_size, 1, bias=False))
    reward = AutoModelForSequenceClassification.from_pretrained(
        a.reward, num_labels=1, attn_implementation="sdpa"
    )
    b = batch(policy.config.vocab_size)

    alone = [dist.new_group([r]) for r in range(world)][rank]  # the whole rows, this rank alone
    set_data_group(alone)
    ref, ref_grads = losses(policy, critic, reward, b)
    ref_cut, cm = cut_logps(policy, b)  # cm: the cut micro-batch's completion tokens

    sp = sequence_parallel.init(world)
    sequence_parallel.install("sdpa")
    set_data_group(sp.data_group)
    got, got_grads = losses(policy, critic, reward, b)
    for name in ref:
        dist.all_reduce(got_grads[name])  # the group's slices add up to the whole rows' gradient
        err = abs(got[name] - ref[name]) / abs(ref[name])
        g, r = got_grads[name], ref_grads[name]
        gerr = ((g - r).abs().max() / r.abs().max()).item()
        if rank == 0:
            print(f"{name}: loss {ref[name]:.6f} rel err {err:.1e}, gradient rel err {gerr:.1e}")
        assert err < 1e-5 and gerr < 1e-5, (name, err, gerr)
    for name, (logps, g, tau) in cut_logps(policy, b)[0].items():
        r_logps, r_g, r_tau = ref_cut[name]
        dist.all_reduce(g)
        err = (logps - r_logps)[cm].abs().max().item()
        gerr = ((g - r_g).abs().max() / r_g.abs().max()).item()
        # the same cut: the count at tau exactly, tau itself to fp32 noise (the logits' own)
        same_cut = tau is None or (
            torch.equal(tau[cm][:, 1], r_tau[cm][:, 1])
            and torch.allclose(tau[cm][:, 0], r_tau[cm][:, 0], rtol=1e-5, atol=1e-5)
        )
        if rank == 0:
            print(f"{name}: log-prob max abs err {err:.1e}, gradient rel err {gerr:.1e}")
        assert err < 1e-5 and gerr < 1e-5 and same_cut, (name, err, gerr, same_cut)
        assert logps[cm].isfinite().all() and (logps[cm] <= 0).all(), name

    # packed sequences under sdpa: the attention sees across their boundary
    ids = torch.randint(3, policy.config.vocab_size, (1, 30))
    pos = torch.cat([torch.arange(12), torch.arange(18)])[None]
    with sequence_parallel.paused():  # the whole row on this rank
        whole = policy(input_ids=ids, position_ids=pos, use_cache=False).logits  # (1, 30, V)

    def logits(i, q, t):
        return policy(input_ids=i, position_ids=q, use_cache=False).logits

    sliced = sequence_parallel.row_forward(logits, ids, pos)  # (1, 30, V)
    packed_err = (sliced - whole)[0, 12:].abs().max().item()
    assert packed_err > 1e-3, packed_err  # the second sequence attended to the first
    dist.barrier()
    if rank == 0:
        print(f"packed under sdpa: off by {packed_err:.2f} (refused by the pre-flight)")
        print(f"OK (S = {sp.size})")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_process(main())

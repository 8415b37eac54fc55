"""Reward-model training from preference pairs (Bradley-Terry), on torchrun + DeepSpeed, so that
`ppo.py --reward_model` can do PPO in the InstructGPT sense from preference data.

    bash run.sh rm                                     # pairs from the built-in task
    bash run.sh ppo --reward_model runs/<that run>/final
    MODEL=HuggingFaceTB/SmolLM2-135M-Instruct DATA=prefs.jsonl bash run.sh rm

One step: each rank takes its `prompts_per_rank` pairs (pairs.py: a prompt, a chosen and a rejected
response), scores both sequences with the reward model (reward_model.sequence_scores: the one label
at the last non-pad token, as ppo.py reads it) and trains on -log sigmoid(r_chosen - r_rejected -
margin), micro-batch by micro-batch, one optimizer step per batch. The model starts from --model's
body and tokenizer with a new score head (reward_model.py), or from --model itself when it is a
reward model already; without --model, the built-in task's tiny shape and vocabulary. harness.py
runs the rest (pre-flight, set-up, logging, held-out pairwise accuracy, checkpoints, final/).

Letters in shape comments: B sequences in a (micro-)batch, 2 per pair (rows 2i chosen, 2i + 1
rejected); N pairs (N = B / 2).

Departures and choices, and why:
- The loss sum is divided by the WHOLE batch's pair count (all micro-batches, all ranks) and
  DeepSpeed's averaging is undone, so micro-batches never change the update (docs/accumulation.md).
- An optional margin per pair (Llama 2; OpenRLHF's margin column): r_c - r_r must exceed it.
- --center_coef (TRL's center_rewards_coefficient): coef x mean (r_c + r_r)^2 keeps scores near 0.
- No packing: a sequence classifier pools at each row's last token; padded rows score each
  sequence as it scores alone (tests/test_rm.py).
"""

import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification

import harness
import recipes
from arguments import arg
from batching import all_sum, micro_batches, plan_micro_batches
from data import batch_rows
from exits import RunError, entry_code, exit_process
from pairs import check_pairs, pair_batch
from reward_model import sequence_scores


# ---- The algorithm: the Bradley-Terry loss (a pure function, tested against a naive loop) ------
def bt_loss(pairs, *, normalizer, center_coef=0.0):
    """-log sigmoid(r_chosen - r_rejected - margin) summed over pairs / normalizer (+ center_coef x
    the sum of (r_chosen + r_rejected)^2 / normalizer). pairs: {"chosen": (N,) scores with grad,
    "rejected": (N,), "margin": (N,) or None}. normalizer: the WHOLE batch's pair count (all
    micro-batches, all ranks). Returns (loss, metric SUMS over the pairs), which add up over
    micro-batches and ranks: pairs, correct (r_c > r_r), margin (r_c - r_r), loss (the summed
    -log sigmoid), chosen, rejected (the scores)."""
    chosen, rejected = pairs["chosen"], pairs["rejected"]  # (N,)
    diff = chosen - rejected  # (N,)
    margin = pairs.get("margin")
    target = diff if margin is None else diff - margin  # (N,)
    per_pair = -F.logsigmoid(target)  # (N,)
    loss = per_pair.sum() / normalizer
    if center_coef:
        loss = loss + center_coef * ((chosen + rejected) ** 2).sum() / normalizer
    with torch.no_grad():
        metrics = {
            "pairs": float(len(diff)),
            "correct": (diff > 0).sum(),
            "margin": diff.sum(),
            "loss": per_pair.sum(),
            "chosen": chosen.sum(),
            "rejected": rejected.sum(),
        }
    return loss, metrics


def split_scores(scores, mb):
    """The pair object bt_loss takes from a micro-batch's (B,) scores, rows 2i and 2i + 1."""
    margin = mb.get("margin")
    return {
        "chosen": scores[0::2],  # (N,)
        "rejected": scores[1::2],  # (N,)
        "margin": None if margin is None else margin[0::2].to(scores.device),  # (N,)
    }


# ---- Configuration: the reward model's own fields and defaults (harness.RunArgs: shared) ------
@dataclass
class Args(harness.RunArgs):
    recipe: str = arg("", recipes.recipe_help(recipes.RM))
    model: str = arg(
        "", "the policy (a new score head) or a reward model to go on; empty: the built-in task's"
    )
    data: str = arg("", "pairs: JSONL/JSON/CSV/parquet, a datasets dir or hub id; empty: built-in")
    chosen_field: str = arg("chosen", "--data's preferred response: a string or messages")
    rejected_field: str = arg("rejected", "--data's other response: a string or messages")
    margin_field: str = arg("", "--data's margin column (r_c - r_r must exceed it); empty: none")
    prompts_per_rank: int = arg(32, "pairs per rank per step (one optimizer step)", ">= 1")
    num_generations: int = arg(2, "sequences per pair: 2 (chosen and rejected)", "[2, 2]")
    max_completion_length: int = arg(
        2,
        "response tokens kept (eos included) from the start: the PPO run's, which cuts alike",
        ">= 1",
    )
    per_device_train_batch_size: int = arg(
        64,
        "sequences per micro-batch (2 per pair: even; TRL's pairs per device per step is "
        "prompts_per_rank)",
        ">= 2",
        aliases="--micro_train_batch_size",
    )
    center_coef: float = arg(0.0, "coef x mean (r_c + r_r)^2 (TRL's centering); 0: none", ">= 0")
    learning_rate: float = arg(1e-3, "peak LR (from scratch; ~1e-5 pretrained)", "> 0")
    max_steps: int = arg(150, "training steps (one batch of pairs each)", ">= 1")
    eval_steps: int = arg(50, "held-out accuracy every this many steps (and at start/end)", ">= 0")
    num_eval_prompts: int = arg(200, "held-out pairs; 0: no eval", ">= 0")


def parse_args(argv=None):
    """Args as given (argv, default sys.argv[1:]), checked on their own (no file read yet)."""
    args = harness.parse(Args, recipes.RM, argv)
    if args.per_device_train_batch_size % 2:
        raise RunError(
            f"--per_device_train_batch_size {args.per_device_train_batch_size}: a pair's two "
            "sequences share a micro-batch; give an even number"
        )
    for flag, off in (
        ("packing", False),
        ("max_tokens_per_microbatch", 0),
        ("use_vllm", False),
        ("lora_r", 0),
        ("eval_samples", 1),
        ("reward_funcs", ""),
        ("memory_budget_gb", 0.0),
        ("log_completions", False),
    ):
        if getattr(args, flag) != off:
            raise RunError(f"--{flag} is not supported by rm.py (it trains on pairs); drop it")
    return args


PHASES = {"update": ("update",), "optimizer_step": ("optimizer_step",)}  # no rollout


def memory_models(args):
    """What this loop builds: the trained model alone, with a score head (fit.py: "pairs")."""
    return {"reference": False, "critic": False, "pairs": True, "phases": PHASES}


# ---- The update ------------------------------------------------------------------------------
def pair_plan(batch, knobs):
    """This rank's micro-batches, pairs kept whole (per_device_train_batch_size is even, rows in
    order); ranks agree on their number (zero-weight repeats, batching.plan_micro_batches)."""
    return plan_micro_batches(batch, knobs.per_device_train_batch_size)


def update(engine, batch, args, knobs, device, ledger=None):
    """One optimizer step on this step's pairs, every rank alike; returns the metric sums of
    bt_loss over the whole batch (every micro-batch, every rank; sorted keys, one all_sum) and
    "skipped" (1.0: DeepSpeed refused a non-finite step).

    Each micro-batch loss is divided by the whole batch's pair count, so the micro-batch losses of
    all ranks add up to the batch loss; DeepSpeed's division by gradient_accumulation_steps is off
    and its average over ranks undone (the world size), as in grpo.train_on_batch: the step applies
    exactly the gradient of the full-batch loss however the batch is split."""
    plan = pair_plan(batch, knobs)
    (normalizer,) = all_sum([batch["input_ids"].shape[0] / 2])
    world, sums = engine.dp_world_size, {}
    phase = ledger.phase if ledger else lambda name: nullcontext()
    with phase("update"):
        for i, (_, mb, weight) in enumerate(micro_batches(batch, plan)):
            engine.set_gradient_accumulation_boundary(i == len(plan) - 1)  # we decide the step
            # through engine.forward, not engine.module: ZeRO-3 counts micro-steps there
            scores = sequence_scores(engine, mb, device)  # (B,)
            loss, metrics = bt_loss(
                split_scores(scores, mb), normalizer=normalizer, center_coef=args.center_coef
            )
            engine.backward(loss * weight * world, scale_wrt_gas=False)  # weight 0: a repeat
            for k, v in metrics.items():  # weighted: every rank holds every key
                sums[k] = sums.get(k, 0.0) + weight * float(v)
    with phase("optimizer_step"):
        engine.step()
    keys = sorted(sums)
    totals = dict(zip(keys, all_sum([sums[k] for k in keys])))
    totals["skipped"] = float(not engine.was_step_applied())  # alike on every rank
    return totals


@torch.no_grad()
def held_out_scores(model, batch, knobs, device):
    """(N,) r_chosen - r_rejected of every pair of `batch`, no grad, on the update's
    micro-batches (zero-weight repeats keep ZeRO-3's gathers in step)."""
    out = torch.zeros(batch["input_ids"].shape[0])  # (B,)
    for idx, mb, weight in micro_batches(batch, pair_plan(batch, knobs)):
        scores = sequence_scores(model, mb, device)  # (b,)
        if weight:
            out[idx] = scores.cpu()
    return out[0::2] - out[1::2]  # (N,)


def step_row(step, totals, engine):
    """One metrics.jsonl row: the means over the batch's pairs of what update() summed."""
    n = max(totals["pairs"], 1.0)
    row = {"step": step, **{k: v / n for k, v in totals.items() if k not in ("pairs", "skipped")}}
    row["accuracy"] = row.pop("correct")
    grad_norm = engine.get_global_grad_norm()
    row.update(pairs=totals["pairs"], lr=engine.get_lr()[0])
    row["grad_norm"] = None if grad_norm is None else float(grad_norm)
    return row


# ---- The loop --------------------------------------------------------------------------------
def main(argv=None):
    args = parse_args(argv)
    if args.estimate_memory or args.preflight:  # one process, before any rank begins
        return harness.before_torchrun(args, memory_models(args), check_pairs)
    run = harness.Run(args, memory_models(args), check_pairs)  # every input checked: pairs.py
    model = run.load(cls=AutoModelForSequenceClassification, num_labels=1)
    engine = run.train_engine(model, args.learning_rate)

    def encode(rows):
        a = args
        return pair_batch(
            run.tokenizer, rows, a.max_prompt_length, a.max_completion_length, run.template_kwargs
        )

    def eval_sample(rows):  # held-out: eval/reward the mean margin, eval/accuracy the share won
        diff = held_out_scores(engine.module, encode(rows), run.knobs, run.device)  # (N,)
        if run.stage == 3:  # no parameter left gathered or in flight for the next step or save
            engine.empty_partition_cache()
        return diff, {"won": (diff > 0).float()}

    run.start(__file__, {"reward_model": engine}, None, eval_sample, figure="accuracy")
    N = args.prompts_per_rank
    for step in run.steps():
        rows = batch_rows(run.train_rows, step, N * run.data_world, args.seed)
        batch = encode(rows[run.data_rank * N : (run.data_rank + 1) * N])
        t1 = time.time()
        totals = update(engine, batch, args, run.knobs, run.device, run.ledger)
        row = step_row(step + 1, totals, engine)
        (tokens,) = all_sum([float(batch["attention_mask"].sum())])
        row.update(completion_tokens=tokens, update_s=time.time() - t1)
        line = f"loss {row['loss']:.4f} acc {row['accuracy']:.3f} margin {row['margin']:.3f}"
        run.end_step(
            row,
            loss=row["loss"],
            grad_norm=row["grad_norm"],
            skipped=totals["skipped"] > 0,
            line=line,
        )
    # curves.png: the loss, pairwise accuracy (train, held-out), the margin r_c - r_r
    panels = [
        ("loss", [("loss", "train", "-")]),
        ("pairwise accuracy", [("accuracy", "train", "-"), ("eval/accuracy", "held-out", "o-")]),
        ("margin r_c - r_r", [("margin", "train", "-"), ("eval/reward", "held-out", "o-")]),
    ]
    run.finish(panels)


if __name__ == "__main__":
    exit_process(entry_code(main))  # a known failure: one message and its exit code (checks.py)

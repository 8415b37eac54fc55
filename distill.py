"""On-policy distillation (Agarwal et al. 2024, GKD; Lu et al. 2025): a teacher's log-probs as a
per-token advantage.

    --teacher_model PATH [--distill_coef 1.0] [--distill_only True]      (grpo.py)

A frozen teacher (the policy's tokenizer) scores every sampled token; coef x (teacher - student
log-prob) is the negated per-token reverse KL of the student from the teacher, added to the
reward's advantage (or alone, --distill_only) and trained by the unchanged GRPO loss: dense,
per-token supervision on the student's own samples.
Letters: B sequences, C completion tokens. Imports batching.py (a sum over ranks); remove this
file, its mixin in grpo.Args and the lines of grpo.py that name `distill` to remove it.
"""

from dataclasses import dataclass

from arguments import arg
from batching import all_sum
from exits import RunError


@dataclass
class DistillArgs:
    teacher_model: str = arg(
        "", "on-policy distillation: a frozen teacher (the policy's tokenizer) scores the samples"
    )
    distill_coef: float = arg(1.0, "--teacher_model: weight of teacher - student logp", ">= 0")
    distill_only: bool = arg(False, "--teacher_model: that advantage alone, no reward advantage")


def check_args(args):
    if args.distill_only and not args.teacher_model:
        raise RunError("--distill_only True needs --teacher_model (the teacher to distil)")


def distill_advantages(advantages, logps, teacher_logps, mask, coef, only=False):
    """(B, C) per-token advantages, coef x (teacher - student log-prob) of each sampled token,
    plus the reward's advantage (B,) unless `only`. logps, teacher_logps: (B, C) the sampling
    policy's and the teacher's, no grad; mask (B, C)."""
    per_token = -coef * (logps - teacher_logps) * mask  # (B, C)
    return per_token if only else advantages[:, None] + per_token  # (B, C)


def teacher_advantages(advantages, logps, teacher_logps, trained, args):
    """distill_advantages by the flags, and the reverse KL per trained token over all ranks
    (distill/reverse_kl). trained (B, C): the tokens the update trains on."""
    how = (trained, args.distill_coef, args.distill_only)
    out = distill_advantages(advantages, logps, teacher_logps, *how)  # (B, C)
    rkl, n = all_sum([((logps - teacher_logps) * trained).sum().item(), trained.sum().item()])
    return out, {"distill/reverse_kl": rkl / max(n, 1.0)}

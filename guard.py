"""The guard against non-finite training steps: DeepSpeed skips them; this counts them and stops a
streak (exit 3, exits.EXIT_DIVERGED).

    guard = StepGuard(max_bad_steps=3)
    ...
    guard.update(step, loss=total_loss, grad_norm=engine.get_global_grad_norm(),
                 skipped=not engine.was_step_applied())  # RunError(code 3): 3 in a row

harness.Run.end_step calls it after each update. Imports exits.py (RunError, EXIT_DIVERGED).
"""

import math

from exits import EXIT_DIVERGED, RunError


class StepGuard:
    """Counts optimizer steps skipped for non-finite loss or gradients; stops after `max_bad_steps`
    in a row.

    DeepSpeed (0.19, ZeRO-1/2/3 in fp32 and bf16) already refuses to apply a step whose gradient
    norm is inf/NaN: it zeroes the gradients, leaves the weights alone and reports
    was_step_applied() False, on every rank alike. This guard makes that visible (a count in the
    metrics), stops a run that keeps diverging, and refuses to go on if a non-finite step was
    applied after all (a config without the check, e.g. ZeRO-0), since the weights may then hold
    NaN.
    """

    def __init__(self, max_bad_steps=3):
        self.max_bad_steps, self.in_a_row, self.skipped = max_bad_steps, 0, 0

    def update(self, step, loss, grad_norm, skipped):
        """step: 1-based; loss: summed over all ranks (NaN if any rank's was); grad_norm: the global
        norm or None; skipped: DeepSpeed skipped an optimizer step of this training step."""
        finite = math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm))
        if not finite and not skipped:
            raise RunError(
                f"step {step}: loss {loss}, gradient norm {grad_norm}, and DeepSpeed applied the "
                f"update anyway (a config without its overflow check, e.g. ZeRO stage 0); the "
                "weights "
                f"may now be NaN: resume from the last checkpoint with ZeRO-1/2/3 and a lower "
                f"--learning_rate",
                EXIT_DIVERGED,
            )
        if not skipped:
            self.in_a_row = 0
            return
        self.skipped += 1
        self.in_a_row += 1
        if self.in_a_row >= self.max_bad_steps:
            raise RunError(
                f"{self.in_a_row} steps in a row (last: step {step}) had a non-finite loss or "
                "gradient "
                f"(loss {loss}, gradient norm {grad_norm}) and were skipped; the weights are those "
                "of "
                f"the last good step. Lower --learning_rate or --max_grad_norm, check the rewards "
                f"for huge values, or use --dtype fp32",
                EXIT_DIVERGED,
            )

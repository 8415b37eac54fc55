"""Every way the loops build a model gives a plain `from_pretrained`'s buffers, parameter dtypes
and outputs, in fp32 and bf16, for every architecture of tiny_models.FAMILIES (tests/dist_parity.py,
2 ranks): ZeRO-3 partitioned loading (policy, reference, teacher), a full load under a frozen
engine, LoRA, PPO's critics, a reward model, all exactly equal. zero.Init used to round RoPE's
fp32 frequencies to bf16 (zero3_load.load_model), which this catches in the buffers and the
log-probs."""

import pytest

import conftest
from tiny_models import FAMILIES, build_family


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    return [f"{f}={build_family(str(root / f), f)}" for f in FAMILIES]


def test_every_build_equals_a_plain_load(families, tiny_reward_model):
    dtypes = ("float32", "bfloat16")
    args = (",".join(dtypes), tiny_reward_model, *families)
    proc = conftest.torchrun("tests/dist_parity.py", *args, timeout=1800)
    cases = [f"{f}/{c}" for f in FAMILIES for c in ("partitioned", "reference", "full_frozen")]
    cases += [f"{f}/{c}" for f in FAMILIES for c in ("lora", "critic")]
    cases += ["reward_model", "critic_from_rm"]
    for dtype in dtypes:
        for case in cases:
            assert f"OK {case} torch.{dtype} " in proc.stdout, (case, proc.stdout[-3000:])
        worst = float(proc.stdout.split(f"WORST torch.{dtype} ")[1].split()[0])
        # exactly: the same weights and buffers run the same computation (with RoPE's frequencies
        # rounded to bf16, the tiny models' log-probs were 0.004-0.12 apart, most past 512)
        assert worst == 0.0, (dtype, proc.stdout[-3000:])

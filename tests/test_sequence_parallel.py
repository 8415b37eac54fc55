"""Sequence parallelism (sequence_parallel.py, --sequence_parallel_size): the left-aligned layout,
the pre-flight's refusals, the losses and gradients of S = 2 against whole rows on 2 real ranks,
and `bash run.sh grpo --sequence_parallel_size 2` end to end. bench/sequence_parallel_runs.py
compares whole runs (S = 2 on 2 ranks against 1 rank) and their memory."""

import json
import os

import pytest
import torch
from transformers import AutoConfig

import grpo
import ppo
import rm
from batching import left_aligned, make_batch, micro_slice
from conftest import SMALL, run_sh, torchrun
from exits import RunError
from generation import Generations
from preflight import check_sequence_parallel
from tiny_models import build_tiny


def test_left_aligned_puts_each_sequence_first_and_finds_its_completion():
    """Each row starts at column 0, padding after it; position j of `where` predicts the j-th
    completion token in the completion mask's row-major order."""
    prompts = [[5, 6, 7], [8]]
    ids = torch.tensor([[10, 11, 0], [12, 13, 14], [15, 0, 0], [16, 17, 0]])
    mask = (ids > 0).long()
    mb = micro_slice(make_batch(prompts, Generations(ids, mask), 0), torch.arange(4))
    rows, pos, where = left_aligned(mb)
    real = [r[a.bool()].tolist() for r, a in zip(mb["input_ids"], mb["attention_mask"])]
    for i, r in enumerate(real):
        assert rows[i, : len(r)].tolist() == r and not rows[i, len(r) :].any()
        assert pos[i].tolist() == list(range(rows.shape[1]))
    predicted = rows.flatten()[where + 1]  # the token each kept position predicts
    assert predicted.tolist() == mb["input_ids"][:, -3:][mb["completion_mask"].bool()].tolist()


SERVER = ["--use_vllm", "True", "--vllm_mode", "server"]  # asynchronous rollouts need a server


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny Llama of 4 attention heads and 2 key/value heads."""
    path = str(tmp_path_factory.mktemp("sp") / "model")
    return build_tiny(path, hidden_size=256, num_layers=1, num_heads=4, num_kv_heads=2)


@pytest.mark.parametrize(
    "flags, world, says",
    [
        (["--sequence_parallel_size", "3"], 2, "does not divide the 2 ranks"),
        (["--sequence_parallel_size", "3"], 3, "4 attention heads do not divide by 3"),
        (["--sequence_parallel_size", "2", "--attn_implementation", "eager"], 2, "eager"),
        (["--sequence_parallel_size", "2", "--packing", "True"], 2, "--packing False"),
        (
            ["--sequence_parallel_size", "2", "--max_staleness", "1", *SERVER],
            2,
            "one at",
        ),
    ],
)
def test_preflight_refuses_what_cannot_work(model, flags, world, says):
    config = AutoConfig.from_pretrained(model)
    with pytest.raises(RunError, match=says):
        check_sequence_parallel(grpo.parse_args(flags), world, config, model)
    check_sequence_parallel(grpo.parse_args(["--sequence_parallel_size", "2"]), 2, config, model)
    cut = ["--sequence_parallel_size", "2", "--top_p", "0.9", "--top_k", "5"]  # sliced per position
    check_sequence_parallel(grpo.parse_args(cut), 2, config, model)


def test_kv_heads_that_do_not_divide_are_refused(tmp_path):
    path = build_tiny(
        str(tmp_path / "m"), hidden_size=384, num_layers=1, num_heads=6, num_kv_heads=3
    )
    config = AutoConfig.from_pretrained(path)
    with pytest.raises(RunError, match="3 key/value heads and 2"):
        check_sequence_parallel(grpo.parse_args(["--sequence_parallel_size", "2"]), 2, config, path)
    check_sequence_parallel(grpo.parse_args(["--sequence_parallel_size", "3"]), 3, config, path)


def test_losses_and_gradients_equal_whole_rows_on_two_ranks(tmp_path):
    """GRPO's loss with the whole-batch normaliser, PPO's value loss and the Bradley-Terry loss:
    S = 2 against each rank alone, gradients summed over the group; log-probs under a top-k /
    top-p cut found, reused and replayed from kept sets (dist_sequence_parallel.py)."""
    kw = dict(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2)
    policy = build_tiny(str(tmp_path / "policy"), **kw)
    reward = build_tiny(str(tmp_path / "reward"), reward_model=True, **kw)
    out = torchrun("tests/dist_sequence_parallel.py", "--policy", policy, "--reward", reward)
    assert "OK (S = 2)" in out.stdout, out.stdout[-3000:]
    for name in ("grpo", "value", "bt"):
        assert f"{name}: loss" in out.stdout
    for name in ("cut found", "cut reused", "kept sets"):  # top-k 5 and top-p 0.9, or replayed
        assert f"{name}: log-prob max abs err" in out.stdout


def test_grpo_end_to_end_with_sequence_parallel_size_2(tmp_path):
    run_dir = tmp_path / "run"
    flags = [*SMALL, "--max_steps", "2", "--beta", "0.04", "--num_iterations", "2"]
    out = run_sh("grpo", "--sequence_parallel_size", "2", "--run_dir", run_dir, *flags)
    assert "sequence parallelism" in out or "step 2/2" in out
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["update_rows"] == 8 for r in steps)  # one group of 2 ranks: 2 x 4 rows, once
    assert all(abs(r["kl"]) < 1 and r["grad_norm"] > 0 for r in steps)


def test_ppo_and_rm_take_the_flag():
    """Both loops' Args have it (harness.RunArgs): parsed as given."""
    assert ppo.parse_args(["--sequence_parallel_size", "2"]).sequence_parallel_size == 2
    assert rm.parse_args(["--sequence_parallel_size", "2"]).sequence_parallel_size == 2

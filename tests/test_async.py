"""Asynchronous GRPO (--max_staleness K, async_rollouts.py and prefetch.py).

- prefetch.Prefetcher with plain functions: step s starts only after step s - K - 1 is done, so no
  result is more than K versions old; one too old is produced again (dropped); a retryable error
  is retried once, then raised in the main thread; any other error is raised as it is.
- The flags: K > 0 needs server mode, refuses --dynamic_sampling, and turns the truncated
  importance weights on (cap 3) unless --vllm_importance_cap is given; the weights are exactly 1
  where the sampler's log-probs equal the trainer's.
- `VLLM_DEVICES=cpu bash run.sh grpo --max_staleness 2` (a vLLM CPU server, 2 ZeRO-3 ranks):
  SIGTERM after step 3, exit 5, then --resume with K = 1 to step 8: each step logged once, every
  batch's staleness <= K, some at K, none dropped; at staleness 0 the sampler equals the trainer
  and the importance ratio is 1. The server killed mid-run with K = 1: tests/test_vllm_server.py.
"""

import math
import os
import signal
import subprocess
import threading
import time

import pytest
import torch

import conftest
from conftest import ROOT, free_port, train_rows
from exits import RunError
from grpo import parse_args
from prefetch import Prefetcher
from vllm_is import importance_cap, vllm_importance_weights


class Flaky(RuntimeError):
    pass


def test_prefetcher_bounds_staleness_and_drops_what_is_older():
    K, version, started = 2, [1], {}
    lock = threading.Lock()

    def produce(step):
        with lock:
            started[step] = version[0]
        return f"batch {step}"

    pf = Prefetcher(produce, 0, 8, K, lambda: version[0])
    for step in range(6):
        result, staleness, _ = pf.get(step, version[0])
        assert result == f"batch {step}" and 0 <= staleness <= K
        time.sleep(0.05)  # the producer gets its chance to run ahead
        with lock:
            assert max(started) <= step + K  # never more than K steps ahead of the trainer
        version[0] += 1  # the update and the weight sync
        pf.step_done()
    assert pf.dropped == 0
    version[0] += K + 1  # step 6 was sampled before this jump: too old now
    result, staleness, _ = pf.get(6, version[0])
    assert result == "batch 6" and staleness == 0 and pf.dropped == 1
    pf.close()


def test_prefetcher_retries_once_then_raises():
    calls = []

    def produce(step):
        calls.append(step)
        if step == 1 or (step == 2 and calls.count(2) == 1):
            raise Flaky(f"server gone at step {step}")
        return step

    pf = Prefetcher(produce, 0, 4, 3, lambda: 1, retryable=(Flaky,))
    assert pf.get(0, 1)[0] == 0
    with pytest.raises(Flaky, match="step 1"):
        pf.get(1, 1)
    assert calls.count(1) == 2  # retried once
    pf.close()

    pf = Prefetcher(lambda step: 1 / 0, 0, 4, 1, lambda: 1, retryable=(Flaky,))
    with pytest.raises(ZeroDivisionError):  # a bug is not retried
        pf.get(0, 1)


SERVER = ["--use_vllm", "True", "--vllm_mode", "server"]


def test_flags_and_importance_weights():
    with pytest.raises(RunError, match="needs a vLLM server"):
        parse_args(["--max_staleness", "1"])
    with pytest.raises(RunError, match="needs a vLLM server"):
        parse_args(["--max_staleness", "1", "--use_vllm", "True"])  # colocated
    with pytest.raises(RunError, match="--dynamic_sampling"):
        parse_args([*SERVER, "--max_staleness", "1", "--dynamic_sampling", "True"])
    assert importance_cap(parse_args([*SERVER])) == 0.0  # synchronous: off by default
    assert importance_cap(parse_args([*SERVER, "--max_staleness", "0"])) == 0.0
    given = parse_args([*SERVER, "--max_staleness", "2", "--vllm_importance_cap", "0"])
    assert importance_cap(given) == 0.0  # given: as given
    args = parse_args([*SERVER, "--max_staleness", "2"])
    assert args.vllm_importance_cap == -1.0 and importance_cap(args) == 3.0  # Args: as given

    sampler = torch.log(torch.rand(4, 5))  # (B, C)
    gap = torch.tensor([0.0, math.log(2.0), math.log(5.0), -1.0])[:, None].expand(4, 5)
    mask = torch.ones(4, 5, dtype=torch.long)
    mask[3, 3:] = 0
    # every row trained: the loss's tokens are the trained ones
    weights, stats = vllm_importance_weights(sampler + gap, sampler, mask, mask, args)  # (B, C)
    assert stats["vllm_is_ratio"] == pytest.approx((5 * 1 + 5 * 2 + 5 * 5 + 3 * math.exp(-1)) / 18)
    assert stats["vllm_is_outside_tokens"] == pytest.approx(5 / 18)  # row 2's tokens: 5 > 3
    assert stats["vllm_is_outside_seqs"] == 0.5  # rows 1 and 2: 2^5 and 5^5 > 3; row 3: e^-3
    assert torch.equal(weights[0], torch.ones(5))  # the sampler is the trainer: exactly 1
    torch.testing.assert_close(weights[1], torch.full((5,), 2.0))
    assert torch.equal(weights[2], torch.full((5,), 3.0))  # capped
    torch.testing.assert_close(weights[3, :3], torch.full((3,), math.exp(-1.0)))
    weights, stats = vllm_importance_weights(sampler.clone(), sampler, mask, mask, args)
    assert torch.equal(weights, torch.ones(4, 5))
    assert stats == {
        "vllm_is_ratio": 1.0,
        "vllm_is_outside_tokens": 0.0,
        "vllm_is_outside_seqs": 0.0,
    }


ASYNC = [
    "--max_steps",
    "8",
    "--save_steps",
    "2",
    *conftest.SMALL[:6],  # prompts per rank, completions, held-out prompts
    "--eval_steps",
    "3",
    "--save_model",
    "False",
]


def test_async_grpo_sigterm_and_resume(tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    env = {
        **os.environ,
        "RUN_DIR": str(run_dir),
        "VLLM_DEVICES": "cpu",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
        "NPROC": "2",
    }
    with open(log, "w") as f:
        proc = subprocess.Popen(
            ["bash", "run.sh", "grpo", *ASYNC, "--max_staleness", "2"],
            cwd=ROOT,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.time() + 600
        while not (run_dir / "metrics.jsonl").exists() or not any(
            r["step"] >= 3 for r in train_rows(run_dir)
        ):
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-4000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=300) == 5, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    stopped = int(open(run_dir / "checkpoints" / "latest").read().removeprefix("step"))
    assert [r["step"] for r in train_rows(run_dir)] == list(range(1, stopped + 1))

    out = conftest.run_sh(
        "grpo",
        *ASYNC,
        "--max_staleness",
        "1",
        "--resume",
        "True",
        env={"RUN_DIR": str(run_dir), "VLLM_DEVICES": "cpu"},
        timeout=900,
    )
    assert f"at step {stopped}" in out, out[-3000:]
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 9)), out[-3000:]
    assert 3 <= stopped <= 6  # two steps or more left for K = 1
    for r in rows:
        k = 2 if r["step"] <= stopped else 1
        assert 0 <= r["async/staleness_max"] <= k and r["async/dropped"] == 0, r
        assert r["vllm_is_ratio"] > 0 and r["weight_sync_s"] > 0, r
        if r["async/staleness_max"] == 0:  # the sampler held the trainer's weights
            assert r["sampling/sampling_logp_difference/max"] < 1e-4, r
            assert abs(r["vllm_is_ratio"] - 1.0) < 1e-4, r
    assert any(r["async/staleness_max"] == 2 for r in rows if r["step"] <= stopped), rows
    assert any(r["async/staleness_max"] == 1 for r in rows if r["step"] > stopped), rows
    assert rows[0]["async/staleness_max"] == 0  # the first batch: the starting weights

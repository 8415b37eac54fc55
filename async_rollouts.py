"""Asynchronous GRPO: a vLLM server samples up to K steps ahead while the trainer updates.

    VLLM_DEVICES=... bash run.sh grpo --max_staleness 2       (grpo.py; docs/async.md)

Generation and the update take turns in plain GRPO. With --max_staleness K, each rank's
Prefetcher (prefetch.py) samples and scores step s over HTTP once step s - K - 1 is trained and
its weights sent, so every batch is at most K weight versions old; the importance weights of
vllm_is.py (cap 3 by default here) correct for the difference.
Imports prefetch.py, vllm_server.py (its errors, retried once) and zero3_utils.py; remove this
file, its mixin in grpo.Args and the lines of grpo.py that name `async_rollouts` to remove it.
"""

from dataclasses import dataclass

import torch

from arguments import arg
from exits import RunError
from prefetch import Prefetcher
from vllm_server import ServerError
from zero3_utils import all_cat


@dataclass
class AsyncArgs:
    max_staleness: int = arg(
        0,
        "K > 0: asynchronous GRPO, server mode only: the vLLM server samples up to K steps "
        "ahead while the trainer updates, each batch at most K weight versions old "
        "(docs/async.md); 0: generate, then update",
        ">= 0",
    )


def check_args(args):
    if args.max_staleness and not (args.use_vllm and args.vllm_mode == "server"):
        raise RunError(
            "--max_staleness > 0 needs a vLLM server (--use_vllm True --vllm_mode server, as "
            "VLLM_DEVICES=... bash run.sh sets): colocated engines and HF generation share the "
            "trainer's devices, so there is nothing to overlap"
        )


def start_prefetch(run, args, sample_step):
    """The starting weights to the server (unless the first held-out score sent them), then a
    Prefetcher whose thread runs sample_step(step) -> this rank's scored groups over HTTP (no
    collective) once step - K - 1 is trained and its weights sent. A failed request is retried
    once; after --resume the steps in flight are sampled again."""
    if not run.vllm.syncs:
        run.vllm.sync_weights(run.policy)
    return Prefetcher(
        sample_step,
        run.start_step,
        args.max_steps,
        args.max_staleness,
        lambda: run.vllm.syncs,  # the weights the server holds now
        (ServerError,),
    )


def async_sample(prefetch, run, step):
    """This rank's scored groups for `step` from the prefetcher, sampled with weights at most K
    versions older than the trainer's (older ones are sampled again), and the async/* stats."""
    with run.ledger.phase("rollout"):
        sample, staleness, waited = prefetch.get(step, run.vllm.syncs)
    mine = [[staleness, waited, prefetch.idle_seconds(), prefetch.dropped]]
    ranks = all_cat(torch.tensor(mine, dtype=torch.float64))  # (world, 4)
    stats = {
        "async/staleness_mean": ranks[:, 0].mean().item(),
        "async/staleness_max": int(ranks[:, 0].max()),
        "async/trainer_wait_s": ranks[:, 1].max().item(),  # the trainer idle, waiting for rollouts
        "async/server_wait_s": ranks[:, 2].max().item(),  # a producer K steps ahead, idle
        "async/dropped": int(ranks[:, 3].sum()),  # over K versions old: sampled again
    }
    return sample, stats

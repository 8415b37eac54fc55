"""The training weights into a vLLM server through vLLM's own weight-transfer API: its HTTP routes
(/init_weight_transfer_engine, /start_weight_update, /update_weights, /finish_weight_update),
its trainer-side engines and its client, with ZeRO-3 weights as the source. On GPUs that is
vLLM's NCCL engine, unchanged; on CPU the same engine with gloo in place of NCCL, registered here
under "gloo" in vLLM's two factories, so a CPU run makes the same requests, handshake and error
paths a GPU run does. Imports vLLM (import this file only where vLLM is used), zero3_utils.py and
generation.py; vllm_server.py drives it.

Public API
    connect(base_url, model_or_engine, rank, workers, timeout_s, max_numel=2**26,
            packed_bytes=0, address=None)
        -> (trainer engine, Client). Every training rank calls it once (rank 0 is the sender:
        it opens the group with the server's `workers` and sends; the others take part in the
        ZeRO-3 gathers only); then `engine.send_weights()` on every rank per sync. NCCL:
        unpacked unless packed_bytes > 0 (packing()); address: where the workers reach rank 0
        (default rendezvous_address(base_url))
    rendezvous_address(base_url)   127.0.0.1 for a local server, else rank 0's address
    packing(packed_bytes)   NCCL's wire settings: unpacked for 0, else vLLM's packed buffers
    Client(base_url, timeout_s)   vLLM's HTTP client; `.version` goes with every finished
        update (the server's /weight_info), `.error` keeps the first failed request
    ZeRO3Weights(model_or_engine, max_numel)   a vLLM WeightSource over iter_full_params: names,
        dtypes and full shapes without a gather; iterating gathers one bounded group at a time
    server_flags()   the `vllm serve` flags the server needs for this: its engine's backend, and
        this file as the workers' extension, which registers "gloo" before the model loads

The gloo engine sends one tensor per broadcast (vLLM's packed path runs on CUDA streams), and
loads each as it arrives through vLLM's layerwise reload, as vLLM's NCCL engine does unpacked,
which is how connect() opens it on GPUs unless asked to pack (packing()).
"""

import ipaddress
import json
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import ClassVar
from urllib.parse import urlsplit

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer import nccl_engine as nccl
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import (
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)

from generation import repack_shared_weights
from zero3_utils import full_param_meta, iter_full_params


def gloo_group(host, port, rank, world_size, timeout_s):
    """A gloo group of its own (rank 0: the training sender, which hosts the store; the server's
    workers after it); returns (group, store), both kept for the group's life."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False
    )
    return dist.ProcessGroupGloo(store, rank, world_size, timeout), store


@dataclass(kw_only=True)
class GlooWorkerInitInfo(nccl.NCCLWeightTransferInitInfo):
    timeout_s: float = 1800.0  # a broadcast whose peer is gone fails after this, not never


class GlooWeightTransferEngine(nccl.NCCLWeightTransferEngine):
    """The workers' side: vLLM's NCCL engine (layerwise reload around the updates) with a gloo
    group and one tensor per broadcast. Joins as rank 1 + its tensor-parallel rank (no data
    parallelism in our server)."""

    init_info_cls = GlooWorkerInitInfo

    def init_transfer_engine(self, init_info):
        rank = init_info.rank_offset + self.parallel_config.rank
        self.model_update_group, self.store = gloo_group(
            init_info.master_address,
            init_info.master_port,
            rank,
            init_info.world_size,
            init_info.timeout_s,
        )

    def update_weights(self, update_info):  # the base class's, less its accelerator sync
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info):
        info = update_info
        for name, dtype, shape in zip(info.names, info.dtype_names, info.shapes):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            self.model_update_group.broadcast(tensor, 0).wait()
            self.model.load_weights([(name, tensor)])

    def finish_weight_update(self):
        super().finish_weight_update()
        repack_shared_weights(self.model)  # vLLM's CPU kernels keep packed copies (generation.py)

    def shutdown(self):
        self.model_update_group = self.store = None


@dataclass
class GlooTrainerInitInfo(nccl.NCCLTrainerInitInfo):
    backend: ClassVar[str] = "gloo"
    packed: bool = False
    timeout_s: float = 1800.0


class GlooTrainerWeightTransferEngine(nccl.NCCLTrainerWeightTransferEngine):
    """The trainer's side: vLLM's NCCL trainer engine (its send_weights: start, update_weights in a
    thread while rank 0 broadcasts, finish) with a gloo group."""

    init_info_cls = GlooTrainerInitInfo

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, packed=False)
        if not engine.is_sender:
            return engine
        worker = GlooWorkerInitInfo(
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            rank_offset=1,
            world_size=init_info.world_size,
            timeout_s=init_info.timeout_s,
        )
        # both ends of a gloo group block in its constructor until all have joined
        with ThreadPoolExecutor(max_workers=1) as exe:
            payload = nccl.worker_init_payload(worker)
            future = exe.submit(client.init_weight_transfer_engine, payload)
            engine.model_update_group, engine.store = gloo_group(
                init_info.master_address,
                init_info.master_port,
                0,
                init_info.world_size,
                init_info.timeout_s,
            )
            future.result()
        return engine

    def _broadcast(self, source, meta):
        if not self.is_sender:
            for _ in source:  # the ZeRO-3 gathers are collectives of every training rank
                pass
            return
        for _name, tensor in self._checked_iter(source, meta):
            self.model_update_group.broadcast(tensor.detach().contiguous(), 0).wait()

    def shutdown(self):
        self.model_update_group = self.store = None


WeightTransferEngineFactory.register_engine("gloo", GlooWeightTransferEngine)
WeightTransferTrainerFactory.register_engine("gloo", GlooTrainerWeightTransferEngine)


class WorkerExtension:
    """Named by `--worker-extension-cls` so that every vLLM worker imports this file, and with it
    registers "gloo", before it loads the model and creates its engine. Adds no methods."""


def server_flags():
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    return [
        "--weight-transfer-config",
        json.dumps({"backend": backend}),
        "--worker-extension-cls",
        "vllm_transfer.WorkerExtension",
    ]


class ZeRO3Weights(WeightSource):
    def __init__(self, model_or_engine, max_numel=2**26):
        self.model, self.max_numel = model_or_engine, max_numel

    def metadata(self):
        return [ParamMeta(n, d, s) for n, d, s in full_param_meta(self.model)]

    def __iter__(self):
        return iter_full_params(self.model, max_numel=self.max_numel)


class Client(HTTPVLLMWeightSyncClient):
    def __init__(self, base_url, timeout_s):
        super().__init__(base_url, timeout=timeout_s)
        self.version, self.error = None, None

    def _post(self, path, json=None):
        try:
            super()._post(path, json)
        except Exception as e:  # requests' errors; rank 0's watchdog reads the first
            self.error = self.error or f"{path}: {type(e).__name__}: {str(e)[:300]}"
            raise

    def finish_weight_update(self, weight_version=None):
        super().finish_weight_update(self.version if weight_version is None else weight_version)


def connect(
    base_url,
    model_or_engine,
    rank,
    workers,
    timeout_s,
    max_numel=2**26,
    packed_bytes=0,
    address=None,
):
    # the group's store is hosted by its rank 0, training rank 0 (vLLM's trainer engine binds it):
    # the server's workers connect to this process, not the other way round
    address = address or rendezvous_address(base_url)
    port = _free_port() if rank == 0 else 0  # only the sender's are used
    common = dict(master_address=address, master_port=port, world_size=1 + workers, rank=rank)
    if torch.cuda.is_available():
        # NCCL's init and vLLM's warm-up all-reduce take no timeout: the caller's watchdog
        # (vllm_server.VLLMServerGenerator._watchdog) holds timeout_s over the handshake
        info = nccl.NCCLTrainerInitInfo(**common, **packing(packed_bytes))
    else:
        info = GlooTrainerInitInfo(**common, timeout_s=timeout_s)
    client = Client(base_url, timeout_s)
    source = ZeRO3Weights(model_or_engine, max_numel)
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source), client


def packing(packed_bytes):
    """NCCLTrainerInitInfo's wire parameters (the trainer hands them to the workers). vLLM's own
    default is packed, 2 buffers of 1 GiB: its producer keeps views of the gathered ZeRO-3 tensors
    until it concatenates them, with the previous buffer still in flight, so rank 0 holds about
    3 x the buffer beside a gathered group (estimate.estimate_memory's weight_sync). 0 (ours):
    unpacked, one broadcast per parameter straight from the gathered group, nothing more."""
    if packed_bytes <= 0:
        return dict(packed=False)
    return dict(packed=True, packed_buffer_size_bytes=int(packed_bytes), packed_num_buffers=2)


def rendezvous_address(base_url):
    """Where the server's workers reach training rank 0: 127.0.0.1 for a server on this machine;
    for one elsewhere (started by hand), MASTER_ADDR (torchrun's: rank 0's node) unless it is a
    loopback address, else this machine's address on its route to the server."""
    host = urlsplit(base_url).hostname or "127.0.0.1"
    if _loopback(host):
        return "127.0.0.1"
    master = os.environ.get("MASTER_ADDR", "")
    if master and not _loopback(master):
        return master
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # UDP: no packet is sent; the kernel picks the route's source address
        return s.getsockname()[0]


def _loopback(host):
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: what it resolves to
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:  # unresolvable here: not this machine
            return False


def _free_port():
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]

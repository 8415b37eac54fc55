"""Server mode's setup, in one process without a vLLM server (issue 37): a stand-in HTTP server
answers vLLM's routes where a request is made.

- The weight transfer's handshake under the watchdog: one that never completes (NCCL's init has
  no timeout; here the group's constructor blocks) ends with exit 6 within sync_timeout.
- The rendezvous address: training rank 0's, not the server's host.
- NCCL's wire settings: unpacked unless asked; the memory estimate's weight_sync phase.
- The server's settings from the pre-flight (dtype, max_model_len), bf16 refused on a GPU
  without it, the colocated engine's scheduler sized from the run.
- /reset_prefix_cache answering HTTP 200 with {"success": false} is an error.
"""

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import torch

from conftest import ROOT
from exits import RunError

pytest.importorskip("vllm")

import vllm_server  # noqa: E402  (after the skip: it imports vLLM's weight transfer on sync)
import vllm_transfer  # noqa: E402
from vllm_server import ServerError, VLLMServerGenerator  # noqa: E402


@contextlib.contextmanager
def stand_in_server(answers):
    """An HTTP server on 127.0.0.1: answers[path] -> (status, JSON body), or None to never
    answer (the request hangs until the server stops); yields its URL."""
    hang = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def _answer(self):
            if self.command == "POST":
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
            answer = answers.get(self.path.split("?", 1)[0], (200, {}))
            if answer is None:
                hang.wait()
                return
            status, body = answer
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _answer

        def log_message(self, *args):  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        hang.set()
        server.shutdown()
        server.server_close()


MODELS = {"/v1/models": (200, {"data": [{"id": "m"}]})}


def test_a_handshake_that_never_completes_ends_with_exit_6(monkeypatch, capsys):
    """The server never answers /init_weight_transfer_engine and rank 0's end of the group never
    forms (as NCCL's ncclCommInitRank waits, with no timeout of its own): the watchdog ends the
    process with exit 6 once sync_timeout has passed (os._exit is recorded here, and releases the
    blocked handshake, so the test goes on)."""
    released, exits = threading.Event(), []

    def blocked_group(*args, **kwargs):
        released.wait(120)  # without the watchdog: the test fails after this, no exit recorded
        raise RuntimeError("the handshake never completed")

    def record_exit(code):
        exits.append(code)
        released.set()

    monkeypatch.setattr(vllm_transfer, "gloo_group", blocked_group)
    monkeypatch.setattr(vllm_server.os, "_exit", record_exit)
    answers = {**MODELS, "/collective_rpc": (200, {"results": [None]})}
    answers["/init_weight_transfer_engine"] = None
    with stand_in_server(answers) as url:
        gen = VLLMServerGenerator(url, sync_timeout=2, log_file="/x/vllm_server.log")
        with pytest.raises(ServerError, match="failed to open the weight transfer"):
            gen.sync_weights(torch.nn.Linear(2, 2))
    assert exits == [6]
    err = capsys.readouterr().err
    assert "[rank 0] error: the vLLM server at" in err
    assert "the weight transfer's handshake did not finish within 2 s" in err
    assert "its log: /x/vllm_server.log" in err


def capture_trainer_init(monkeypatch):
    seen = []

    def trainer_init(info, *, client, source):
        seen.append(info)
        return SimpleNamespace(), client

    monkeypatch.setattr(vllm_transfer.WeightTransferTrainerFactory, "trainer_init", trainer_init)
    return seen


def test_rendezvous_on_training_rank_0(monkeypatch):
    """The transfer group's store is hosted by training rank 0, which the server's workers
    connect to: 127.0.0.1 for a local server; MASTER_ADDR for one elsewhere; with a loopback
    MASTER_ADDR (one node), this machine's address on its route to the server."""
    seen = capture_trainer_init(monkeypatch)
    model = torch.nn.Linear(2, 2)
    monkeypatch.setenv("MASTER_ADDR", "node0.cluster.invalid")
    for url in ("http://127.0.0.1:8000", "http://localhost:8000/"):
        vllm_transfer.connect(url, model, 0, 1, 60)
    vllm_transfer.connect("http://10.9.8.7:8000", model, 0, 1, 60)
    assert [i.master_address for i in seen] == ["127.0.0.1", "127.0.0.1", "node0.cluster.invalid"]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.77", 9))  # TEST-NET-1: only the route's source address is read
        except OSError:
            pytest.skip("no IPv4 route off this machine")
        own = s.getsockname()[0]
    assert vllm_transfer.rendezvous_address("http://192.0.2.77:8000") == own != "127.0.0.1"
    assert vllm_transfer.connect("http://x:1", model, 0, 1, 60, address="10.0.0.5")[0] is not None
    assert seen[-1].master_address == "10.0.0.5"


def test_nccl_transfer_is_unpacked_unless_asked(monkeypatch):
    """vLLM's NCCL trainer init defaults to packed 1 GiB buffers x 2 (about 3 GiB more on rank 0
    while it syncs); ours is unpacked unless packed_bytes is given, and the memory estimate's
    weight_sync counts the packed buffers when they are."""
    from estimate import estimate_memory
    from tiny_models import llama_config

    seen = capture_trainer_init(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = torch.nn.Linear(2, 2)
    vllm_transfer.connect("http://127.0.0.1:8000", model, 0, 1, 60)
    vllm_transfer.connect("http://127.0.0.1:8000", model, 0, 1, 60, packed_bytes=2**28)
    assert [(i.backend, i.packed) for i in seen] == [("nccl", False), ("nccl", True)]
    assert seen[1].packed_buffer_size_bytes == 2**28 and seen[1].packed_num_buffers == 2

    cfg = llama_config(vocab_size=1000, hidden_size=256, num_layers=4, intermediate_size=512)
    kw = dict(model_config=cfg, world_size=2, zero_stage=3, dtype="bf16", seq_len=256)
    kw.update(completion_len=128, micro_batch_size=2)
    plain = estimate_memory(**kw)
    server = estimate_memory(**kw, vllm_server=True)
    packed = estimate_memory(**kw, vllm_server=True, packed_bytes=2**28)
    assert "weight_sync" not in plain["phases"]
    group = 2**26 * 2  # one gathered group: 2**26 bf16 elements (every tensor here is smaller)
    resident = plain["phases"]["optimizer_step"] - plain["pieces"]["fp32_grad_partition"]
    resident -= plain["pieces"]["adam_temporaries"]
    live = server["pieces"]["zero3_live"]
    assert server["phases"]["weight_sync"] == resident + live + group
    assert packed["phases"]["weight_sync"] == resident + live + group + 3 * 2**28
    import ppo

    est = estimate_memory(**kw, vllm_server=True, phase_groups=ppo.PHASES, critic_config=cfg)
    assert "weight_sync" in est["phases"]  # ppo.py's ledger has the phase too


def test_preflight_writes_the_server_settings(tmp_path):
    """run.sh's pre-flight of a server-mode run writes what `vllm serve` must match: the
    trainer's dtype and prompt + completion as max_model_len (run.sh passes them, with
    VLLM_SERVER_ARGS after them)."""
    run_dir = tmp_path / "run"
    argv = [sys.executable, "grpo.py", "--preflight", "True", "--run_dir", str(run_dir)]
    argv += ["--use_vllm", "True", "--vllm_mode", "server"]
    argv += ["--vllm_server_url", "http://127.0.0.1:9", "--max_prompt_length", "40"]
    argv += ["--max_completion_length", "24", "--num_eval_prompts", "0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    settings = json.loads((run_dir / "vllm_server.json").read_text())
    assert settings == {"dtype": "float32", "max_model_len": 64}


def test_explicit_bf16_on_a_gpu_without_it_is_refused(monkeypatch):
    from checks import training_dtype

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100-SXM2-16GB")
    assert training_dtype("auto") == torch.float32 and training_dtype("fp32") == torch.float32
    with pytest.raises(RunError, match=r"--dtype bf16: this GPU \(Tesla V100-SXM2-16GB\) has no"):
        training_dtype("bf16")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert training_dtype("bf16") == training_dtype("auto") == torch.bfloat16


def test_colocated_engine_sized_from_the_run(monkeypatch):
    """On GPU the colocated engine gets max_num_seqs = the sequences one call brings (tensor-
    parallel ranks x prompts x generations) and a token budget of their lengths, at most 4,096,
    not vLLM's defaults for a large GPU (1,024 sequences, 16,384 tokens), and compiles; on CPU
    whole-prompt prefill, and eager (compiling adds ~45 s to a start: bench/vllm_compile.py)."""
    import grpo
    from generation import cpu_engine_kwargs, gpu_scheduler_kwargs

    made = []
    monkeypatch.setattr(vllm_server, "VLLMGenerator", lambda *a, **kw: made.append(kw))
    args = grpo.parse_args(
        ["--use_vllm", "True", "--vllm_tensor_parallel_size", "2", "--prompts_per_rank", "4"]
        + ["--num_generations", "8"]
    )
    vllm_server.vllm_generator(args, "m", torch.float32, 320, 0)
    assert "max_num_seqs" not in made[-1]  # this machine: CPU (VLLMGenerator adds these)
    assert cpu_engine_kwargs(320) == dict(
        enable_chunked_prefill=False, max_num_batched_tokens=4096, enforce_eager=True
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    vllm_server.vllm_generator(args, "m", torch.bfloat16, 320, 0)
    assert made[-1]["max_num_seqs"] == 64 and made[-1]["max_num_batched_tokens"] == 4096
    assert made[-1]["dtype"] == "bfloat16" and cpu_engine_kwargs(320) == {}
    assert gpu_scheduler_kwargs(64, 4) == dict(max_num_seqs=4, max_num_batched_tokens=256)
    assert gpu_scheduler_kwargs(8, 5000) == dict(max_num_seqs=1024, max_num_batched_tokens=4096)


def test_a_prefix_cache_reset_that_failed_is_an_error():
    """vLLM answers /reset_prefix_cache with HTTP 200 and {"success": false} when it could not
    reset (blocks still held): the sync must not go on with KV blocks of the old weights."""
    answers = {**MODELS, "/reset_prefix_cache": (200, {"success": False})}
    with stand_in_server(answers) as url:
        gen = VLLMServerGenerator(url, log_file="/x/vllm_server.log")
        gen.transfer = SimpleNamespace(send_weights=lambda: None)  # connected; nothing to send
        gen.client = SimpleNamespace(version=None, error=None)
        with pytest.raises(ServerError, match="did not reset its prefix cache"):
            gen.sync_weights(torch.nn.Linear(2, 2))
        answers["/reset_prefix_cache"] = (200, {"success": True})
        gen.sync_weights(torch.nn.Linear(2, 2))
        assert gen.client.version == "2"

"""vLLM server mode (vllm_server.py) on CPU, real processes: one vLLM CPU server, 2 ZeRO-3 ranks.

- tests/dist_vllm_server.py: server greedy == HF == colocated, vllm_batch_size chunks in order,
  sampler log-probs == HF's (< 1e-3), after 2 steps and a sync server == updated HF (!= before).
- `bash run.sh ppo --use_vllm True` for 2 steps, colocated and with VLLM_DEVICES (server mode);
  the server is gone afterwards.
- The server killed mid-run: run.sh exits 6 naming its address and log; no process left behind.
"""

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

import conftest
from conftest import ROOT, free_port, torchrun, train_rows

pytest.importorskip("vllm")

SMALL = [
    "--prompts_per_rank",
    "2",
    "--num_generations",
    "2",
    "--num_eval_prompts",
    "0",
    "--per_device_train_batch_size",
    "4",
    "--save_model",
    "False",
]


def session_processes(sid):
    """pids of the live (not zombie) processes in session `sid`."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,sid=,stat="], capture_output=True, text=True)
    rows = [line.split() for line in out.stdout.splitlines()]
    return [int(p) for p, s, stat in rows if int(s) == sid and not stat.startswith("Z")]


def processes_mentioning(text):
    out = subprocess.run(["ps", "-e", "-o", "pid=,args="], capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if text in line and "ps -e" not in line]


@contextlib.contextmanager
def serve(model, log):
    """One vLLM CPU server on `model` (its own session), logging to `log`; yields (url, pid);
    stopped with its group."""
    port = free_port()
    argv = [sys.executable, "vllm_server.py", model, str(port), "127.0.0.1", "1"]
    argv += ["--dtype", "float32", "--max-model-len", "128", "--enforce-eager"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    with open(log, "w") as f:
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=5)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    pytest.fail(f"vLLM server did not start:\n{log.read_text()[-4000:]}")
                time.sleep(2)
        yield url, proc.pid
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        time.sleep(1)
        for pid in session_processes(proc.pid):  # vLLM's engine core and workers too
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    with serve(tiny_model, tmp_path_factory.mktemp("server") / "vllm_server.log") as (url, _):
        yield url


def test_server_generation_logprobs_and_sync(tiny_model, server):
    """Greedy == HF == colocated, batches in order, sampler log-probs == HF (< 1e-3), sync after
    2 steps."""
    proc = torchrun("tests/dist_vllm_server.py", tiny_model, server)
    assert proc.stdout.count("DONE") == 2, proc.stdout[-3000:]
    assert "OK weight sync" in proc.stdout


def test_server_never_sleeps(monkeypatch):
    """The server's devices are its own: its argv has no --enable-sleep-mode even where CUDA is
    available (sleep would copy every weight to host memory and back each step), and sleep() sends
    nothing (the unreachable address below would fail any request)."""
    from vllm_server import VLLMServerGenerator, server_argv

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert "--enable-sleep-mode" not in server_argv("m", 8000, tensor_parallel_size=2)
    gen = VLLMServerGenerator.__new__(VLLMServerGenerator)  # no server: sleep() must not call it
    gen.url, gen.rank, gen.timeout, gen.log_file = f"http://127.0.0.1:{free_port()}", 0, 5, "-"
    gen.sleep()
    assert not hasattr(gen, "wake_up")


def test_seeded_sampling_over_more_prompt_tokens_than_one_step(server, monkeypatch):
    """40 prompts x 100 tokens in one request: more than the CPU server's token budget per
    scheduler step (2048). Seeded requests (every request here) whose prompts vLLM prefilled in
    chunks killed its CPU engine ("CPU Generator does not use offset"); server_argv turns
    chunked prefill off on CPU. The server answers, and answers again (it is alive)."""
    from vllm_server import VLLMServerGenerator, server_argv

    assert "--no-enable-chunked-prefill" in server_argv("m", 8000)  # this machine: CPU
    assert "--no-enable-chunked-prefill" not in server_argv(
        "m", 8000, extra=["--enable-chunked-prefill"]
    )
    gen = VLLMServerGenerator(server, seed=3)
    prompts = [[3 + (i * 7 + j) % 40 for j in range(100)] for i in range(40)]
    for _ in range(2):
        out = gen.generate(prompts, max_new_tokens=4, temperature=1.0)
        assert out.completion_ids.shape[0] == 40 and out.completion_mask.sum() >= 40
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # GPU: vLLM's defaults stay
    assert "--no-enable-chunked-prefill" not in server_argv("m", 8000)


def test_server_worker_killed_mid_sync(tiny_model, tmp_path):
    """The server's engine process (its worker) killed in the middle of a weight sync, after a
    first sync that worked: rank 0 ends with the one-line server error, never a hang (this
    test's timeout is far below the sync's 30-minute limit)."""
    log = tmp_path / "vllm_server.log"
    with serve(tiny_model, log) as (url, pid):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node=2",
                f"--master_port={free_port()}",
                "tests/dist_vllm_sync_kill.py",
                tiny_model,
                url,
                str(pid),
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            timeout=600,
        )
    out = proc.stdout + proc.stderr
    assert "OK first sync, weight version 1" in out, out[-4000:]
    assert "killed the server's engine" in out, out[-4000:]
    assert proc.returncode != 0, out[-4000:]
    assert "rank 0 exit 6" in out or "[rank 0] error: the vLLM server at" in out, out[-4000:]
    assert "DONE" not in out, out[-4000:]


def test_unreachable_server_error():
    """One message naming the address and the log file, and the documented exit code."""
    import exits
    from vllm_server import ServerError, VLLMServerGenerator

    assert ServerError.exit_code == exits.EXIT_SERVER == 6
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerError, match=f"{url}.*unreachable.*its log: /x/vllm_server.log"):
        VLLMServerGenerator(url, log_file="/x/vllm_server.log", wait=0)


@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_run_sh_ppo_vllm(tmp_path, mode):
    """2 PPO steps generating with vLLM, colocated or from a server run.sh starts and stops; each
    step's sampler-vs-trainer log-prob gap is float noise (vLLM holds the synced weights)."""
    run_dir = tmp_path / "run"
    env = {"RUN_DIR": str(run_dir)} | ({"VLLM_DEVICES": "cpu"} if mode == "server" else {})
    out = conftest.run_sh(
        "ppo", *SMALL, "--max_steps", "2", "--use_vllm", "True", env=env, timeout=900
    )
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2], out[-3000:]
    assert all(r["weight_sync_s"] > 0 for r in rows)
    conftest.assert_vllm_holds_trainer_weights(rows)  # untied embeddings
    if mode == "server":
        assert "vLLM server answers at" in out
        assert (run_dir / "vllm_server.log").stat().st_size > 0
        pid = int((run_dir / "vllm_server.pid").read_text())
        time.sleep(1)
        assert session_processes(pid) == [], "the vLLM server outlived run.sh"


ASYNC_GRPO = [*SMALL[:6], "--per_device_train_batch_size", "4", "--save_model", "False"]
ASYNC_GRPO += ["--max_staleness", "1"]


@pytest.mark.parametrize("algo", ["ppo", "grpo-async"])
def test_server_killed_mid_run(tmp_path, algo):
    """The server dies during training (PPO; asynchronous GRPO, whose rollouts run in a thread of
    their own, K = 1): run.sh exits 6 with one message naming the server's address and log file,
    and no process of the run or the server is left."""
    run_dir = tmp_path / "run"
    proc = conftest.run_sh(
        algo.split("-")[0],
        *(SMALL if algo == "ppo" else ASYNC_GRPO),
        "--max_steps",
        "200",
        env={"RUN_DIR": str(run_dir), "VLLM_DEVICES": "cpu"},
        wait=False,
    )
    try:
        deadline = time.time() + 900
        while not (run_dir / "metrics.jsonl").exists() or not train_rows(run_dir):
            assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-3000:]
            time.sleep(1)
        pid = int((run_dir / "vllm_server.pid").read_text())
        # its API server only: the engine core and worker are left for run.sh to find and stop
        os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:  # the test failed: stop run.sh so its trap stops the server
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
        time.sleep(2)
        pid_file = run_dir / "vllm_server.pid"
        left = session_processes(int(pid_file.read_text())) if pid_file.exists() else []
        for pid in left:
            os.kill(pid, signal.SIGKILL)  # nothing outlives the test, whatever it found
    assert proc.returncode == 6, out[-4000:]
    log = run_dir / "vllm_server.log"
    assert f"died during the run; its log: {log}" in out, out[-3000:]
    assert "error: the vLLM server at http://127.0.0.1:" in out, out[-3000:]
    assert left == [], "a vLLM server process outlived run.sh"
    assert processes_mentioning(str(run_dir)) == [], "a process of the run outlived run.sh"

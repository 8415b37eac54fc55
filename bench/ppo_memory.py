"""Peak memory per phase and seconds per PPO step for the memory options, measured by running
ppo.py itself through torchrun for a few steps and reading its metrics.jsonl.

    python bench/ppo_memory.py                # CPU: 2 processes; GPU: every GPU, one process each
    python bench/ppo_memory.py --steps 6      # more steps per config (the first is warm-up)

All four models exist in every config: the actor (a random Llama, hidden 768, 6 layers, ~35M
parameters), a reward model of the same size (which also initialises the critic) and the
reference; 4 prompts x 2 samples per rank, 16 new tokens, prompts of 8-64 characters (a JSONL
written here), so batches carry real padding.
Configs, one after another in one invocation so their ratios are comparable:
  naive            ZeRO stage 0 (plain data parallel): actor and critic with full optimizer
                   states on every rank, reference and reward model resident and unsharded
  ZeRO-3           actor and critic sharded; reference and reward model as ZeRO-3 inference engines
  + offload        frozen models' shards in CPU memory (on a CPU-only machine: the same place)
  + packing        micro-batches as one row without padding
  + checkpointing  gradient checkpointing of actor and critic
  + LoRA           rank-16 adapters; no reference model (the actor with adapters off); needs peft
  eager            ZeRO-3 with eager attention instead of SDPA, for comparison with the ZeRO-3 row
Memory: on GPU, peak allocated per phase (reset between phases); on CPU, the peak resident set of
rank 0's process during each phase (Linux VmHWM, reset between phases, with glibc's mmap threshold
fixed at 64 KiB so freed tensors leave the process), which includes the Python/torch/DeepSpeed
runtime (~0.5 GB per process). Prints a Markdown table (docs/ppo.md).
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from tiny_models import build_tiny  # noqa: E402


def have_peft():
    try:
        import peft  # noqa: F401

        return True
    except ImportError:
        return False


def configs(tmp):
    actor = build_tiny(os.path.join(tmp, "actor"), hidden_size=768, num_layers=6)
    rm = build_tiny(
        os.path.join(tmp, "rm"), hidden_size=768, num_layers=6, reward_model=True, seed=1
    )
    rng = random.Random(0)
    data = os.path.join(tmp, "prompts.jsonl")
    with open(data, "w") as f:
        for _ in range(400):
            f.write(
                json.dumps(
                    {
                        "prompt": "".join(
                            rng.choice("abcdefghij ") for _ in range(rng.randint(8, 64))
                        ),
                        "answer": "",
                    }
                )
                + "\n"
            )
    with open("configs/zero3.json") as f:
        zero0 = json.load(f)
    zero0["zero_optimization"] = {"stage": 0}
    zero0_path = os.path.join(tmp, "zero0.json")
    with open(zero0_path, "w") as f:
        json.dump(zero0, f)
    base = [
        "--model",
        actor,
        "--reward_model",
        rm,
        "--data",
        data,
        "--max_completion_length",
        "16",
        "--prompts_per_rank",
        "4",
        "--num_generations",
        "2",
        "--per_device_train_batch_size",
        "4",
        "--ppo_epochs",
        "1",
        "--learning_rate",
        "1e-5",
        "--critic_learning_rate",
        "1e-5",
    ]
    z3 = "configs/zero3.json"
    rows = [
        ("naive: ZeRO-0, frozen models resident", zero0_path, base),
        ("ZeRO-3, frozen models as ZeRO-3 engines", z3, base),
        ("ZeRO-3 + frozen offload", z3, base + ["--frozen_offload", "True"]),
        (
            "ZeRO-3 + frozen offload + packing",
            z3,
            base + ["--frozen_offload", "True", "--packing", "True"],
        ),
        (
            "... + gradient checkpointing",
            z3,
            base
            + ["--frozen_offload", "True", "--packing", "True", "--gradient_checkpointing", "True"],
        ),
        (
            "... + LoRA r=16 (no reference copy)",
            z3,
            base
            + [
                "--frozen_offload",
                "True",
                "--packing",
                "True",
                "--gradient_checkpointing",
                "True",
                "--lora_r",
                "16",
            ],
        ),
        ("ZeRO-3, eager attention (vs SDPA above)", z3, base + ["--attn_implementation", "eager"]),
    ]
    return [r for r in rows if "--lora_r" not in r[2] or have_peft()]


def run(name, ds_config, extra, steps, tmp, nproc):
    run_dir = os.path.join(tmp, str(abs(hash(name))))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_port=29519",
        "ppo.py",
        "--ds_config",
        ds_config,
        "--run_dir",
        run_dir,
        "--max_steps",
        str(steps),
        "--num_eval_prompts",
        "0",
        "--save_model",
        "False",
        *extra,
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "WANDB_MODE": "offline",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        # CPU: glibc keeps freed heap blocks (and raises its mmap threshold after each large free),
        # so RSS would show every full checkpoint ever loaded; a fixed 64 KiB threshold serves large
        # tensors from mmap and returns them on free, so RSS follows the live tensors
        "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", "65536"),
    }
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "step_s" in r][1:]  # drop the warm-up step
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    return [
        name,
        f"{med('step_s'):.2f}",
        f"{med('rollout_s'):.2f}",
        f"{med('update_s'):.2f}",
        *(f"{med(f'mem/{p}'):.2f}" for p in ("rollout", "logprobs", "update")),
    ]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    nproc = torch.cuda.device_count() or 2
    device = (
        torch.cuda.get_device_name(0)
        if torch.cuda.is_available()
        else f"CPU ({os.cpu_count()} cores)"
    )
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for c in configs(tmp):
            rows.append(run(*c, a.steps, tmp, nproc))
            print(" | ".join(rows[-1]), flush=True)
    print(
        f"\n{device}, {nproc} processes, median of {a.steps - 1} steps"
        + ("" if have_peft() else " (peft not installed: no LoRA row)")
        + "\n"
    )
    head = [
        "config",
        "s/step",
        "rollout s",
        "update s",
        "peak GB rollout",
        "peak GB scoring",
        "peak GB update",
    ]
    print("| " + " | ".join(head) + " |\n|" + " --- |" * len(head))
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()

"""Will it fit on my GPU? On paper: what `--estimate_memory True --gpu_gb N` prints
(fit.fit_for_gpu), for GRPO at the Qwen2.5 0.5B / 1.5B / 7B shapes (shapes.PRESETS: the sizes
of their published config.json, no download), full fine-tune and LoRA, on one GPU of 24, 48 or
80 GB. Every figure is the estimate's; none was measured on a GPU.

    python bench/gpu_fit.py             # the Markdown table of docs/memory.md

The run: one rank, colocated vLLM (--vllm_gpu_memory_utilization 0.3, asleep outside the
rollout), 8 prompts x 8 completions, 512 prompt + 1024 completion tokens, micro-batch 8 as given;
the fitter lowers the micro-batch, the log-prob tile, then turns on gradient checkpointing and
the rest of its ladder (fit.py) until every phase is under 90 % of the GPU. Where nothing fits
under configs/zero3.json, the same with the optimizer offloaded to the host
(configs/zero3_offload.json; its host memory is the table's last column).
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.chdir(ROOT)

import fit  # noqa: E402
import grpo  # noqa: E402
from estimate import estimate_memory  # noqa: E402
from exits import RunError  # noqa: E402
from memory import GB  # noqa: E402

SHAPES = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b")
GPUS = (24, 48, 80)
RUN = ["--use_vllm", "True", "--prompts_per_rank", "8", "--num_generations", "8"]
RUN += ["--max_prompt_length", "512", "--max_completion_length", "1024"]
RUN += ["--per_device_train_batch_size", "8"]
PHASES = ("rollout", "weight_sync", "old_logprobs", "update", "optimizer_step")


def fitted(shape, lora, gpu_gb):
    """(config, knobs changed, phases in GB, host GB) or (config, why nothing fits, None, None)."""
    for ds in ("configs/zero3.json", "configs/zero3_offload.json"):
        argv = [*RUN, "--model", shape, "--ds_config", ds, "--lora_r", "16" if lora else "0"]
        args = grpo.parse_args(argv)
        models = grpo.memory_models(args)
        try:
            knobs, phases = fit.fit_for_gpu(args, 1, models, gpu_gb, say=lambda s: None)
        except RunError as e:
            why = str(e)
            continue
        given = fit.Knobs.given(args)
        changed = [
            f"{k} {getattr(given, k)} -> {getattr(knobs, k)}"
            for k in vars(knobs)
            if getattr(knobs, k) != getattr(given, k) and k != "memory_budget_gb"
        ]
        kw = fit.estimate_kwargs(args, 1, models, knobs, gpu_gb)
        host = estimate_memory(**kw)["cpu"] / GB  # offloaded optimizer states and gradients
        return ds, changed, {k: v / GB for k, v in phases.items()}, host
    return ds, why.split("nothing fits. ")[-1], None, None


def main():
    head = ["model", "trains", "GPU GB", "config", "knobs the fitter changed", *PHASES]
    print("| " + " | ".join(head + ["highest phase", "host GB"]) + " |")
    print("|---|---|---:|---|---|" + "---:|" * (len(PHASES) + 2))
    for shape in SHAPES:
        for lora in (False, True):
            for gpu in GPUS:
                ds, changed, phases, host = fitted(shape, lora, gpu)
                name = (
                    f"{shape.replace('qwen', 'Qwen')} | {'LoRA r 16' if lora else 'full'} | {gpu}"
                )
                if phases is None:
                    print(f"| {name} | nothing fits | {changed} |" + " |" * (len(PHASES) + 2))
                    continue
                top = max(phases, key=phases.get)
                cells = " | ".join(f"{phases[p]:.1f}" if p in phases else "-" for p in PHASES)
                knobs = "; ".join(changed) or "none"
                print(
                    f"| {name} | {os.path.basename(ds)} | {knobs} | {cells} | {top} "
                    f"{phases[top]:.1f} | {host:.1f} |"
                )


if __name__ == "__main__":
    main()

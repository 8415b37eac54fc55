"""The four --vllm_importance_mode values side by side, on what the weights exist for: samples vLLM
drew with weights one version behind the trainer's (asynchronous GRPO, --max_staleness 1).

    python bench/importance_modes.py                             # the default task, 20 steps each
    python bench/importance_modes.py --config smollm2 --steps 4  # SmolLM2-135M-Instruct, 96 tokens

One vLLM CPU server (bench/async_grpo.py's: fp32, eager, pinned to --server_cpus), then one run per
mode with the same seed, data and steps (cap 3; the mask modes with the band's lower end
--mask_low, IcePop's two-sided band). Per run, from each step's row in metrics.jsonl: the mean
token ratio r = exp(trainer - sampler log-prob) over the trained tokens, the shares of tokens and
of sequences whose r lies outside the run's band (what truncation caps or masking drops), and
the held-out reward at the start and the end. Prints a Markdown table (docs/update.md) and writes
bench/out/importance_modes/<config>.json.
"""

import json
import os
import signal
import statistics
import sys
from dataclasses import dataclass, field

from transformers import HfArgumentParser

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import async_grpo  # noqa: E402  (the server and the run, shared with the async bench)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from vllm_is import VLLM_IMPORTANCE_MODES  # noqa: E402


@dataclass
class Args(async_grpo.Args):
    steps: int = field(default=20, metadata={"help": "training steps per run"})
    modes: str = field(
        default=",".join(VLLM_IMPORTANCE_MODES), metadata={"help": "comma-separated modes"}
    )
    mask_low: float = field(default=1 / 3, metadata={"help": "the mask modes' lower end"})
    out_dir: str = field(default="bench/out/importance_modes", metadata={"help": "runs, results"})


def summary(run):
    """The ratio's distribution over a run's steps (each step's share of the run's tokens or
    sequences outside its band; their median and largest) and its held-out rewards."""
    rows = [r for r in run["rows"] if "vllm_is_ratio" in r]
    names = ("vllm_is_ratio", "vllm_is_outside_tokens", "vllm_is_outside_seqs")
    col = {k: [r[k] for r in rows] for k in names}
    out = {"steps": len(rows), "eval_start": run["eval_start"], "eval_end": run["eval_end"]}
    for k, v in col.items():
        out[k] = {"median": statistics.median(v), "min": min(v), "max": max(v)}
    out["step_s"] = run["step_s"]
    return out


def main():
    (args,) = HfArgumentParser(Args).parse_args_into_dataclasses()
    os.makedirs(args.out_dir, exist_ok=True)
    model, flags = async_grpo.config_flags(args)
    server, url = async_grpo.start_server(model, args)
    results = {}
    try:
        for mode in args.modes.split(","):
            low = args.mask_low if mode.endswith("mask") else 0.0
            extra = ["--vllm_importance_mode", mode, "--vllm_importance_min", str(low)]
            run = async_grpo.one_run(url, flags, 1, mode, args, extra)
            results[mode] = {"band": [low, 3.0], **summary(run), "rows": run["rows"]}
            print(f"{mode}: {json.dumps({k: v for k, v in results[mode].items() if k != 'rows'})}")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)
    print(f"\n{args.config}, {args.steps} steps, --max_staleness 1, cap 3:\n")
    print(
        "| mode | band | mean token r (median, min-max over steps) | tokens outside (median, max)"
        " | sequences outside (median, max) | held-out reward start -> end |"
    )
    print("|---|---|---|---|---|---|")
    for mode, r in results.items():
        t, o, q = r["vllm_is_ratio"], r["vllm_is_outside_tokens"], r["vllm_is_outside_seqs"]
        print(
            f"| `{mode}` | [{r['band'][0]:.2f}, 3] | {t['median']:.4f} ({t['min']:.4f}-"
            f"{t['max']:.4f}) | {o['median']:.4f}, {o['max']:.4f} | {q['median']:.4f}, "
            f"{q['max']:.4f} | {r['eval_start']:.3f} -> {r['eval_end']:.3f} |"
        )
    with open(os.path.join(args.out_dir, f"{args.config}.json"), "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

"""GSM8K accuracy of a model, greedy, in the smollm2-gsm8k recipe's prompt format: one process,
vLLM on CPU (generation.VLLMGenerator), the recipe's prompt and completion lengths, stop ids and
rewards. For the before/after figures of docs/real-model.md:

    python bench/gsm8k_eval.py                                   # the converted model
    python bench/gsm8k_eval.py --model runs/<grpo run>/final     # after training

    python bench/gsm8k_eval.py --split train --max_calculations 1 --num_problems 32 \
        --samples 8 --temperature 0.8     # does GRPO get a signal? groups with a reward spread

Prints accuracy (rewards.math_reward), the share ending with the answer line
(rewards.answer_line_reward), mean completion tokens and the share cut at the length limit;
with --samples G > 1, the problems whose G completions do not all score the same (the groups
GRPO learns from). Writes every completion to <out>.jsonl to read what the model does.
"""

import json
import os
import sys
import time
from dataclasses import dataclass, field

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root

from transformers import AutoTokenizer, HfArgumentParser, set_seed  # noqa: E402

import grpo  # noqa: E402
import rewards  # noqa: E402
import smollm2  # noqa: E402
from batching import encode_prompts, stop_token_ids  # noqa: E402
from data import load_rows  # noqa: E402
from generation import VLLMGenerator  # noqa: E402


@dataclass
class Args:
    model: str = field(default="", metadata={"help": "model directory; empty: smollm2.model_dir()"})
    split: str = field(default="test", metadata={"help": "GSM8K split (test: 1,319 problems)"})
    num_problems: int = field(default=500, metadata={"help": "the split's first N problems"})
    max_calculations: int = field(
        default=0, metadata={"help": "only problems of at most this many steps; 0: all"}
    )
    samples: int = field(default=1, metadata={"help": "G completions per problem"})
    temperature: float = field(default=0.0, metadata={"help": "0: greedy; else sampled"})
    out: str = field(default="runs/gsm8k-eval", metadata={"help": "completions: <out>.jsonl"})


def main():
    (args,) = HfArgumentParser(Args).parse_args_into_dataclasses()
    # VLLMGenerator's engine is an external_launcher one: a world of one process, as torchrun sets
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1").items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    recipe = grpo.parse_args(["--recipe", "smollm2-gsm8k", "--model", "unused"])
    model = args.model or smollm2.model_dir()
    rows = load_rows(smollm2.gsm8k_file(args.split, args.max_calculations))[: args.num_problems]
    G = args.samples
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt_ids = encode_prompts(tokenizer, rows, recipe.max_prompt_length)
    max_len = recipe.max_prompt_length + recipe.max_completion_length
    gen = VLLMGenerator(model, max_model_len=max_len, dtype="float32", enforce_eager=True)
    set_seed(0)  # vLLM's per-request seeds come from torch's generator
    t0 = time.time()
    out = gen.generate(
        prompt_ids,
        num_generations=G,
        max_new_tokens=recipe.max_completion_length,
        temperature=args.temperature or 1.0,
        greedy=args.temperature == 0,
        stop_token_ids=stop_token_ids(tokenizer, model),
    )
    seconds = time.time() - t0
    texts = tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
    answers = [r["answer"] for r in rows for _ in range(G)]  # completions are prompt-major
    correct = rewards.math_reward(None, texts, answers)
    line = rewards.answer_line_reward(None, texts, answers)
    lengths = out.completion_mask.sum(1).tolist()  # (N,) tokens up to and with the stop
    cut = [n >= recipe.max_completion_length for n in lengths]
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(f"{args.out}.jsonl", "w") as f:
        for a, t, c in zip(answers, texts, correct):
            f.write(json.dumps({"answer": a, "correct": c, "completion": t}) + "\n")
    n, groups = len(texts), [correct[i : i + G] for i in range(0, len(texts), G)]
    spread = sum(min(g) != max(g) for g in groups)
    how = "greedy" if args.temperature == 0 else f"{G} samples at T={args.temperature}"
    subset = f" (<= {args.max_calculations} calculations)" if args.max_calculations else ""
    print(
        f"{model} GSM8K {args.split}{subset}[:{len(rows)}] {how}: accuracy {sum(correct) / n:.3f} "
        f"({int(sum(correct))}/{n}), answer line {sum(line) / n:.3f}, "
        f"mean tokens {sum(lengths) / n:.0f}, cut at {recipe.max_completion_length} "
        f"{sum(cut) / n:.3f}, {seconds:.0f} s; completions in {args.out}.jsonl"
        + (
            f"; problems whose {G} completions differ in reward: {spread}/{len(rows)}"
            if G > 1
            else ""
        )
    )


if __name__ == "__main__":
    main()

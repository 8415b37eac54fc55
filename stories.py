"""A real pretrained model that learns: GRPO teaches stories260K, a 260K-parameter Llama trained on
TinyStories, to bring a dog into its stories while staying as fluent as it was.

    python stories.py                      # writes the prompts, then `bash run.sh grpo` with RECIPE
    python stories.py --max_steps 10       # extra arguments go to grpo.py (they win over RECIPE)

The prompts are story openings ("One day, Tom went to the park. He"); there are no answers. The
reward (`reward`, passed as --reward_funcs stories:reward) is the product of three parts, so that
no single one can be gamed alone:
- mentions_dog: 1 if the completion names a dog ("dog" or "dogs"), else 0. The initial model does
  so in about 8 % of its samples, so most groups of 8 hold a success to learn from;
- fluency: how likely the initial model finds the completion, as the mean log-prob per token of
  the completion given the prompt under the frozen initial model, mapped linearly from -2.5 nats
  (0) to -1.0 (1); its own samples score -2.1 to -0.7. "dog dog dog dog" scores -3.3: 0;
- novelty: 1 minus the share of word trigrams the completion already used, so "The dog was happy.
  The dog was happy. ..." (fluent to the initial model, -1.2) earns little.
The three parts are also passed with weight 0, so metrics.jsonl logs each one
(rewards/mentions_dog/mean, ...) while only the product trains.

The judge is the initial model itself, read from ../shared/assets/stories260K-hf (or STORIES_MODEL),
loaded once per process. Its head width (8) is below what vLLM's CPU attention takes, so the
rollout uses HF generation. Imports no sibling file.
"""

import functools
import json
import os
import re
import sys

import torch

ROOT = os.path.dirname(os.path.abspath(__file__))
MODEL = os.environ.get(
    "STORIES_MODEL", os.path.join(ROOT, "..", "shared", "assets", "stories260K-hf")
)
DATA = os.path.join(ROOT, "runs", "stories-prompts.jsonl")
FLUENCY_RANGE = (-2.5, -1.0)  # mean log-prob per token (nats) mapped to 0 and 1
RECIPE = [  # a 260K-parameter model on 2 CPU processes: about 3 minutes for 16 steps
    "--model",
    MODEL,
    "--pad_token",
    "</s>",
    "--data",
    DATA,
    "--reward_funcs",
    "stories:reward,stories:mentions_dog,stories:fluency,stories:novelty",
    "--reward_weights",
    "1,0,0,0",
    "--max_prompt_length",
    "40",
    "--max_completion_length",
    "48",
    "--prompts_per_rank",
    "8",
    "--num_generations",
    "8",
    "--per_device_train_batch_size",
    "64",
    "--learning_rate",
    "5e-4",  # 2e-3 got the dog in 3 steps and lost fluency (0.69 -> 0.18)
    "--max_steps",
    "16",
    "--eval_steps",
    "8",
    "--num_eval_prompts",
    "64",
    "--temperature",
    "1.0",
]

NAMES = ["Lily", "Tom", "Sam", "Mia", "Ben", "Sue", "Tim", "Anna", "Max", "Lucy", "Jack", "Emma"]
PLACES = ["park", "beach", "forest", "garden", "store", "lake", "farm", "zoo"]
OPENINGS = [
    "Once upon a time, there was a little {kind} named {name}. {Pron}",
    "One day, {name} went to the {place}. {Pron}",
    "{name} and {friend} were friends. One sunny day, they",
    "Once upon a time, in a small town, there lived a {kind} named {name}. Every day, {pron}",
    "{name} was playing near the {place} when {pron}",
]


def prompts():
    """The story openings: 5 templates x 12 names x places and friends, 324 unique."""
    rows = []
    for template in OPENINGS:
        for i, name in enumerate(NAMES):
            for j in range(9):
                kind, pron = ("girl", "she") if i % 2 == 0 else ("boy", "he")
                text = template.format(
                    kind=kind,
                    name=name,
                    Pron=pron.capitalize(),
                    pron=pron,
                    place=PLACES[j % len(PLACES)],
                    friend=NAMES[(i + 1 + j) % 12],
                )
                rows.append(text)
    return [{"prompt": p} for p in dict.fromkeys(rows)]  # unique, in order


# ---- the reward ---------------------------------------------------------------------------------
def mentions_dog(prompts, completions, answers):
    return [float(re.search(r"\bdogs?\b", c.lower()) is not None) for c in completions]


def novelty(prompts, completions, answers):
    out = []
    for c in completions:
        words = re.findall(r"[a-z']+", c.lower())
        grams = [tuple(words[i : i + 3]) for i in range(len(words) - 2)]
        out.append(1.0 - (len(grams) - len(set(grams))) / len(grams) if grams else 1.0)
    return out


@functools.lru_cache(maxsize=1)
def judge():
    """The frozen initial model and its tokenizer (once per process)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isdir(MODEL):
        raise FileNotFoundError(
            f"stories.py judges with the initial model at {MODEL}: not found; set "
            f"STORIES_MODEL to the stories260K-hf directory"
        )
    return (
        AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval(),
        AutoTokenizer.from_pretrained(MODEL),
    )


@torch.no_grad()
def mean_logps(prompts, completions):
    """Mean log-prob per token of each completion given its prompt, under the initial model."""
    model, tok = judge()
    out = []
    for p, c in zip(prompts, completions):
        a, b = tok(p).input_ids, tok(c, add_special_tokens=False).input_ids
        if not b:
            out.append(float("-inf"))
            continue
        ids = torch.tensor([a + b])  # (1, T)
        logp = model(ids).logits[0, :-1].log_softmax(-1)  # (T - 1, V), V = 512
        out.append(logp[len(a) - 1 :].gather(1, ids[0, len(a) :, None]).mean().item())
    return out


def fluency(prompts, completions, answers):
    lo, hi = FLUENCY_RANGE
    return [min(1.0, max(0.0, (lp - lo) / (hi - lo))) for lp in mean_logps(prompts, completions)]


def reward(prompts, completions, answers):
    """mentions_dog x fluency x novelty, in [0, 1]."""
    parts = zip(
        mentions_dog(prompts, completions, answers),
        fluency(prompts, completions, answers),
        novelty(prompts, completions, answers),
    )
    return [m * f * n for m, f, n in parts]


def write_prompts(path=DATA):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in prompts())
    return path


if __name__ == "__main__":
    write_prompts()
    os.chdir(ROOT)
    os.execvp("bash", ["bash", "run.sh", "grpo", *RECIPE, *sys.argv[1:]])

"""--recipe NAME: named sets of defaults for grpo.py and ppo.py, side by side; a flag given on the
command line wins (apply_recipe, below). Each loop's Args defaults fit the from-scratch tiny task;
run.sh passes --recipe pretrained with MODEL. A value may be a function (smollm2.model_dir: a
download), called only when its flag is not given. What each recipe measured, and why its values:
docs/real-model.md (SmolLM2), docs/envs.md (the calculator), docs/ppo.md (PPO against GRPO).
"""

import dataclasses
import sys

import envs
import smollm2
from arguments import check_ranges
from exits import RunError

GRPO = {
    "pretrained": {  # a small LR, longer answers, a batch that fits beside a real model
        "learning_rate": 1e-6,
        "max_completion_length": 256,
        "prompts_per_rank": 4,
        "per_device_train_batch_size": 4,
        "gradient_checkpointing": True,
        "eval_steps": 100,
    },
    # SmolLM2-135M-Instruct on GSM8K problems of at most two calculations, 2 CPU ranks, ZeRO-3,
    # colocated vLLM: micro-batches of 2 (8 was killed for memory in the update)
    "smollm2-gsm8k": {
        "model": smollm2.model_dir,
        "data": smollm2.gsm8k_train_file,
        "reward_funcs": "rewards:math_reward",
        "use_vllm": True,
        "max_prompt_length": 320,
        "max_completion_length": 192,
        "prompts_per_rank": 4,
        "num_generations": 8,
        "per_device_train_batch_size": 2,
        "gradient_checkpointing": True,
        "learning_rate": 2e-5,
        "temperature": 0.8,
        "max_steps": 10,
        "eval_steps": 5,
        "num_eval_prompts": 200,
    },
}
# the same model on two-digit additions, where it gets the signal GSM8K gives it almost none of
GRPO["smollm2-addition"] = {
    **GRPO["smollm2-gsm8k"],
    "data": smollm2.addition_file,
    "max_completion_length": 32,
    "per_device_train_batch_size": 8,
    "learning_rate": 1e-5,
    "max_steps": 15,
}
# the same model with a calculator tool, multi-turn (envs.py): up to 3 assistant turns in 64 tokens
GRPO["smollm2-calculator"] = {
    **GRPO["smollm2-gsm8k"],
    "data": envs.problems_file,
    "env": "envs:calculator",
    "reward_funcs": "envs:calculator_reward",
    "max_turns": 3,
    "max_prompt_length": 256,
    "max_completion_length": 64,
    "per_device_train_batch_size": 8,
    "temperature": 1.0,
    "max_steps": 15,
    "num_eval_prompts": 100,
}

# rm.py: a reward model from a pretrained policy (MODEL=... bash run.sh rm): a small LR, answers of
# up to 256 tokens, micro-batches of 4 pairs
RM = {
    "pretrained": {
        "learning_rate": 1e-5,
        "max_completion_length": 256,
        "prompts_per_rank": 8,
        "per_device_train_batch_size": 8,
        "gradient_checkpointing": True,
        "eval_steps": 50,
    },
}
# PPO: sized for 2 CPU ranks of a 24 GB machine, ZeRO-3, with `--estimate_memory True`: actor,
# critic and reference side by side
PPO = {
    "pretrained": {  # small LRs, longer answers, micro-batches that fit beside three models
        "learning_rate": 1e-6,
        "critic_learning_rate": 9e-6,
        "max_completion_length": 256,
        "prompts_per_rank": 4,
        "per_device_train_batch_size": 2,
        "gradient_checkpointing": True,
        "eval_steps": 100,
    },
}
# GRPO's recipe with PPO's two LRs, on-policy without KL as GRPO's (one epoch, kl_coef 0: no
# reference model, the update's own forward gives the old log-probs)
PPO["smollm2-gsm8k"] = {
    **GRPO["smollm2-gsm8k"],
    "max_completion_length": 256,
    "learning_rate": 1e-6,
    "critic_learning_rate": 9e-6,
    "ppo_epochs": 1,
    "kl_coef": 0.0,
    "max_steps": 40,
    "eval_steps": 10,
}
# GRPO's smollm2-addition for PPO: the same data, completions and steps, both LRs 1e-5
PPO["smollm2-addition"] = {
    **PPO["smollm2-gsm8k"],
    "data": smollm2.addition_file,
    "max_completion_length": 32,
    "per_device_train_batch_size": 8,
    "learning_rate": 1e-5,
    "critic_learning_rate": 1e-5,
    "max_steps": 15,
    "eval_steps": 5,
}


# ---- How a recipe is shown and applied ------------------------------------------------------
def recipe_help(recipes):
    """--recipe's --help text: every recipe with its values, a function shown as module.name()."""

    def shown(v):
        return f"{v.__module__}.{v.__name__}()" if callable(v) else v

    return "a named set of defaults, flags on the command line win; " + "; ".join(
        f"{name}: " + ", ".join(f"--{k} {shown(v)}" for k, v in values.items())
        for name, values in recipes.items()
    )


def apply_recipe(args, recipes, argv=None):
    """args.recipe's values set on args, except the flags given in argv (default sys.argv[1:]);
    then the ranges checked again. An unknown recipe is a RunError naming the known ones."""
    if not args.recipe:
        return
    if args.recipe not in recipes:
        raise RunError(f"--recipe {args.recipe}: choose one of {', '.join(recipes)}")
    argv = sys.argv[1:] if argv is None else argv
    given = {a[2:].split("=")[0] for a in argv if a.startswith("--")}
    for f in dataclasses.fields(args):  # an old name given is its field given
        if given & {a[2:] for a in f.metadata.get("aliases", ())}:
            given.add(f.name)
    for name, value in recipes[args.recipe].items():
        if name not in given:
            setattr(args, name, value() if callable(value) else value)
    check_ranges(args)

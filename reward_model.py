"""A reward model directory that `ppo.py --reward_model` takes: a sequence classifier with one label
(AutoModelForSequenceClassification, num_labels=1; its score at the last non-pad token is the
reward) that has the policy's tokenizer (the policy's token ids reach it as they are) and names the
run's pad token in its config (which tokens are padding when it finds the last one).

    python reward_model.py --path runs/rm --policy Qwen/Qwen2.5-0.5B-Instruct   # from your policy
    MODEL=Qwen/Qwen2.5-0.5B-Instruct bash run.sh ppo --reward_model runs/rm
    python reward_model.py --path runs/rm                 # a tiny one for the built-in task
    bash run.sh ppo --reward_model runs/rm
    scores = sequence_scores(model, mb, device)           # (b,) the score of each sequence

From --policy: the policy's body (its weights and config) and its tokenizer, with a new score head,
random (seeded): it scores, but has learnt nothing yet. Train it on preference pairs with
`bash run.sh rm` (rm.py, which starts from this same build and saves this format; TRL's
RewardTrainer does too), or use it as it is to try the set-up. Without
--policy: a tiny random Llama in the built-in task's vocabulary (tasks.TASK_CHARS).
"""

import sys
from dataclasses import dataclass

import torch
from transformers import AutoModelForSequenceClassification

import sequence_parallel
from arguments import arg, parse_args_quietly
from batching import left_aligned
from checks import load_tokenizer
from exits import entry
from logprobs import positions_from_mask
from tasks import TASK_CHARS
from tiny_models import build_tiny


def build_reward_model(path, policy="", seed=0, pad_token=""):
    """Write a one-label reward model to `path` and return `path`: from `policy` (a path or hub id:
    its body, its tokenizer, a new score head initialised under `seed`), or without it a tiny
    random one for the built-in task. pad_token: the run's --pad_token, for a policy without one."""
    if not policy:
        return build_tiny(path, reward_model=True, chars=TASK_CHARS, seed=seed)
    tokenizer = load_tokenizer(policy, pad_token)  # the pad token the run will use
    torch.manual_seed(seed)  # the new score head's initialisation
    model = AutoModelForSequenceClassification.from_pretrained(policy, num_labels=1, dtype="auto")
    model.config.pad_token_id = tokenizer.pad_token_id  # the score is read before the padding
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def sequence_scores(model, mb, device):
    """(b,) fp32: each sequence's score, the one label at its rightmost non-pad token (transformers'
    sequence classifiers pool there, by config.pad_token_id), for a micro-batch {"input_ids",
    "attention_mask"} (b, t) with left-padded prompts (positions from the mask). The one place a
    reward model is read: `ppo.py --reward_model` scores with it and rm.py trains through it."""
    if sequence_parallel.layout() is not None:  # each rank its 1/S of every sequence
        return _sliced_scores(model, mb, device)
    am = mb["attention_mask"].to(device)  # (b, t)
    logits = model(
        input_ids=mb["input_ids"].to(device),
        attention_mask=am,
        position_ids=positions_from_mask(am),
        use_cache=False,
    ).logits  # (b, 1)
    return logits[:, 0].float()  # (b,)


def _sliced_scores(model, mb, device):
    """(b,) fp32 under sequence parallelism: the head's per-position scores of each rank's slice
    of the left-aligned rows (caught as the head returns them, so the model runs its own forward:
    a DeepSpeed engine counts it), gathered, read at each sequence's last token."""
    head = getattr(model, "module", model).score  # transformers' name for a classifier's head
    caught = []
    ids, pos, _ = left_aligned(mb)  # (b, L): each sequence from column 0, padding after it
    last = mb["attention_mask"].sum(1) - 1  # (b,) each one's last token

    def score(ids, pos, targets):  # (b, n): this rank's slice
        # a hook after ZeRO-3's: the output its backward hooks are attached to
        hook = head.register_forward_hook(lambda module, inputs, out: caught.append(out))
        try:
            model(input_ids=ids.to(device), position_ids=pos.to(device), use_cache=False)
        finally:
            hook.remove()
        return caught.pop()[..., 0].float()  # (b, n)

    scores = sequence_parallel.row_forward(score, ids, pos)  # (b, L)
    return scores[torch.arange(len(last)), last.to(scores.device)]  # (b,)


@dataclass
class Args:
    path: str = arg("runs/rm", "output directory: pass it as --reward_model")
    policy: str = arg("", "the policy's path or hub id; empty: a tiny one for the built-in task")
    seed: int = arg(0, "initialisation seed of the new score head")
    pad_token: str = arg("", "the run's --pad_token, for a policy whose tokenizer has none")


def main(argv=None):
    a = parse_args_quietly(Args, argv)
    build_reward_model(a.path, a.policy, a.seed, a.pad_token)
    print(f"wrote {a.path}: bash run.sh ppo --reward_model {a.path}")


if __name__ == "__main__":
    sys.exit(entry(main))  # bad input: one message, exit 2 (exits.RunError)

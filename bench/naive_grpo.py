"""grpo.py with naive log-probs, the contrast of bench/scale.py: the model's full (B, C, V) logits,
an fp32 copy and log_softmax, as most RL trainers compute them. Launch it like grpo.py (same
arguments):

    python -m torch.distributed.run --nproc_per_node 1 bench/naive_grpo.py --model ... \
        --ds_config ...

Letters: B sequences, C completion tokens scored (logits_to_keep), V vocabulary. Only a benchmark:
grpo.py scores every micro-batch through batching.forward_logps, which calls model_logps through
batching's own module attribute, so replacing batching.model_logps swaps every call (old and
reference log-probs and the update). tests/test_bench_patches.py fails if that name goes away.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import batching  # noqa: E402
import grpo  # noqa: E402
import logprobs  # noqa: E402
from exits import entry_code, exit_process  # noqa: E402


def naive_model_logps(
    model,
    input_ids,
    attention_mask,
    logits_to_keep,
    temperature=1.0,
    return_entropy=False,
    position_ids=None,
    **_,
):
    """(B, C) log-probs of input_ids[:, -C:] (and entropies) from the materialised logits."""
    if position_ids is None and attention_mask is not None:
        position_ids = logprobs.positions_from_mask(attention_mask)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=logits_to_keep + 1,
        use_cache=False,
    )
    logits = out.logits[:, :-1].float() / temperature  # (B, C, V) fp32 copy
    logp_all = logits.log_softmax(-1)  # (B, C, V)
    logp = logp_all.gather(-1, input_ids[:, -logits_to_keep:, None]).squeeze(-1)  # (B, C)
    if return_entropy:
        return logp, -(logp_all.exp() * logp_all).sum(-1)  # (B, C)
    return logp


if __name__ == "__main__":
    batching.model_logps = naive_model_logps
    torch.manual_seed(0)
    exit_process(entry_code(grpo.main))

"""generation.py: pure helpers here; ZeRO-3 (2 ranks, torchrun) and vLLM checks in worker
scripts."""

import torch

from conftest import torchrun
from generation import _cut_after_eos, _stack_right_padded, generate_hf


def test_cut_after_eos_matches_naive():
    torch.manual_seed(0)
    ids = torch.randint(0, 6, (50, 9))  # (b, C); ids 2 and 5 act as EOS
    out, mask = _cut_after_eos(ids, torch.tensor([2, 5]), pad_token_id=0)
    for row, o, m in zip(ids.tolist(), out.tolist(), mask.tolist()):
        stop = next((i for i, t in enumerate(row) if t in (2, 5)), len(row) - 1)
        assert m == [1] * (stop + 1) + [0] * (len(row) - stop - 1)
        assert o == row[: stop + 1] + [0] * (len(row) - stop - 1)


def test_stack_right_padded():
    t = _stack_right_padded([[1, 2], [], [3]], 9, torch.long)
    assert t.tolist() == [[1, 2], [9, 9], [3, 9]]


def test_generate_hf_plain_model_prompt_order(tiny_model):
    """One process, no DeepSpeed: each row of a batched call equals that prompt generated alone."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    prompts = [tok(t)["input_ids"] for t in ["ab", "hello there", "x", "Q: 2+2"]]
    both = generate_hf(
        model, prompts, num_generations=2, batch_size=3, max_new_tokens=6, greedy=True
    )
    assert both.completion_ids.shape[0] == 8
    for i, p in enumerate(prompts):
        alone = generate_hf(model, [p], max_new_tokens=6, greedy=True)
        n = int(alone.completion_mask.sum())
        for g in range(2):
            assert (
                both.completion_ids[2 * i + g, :n].tolist() == alone.completion_ids[0, :n].tolist()
            )


def test_zero3_generation(tiny_model, tiny_tied_model, tmp_path):
    """Greedy plain == ZeRO-3 gathered == sharded, context-manager restoration after exceptions,
    sampling/EOS cut, iter_full_params bound, save_hf round trip, frozen_engine with offload."""
    proc = torchrun("tests/dist_zero3_gen.py", tiny_model, tiny_tied_model, tmp_path)
    assert proc.stdout.count("DONE") == 2, proc.stdout[-3000:]


def test_vllm_generation(tiny_model, tmp_path):
    """One vLLM engine per rank, started from a save_hf checkpoint: vllm_batch_size=3 on 10 prompts
    == one call (ranks with 4 and 3 batches), HF greedy == vLLM greedy, sampler logprobs == HF
    log-softmax (under top-k/top-p: == the trainer's truncated log-probs), weight sync after a
    training step, sleep (generate refuses until a sync)."""
    proc = torchrun("tests/dist_vllm_gen.py", tiny_model, tmp_path)
    assert proc.stdout.count("DONE") == 2, proc.stdout[-3000:]


def test_vllm_tensor_parallel(tiny_model):
    """tensor_parallel_size=2: one engine across both ranks; each rank gets its own prompts'
    outputs, equal to HF greedy before and after a training step + weight sync; at temperature 1
    the sampler's log-probs equal HF's (both ranks sampled the same tokens), and the same seeds
    replay them."""
    proc = torchrun("tests/dist_vllm_tp_gen.py", tiny_model)
    assert proc.stdout.count("DONE") == 2, proc.stdout[-3000:]

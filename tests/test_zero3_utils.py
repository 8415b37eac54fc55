"""zero3_utils on one process: load_ds_config arithmetic and errors, parameter grouping, no-op
paths off ZeRO-3. The multi-process parts (gather, hooks, streaming, save_hf, frozen_engine) run
under torchrun in tests/test_generation.py::test_zero3_generation."""

import json

import pytest
import torch

from zero3_utils import (
    _groups,
    full_param_meta,
    gathered,
    is_sharded,
    is_zero3,
    iter_full_params,
    load_ds_config,
)


def write(tmp_path, cfg):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_load_ds_config_fills_auto_and_derives_batch(tmp_path):
    path = write(
        tmp_path,
        {
            "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
            "bf16": {"enabled": "auto"},
            "zero_optimization": {
                "stage": 3,
                "reduce_bucket_size": "auto",
                "stage3_param_persistence_threshold": "auto",
            },
        },
    )
    cfg = load_ds_config(
        path,
        world_size=4,
        hidden_size=128,
        train_micro_batch_size_per_gpu=2,
        gradient_accumulation_steps=3,
        gradient_clipping=1.0,
        **{"bf16.enabled": True},
    )
    assert cfg["train_batch_size"] == 24
    assert cfg["gradient_clipping"] == 1.0 and cfg["bf16"]["enabled"] is True
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 128 * 128
    assert cfg["zero_optimization"]["stage3_param_persistence_threshold"] == 1280


def test_load_ds_config_derives_missing_member():
    cfg = load_ds_config(
        {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}, world_size=2
    )
    assert cfg["gradient_accumulation_steps"] == 4


@pytest.mark.parametrize(
    "cfg, kwargs, words",
    [
        (
            {
                "train_batch_size": 10,
                "train_micro_batch_size_per_gpu": 2,
                "gradient_accumulation_steps": 2,
            },
            {"world_size": 2},
            ["train_batch_size=10", "= 8"],
        ),
        (
            {"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2},
            {"world_size": 2},
            ["train_batch_size=7"],
        ),
        (
            {"train_micro_batch_size_per_gpu": 4},
            {"train_micro_batch_size_per_gpu": 2},
            ["train_micro_batch_size_per_gpu=4", "2"],
        ),
        (
            {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": "auto"},
            {},
            ["gradient_clipping", "auto"],
        ),
    ],
)
def test_load_ds_config_rejects_contradictions(cfg, kwargs, words):
    with pytest.raises(ValueError) as e:
        load_ds_config(cfg, **kwargs)
    for w in words:
        assert w in str(e.value), f"{w!r} missing from: {e.value}"


def test_groups_are_bounded_and_ordered():
    sized = [(f"p{i}", n) for i, n in enumerate([5, 5, 3, 20, 1, 1, 9])]
    groups = list(_groups(sized, max_numel=10))
    assert [[n for n, _ in g] for g in groups] == [
        ["p0", "p1"],
        ["p2"],
        ["p3"],
        ["p4", "p5"],
        ["p6"],
    ]
    for g in groups:  # a group exceeds the bound only when it is one item larger than it
        assert sum(n for _, n in g) <= 10 or len(g) == 1


def test_a_lora_model_streams_as_its_merged_base_model(tiny_model):
    """peft LoRA: names of the base model, weights W + scaling * B @ A, and the model untouched."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), cfg)
    torch.manual_seed(0)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            p.data.normal_()  # peft starts B at zero: make the merge visible
    before = {n: p.clone() for n, p in model.named_parameters()}
    streamed = {n: t.clone() for n, t in iter_full_params(model, max_numel=5000)}
    assert list(streamed) == [n for n, _ in base.named_parameters()]
    # what vLLM's weight transfer is told before the stream (vllm_transfer.ZeRO3Weights)
    assert full_param_meta(model) == [(n, t.dtype, tuple(t.shape)) for n, t in streamed.items()]
    merged = model.merge_and_unload()  # peft's own merge, as the reference
    for n, p in merged.named_parameters():
        torch.testing.assert_close(streamed[n], p.data, rtol=1e-6, atol=1e-6)
    assert any(not torch.equal(streamed[n], p) for n, p in base.named_parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before)


def test_off_zero3_helpers_are_no_ops(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert not is_zero3(model) and not is_sharded(model)
    with gathered(model):
        pass
    names = [n for n, _ in iter_full_params(model)]
    assert names == [n for n, _ in model.named_parameters()]

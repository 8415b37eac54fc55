"""Model shapes without weights: the Qwen2.5 presets, the sizes of a transformers config that the
memory estimate and the pre-flight need, and the parameters LoRA adds.

    s = model_shape("qwen2.5-7b")          # or a config.json path, its directory, a config, a dict
    s["N"], s["L"], s["h"], s["k"]         # parameters, layers, query / key-value heads
    lora_params("qwen2.5-7b", r=16)        # the parameters LoRA adds and trains

Letters as estimate.py's: V vocabulary, H hidden, L layers, I MLP width, h / k query / key-value
heads of width d, N parameters. Imports no sibling.
"""

import json
import os

_QWEN = dict(
    model_type="qwen2", vocab_size=151936, max_position_embeddings=32768, hidden_act="silu"
)


PRESETS = {  # Qwen2.5 base configs' shapes (config.json on the hub), so no download is needed
    "qwen2.5-0.5b": dict(
        _QWEN,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": dict(
        _QWEN,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2.5-3b": dict(
        _QWEN,
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": dict(
        _QWEN,
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    ),
}


def model_shape(config):
    """A preset name, a config.json path or its directory, a transformers config, or a dict ->
    dict of the sizes the estimate needs (no weights are loaded)."""
    if isinstance(config, str):
        if config.lower() in PRESETS:
            config = PRESETS[config.lower()]
        elif os.path.exists(config):
            with open(
                os.path.join(config, "config.json") if os.path.isdir(config) else config
            ) as f:
                config = json.load(f)
        else:
            raise ValueError(
                f"model {config!r}: not a file or directory, and not one of the presets "
                f"{list(PRESETS)}"
            )
    c = config if isinstance(config, dict) else config.to_dict()
    c = c.get("text_config", c)  # multimodal wrappers keep the LM's sizes here
    missing = [
        k
        for k in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
        )
        if k not in c
    ]
    if missing:
        raise ValueError(
            f"model config lacks {missing}: the estimate knows decoder-only Llama/Qwen-style "
            "configs"
        )
    h, H = c["num_attention_heads"], c["hidden_size"]
    s = dict(
        V=c["vocab_size"],
        H=H,
        L=c["num_hidden_layers"],
        I=c["intermediate_size"],
        h=h,
        k=c.get("num_key_value_heads") or h,
        d=c.get("head_dim") or H // h,
        tied=bool(c.get("tie_word_embeddings", False)),
    )
    bias = c.get("attention_bias", c.get("model_type") == "qwen2")  # Qwen2 has q/k/v biases
    qkv = (s["h"] + 2 * s["k"]) * s["d"]
    s["qkv_bias"] = bool(bias)
    s["layer_params"] = (
        H * qkv + (qkv if bias else 0) + s["h"] * s["d"] * H + 3 * H * s["I"] + 2 * H
    )
    s["embed_params"] = s["V"] * H
    s["N"] = s["L"] * s["layer_params"] + s["embed_params"] * (1 if s["tied"] else 2) + H
    return s


def lora_params(model_config, r, target_modules="all-linear"):
    """The parameters LoRA adds and trains: r x (in + out) per targeted linear layer of each
    decoder layer ("all-linear": every one but the lm_head, as peft; else comma-separated names)."""
    s = model_shape(model_config)
    H, I, q, kv = s["H"], s["I"], s["h"] * s["d"], s["k"] * s["d"]
    shapes = {"q_proj": H + q, "k_proj": H + kv, "v_proj": H + kv, "o_proj": q + H}
    shapes.update(gate_proj=H + I, up_proj=H + I, down_proj=I + H)
    names = list(shapes) if target_modules == "all-linear" else target_modules.split(",")
    return s["L"] * r * sum(shapes.get(n.strip(), 0) for n in names)


def heads_split(config, size):
    """None, or why a model of this config cannot share its attention over `size` ranks
    (sequence parallelism: DeepSpeed 0.19.8 UlyssesSPAttentionHF splits the query heads evenly;
    the key/value heads must divide by `size` or `size` by them, which replicates them)."""
    s = model_shape(config)
    if s["h"] % size:
        return f"its {s['h']} attention heads do not divide by {size}"
    if s["k"] % size and size % s["k"]:
        return f"its {s['k']} key/value heads and {size} do not divide one another"
    return None

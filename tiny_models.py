"""Tiny, deterministic, offline models: a char-level tokenizer, a Llama causal LM and
a Llama sequence-classification (reward) model, written to a directory.

Nothing here touches a model hub. The saved directories load with
`AutoTokenizer.from_pretrained`, `AutoModelForCausalLM.from_pretrained`,
`AutoModelForSequenceClassification.from_pretrained` and vLLM's `LLM(model=path)`.
Tests, benchmarks and the default `bash run.sh` task all build their models here.

    python tiny_models.py --path runs/tiny-llama                      # causal LM + tokenizer
    python tiny_models.py --path runs/tiny-rm --reward_model          # reward model + tokenizer
    python tiny_models.py --path runs/x --hidden_size 256 --num_layers 4 --tie_word_embeddings

head_dim is fixed at 64 (hidden_size / num_heads) because vLLM's CPU attention
rejects smaller heads; hidden_size must therefore be a multiple of 64.
"""

import json
import os
import string
from dataclasses import dataclass, field

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    HfArgumentParser,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    PreTrainedTokenizerFast,
)

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]  # ids 0, 1, 2, 3
# Printable ASCII (digits first, so their ids are small and stable) plus newline.
DEFAULT_CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"
HEAD_DIM = 64


def build_tokenizer(path, chars=DEFAULT_CHARS):
    """A char-level fast tokenizer: every character is one token; BOS is prepended.

    Unknown characters map to <unk>. Saved with `save_pretrained` so both
    transformers and vLLM load it (tokenizer.json + tokenizer_config.json).
    """
    if len(set(chars)) != len(chars):
        raise ValueError("chars must not repeat a character")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({c: len(SPECIAL_TOKENS) + i for i, c in enumerate(chars)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # One token per character, whitespace and newline included ("(?s)." would drop "\n").
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # join characters back without spaces
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",  # generation wants left padding; per-call code may override
    )
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(path)
    return fast


def llama_config(
    vocab_size,
    hidden_size=128,
    num_layers=2,
    num_heads=None,
    num_kv_heads=None,
    intermediate_size=None,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    **extra,
):
    """A LlamaConfig with head_dim 64 and this tokenizer's special-token ids."""
    if hidden_size % HEAD_DIM:
        raise ValueError(
            f"hidden_size={hidden_size} must be a multiple of {HEAD_DIM} (head_dim 64 for vLLM's "
            "CPU attention)"
        )
    num_heads = num_heads or hidden_size // HEAD_DIM
    if hidden_size != num_heads * HEAD_DIM:
        raise ValueError(
            f"num_heads={num_heads} gives head_dim {hidden_size // num_heads}; use "
            f"num_heads={hidden_size // HEAD_DIM}"
        )
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads or num_heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **extra,
    )


def build_tiny(
    path,
    hidden_size=128,
    num_layers=2,
    num_heads=None,
    num_kv_heads=None,
    intermediate_size=None,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    reward_model=False,
    seed=0,
    dtype=torch.float32,
    chars=DEFAULT_CHARS,
):
    """Write tokenizer + randomly initialised (seeded) model to `path`; return `path`.

    reward_model=False: LlamaForCausalLM. reward_model=True: LlamaForSequenceClassification
    with one label (a scalar score read at the last non-pad token), usable as a reward model.
    """
    tokenizer = build_tokenizer(path, chars)
    config = llama_config(
        len(tokenizer),
        hidden_size,
        num_layers,
        num_heads,
        num_kv_heads,
        intermediate_size,
        max_position_embeddings,
        tie_word_embeddings,
        torch_dtype=dtype,
    )
    if reward_model:
        config.num_labels = 1
    torch.manual_seed(seed)
    cls = LlamaForSequenceClassification if reward_model else LlamaForCausalLM
    model = cls(config).to(dtype)
    if not reward_model:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    with open(os.path.join(path, "tiny_models.json"), "w") as f:
        json.dump(
            {"seed": seed, "reward_model": reward_model, "num_parameters": model.num_parameters()},
            f,
        )
    return path


@dataclass
class Args:
    path: str = field(metadata={"help": "output directory"})
    hidden_size: int = field(
        default=128, metadata={"help": "model width, a multiple of 64 (head_dim 64)"}
    )
    num_layers: int = field(default=2, metadata={"help": "decoder layers"})
    intermediate_size: int = field(
        default=0, metadata={"help": "MLP width; 0 means 2 x hidden_size"}
    )
    max_position_embeddings: int = field(default=512, metadata={"help": "longest sequence"})
    tie_word_embeddings: bool = field(
        default=False, metadata={"help": "share the input embedding with lm_head"}
    )
    reward_model: bool = field(
        default=False, metadata={"help": "build a 1-label sequence-classification model"}
    )
    seed: int = field(default=0, metadata={"help": "initialisation seed"})


if __name__ == "__main__":
    (a,) = HfArgumentParser(Args).parse_args_into_dataclasses()
    build_tiny(
        a.path,
        a.hidden_size,
        a.num_layers,
        intermediate_size=a.intermediate_size or None,
        max_position_embeddings=a.max_position_embeddings,
        tie_word_embeddings=a.tie_word_embeddings,
        reward_model=a.reward_model,
        seed=a.seed,
    )
    print(f"wrote {a.path}")

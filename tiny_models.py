"""Tiny, deterministic, offline models: a char-level tokenizer, a Llama causal LM and
a Llama sequence-classification (reward) model, written to a directory.

Nothing here touches a model hub. The saved directories load with
`AutoTokenizer.from_pretrained`, `AutoModelForCausalLM.from_pretrained`,
`AutoModelForSequenceClassification.from_pretrained` and vLLM's `LLM(model=path)`.
Tests, benchmarks and the default `bash run.sh` task all build their models here.

    python tiny_models.py --path runs/tiny-llama                      # causal LM + tokenizer
    python tiny_models.py --path runs/tiny-rm --reward_model          # reward model + tokenizer
    python tiny_models.py --path runs/x --hidden_size 256 --num_layers 4 --tie_word_embeddings

`build_family(path, family)` builds the same tiny shape as a Llama, Qwen2, Qwen3, Mistral,
Gemma-2 or Phi-3 model (FAMILIES), for the architecture matrix of tests/test_families.py;
`tokenizer_dir=` gives it a real tokenizer instead (Qwen2.5's, for tests/test_chat.py).

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


# ---- One tiny model per architecture family people fine-tune (tests/test_families.py) ----
# Each family keeps what makes it differ on the paths a run takes: Qwen2's qkv bias and tied
# embeddings, Qwen3's q/k norms, Mistral's and the Qwens' grouped KV heads, Gemma-2's scaled
# embeddings, (1 + w) norms and final-logit soft-cap, Phi-3's fused qkv_proj / gate_up_proj.
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "phi3")


def family_config(family, vocab_size, hidden_size=128, num_layers=2, num_kv_heads=None):
    """A config of `family` at a tiny shape (head_dim 64 for vLLM's CPU attention, 2 layers)."""
    import transformers

    heads = hidden_size // HEAD_DIM
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    gqa = num_kv_heads or max(1, heads // 2)  # grouped KV heads, as the real models have
    if family == "llama":
        return llama_config(vocab_size, hidden_size, num_layers)
    if family == "qwen2":
        return transformers.Qwen2Config(**common, num_key_value_heads=gqa, tie_word_embeddings=True)
    if family == "qwen3":
        return transformers.Qwen3Config(
            **common, num_key_value_heads=gqa, tie_word_embeddings=False
        )
    if family == "mistral":
        return transformers.MistralConfig(
            **common, num_key_value_heads=gqa, tie_word_embeddings=False
        )
    if family == "gemma2":
        # At the default init (0.02) the logits are ~0.2 wide and Gemma-2's cap of 30 would never
        # bend them: a wider init and a cap of 2 make the soft-cap change every log-prob.
        return transformers.Gemma2Config(
            **common,
            num_key_value_heads=gqa,
            tie_word_embeddings=True,
            query_pre_attn_scalar=HEAD_DIM,
            initializer_range=0.1,
            final_logit_softcapping=2.0,
        )
    if family == "phi3":
        common.pop("head_dim")  # Phi-3 derives it (hidden / heads)
        return transformers.Phi3Config(
            **common, num_key_value_heads=heads, tie_word_embeddings=False
        )
    raise ValueError(f"unknown family {family!r}; one of {', '.join(FAMILIES)}")


def build_qwen_tokenizer(path, chars=DEFAULT_CHARS):
    """The char tokenizer's vocabulary (same ids) as a Qwen2Tokenizer: byte-level BPE without
    merges, so each character is still one token; no BOS, as Qwen's tokenizers add none.

    Why: for model_type "qwen2" transformers' AutoTokenizer ignores the saved tokenizer class and
    rebuilds a Qwen2Tokenizer (byte-level pre-tokenizer) from the vocabulary, which silently drops
    every space and newline of the plain char tokenizer. Written in the form it rebuilds, it loads
    unchanged in transformers and vLLM.
    """
    from transformers import Qwen2Tokenizer

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for c in chars:  # " " -> "Ġ", "\n" -> "Ċ"; printable ASCII stays itself
        ((piece, _),) = byte_level.pre_tokenize_str(c)
        vocab[piece] = len(vocab)
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token="<unk>",
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        padding_side="left",
    )
    os.makedirs(path, exist_ok=True)
    tok.save_pretrained(path)
    return tok


def build_family(
    path,
    family,
    seed=0,
    chars=DEFAULT_CHARS,
    dtype=torch.float32,
    tokenizer_dir="",
    hidden_size=128,
):
    """Write the char tokenizer and a randomly initialised (seeded) tiny `family` causal LM to
    `path` (hidden 128, 2 layers, 2 heads of 64); return `path`. Loads in transformers and vLLM,
    and `bash run.sh grpo --model path` runs it on the built-in task (chars cover TASK_CHARS).

    tokenizer_dir: a real tokenizer instead (e.g. ../shared/assets/qwen2.5-tokenizer, with its
    chat template): copied beside the model, its size the vocabulary, its pad / bos / eos ids in
    the config, and generation_config's eos_token_id [eos, pad] as Qwen2.5-Instruct ships it
    (<|im_end|>, <|endoftext|>)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    qwen = family in ("qwen2", "qwen3")  # real Qwen models use Qwen2Tokenizer, as these do
    if tokenizer_dir:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        tokenizer.save_pretrained(path)
    else:
        tokenizer = build_qwen_tokenizer(path, chars) if qwen else build_tokenizer(path, chars)
    config = family_config(family, len(tokenizer), hidden_size)
    if tokenizer_dir:
        for name in ("pad", "bos", "eos"):
            setattr(config, f"{name}_token_id", getattr(tokenizer, f"{name}_token_id"))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    if tokenizer_dir:
        stops = [tokenizer.eos_token_id, tokenizer.pad_token_id]
        model.generation_config.eos_token_id = list(dict.fromkeys(stops))
    model.save_pretrained(path)
    with open(os.path.join(path, "tiny_models.json"), "w") as f:
        json.dump({"seed": seed, "family": family, "num_parameters": model.num_parameters()}, f)
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

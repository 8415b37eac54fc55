"""The GPU tier's device, shapes and summary (tests/gpu; `bash test.sh --gpu`, docs/gpu.md).

On a CUDA device the tier runs at the issue's shapes; with GPU_TIER_ON_CPU=1 and no CUDA device it
runs on a stand-in: CPU, gloo, the same dtypes, small shapes, so the tier itself is tested before
a GPU sees it. Every result is printed as it comes and the summary, gpu_tier.json and gpu_tier.md
(the table docs/gpu.md shows), is rewritten after each one in $GPU_TIER_OUT (default: a new
directory runs/gpu-tier-<time>).
"""

import datetime
import importlib.metadata
import json
import os
import time

import torch

CUDA = torch.cuda.is_available()
ON_CPU = not CUDA and os.environ.get("GPU_TIER_ON_CPU") == "1"
DEVICE = torch.device("cuda" if CUDA else "cpu")
SKIP_REASON = (
    "no CUDA device: the GPU tier runs on a GPU (GPU_TIER_ON_CPU=1 runs it on CPU at small shapes)"
)
# bf16 dense tensor-core peaks in TFLOP/s from the vendors' data sheets (no sparsity), by the
# exact name torch.cuda.get_device_name gives, less "NVIDIA " (a substring would take "H200 NVL"
# for "H200"); a device not named here gets one large matmul's measured rate
BF16_PEAK_TFLOPS = {
    "H100 80GB HBM3": 989.0,  # SXM
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H200": 989.0,  # SXM
    "H200 NVL": 835.0,
    "A100-SXM4-80GB": 312.0,
    "A100 80GB PCIe": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
}


def shapes():
    """The tier's shapes: the issue's on CUDA, small ones on the CPU stand-in. V, N, H: b's
    matmul; T, B, steps: a's rows and e's benchmark; C: the completion tokens of c's and d's runs
    at the models' shapes (on CUDA the pretrained recipe's)."""
    if CUDA:
        return dict(V=151_936, N=8192, H=896, T=2048, B=2, C=256, models=("0.5b", "1.5b"), steps=5)
    return dict(V=16_384, N=1024, H=64, T=640, B=2, C=16, models=("tiny",), steps=2)


def device_name():
    if CUDA:
        return torch.cuda.get_device_name(0)
    return "CPU stand-in (GPU_TIER_ON_CPU=1)"


def bf16_peak_flops():
    """(FLOP/s, where it came from): the data sheet's bf16 peak for a known GPU, else one large
    bf16 matmul's measured rate (on CPU: the stand-in's, a CPU figure)."""
    if CUDA:
        name = torch.cuda.get_device_name(0).removeprefix("NVIDIA ")
        if name in BF16_PEAK_TFLOPS:
            return BF16_PEAK_TFLOPS[name] * 1e12, f"data sheet ({name})"
    n = 8192 if CUDA else 512
    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    a @ b  # warm-up
    sync()
    reps, t0 = (20 if CUDA else 3), time.perf_counter()
    for _ in range(reps):
        a @ b
    sync()
    return 2 * n**3 * reps / (time.perf_counter() - t0), f"measured ({n}^3 bf16 matmul)"


def sync():
    if CUDA:
        torch.cuda.synchronize()


def _shown(value):
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return " / ".join(_shown(v) for v in value)
    return str(value)


class Summary:
    """The tier's results: one row each, printed as it comes, the files rewritten after each."""

    def __init__(self, out_dir=None):
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.dir = (
            out_dir
            or os.environ.get("GPU_TIER_OUT")
            or os.path.join(root, "runs", f"gpu-tier-{stamp}")
        )
        os.makedirs(self.dir, exist_ok=True)
        self.head = {
            "device": device_name(),
            "mode": "cuda" if CUDA else "cpu stand-in",
            "torch": torch.__version__,
            "transformers": importlib.metadata.version("transformers"),
            "date": datetime.date.today().isoformat(),
            "shapes": {k: v for k, v in shapes().items() if k != "models"},
        }
        self.rows = []

    def add(self, check, measure, value, unit="", note=""):
        """One result: check (a-e), what was measured, its value (number or text)."""
        row = dict(check=check, measure=measure, value=value, unit=unit, note=note)
        self.rows.append(row)
        shown = _shown(value)
        print(f"\n[gpu tier] {check}: {measure} = {shown} {unit} {note}".rstrip(), flush=True)
        self.write()

    def write(self):
        with open(os.path.join(self.dir, "gpu_tier.json"), "w") as f:
            json.dump({**self.head, "results": self.rows}, f, indent=1)
        with open(os.path.join(self.dir, "gpu_tier.md"), "w") as f:
            f.write(self.markdown())

    def markdown(self):
        h = self.head
        lines = [
            f"Device: {h['device']}; torch {h['torch']}; {h['date']}"
            + ("" if CUDA else " (CPU figures: a stand-in, not a GPU's)"),
            "",
            "| check | measure | value | note |",
            "|---|---|---|---|",
        ]
        for r in self.rows:
            cells = (r["check"], r["measure"], f"{_shown(r['value'])} {r['unit']}", r["note"])
            lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
        return "\n".join(lines) + "\n"


def build_shape(path, name):
    """A causal LM with random weights at path: "tiny" (tiny_models' Qwen2, hidden 128) or a
    Qwen2.5 shape of shapes.PRESETS ("0.5b", "1.5b") in bf16 with the char tokenizer (no
    download; the vocabulary is the real 151,936 wide, most of it never sampled). Returns path."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from shapes import PRESETS
    from tiny_models import build_family, build_qwen_tokenizer

    if name == "tiny":
        return build_family(path, "qwen2")
    tok = build_qwen_tokenizer(path)
    shape = {k: v for k, v in PRESETS[f"qwen2.5-{name}"].items() if k != "model_type"}
    ids = {f"{t}_token_id": getattr(tok, f"{t}_token_id") for t in ("pad", "bos", "eos")}
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**shape, **ids), dtype=torch.bfloat16)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    del model
    if CUDA:  # the runs after it start processes of their own on this GPU
        torch.cuda.empty_cache()
    return path

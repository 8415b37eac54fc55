"""The run both loops share, called by the loop and never calling it: the fields both `Args` have,
parsing with recipes, the pre-flight's call (preflight.py), models and engines, the generation
glue, held-out evaluation given a sampling function, and `Run`, this rank's run state.

    args = parse(Args, RECIPES, argv)                  # the configuration as given
    run = Run(args, memory_models(args))               # process group, pre-flight, run dir
    policy = run.train_engine(run.load(), args.learning_rate)
    vllm = run.vllm_engine()                           # or None without --use_vllm
    run.start(__file__, {"policy": policy}, vllm, eval_sample)  # resume, log, ledger, signals
    for step in run.steps():                           # each step's seed and clock
        ...rollout, log-probs, advantages, update: the loop's own...
        run.end_step(row, loss=..., grad_norm=..., line=...)   # log, adapt, evaluate, save or stop
    run.finish(panels)                                 # held-out score, memory, final model
    # --max_steps 0: steps() yields nothing and finish() scores the model as given, saving nothing

`Run` owns no step order (no train(), no hooks): the loop's body is the algorithm. Derived state
lives here, never on `args`: `run.stop_ids`, `run.template_kwargs`, `run.funcs` / `run.weights`
(the reward functions), and `run.knobs`, the memory knobs in effect (fit.Knobs: as given, or as
--memory_budget_gb fitted them before the first step and moves them between steps).
The pre-flight (preflight.py) is one pass on every rank before a model loads: every input checked,
then the memory estimate and the fit, then the DeepSpeed config, the resume check and the disk.
run.sh runs it in one process first (`--preflight True`), which writes nothing.
"""

import os
import sys
import time
from dataclasses import dataclass

import deepspeed
import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers import AutoModelForCausalLM

import sequence_parallel
from arguments import arg, parse_args_quietly
from batching import all_sum, encode_prompts, init_distributed
from build_locks import clear_stale_build_locks
from checkpoint import (
    StopOnSignal,
    Stopped,
    clear_run,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from checks import check_attn_implementation
from ds_json import deepspeed_config
from exits import RunError
from fit import OOM_HINTS, KnobAdapter
from generation import (
    attn_implementation_for,
    generate_hf,
    sampler_top_k_rule,
    unwrap_for_generation,
)
from guard import StepGuard
from logprobs import DEFAULT_CHUNK_SIZE
from memory import MemoryLedger
from preflight import (  # before_torchrun: the loops' --preflight / --estimate_memory, through here
    before_torchrun,  # noqa: F401
    checkpoint_config,
    default_run_dir,
    nothing_left_if_refused,
    preflight,
)
from recipes import apply_recipe
from runlog import RunLog
from tasks import pass_at_k, score_completions, solved_mask
from tiled_mlp import tile_mlps
from vllm_server import vllm_generator
from zero3_load import enable_gradient_checkpointing, load_model
from zero3_utils import (
    from_rank0,
    frozen_config,
    frozen_engine,
    save_adapter,
    save_hf,
    set_data_group,
)


# ---- The fields both loops have (each loop's Args extends this) --------------------------------
@dataclass
class RunArgs:
    model: str = arg("", "the policy's hub id or path; empty: a tiny model from scratch")
    recipe: str = arg("", "a named set of defaults (recipes.py); flags given win")
    data: str = arg(
        "", "JSONL/JSON/CSV/parquet, a datasets dir or hub id; empty: the built-in task"
    )
    data_split: str = arg("train", "--data's split (a single file is 'train'; 'train[:1000]' too)")
    data_config: str = arg("", "--data's subset (config name) on the hub, e.g. gsm8k's main")
    prompt_field: str = arg("prompt", "--data's prompt: a string or a list of {role, content}")
    answer_field: str = arg(
        "answer", "--data's answer field, given to the rewards (None if absent)"
    )
    chat_template_kwargs: str = arg("", 'chat template arguments, JSON: {"enable_thinking": false}')
    reward_funcs: str = arg(
        "", "module:function,... (prompts, completions, answers) -> list[float]"
    )
    reward_weights: str = arg("", "one weight per reward; empty: 0.25,0.75 (task) or 1s")
    # empty, named when the run starts (default_run_dir); "%(default)s" (the empty string) in the
    # help keeps argparse from adding "(default: )"
    run_dir: str = arg(
        "",
        "metrics.jsonl, args, checkpoints, final model (default: runs/<algo>-<start time>, e.g. "
        "runs/grpo-20250101-120000%(default)s)",
    )
    ds_config: str = arg("configs/zero3.json", 'DeepSpeed JSON, "auto" from these args')
    seed: int = arg(0, "data order, sampling and (default task) model init", ">= 0")
    # rollout
    prompts_per_rank: int = arg(16, "prompts per rank per step, G completions each", ">= 1")
    num_generations: int = arg(8, "G, the group size: completions per prompt", ">= 1")
    max_prompt_length: int = arg(512, "prompt tokens kept (from the left end)", ">= 1")
    max_completion_length: int = arg(2, "C: new tokens per completion", ">= 1")
    temperature: float = arg(1.0, "sampling temperature (log-probs use it too)", "> 0")
    top_p: float = arg(1.0, "nucleus sampling", "(0, 1]")
    top_k: int = arg(0, "top-k sampling: the k likeliest tokens (0: off)", ">= 0")
    use_vllm: bool = arg(False, "generate with vLLM (--vllm_mode: colocated, or a server)")
    vllm_mode: str = arg(
        "colocate",
        "colocate: an engine per rank; server: VLLM_DEVICES=... run.sh",
        ("colocate", "server"),
    )
    vllm_server_url: str = arg("http://127.0.0.1:8000", "server mode: the vLLM server's address")
    gather_for_generation: bool = arg(True, "ZeRO-3: gather to generate; False: layer by layer")
    generation_resident_gb: float = arg(0.0, "layer by layer: GB of layers kept gathered", ">= 0")
    generation_batch_size: int = arg(256, "HF generate: sequences per call", ">= 1")
    vllm_batch_size: int = arg(0, "vLLM: prompts per call, 0 = all at once", ">= 0")
    vllm_gpu_memory_utilization: float = arg(0.3, "vLLM's share of GPU memory", "(0, 1]")
    vllm_tensor_parallel_size: int = arg(1, "ranks sharing one vLLM engine", ">= 1")
    # the update
    learning_rate: float = arg(1e-3, "peak LR (from scratch; ~1e-6 pretrained)", "> 0")
    weight_decay: float = arg(0.0, "AdamW weight decay", ">= 0")
    warmup_steps: int = arg(0, "linear LR warmup steps", ">= 0")
    max_grad_norm: float = arg(1.0, "gradient clipping", ">= 0")
    max_bad_steps: int = arg(3, "stop after this many non-finite steps in a row", ">= 1")
    # memory (fit.MEMORY_KNOBS); the old names are still accepted
    per_device_train_batch_size: int = arg(
        32,
        "sequences per micro-batch (not TRL's completions per device per step: that is "
        "prompts_per_rank x num_generations)",
        ">= 1",
        aliases="--micro_train_batch_size",
    )
    max_tokens_per_microbatch: int = arg(0, "> 0: micro-batches by padded-token budget", ">= 0")
    gradient_checkpointing: bool = arg(False, "recompute activations in backward")
    logprob_chunk_size: int = arg(
        0, f"tokens per fused log-prob tile; 0: logprobs.py's {DEFAULT_CHUNK_SIZE}", ">= 0"
    )
    frozen_offload: bool = arg(
        False, "ZeRO-3: reference and reward model shards in CPU memory", aliases="--ref_offload"
    )
    attn_implementation: str = arg("sdpa", "sdpa, eager or flash_attention_2 (CUDA, flash-attn)")
    partitioned_loading: bool = arg(True, "ZeRO-3: each rank reads only its shard (zero3_load.py)")
    packing: bool = arg(False, "micro-batches as one row, no padding")
    # long sequences (docs/long-context.md)
    sequence_parallel_size: int = arg(
        1,
        "S: ranks that share every sequence, each computing 1/S of its tokens (DeepSpeed "
        "Ulysses); the world splits into world / S data-parallel groups",
        ">= 1",
    )
    activation_offload: bool = arg(
        False, "gradient checkpoints (layer inputs) kept in host memory until backward"
    )
    tiled_mlp: bool = arg(False, "each MLP computed in sequence tiles (DeepSpeed's TiledMLP)")
    lora_r: int = arg(0, "> 0: train LoRA adapters of this rank only (peft)", ">= 0")
    lora_alpha: float = arg(32.0, "LoRA scaling numerator", "> 0")
    lora_target_modules: str = arg("all-linear", "peft target_modules")
    save_merged: bool = arg(
        True, "LoRA: beside the adapter (final/), the merged plain model in <run_dir>/final_merged"
    )
    dtype: str = arg(
        "auto", "auto (bf16 on a GPU with bf16, else fp32), bf16 or fp32", ("auto", "bf16", "fp32")
    )
    pad_token: str = arg("", "a pad token for a tokenizer without one (its eos token is fine)")
    max_steps: int = arg(
        100, "training steps (one rollout batch each); 0: evaluate the model as given", ">= 0"
    )
    # evaluation, logging, saving
    eval_steps: int = arg(25, "held-out reward every this many steps (and at start/end)", ">= 0")
    num_eval_prompts: int = arg(
        -1, "held-out prompts; -1: a fifth of the rows, at most 200; 0: no eval", ">= -1"
    )
    eval_samples: int = arg(1, "k samples per held-out prompt; > 1: eval/pass@1, pass@k", ">= 1")
    save_steps: int = arg(0, "DeepSpeed checkpoint every this many steps; 0: none", ">= 0")
    save_last: bool = arg(
        True,
        "checkpoint the last step too: --resume True with a larger --max_steps extends the run",
    )
    save_total_limit: int = arg(0, "keep only this many newest checkpoints; 0: all", ">= 0")
    resume: bool = arg(False, "continue from the latest checkpoint in run_dir (checkpoint.py)")
    overwrite: bool = arg(False, "delete an earlier run's checkpoints and metrics in run_dir")
    save_model: bool = arg(True, "write the final HF model to <run_dir>/final")
    report_to: str = arg(
        "none", "none or wandb (offline unless WANDB_MODE is set)", ("none", "wandb")
    )
    log_completions: bool = arg(
        False,
        "each step's prompts, completions and rewards (rank 0's) in <run_dir>/completions.jsonl, "
        "and as a wandb table with --report_to wandb",
    )
    num_completions_to_print: int = arg(
        0, "--log_completions: print this many of each step's completions", ">= 0"
    )
    estimate_memory: bool = arg(False, "print the per-phase memory estimate (fit.py) and exit")
    gpu_gb: float = arg(0.0, "--estimate_memory on paper for a GPU of this many GB", ">= 0")
    memory_budget_gb: float = arg(
        0.0, "> 0: GB per rank the knobs are fitted under, before and between steps", ">= 0"
    )
    preflight: bool = arg(False, "check every input, then exit; run.sh does this first")


def parse(args_class, recipes, argv=None):
    """The command line (argv, default sys.argv[1:]) as `args_class`, a recipe's defaults under it,
    and the checks every loop's fields need on their own (no file read yet)."""
    args = parse_args_quietly(args_class, argv)  # argparse's errors: exit 2; then each "range"
    apply_recipe(args, recipes, argv)  # a flag given on the command line wins
    check_attn_implementation(args.attn_implementation, args.dtype)  # flash attention
    if args.use_vllm and args.gather_for_generation is False:
        raise RunError(
            "--gather_for_generation False applies to HF generation; drop it with --use_vllm"
        )
    if args.num_completions_to_print and not args.log_completions:
        raise RunError(
            "--num_completions_to_print prints what --log_completions True logs: pass both"
        )
    if args.max_steps == 0 and args.resume:
        raise RunError(
            "--max_steps 0 evaluates a model as given, in a run directory of its own: to score a "
            "run's last weights, drop --resume True and pass --model <that run_dir>/final"
        )
    if args.max_steps == 0 and args.num_eval_prompts == 0:
        raise RunError(
            "--max_steps 0 evaluates the model on the held-out prompts, and --num_eval_prompts 0 "
            "holds out none: pass --num_eval_prompts N (without it: a fifth of the rows, <= 200)"
        )
    if args.activation_offload and not args.gradient_checkpointing:
        raise RunError(
            "--activation_offload True moves the gradient checkpoints (each layer's inputs) to "
            "host memory, and this run keeps none: add --gradient_checkpointing True"
        )
    if args.lora_r:
        try:
            import peft  # noqa: F401  (optional: only LoRA runs need it)
        except ImportError:
            raise RunError("--lora_r needs peft: pip install peft==0.21.2") from None
    return args


# ---- How the policy samples, and the engine as the loops run it ---------------------------------


def sampling_params(args):
    """How the policy samples (Run.generate: HF generate and vLLM take them alike)."""
    return dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)


def sampling_cut(args):
    """batching.forward_logps' keywords for the sampling policy's log-probs: the cut its sampler
    made (--top_k, --top_p, with the top-k rule of the sampler that samples here:
    generation.sampler_top_k_rule); {} without one (the full distribution)."""
    if args.top_k == 0 and args.top_p == 1:
        return {}
    return dict(top_k=args.top_k, top_p=args.top_p, top_k_rule=sampler_top_k_rule(args.use_vllm))


def without_lone_allreduce(engine):
    """The training engine as the loops run it: on one rank at ZeRO-0, DeepSpeed's backward
    gradient all-reduce turned off (it would only copy every gradient into one flat buffer: 0.32
    GB at 85M parameters, bench/vs_trl.py; the update is the same). The GPU tier's benchmark
    calls it too."""
    if engine.dp_world_size == 1 and engine.zero_optimization_stage() == 0:
        engine.enable_backward_allreduce = False
    return engine


# ---- The run on this rank --------------------------------------------------------------------
class Run:
    """This rank's run: the process group, the checked inputs (preflight.Inputs' fields are its
    attributes; `check`: the loop's own input check, as in preflight), the run dir; after
    start(), the checkpoints, the run log, the memory ledger, the step guard, the knob adapter
    and the signal handler. The loop calls it; it calls no loop."""

    def __init__(self, args, models, check=None):
        self.args = args
        if os.environ.get("LOCAL_RANK", "0") == "0":  # before DeepSpeed builds its ops: no hang
            clear_stale_build_locks()
        self.rank, self.world, self.device = init_distributed()  # NCCL on GPUs, gloo on CPU
        # the ranks that hold different data: all of them, or one per sequence-parallel group
        self.data_rank, self.data_world, self.sp = self.rank, self.world, None
        if not args.run_dir:  # rank 0's start time names it on every rank
            args.run_dir = from_rank0(default_run_dir(args))
        self.say = print if self.rank == 0 else (lambda *a, **k: None)
        said = os.environ.get("PREFLIGHT_SAID") == "1"  # run.sh's pass printed its lines
        if self.world == 1:  # one process: a refusal leaves nothing behind (run.sh's pre-flight)
            with nothing_left_if_refused(args.run_dir):
                inputs = preflight(args, self.rank, self.world, models, self.say, check, said=said)
        else:
            inputs = preflight(args, self.rank, self.world, models, self.say, check, said=said)
        self.__dict__.update(vars(inputs))
        os.makedirs(args.run_dir, exist_ok=True)  # the pre-flight wrote nothing (a built-in model)
        # every rank has read run_dir (check_new_run, check_disk) before rank 0 clears or writes it
        dist.barrier()
        if args.overwrite:
            if self.rank == 0:
                clear_run(args.run_dir)  # an earlier run's checkpoints, metrics and final model
            dist.barrier()  # and no rank reads run_dir while rank 0 clears it
        if self.knobs.sequence_parallel_size > 1:  # groups of S ranks share each sequence
            self.sp = sequence_parallel.init(self.knobs.sequence_parallel_size)
            sequence_parallel.install(args.attn_implementation)
            set_data_group(self.sp.data_group)  # batch sums: one rank per group
            self.data_rank, self.data_world = self.sp.data_rank, self.sp.data_world
        self.stage = self.ds_config.get("zero_optimization", {}).get("stage", 0)
        self.mini_batches = models.get("mini_batches", 1)  # optimizer steps per batch and pass

    # ---- models and engines ----
    def ds(self, lr):
        """The DeepSpeed config of a model trained with this learning rate."""
        hidden, args, mini = self.config.hidden_size, self.args, self.mini_batches
        return deepspeed_config(args, self.knobs, self.world, hidden, self.dtype, lr, mini)

    def load(self, path=None, cls=AutoModelForCausalLM, frozen=False, **kw):
        """A model (default: the policy) built partitioned under ZeRO-3, each rank reading only its
        shard (zero3_load.py; --partitioned_loading False: the full load), else whole; a trained
        one with gradient checkpointing when the knob is on (long_sequence_knobs)."""
        part = self.args.partitioned_loading and self.stage == 3
        ds = frozen_config(self.ds_config, self.knobs.frozen_offload) if frozen else self.ds_config
        path = path or self.model_path
        # each model its own (eager under a soft-cap): a Gemma-2 teacher beside another policy
        attn = attn_implementation_for(path, self.args.attn_implementation)
        kw.update(dtype=self.dtype, attn_implementation=attn)
        model = load_model(cls, path, ds_config=ds if part else None, **kw)
        return self.long_sequence_knobs(model, frozen)

    def long_sequence_knobs(self, model, frozen=False):
        """`model` as the knobs lay out its activations: a trained one with gradient
        checkpointing (its checkpoints in host memory with --activation_offload), every one with
        its MLPs in tiles with --tiled_mlp (tiled_mlp.py). Returns the model."""
        if self.knobs.gradient_checkpointing and not frozen:
            enable_gradient_checkpointing(model, offload=self.knobs.activation_offload)
        if self.knobs.tiled_mlp:
            tile_mlps(model)
        return model

    def lora(self, model, task="CAUSAL_LM"):
        """LoRA adapters (peft) on `model`: only they train."""
        from peft import LoraConfig, get_peft_model  # optional and slow to import: LoRA runs only

        if self.knobs.gradient_checkpointing:  # frozen embeddings: checkpointed layers need a grad
            model.enable_input_require_grads()
        a = self.args
        config = LoraConfig(
            r=a.lora_r,
            lora_alpha=a.lora_alpha,
            task_type=task,
            target_modules=a.lora_target_modules,
        )
        return get_peft_model(model, config)

    def train_engine(self, model, lr):
        """A DeepSpeed training engine over the model's trainable parameters, with linear warmup
        (a client scheduler, so the JSON needs no scheduler section)."""
        ds = self.ds_config if lr == self.args.learning_rate else self.ds(lr)
        steps = self.args.warmup_steps
        engine, *_ = deepspeed.initialize(
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=ds,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
                opt, lambda s: min(1.0, (s + 1) / (steps + 1))
            ),
        )
        return without_lone_allreduce(engine)

    def frozen(self, model):
        """A frozen model (reference, reward): under ZeRO-3 the module of an inference engine,
        sharded like the trained models (its shards in CPU memory with --frozen_offload), else
        resident on the device."""
        if self.stage == 3:
            return frozen_engine(model, self.ds_config, offload=self.knobs.frozen_offload).module
        return model.to(self.device).eval().requires_grad_(False)

    def vllm_engine(self):
        """The vLLM generator of --use_vllm (colocated engines or a server client), else None."""
        if not self.args.use_vllm:
            return None
        max_len = self.args.max_prompt_length + self.args.max_completion_length
        max_len = min(max_len, self.config.max_position_embeddings)
        pad = self.tokenizer.pad_token_id
        return vllm_generator(self.args, self.model_path, self.dtype, max_len, pad)

    # ---- rollout glue ----
    def encode(self, rows):
        """Prompt ids through the chat template, cut to max_prompt_length from the left."""
        return encode_prompts(
            self.tokenizer, rows, self.args.max_prompt_length, self.template_kwargs
        )

    def score(self, rows, completions, num_generations, gens=None):
        """The reward functions' weighted total (B,) and each one's raw rewards {name: (B,)};
        gens (generation.Generations): the completions' token ids, for TRL's form of reward.
        Under sequence parallelism the group's first rank scores and the others receive."""
        out = None
        if self.sp is None or self.sp.rank == 0:
            ids = None
            if gens is not None:  # each completion's ids, as TRL passes them: B lists, no padding
                pairs = zip(gens.completion_ids, gens.completion_mask.bool())
                ids = [row[mask].tolist() for row, mask in pairs]
            args = (self.funcs, self.weights, rows, completions, num_generations)
            out = score_completions(*args, completion_ids=ids)
        return out if self.sp is None else sequence_parallel.from_first(out)

    def generate(self, prompt_ids, num_generations, max_new_tokens=None):
        """G completions of each prompt, prompt-major, from vLLM or the policy (HF generate).
        Under sequence parallelism the group's first rank samples (the others run the
        collectives with nothing to sample) and sends the group its completions: a group
        samples what one rank sampling its prompts would."""
        if self.sp is not None:
            mine = prompt_ids if self.sp.rank == 0 else []
            with sequence_parallel.paused():  # whole sequences
                out = self._generate(mine, num_generations, max_new_tokens)
            # and the first rank's generator: what draws next (an environment's turn, say) alike
            out, rng = sequence_parallel.from_first((out, torch.get_rng_state()))
            torch.set_rng_state(rng)
            return out
        return self._generate(prompt_ids, num_generations, max_new_tokens)

    def _generate(self, prompt_ids, num_generations, max_new_tokens=None):
        a = self.args
        kw = dict(
            num_generations=num_generations,
            max_new_tokens=max_new_tokens or a.max_completion_length,
            **sampling_params(a),
        )
        if self.vllm is not None:
            return self.vllm.generate(prompt_ids, stop_token_ids=self.stop_ids, **kw)
        knobs = self.knobs
        resident = int(knobs.generation_resident_gb * 2**30)
        with unwrap_for_generation(self.policy, knobs.gather_for_generation, resident) as model:
            return generate_hf(
                model,
                prompt_ids,
                batch_size=knobs.generation_batch_size,
                pad_token_id=self.tokenizer.pad_token_id,
                eos_token_id=self.stop_ids,  # eos ids and the chat template's end of turn
                **kw,
            )

    # ---- the steps ----
    def start(
        self, script, engines, vllm=None, eval_sample=None, sync_for_eval=True, figure="reward"
    ):
        """After the models: resume (every engine's state and the step), the run log, the memory
        ledger, the step guard, the knob adapter; the first held-out score. eval_sample(rows) ->
        (total reward (B,), {name: (B,)}) samples one completion per held-out prompt. figure: the
        key of the loop's rows that the progress bar shows."""
        a, ckpt_dir = self.args, os.path.join(self.args.run_dir, "checkpoints")
        self.engines, self.vllm, self.policy = engines, vllm, next(iter(engines.values()))
        self.script = os.path.splitext(os.path.basename(script))[0]
        self.eval_sample, self.sync_for_eval, self.figure = eval_sample, sync_for_eval, figure
        self.ckpt_dir, self.start_step = ckpt_dir, 0
        self.ckpt_config = checkpoint_config(a, self.world, self.eval_rows)
        if a.resume:  # every engine's state (model, optimizer, LR schedule) and the step
            self.start_step = load_checkpoint(engines, ckpt_dir)
            self.say(f"resumed from {latest_checkpoint(ckpt_dir)} at step {self.start_step}")
        self.log = RunLog(
            a.run_dir,
            script,
            vars(a),
            self.rank,
            a.report_to,
            resume_step=self.start_step if a.resume else None,  # drop rows written after it
            extra={  # beside the arguments as given: the memory knobs the run starts with
                "world_size": self.world,
                "ds_config_resolved": self.ds_config,
                "knobs": vars(self.knobs).copy(),
            },
        )  # what ran, metrics.jsonl, wandb
        # peak memory per phase: CUDA allocated (less a sleeping vLLM's pool), or RSS on CPU; the
        # phase running now in a file for run.sh, which names it when the kernel kills this rank
        phase_file = os.path.join(a.run_dir, f"memory_phase.rank{self.rank}")
        sleeping = vllm.sleeping_bytes if vllm is not None else None
        self.ledger = MemoryLedger(self.device, OOM_HINTS, sleeping, phase_file)
        self.guard = StepGuard(a.max_bad_steps)  # non-finite steps: counted, a streak stops
        self.adapter = KnobAdapter(a, self.knobs)  # --memory_budget_gb: between steps
        self.t_start, self.first_eval = time.time(), float("nan")
        # on resume it is in metrics.jsonl already; --max_steps 0: finish() scores the model once
        if self.eval_rows and not a.resume and a.max_steps:
            self.first_eval = self.held_out(self.start_step, f"step {self.start_step}")

    def steps(self):
        """The steps from start (or the resumed one) to max_steps, each with its sampling seed (so
        a resumed run samples what the stopped one would have) and its clock."""
        a = self.args
        self.stop = StopOnSignal()  # SIGTERM / Ctrl-C from here: finish the step, save, exit 5
        bar = tqdm(
            range(self.start_step, a.max_steps),
            disable=self.rank != 0 or not sys.stderr.isatty(),
            desc=self.script,
        )
        for step in bar:
            self.t0, self.step = time.time(), step + 1
            torch.manual_seed(a.seed * 7919 + step * self.data_world + self.data_rank)
            yield step
            bar.set_postfix({self.figure: f"{self.row[self.figure]:.3f}"})
        bar.close()

    def end_step(self, row, *, loss, grad_norm, skipped, line, updated=True):
        """After the update: the step guard, the knob adapter, the row with the step's times and
        memory in metrics.jsonl, the line rank 0 prints; the held-out score when due; a checkpoint
        when due or when a signal asked to stop (then exit 5). Collectives: call it on every rank.
        updated False (a step whose every row was dropped): nothing to guard, no knob moves."""
        a, step = self.args, self.step
        if updated:
            self.guard.update(step, loss, grad_norm, skipped)
        row["skipped_steps"] = self.guard.skipped
        dt, mem_line = time.time() - self.t0, self.ledger.line()
        knob_changes = self.adapter.after_step(self.ledger.step, step, updated=updated)
        row.update(
            tokens_per_s=row.pop("completion_tokens") / dt,
            step_s=dt,
            weight_sync_s=self.vllm.last_sync_seconds if self.vllm is not None else 0.0,
            elapsed_s=time.time() - self.t_start,
            **self.ledger.step_metrics(),  # mem/<phase>: this step's peak GB per phase
        )
        self.log.record(row)
        for change in knob_changes:  # for the next step
            self.log.record(change)
            self.say(
                f"fit: {change['fit/knob']} {change['fit/from']} -> {change['fit/to']}: "
                f"{change['fit/reason']}"
            )
        self.row = row
        if self.rank == 0:
            tqdm.write(f"step {step}/{a.max_steps} {line} {dt:.2f}s | {mem_line}")
        if a.eval_steps and self.eval_rows and step % a.eval_steps == 0 and step < a.max_steps:
            self.held_out(step, f"step {step}")
        saved = None
        # after this step's rows, none twice; the last step's: what --resume True extends
        if a.save_steps and step % a.save_steps == 0 or a.save_last and step == a.max_steps:
            saved = self.save(step)
        if signum := self.stop.requested():  # SIGTERM or Ctrl-C on any rank: keep this step, stop
            saved = saved or self.save(step)
            raise Stopped(self.stop.message(signum, step, saved))  # exit 5 (checkpoint.py)

    def log_completions(self, prompt_ids, gens, rewards, per_func, advantages=None):
        """--log_completions: rank 0's prompts of this step (as the model read them), each
        completion with its total reward, each function's reward and its advantage ((B,), if
        given) in completions.jsonl and wandb's table; --num_completions_to_print of them printed.
        No collective: call it on every rank or on rank 0 alone."""
        if not self.args.log_completions or self.rank != 0:
            return
        prompts = self.tokenizer.batch_decode(prompt_ids)
        texts = self.tokenizer.batch_decode(gens.completion_ids, skip_special_tokens=True)
        rows = self.log.completions(self.step, prompts, texts, rewards, per_func, advantages)
        for r in rows[: self.args.num_completions_to_print]:
            tqdm.write(f"  {r['prompt']!r} -> {r['completion']!r}: reward {r['reward']:.3f}")

    def save(self, step):
        a, adapter = self.args, self.policy if self.args.lora_r else None
        return save_checkpoint(
            self.engines, self.ckpt_dir, step, self.ckpt_config, a.save_total_limit, adapter
        )

    def held_out(self, step, when):
        """Held-out mean reward and accuracy (every reward function >= 1: tasks.solved_mask) over
        --eval_samples k sampled completions per prompt, prompts split over ranks, the same samples
        at every point of a run; k > 1: also eval/pass@1 and eval/pass@k by Chen et al.'s
        estimator."""
        # wakes it after sleep(); asynchronous runs sync after each update, and once before their
        # first score (a server holds what it was started with: another run's weights, say)
        if self.vllm is not None and (self.sync_for_eval or not self.vllm.syncs):
            self.vllm.sync_weights(self.policy)
        mine, k = self.eval_rows[self.data_rank :: self.data_world], self.args.eval_samples
        # fewer prompts than ranks: a rank without one samples the first prompt with weight 0, so
        # it still joins every collective (ZeRO-3 gathers, vLLM's lockstep, the reward model's
        # forwards) and the score is the mean over the real prompts only
        weight, mine = (1, mine) if mine else (0, self.eval_rows[:1])
        torch.manual_seed(self.args.seed + 12345 + self.data_rank)
        reward = acc = pass1 = passk = float("nan")
        if self.eval_rows:
            total, per_func = self.eval_sample(mine)  # (B * k,), {name: (B * k,)}, prompt-major
            solved = (
                solved_mask(per_func)  # every function that scored it gave >= 1
                if per_func
                else torch.zeros(len(mine) * k)  # a reward model's score: no accuracy
            )  # (B * k,)
            right = [int(c) for c in solved.view(-1, k).sum(1)]  # (B,) correct samples per prompt
            passes = [sum(pass_at_k(k, c, j) for c in right) for j in (1, k)]
            mine_sums = [total.sum().item(), solved.sum().item(), len(mine) * k, *passes]
            sums = all_sum([x * weight for x in mine_sums])
            reward, acc = sums[0] / sums[2], sums[1] / sums[2]
            pass1, passk = (x * k / sums[2] for x in sums[3:])  # means over prompts
        row = {"step": step, "eval/reward": reward, "eval/accuracy": acc}
        if k > 1:  # k = 1: pass@1 is the accuracy, and the keys stay those of earlier runs
            row.update({"eval/pass@1": pass1, f"eval/pass@{k}": passk})
        n, more = len(self.eval_rows), f", pass@{k} {passk:.3f}" if k > 1 else ""
        self.say(f"held-out reward at {when}: {reward:.3f} (accuracy {acc:.3f}, {n} prompts{more})")
        self.log.record(row)
        return reward

    def finish(self, panels):
        """After the last step: the held-out score, the memory summary, the final model in final/
        (the policy's full weights; LoRA: its adapter as peft saves it, and with --save_merged the
        merged model in final_merged/), curves.png; then the process group closes. --max_steps 0:
        the held-out score of the model as given, no final model."""
        a = self.args
        if not a.max_steps:  # evaluation only: the model as given, no checkpoint, no final model
            self.held_out(0, f"step 0, {self.model_path} as given (--max_steps 0)")
            self.say(f"--max_steps 0: evaluated in {time.time() - self.t_start:.0f}s; no training")
        elif self.eval_rows:
            last = self.held_out(a.max_steps, "end")
            since = (
                f"resumed at step {self.start_step}" if a.resume else f"start {self.first_eval:.3f}"
            )
            self.say(
                f"held-out reward: {since} -> end {last:.3f} in "
                f"{time.time() - self.t_start:.0f}s ({a.max_steps - self.start_step} steps)"
            )
        if a.max_steps:
            mem = self.ledger.summary()  # rank 0's peaks; the highest phase: where to look first
            self.say(mem["text"])
            self.log.record(
                {
                    "step": a.max_steps,
                    "mem/highest_phase": mem["highest"],
                    **{f"mem/run_peak/{k}": v for k, v in mem["peak_gb"].items()},
                }
            )
        if a.save_model and a.max_steps:
            final = os.path.join(a.run_dir, "final")
            if a.lora_r:  # TRL's layout: PeftModel.from_pretrained(base, final)
                save_adapter(self.policy, self.tokenizer, final)
            if a.save_merged or not a.lora_r:  # a plain model (LoRA: merged) for vLLM, --model
                save_hf(self.policy, self.tokenizer, final + "_merged" if a.lora_r else final)
        self.log.close(panels=panels)
        dist.barrier()
        if self.vllm is None:  # vLLM's exit handler tears down its groups with the default one
            dist.destroy_process_group()

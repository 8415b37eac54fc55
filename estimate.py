"""Memory as predicted: each phase's peak bytes per GPU from a model config, before anything
runs (the pre-flight's verdict, fit.py's knobs, --estimate_memory); memory.py measures them.

    from estimate import estimate_memory
    est = estimate_memory("qwen2.5-7b", world_size=1, zero_stage=3, offload_optimizer=True, ...)
    est["phases"]["update"]                # predicted peak bytes per GPU in the update phase
    python estimate.py --model qwen2.5-7b --zero_stage 3 --offload_optimizer --device_gb 80

Estimated (bytes per GPU; letters: N parameters, W world size, b bytes per model element (2 bf16,
4 fp32), L layers, H hidden, I MLP width, V vocabulary, h/k query/key-value heads of width d,
S tokens per sequence (prompt + completion), C completion tokens, m micro-batch in sequences):
- every phase holds the resident states: parameters N*b (/W under ZeRO-3; 0 with parameter
  offload), gradients N*b (/W under ZeRO-2/3; one reduce bucket H*H*b with optimizer offload),
  Adam states 12N (fp32 master + 2 moments, mixed precision) or 8N (fp32 training) (/W under
  ZeRO-1/2/3; 0 with optimizer offload), a frozen reference model N*b/W, a vLLM share;
- ZeRO-3 gathers up to `zero3_live_params` (DeepSpeed's stage3_max_live_parameters, 1e9) at once;
- activations per token per layer (Llama/Qwen decoder, SDPA/flash attention, no dropout):
  A = 2(4 + b)H [two RMSNorms: fp32 input + normed output] + b(2h + 2k)d [q, k after RoPE, v,
  attention output] + 4h [logsumexp] + 4bI [gate, up, silu(gate), product]. Without
  checkpointing (L + 1) A m S (the +1: one layer's gradients in flight); with checkpointing
  L b H m S (layer inputs) + A m S (one layer recomputed at a time);
- long sequences (docs/long-context.md): sequence parallelism over P ranks (Ulysses) gives each
  rank S / P tokens of every sequence: the activation, attention and log-prob terms take m S / P
  tokens (ZeRO still partitions over all W ranks: DeepSpeed's sequence-data-parallel group);
  activation offload moves the L b H m S / P layer checkpoints to host memory (one layer's
  coming back, one going out: 2 b H m S / P on the device); a tiled MLP holds its 4bI per token
  for one tile of m min(S / P, H) tokens (x2 in backward) in place of every token;
- attention's own memory, by path (attention_path): sdpa builds a (m, 1, S, S) bool mask for a
  padded micro-batch of m > 1 rows and a (1, 1, mS, mS) one for a packed row (none for one
  unpadded sequence per row: SDPA's is_causal); eager builds the mask always (in b), and its scores
  (m, h, S, S) in b, their fp32 softmax and the probabilities ((4 + b) h m S^2 kept per layer for
  backward, 2b + 4 in flight); flex attention a block mask of (S / 128)^2 int32 blocks; flash
  attention none (varlen);
- fused log-probs: a tile (c tokens x v vocab) fp32 and its exp (x2 forward); backward adds the
  (V, H) fp32 weight gradient, an fp32 (mC, H) hidden gradient and the larger of a (v, H) fp32
  weight slice beside the tile and, at its end in bf16, both gradients' bf16 copies (V + mC) H b.
  Naive log-probs: (mC, V) logits in b + fp32 copy + log_softmax (x2 with gradients);
- optimizer step: + the fp32 gradient (mixed precision) of what one step() call holds + torch
  Adam's temporaries of it (adam_step_temporaries): ZeRO-0 every parameter (4N), ZeRO-1/2 the
  flat partition (4N/W), ZeRO-3 its largest sub-group (largest_sub_group: ~sub_group_size, 1e9
  elements); foreach (CUDA) one fp32 temporary of all of it, the for-loop (CPU) two of the tensor
  it steps and the previous one's denominator; fused Adam: none;
- HF generation: KV cache 2 L k d b per token of every sequence in flight, plus (sequences, V)
  fp32 logits x3 (logits, probabilities, top-p sort); vLLM: gpu_memory_utilization x device
  (on CPU, vllm_bytes: its KV cache space, its own copy of the weights and its runtime); its
  weight sync adds its largest layer, which vLLM's in-place reload builds anew outside its share;
  a vLLM server generates on its own devices (the trainer's rollout: the resident states);
- a distillation teacher: its shards, and its forward's working set from its own shape.
The largest phase is the pre-flight verdict; `knobs_to_fit` lists the changes that get under it.
"""

from logprobs import DEFAULT_CHUNK_SIZE, DEFAULT_VOCAB_CHUNK_SIZE
from memory import GB
from shapes import PRESETS, heads_split, model_shape


# ---- The estimate -----------------------------------------------------------------------------
def _layer_bytes_per_token(s, b, tiled_mlp=False):
    """A: bytes per token per layer of a model of shape s (the module docstring's formula); a tiled
    MLP's 4bI are held for one tile only (_mlp_tile_bytes), not per token."""
    H, h, k, d = s["H"], s["h"], s["k"], s["d"]
    return 2 * (4 + b) * H + b * (2 * h + 2 * k) * d + 4 * h + (0 if tiled_mlp else 4 * b * s["I"])


def _mlp_tile_bytes(s, b, micro_batch_size, tokens):
    """A tiled MLP's working set (tiled_mlp.py): its 4bI temporaries for one tile of m x min(tokens,
    H) tokens, twice in backward (the tile's recompute and its gradients)."""
    return 2 * 4 * b * s["I"] * micro_batch_size * min(tokens, s["H"])


ATTENTION_PATHS = {  # what each attention path builds beside q, k, v (attention_path's names)
    "flash": "flash attention (varlen): no mask",
    "flex": "flex attention: a block mask, no (T, T) mask",
    "sdpa_causal": "sdpa, one unpadded sequence per row: no mask (is_causal)",
    "sdpa_mask": "sdpa with a (B, 1, T, T) bool mask",
    "eager": "eager: a (B, 1, T, T) mask and (B, h, T, T) scores",
}


def attention_path(attn_implementation, micro_batch_size, packing):
    """Which of ATTENTION_PATHS a forward takes (transformers 5.19's masking_utils): sdpa skips
    its mask only for rows without padding or packing (one sequence per row after micro_slice cuts
    the padding columns); eager builds it always; flash and flex never build a (T, T) one."""
    if attn_implementation.startswith("flash_attention"):
        return "flash"
    if attn_implementation == "flex_attention":
        return "flex"
    if attn_implementation == "eager":
        return "eager"
    return "sdpa_mask" if packing or micro_batch_size > 1 else "sdpa_causal"


def _attention_bytes(s, b, path, micro_batch_size, tokens, packing, sp=1):
    """(mask bytes of one forward, eager's scores kept per layer, eager's scores in flight) for
    rows of `tokens` tokens (a rank's slice under sequence parallelism: sp ranks share the heads
    of the whole sequence for the scores)."""
    rows, T = (1, micro_batch_size * tokens) if packing else (micro_batch_size, tokens)
    if path == "flex":  # kv_num_blocks/indices and their full_ and q_ twins, (B, 1, T/128, T/128)
        return 4 * 4 * rows * (-(-T // 128)) ** 2, 0, 0
    if path in ("flash", "sdpa_causal"):
        return 0, 0, 0
    mask = rows * T * T  # sdpa's: bool
    if path == "sdpa_mask":
        return mask, 0, 0
    mask *= b  # eager's: additive, in the model's dtype
    scores = rows * s["h"] * (T * sp) ** 2 // sp  # eager: whole rows' scores, h / sp heads a rank
    return mask, (4 + b) * scores, (2 * b + 4) * scores


def _logprob_fwd_bytes(V, completion_tokens, b, fused, logprob_chunk):
    """A no-grad log-prob pass over completion_tokens: fused, one fp32 tile and its exp; naive, the
    (tokens, V) logits in b, an fp32 copy and the log_softmax."""
    tc, tv = logprob_chunk
    if fused:
        return 2 * min(tc, completion_tokens) * min(tv, V) * 4
    return completion_tokens * V * (b + 8)


def param_sizes(s, reward_head=False):
    """The model's parameters' sizes (elements) in the order DeepSpeed steps them (the order of
    model.parameters() for a Llama/Qwen decoder): the embedding; per layer q, k, v (each with its
    bias on Qwen2), o, gate, up, down, the two norms; the final norm; an untied lm_head (a reward
    model: its (H, 1) score head instead)."""
    H, I, q, kv = s["H"], s["I"], s["h"] * s["d"], s["k"] * s["d"]
    attn = [H * q, q, H * kv, kv, H * kv, kv] if s["qkv_bias"] else [H * q, H * kv, H * kv]
    layer = [*attn, q * H, I * H, I * H, H * I, H, H]
    head = [H] if reward_head else ([] if s["tied"] else [s["embed_params"]])
    return [s["embed_params"], *layer * s["L"], H, *head]


def largest_sub_group(sizes, world_size, sub_group_size):
    """ZeRO-3's largest optimizer sub-group, in elements per rank: the parameters' partitions
    (ceil(n / W) each) taken in order until they reach sub_group_size, all of them when they do
    not (DeepSpeed's stage3._create_fp16_sub_groups; sub_group_size from its config, 1e9 by
    default). Each sub-group's fp32 gradient is made, stepped and freed before the next's."""
    parts = [-(-n // world_size) for n in sizes]
    if sub_group_size >= sum(parts):
        return sum(parts)
    largest = run = 0
    for n in parts:
        run += n
        if run >= sub_group_size:
            largest, run = max(largest, run), 0
    return max(largest, run)


def adam_step_temporaries(stepped, foreach):
    """Bytes torch's Adam/AdamW allocates beside its states in one step() over the fp32 tensors
    `stepped` (elements each): foreach (the path torch takes for CUDA tensors when DeepSpeed
    builds it with foreach=None) makes one temporary of every tensor at once (_foreach_sqrt of
    exp_avg_sq, then in place); the for-loop (CPU) makes two of the tensor it steps
    (exp_avg_sq.sqrt() / c) while the previous tensor's denominator is still held."""
    if foreach:
        return 4 * sum(stepped)
    return 4 * max(2 * n + prev for prev, n in zip([0, *stepped], stepped))


def estimate_memory(
    model_config,
    *,
    world_size=1,
    zero_stage=3,
    offload_optimizer=False,
    offload_params=False,
    dtype="bf16",
    gradient_checkpointing=False,
    micro_batch_size=8,
    seq_len=1536,
    completion_len=1024,
    num_generations=8,
    prompts_per_rank=1,
    logprob_chunk=(DEFAULT_CHUNK_SIZE, DEFAULT_VOCAB_CHUNK_SIZE),
    fused_logprobs=True,
    use_vllm=False,
    gpu_memory_utilization=0.3,
    device_gb=80.0,
    vllm_bytes=None,
    vllm_sleep=False,
    gather_for_generation=True,
    generation_batch_size=256,
    reference_model=False,
    ref_offload=False,
    zero3_live_params=1e9,
    fused_adam=False,
    adam_foreach=False,
    sub_group_size=10**9,
    generation_resident_bytes=0,
    critic_config=None,
    reward_config=None,
    teacher_config=None,
    phase_groups=None,
    vllm_server=False,
    packed_bytes=0,
    trainable_params=None,
    reward_head=False,
    sequence_parallel_size=1,
    activation_offload=False,
    tiled_mlp=False,
    attn_implementation="sdpa",
    packing=False,
):
    """Predicted peak bytes per GPU for each phase of the loop, and the pieces they are made of.

    seq_len S: prompt + completion tokens per sequence (padded length); completion_len C;
    micro_batch_size m in sequences; logprob_chunk (tokens, vocab entries) of fused_logps' tile.
    generation_resident_bytes: ZeRO-3 sharded generation's middle mode (layers kept gathered).
    critic_config: a trained critic (its body: the config's model without the lm_head; params,
    grads and Adam states like the policy's); reward_config: a frozen reward model (sharded like
    the reference under ZeRO-3, on CPU with ref_offload = --frozen_offload; resident otherwise).
    teacher_config: GRPO's distillation teacher, its shards held like the reward model's, and its
    own teacher_logprobs phase: its ZeRO-3 gather, layer temporaries and log-prob tile sized from
    its shape, not the policy's.
    phase_groups {phase: (estimate phases...)}: a loop whose ledger names its phases otherwise
    (ppo.py: one "logprobs" phase for old, reference, values and rewards; the optimizer steps
    inside "update") gets each of its phases as the largest of its group.
    vllm_server: a vLLM server (--vllm_mode server) takes the weights (its weight_sync phase: the
    gathered group, and with packed_bytes > 0 the NCCL transfer's packed buffers,
    vllm_transfer.packing) and generates on its own devices (rollout: the resident states).
    trainable_params: the parameters that train (LoRA's adapters, lora_params; default all N):
    gradients, Adam states and their fp32 partitions scale with them, the weights with N.
    reward_head: the trained model is a reward model (rm.py): a score head (H, 1) in place of the
    lm_head and no log-prob tile; a policy's update without generation (phase_groups: its phases).
    sequence_parallel_size P: each rank computes 1/P of every sequence's tokens (the activation,
    attention and log-prob terms); activation_offload: the layer checkpoints in host memory (with
    gradient_checkpointing); tiled_mlp: the MLP in tiles; attn_implementation and packing: the
    attention path (attention_path) and what it builds.
    fused_adam: DeepSpeed's fused Adam (no step temporaries); else torch's, adam_foreach: its
    foreach path (CUDA tensors), not its for-loop (CPU); sub_group_size: ZeRO-3's optimizer
    sub-group (DeepSpeed's zero_optimization.sub_group_size).
    Returns {"phases": {phase: bytes}, "pieces": {piece: bytes}, "cpu": offloaded bytes per rank,
    "highest": phase, "params": N}.
    """
    s = model_shape(model_config)
    if dtype not in ("bf16", "fp16", "fp32"):
        raise ValueError(f"dtype={dtype!r}: bf16, fp16 or fp32")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage}: 0, 1, 2 or 3")
    if offload_params and zero_stage != 3:
        raise ValueError(
            "offload_params needs zero_stage 3 (DeepSpeed offloads parameters only under ZeRO-3)"
        )
    if offload_optimizer and zero_stage < 1:
        raise ValueError("offload_optimizer needs zero_stage >= 1")
    N, V, H, L, I, W = s["N"], s["V"], s["H"], s["L"], s["I"], world_size
    if reward_head:  # a sequence classifier: the body and an (H, 1) score head
        N = N - (0 if s["tied"] else s["embed_params"]) + H
    T = N if trainable_params is None else trainable_params  # trained: gradients, Adam states
    b = 4 if dtype == "fp32" else 2
    mixed = b == 2
    p, tc, tv = {}, logprob_chunk[0], logprob_chunk[1]
    # resident states, every phase
    p["params"] = 0 if offload_params else N * b // (W if zero_stage == 3 else 1)
    bucket = H * H * b  # reduce_bucket_size "auto" = H^2 elements (zero3_utils.load_ds_config)
    p["grads"] = bucket if offload_optimizer else T * b // (W if zero_stage >= 2 else 1)
    opt = (12 if mixed else 8) * T // (W if zero_stage >= 1 else 1)
    p["optimizer"] = 0 if offload_optimizer else opt
    # frozen models: sharded under ZeRO-3, resident otherwise (harness.Run.frozen)
    frozen_n = N if reference_model and not ref_offload else 0
    p["reference"] = frozen_n * b // (W if zero_stage == 3 else 1)
    critic_n = 0
    if critic_config is not None:  # the body without the lm_head, plus a (H, 1) value head
        c = model_shape(critic_config)
        critic_n = c["N"] - (0 if c["tied"] else c["embed_params"]) + c["H"]
    p["critic"] = (
        critic_n * b // (W if zero_stage == 3 else 1)
        + critic_n * b // (W if zero_stage >= 2 else 1)
        + (0 if offload_optimizer else (12 if mixed else 8) * critic_n // (W if zero_stage else 1))
    )
    reward_n = model_shape(reward_config)["N"] if reward_config is not None else 0
    p["reward_model"] = 0 if ref_offload else reward_n * b // (W if zero_stage == 3 else 1)
    t = model_shape(teacher_config) if teacher_config is not None else None
    teacher_n = t["N"] if t else 0
    p["teacher"] = 0 if ref_offload else teacher_n * b // (W if zero_stage == 3 else 1)
    # vllm_bytes: what the engine holds when it is not a share of a GPU (CPU: fit.py says)
    vllm_share = int(gpu_memory_utilization * device_gb * GB) if vllm_bytes is None else vllm_bytes
    vllm_share = vllm_share if use_vllm else 0
    # working sets
    largest = max(s["layer_params"], s["embed_params"])
    p["zero3_live"] = int(min(N, max(zero3_live_params, largest)) * b) if zero_stage == 3 else 0
    A, P = _layer_bytes_per_token(s, b, tiled_mlp), sequence_parallel_size
    # a rank's tokens: its 1/P slice of every sequence under sequence parallelism
    tok, ctok = micro_batch_size * -(-seq_len // P), micro_batch_size * -(-completion_len // P)
    tile = _mlp_tile_bytes(s, b, micro_batch_size, -(-seq_len // P)) if tiled_mlp else 0
    path = attention_path(attn_implementation, micro_batch_size, packing)
    mask, kept, scores = _attention_bytes(
        s, b, path, micro_batch_size, -(-seq_len // P), packing, P
    )
    p["attention_mask"], p["attention_scores"] = mask, scores
    p["mlp_tile"] = tile
    p["activations_full"] = (L + 1) * A * tok + L * kept + scores + tile
    p["layer_checkpoints"] = L * b * H * tok  # each layer's inputs, kept until its recompute
    offload = activation_offload and gradient_checkpointing
    on_device = 2 * b * H * tok if offload else p["layer_checkpoints"]  # one in, one out
    p["activations_ckpt"] = on_device + A * tok + kept + scores + tile
    p["activations"] = p["activations_ckpt"] if gradient_checkpointing else p["activations_full"]
    # no-grad forward: about one layer's temporaries at a time
    p["inference_layer"] = A * tok + scores + tile
    p["logprob_fwd"] = _logprob_fwd_bytes(V, ctok, b, fused_logprobs, logprob_chunk)
    if reward_head:  # one score per sequence, no vocabulary's logits
        p["logprob_fwd"] = p["logprob_update"] = 0
    elif fused_logprobs:
        # the fp32 gradients of the weight and the hidden states, and either a tile with its
        # weight slice (the loop) or, at its end, their copies in the model's dtype (bf16:
        # .to(bf16) beside the fp32 accumulators; fp32: no copy)
        tile = p["logprob_fwd"] + 4 * min(tv, V) * H
        cast = 2 * (V + ctok) * H if mixed else 0
        p["logprob_update"] = 4 * V * H + 4 * ctok * H + max(tile, cast)
    else:
        p["logprob_update"] = 2 * p["logprob_fwd"]
    seqs = min(generation_batch_size, prompts_per_rank * num_generations)
    p["kv_cache"] = 2 * L * s["k"] * s["d"] * b * seqs * seq_len
    p["generation_logits"] = 3 * seqs * V * 4
    held = max(p["zero3_live"], min(N * b, generation_resident_bytes))  # middle mode: resident
    p["generation_params"] = (N * b if gather_for_generation else held) if zero_stage == 3 else 0
    # the optimizer step: each step() call's fp32 tensors, and its fp32 gradient beside them.
    # ZeRO-0 steps every parameter in one call (mixed precision: FP16_UnfusedOptimizer's fp32
    # copies, each with its fp32 gradient); ZeRO-1/2 the flat partition of the group; ZeRO-3 one
    # sub-group at a time (largest_sub_group), its fp32 gradient made and freed around its step
    sizes = param_sizes(s, reward_head) if trainable_params is None else [T]
    if zero_stage == 0:
        stepped = sizes
    elif zero_stage < 3:
        stepped = [T // W]
    else:
        stepped = [min(T // W, largest_sub_group(sizes, W, sub_group_size))]
    p["fp32_grad_partition"] = 0 if (offload_optimizer or not mixed) else 4 * sum(stepped)
    # torch Adam ("torch_adam": true in configs/): adam_step_temporaries; fused Adam: none
    p["adam_temporaries"] = (
        0 if offload_optimizer or fused_adam else adam_step_temporaries(stepped, adam_foreach)
    )
    p["vllm"] = vllm_share
    resident = (
        p["params"] + p["grads"] + p["optimizer"] + p["reference"] + p["critic"] + p["reward_model"]
    ) + p["teacher"]
    # the level-2 sleep (generation.VLLMGenerator.sleep) frees vLLM's weights, KV cache and, with
    # sleep_mode_offload_cudagraph, its CUDA graphs; left out: the model runner's input buffers
    # (max_num_seqs and max_num_batched_tokens wide), kept resident (docs/gpu.md)
    v_train = 0 if vllm_sleep else vllm_share
    phases = {}
    # the weight sync gathers one group of at most max(2**26 elements, the largest parameter) at a
    # time (zero3_utils.iter_full_params); a server's packed NCCL transfer holds ~3 of its buffers
    # more on rank 0 (vllm_transfer.packing; unpacked, 0, by default)
    group = max(2**26, largest) * b
    if vllm_server:  # its devices are its own: nothing of vLLM on the trainer's
        p["transfer_buffers"] = 3 * packed_bytes
        phases["weight_sync"] = resident + p["zero3_live"] + group + p["transfer_buffers"]
    if use_vllm:
        # vLLM's in-place reload builds each of its layers anew outside its own share, one at a
        # time, then copies it into the live weights (vllm/model_executor/model_loader/reload/
        # layerwise.py, _layerwise_process: materialize_layer; Worker.reload_weights runs outside
        # its memory pool): the largest layer, vLLM fusing q/k/v and gate/up (tensor parallel
        # splits it: not counted)
        qkv = (s["h"] + 2 * s["k"]) * s["d"] * (H + 1)
        p["vllm_reload_layer"] = max(s["embed_params"], 2 * I * H, qkv) * b
        phases["rollout"] = resident + vllm_share
        phases["weight_sync"] = (
            resident + vllm_share + p["zero3_live"] + group + p["vllm_reload_layer"]
        )
    elif vllm_server:  # it generates on its own devices: the trainer waits on HTTP
        phases["rollout"] = resident
    else:
        prefill = A * seqs * (seq_len - completion_len)
        phases["rollout"] = (
            resident + p["generation_params"] + p["kv_cache"] + p["generation_logits"] + prefill
        )
    logps = resident + v_train + p["zero3_live"] + mask + p["inference_layer"] + p["logprob_fwd"]
    phases["old_logprobs"] = logps
    if reference_model:
        phases["ref_logprobs"] = logps  # its own ZeRO-3 working set instead of the policy's
    if t:  # the teacher's forward: its own gather, layer temporaries and log-prob tile
        t_largest = max(t["layer_params"], t["embed_params"])
        p["teacher_live"] = (
            int(min(teacher_n, max(zero3_live_params, t_largest)) * b) if zero_stage == 3 else 0
        )
        t_tile = _mlp_tile_bytes(t, b, micro_batch_size, -(-seq_len // P)) if tiled_mlp else 0
        t_att = _attention_bytes(t, b, path, micro_batch_size, -(-seq_len // P), packing, P)
        p["teacher_layer"] = (
            _layer_bytes_per_token(t, b, tiled_mlp) * tok + t_att[0] + t_att[2] + t_tile
        )
        p["teacher_logprob_fwd"] = _logprob_fwd_bytes(t["V"], ctok, b, fused_logprobs, (tc, tv))
        phases["teacher_logprobs"] = (
            resident + v_train + p["teacher_live"] + p["teacher_layer"] + p["teacher_logprob_fwd"]
        )
    phases["update"] = (
        resident
        + v_train
        + p["zero3_live"]
        + mask
        + p["activations"]
        + p["logprob_update"]
        + (bucket if zero_stage >= 2 else 0)
    )
    phases["optimizer_step"] = resident + v_train + p["fp32_grad_partition"] + p["adam_temporaries"]
    if phase_groups:  # the loop's ledger's phases (those of the estimate it has)
        phases = {
            name: max(phases[g] for g in group if g in phases)
            for name, group in phase_groups.items()
            if any(g in phases for g in group)
        }
    # states + fp32 grads
    cpu = (opt if offload_optimizer else 0) + (4 * T // W if offload_optimizer else 0)
    cpu += N * b // W if offload_params else 0
    cpu += N * b // W if reference_model and ref_offload else 0
    cpu += (reward_n + teacher_n) * b // W if ref_offload else 0
    cpu += p["layer_checkpoints"] if offload else 0  # the update's, while it runs
    return {
        "phases": phases,
        "pieces": p,
        "cpu": cpu,
        "highest": max(phases, key=phases.get),
        "params": N,
    }


# ---- Which knob brings it under the device ----------------------------------------------------
def _knob_changes(kw):
    """Single changes to try, each one step leaner than kw (all of estimate_memory's kwargs):
    (label, kwargs)."""
    out, z = [], kw["zero_stage"]

    def add(cond, label, **change):
        if cond:
            out.append((label, dict(kw, **change)))

    add(z < 3, "zero_stage 3", zero_stage=3)
    add(z >= 1 and not kw["offload_optimizer"], "offload_optimizer", offload_optimizer=True)
    add(z == 3 and not kw["offload_params"], "offload_params", offload_params=True)
    add(not kw["gradient_checkpointing"], "gradient_checkpointing", gradient_checkpointing=True)
    ckpt = kw["gradient_checkpointing"]
    add(ckpt and not kw["activation_offload"], "activation_offload", activation_offload=True)
    add(not kw["tiled_mlp"], "tiled_mlp", tiled_mlp=True)
    P, W = 2 * kw["sequence_parallel_size"], kw["world_size"]
    heads = heads_split(kw["model_config"], P) is None  # Ulysses splits the heads
    add(W % P == 0 and heads, f"sequence_parallel_size {P}", sequence_parallel_size=P)
    m, (tc, tv) = kw["micro_batch_size"], kw["logprob_chunk"]
    add(m > 1, f"micro_batch_size {m // 2}", micro_batch_size=m // 2)
    add(not kw["fused_logprobs"], "fused_logprobs", fused_logprobs=True)
    add(
        kw["fused_logprobs"] and tc > 256,
        f"logprob_chunk {tc // 2},{tv}",
        logprob_chunk=(tc // 2, tv),
    )
    util, weights = (
        kw["gpu_memory_utilization"],
        model_shape(kw["model_config"])["N"] * (4 if kw["dtype"] == "fp32" else 2),
    )
    add(kw["use_vllm"] and not kw["vllm_sleep"], "vllm_sleep", vllm_sleep=True)
    add(
        kw["use_vllm"]
        and (util - 0.1) * kw["device_gb"] * GB > 1.2 * weights,  # vLLM still holds its weights
        f"gpu_memory_utilization {util - 0.1:.1f}",
        gpu_memory_utilization=round(util - 0.1, 2),
    )
    add(
        not kw["use_vllm"] and not kw["vllm_server"] and z == 3 and kw["gather_for_generation"],
        "gather_for_generation False",
        gather_for_generation=False,
    )
    frozen = kw["reference_model"] or kw["reward_config"] or kw["teacher_config"]
    add(frozen and not kw["ref_offload"], "ref_offload", ref_offload=True)
    return out


def _defaults():
    """estimate_memory's keyword arguments as it defaults them."""
    import inspect

    params = inspect.signature(estimate_memory).parameters.items()
    return {k: v.default for k, v in params if k != "model_config"}


def knobs_to_fit(model_config, device_gb, **kw):
    """Greedy: apply the single change that lowers the highest phase most, until it fits in
    device_gb (or nothing helps). Returns [(change, highest GiB after it)], each change as this
    file's CLI flag ("--offload_optimizer True", "--micro_batch_size 4")."""
    kw = {**_defaults(), **kw, "device_gb": device_gb, "model_config": model_config}
    top, steps = max(estimate_memory(**kw)["phases"].values()), []
    while top > device_gb * GB:
        tried = [
            (max(estimate_memory(**k)["phases"].values()), label, k)
            for label, k in _knob_changes(kw)
        ]
        best = min(tried, key=lambda t: t[0], default=None)
        if best is None or best[0] >= top:
            break
        top, label, kw = best
        steps.append((f"--{label}" + ("" if " " in label else " True"), top / GB))
    return steps


def format_table(est, device_gb=None, per="GPU"):
    """The phases and pieces in GiB (2**30 bytes, the unit of --device_gb and the loops' --gpu_gb
    and --memory_budget_gb) per GPU (per="rank": a CPU rank's process), and the highest phase
    against device_gb when given."""
    rows = [f"{'phase':<16}{'GiB/' + per:>10}"] + [
        f"{k:<16}{v / GB:>10.2f}" for k, v in est["phases"].items()
    ]
    rows += ["", f"{'piece':<20}{'GiB':>10}"] + [
        f"{k:<20}{v / GB:>10.2f}" for k, v in est["pieces"].items() if v
    ]
    top = est["phases"][est["highest"]]
    verdict = ""
    if device_gb:
        verdict = f" ({'fits' if top <= device_gb * GB else 'OVER'} {device_gb:g} GiB per {per})"
    rows.append(
        f"parameters {est['params'] / 1e9:.3f} B; offloaded to CPU per rank {est['cpu'] / GB:.1f} "
        f"GiB; highest phase: {est['highest']}{verdict}"
    )
    return "\n".join(rows)


# ---- CLI --------------------------------------------------------------------------------------
def main(argv=None):
    from dataclasses import dataclass, field

    from transformers import HfArgumentParser

    @dataclass
    class Args:
        model: str = field(
            metadata={"help": f"config.json, its directory, or a preset: {', '.join(PRESETS)}"}
        )
        device_gb: float = field(
            default=80.0, metadata={"help": "memory per GPU; over it, the knobs that fit"}
        )
        world_size: int = field(default=1, metadata={"help": "data-parallel ranks (GPUs)"})
        zero_stage: int = field(default=3, metadata={"help": "DeepSpeed ZeRO stage 0-3"})
        offload_optimizer: bool = field(
            default=False, metadata={"help": "Adam states (and fp32 grads) on CPU"}
        )
        offload_params: bool = field(
            default=False, metadata={"help": "ZeRO-3 parameter partitions on CPU"}
        )
        dtype: str = field(
            default="bf16", metadata={"help": "bf16 (mixed precision, fp32 master) or fp32"}
        )
        gradient_checkpointing: bool = field(
            default=False, metadata={"help": "recompute layers in backward"}
        )
        micro_batch_size: int = field(
            default=8, metadata={"help": "sequences per forward/backward"}
        )
        seq_len: int = field(
            default=1536, metadata={"help": "prompt + completion tokens per sequence"}
        )
        completion_len: int = field(
            default=1024, metadata={"help": "completion tokens (log-prob positions)"}
        )
        num_generations: int = field(default=8, metadata={"help": "completions per prompt"})
        prompts_per_rank: int = field(default=1, metadata={"help": "prompts per rank per step"})
        logprob_chunk: str = field(
            default=f"{DEFAULT_CHUNK_SIZE},{DEFAULT_VOCAB_CHUNK_SIZE}",
            metadata={"help": "fused log-prob tile: tokens,vocab"},
        )
        fused_logprobs: bool = field(
            default=True, metadata={"help": "False: naive (m, C, V) logits"}
        )
        use_vllm: bool = field(default=False, metadata={"help": "colocated vLLM generates"})
        gpu_memory_utilization: float = field(
            default=0.3, metadata={"help": "vLLM's share of the GPU"}
        )
        vllm_sleep: bool = field(
            default=False, metadata={"help": "vLLM sleeps (level 1) outside the rollout"}
        )
        gather_for_generation: bool = field(
            default=True, metadata={"help": "ZeRO-3: gather the model to generate"}
        )
        generation_batch_size: int = field(
            default=256, metadata={"help": "HF generate: sequences per call"}
        )
        reference_model: bool = field(
            default=False, metadata={"help": "a frozen reference (beta > 0)"}
        )
        ref_offload: bool = field(default=False, metadata={"help": "reference shards on CPU"})
        fused_adam: bool = field(
            default=False, metadata={"help": "fused Adam: no step temporaries"}
        )
        sequence_parallel_size: int = field(
            default=1, metadata={"help": "ranks sharing every sequence (Ulysses)"}
        )
        activation_offload: bool = field(
            default=False, metadata={"help": "layer checkpoints in host memory"}
        )
        tiled_mlp: bool = field(default=False, metadata={"help": "the MLP in sequence tiles"})
        attn_implementation: str = field(
            default="sdpa", metadata={"help": "sdpa, eager, flex_attention, flash_attention_2"}
        )
        packing: bool = field(default=False, metadata={"help": "micro-batches as one row"})

    (a,) = HfArgumentParser(Args).parse_args_into_dataclasses(argv)
    kw = {k: v for k, v in vars(a).items() if k not in ("model", "device_gb")}
    kw["logprob_chunk"] = tuple(int(x) for x in a.logprob_chunk.split(","))
    print_estimate(a.model, a.device_gb, **kw)


def describe(kw):
    """What an estimate assumes, in words: {part: text} in the order a line prints them (kw:
    estimate_memory's keyword arguments; those left out at its defaults)."""
    kw = {**_defaults(), **kw}
    z, W = kw["zero_stage"], kw["world_size"]
    offloaded = [n for n in ("optimizer", "params") if kw[f"offload_{n}"]]
    prompt = kw["seq_len"] - kw["completion_len"]
    if kw["vllm_server"]:
        gen = "a vLLM server on GPUs of its own"
    elif kw["use_vllm"] and kw["vllm_bytes"] is not None:  # on CPU: what the engine holds
        gen = f"colocated vLLM, {kw['vllm_bytes'] / GB:.1f} GiB"
    elif kw["use_vllm"]:
        gen = f"colocated vLLM, {kw['gpu_memory_utilization']:g} of the GPU"
        gen += ", asleep outside the rollout" if kw["vllm_sleep"] else ""
    else:
        seqs = min(kw["generation_batch_size"], kw["prompts_per_rank"] * kw["num_generations"])
        resident = kw["generation_resident_bytes"] / GB
        mode = (
            "the model gathered"
            if kw["gather_for_generation"] or z != 3
            else f"{resident:g} GiB kept gathered"
            if resident
            else "layer by layer"
        )
        gen = f"HF generate, {seqs} sequences per call, {mode}"
    frozen = [
        name
        for name, on in (
            ("reference", kw["reference_model"]),
            ("critic", kw["critic_config"] is not None),
            ("reward model", kw["reward_config"] is not None),
            ("teacher", kw.get("teacher_config") is not None),
        )
        if on
    ]
    out = {
        "gpus": f"{W} GPU{'s' if W > 1 else ''}",
        "gpu_gb": f"{kw['device_gb']:g} GiB per GPU",
        "dtype": "bf16 (fp32 master weights)" if kw["dtype"] != "fp32" else "fp32",
        "zero": f"ZeRO-{z}" + (f" ({' and '.join(offloaded)} on the host)" if offloaded else ""),
        "tokens": f"prompt {prompt} + completion {kw['completion_len']} tokens",
        "batch": f"{kw['prompts_per_rank']} prompt{'s' if kw['prompts_per_rank'] > 1 else ''} x "
        f"{kw['num_generations']} completions per rank",
        "micro_batch": f"micro-batch {kw['micro_batch_size']}",
        "checkpointing": "gradient checkpointing"
        if kw["gradient_checkpointing"]
        else "no gradient checkpointing",
        "generation": f"generation: {gen}",
        "attention": "attention: "
        + ATTENTION_PATHS[
            attention_path(kw["attn_implementation"], kw["micro_batch_size"], kw["packing"])
        ]
        + (" (packed rows)" if kw["packing"] else ""),
    }
    long = [
        f"sequence parallel over {kw['sequence_parallel_size']} ranks"
        if kw["sequence_parallel_size"] > 1
        else "",
        "layer checkpoints in host memory"
        if kw["activation_offload"] and kw["gradient_checkpointing"]
        else "",
        "tiled MLP" if kw["tiled_mlp"] else "",
    ]
    if any(long):
        out["long"] = ", ".join(x for x in long if x)
    if kw["reward_head"]:  # rm.py: pairs, no generation
        out["batch"] = f"{kw['prompts_per_rank']} pairs per rank (a reward model's update)"
        out["tokens"] = f"prompt {prompt} + response {kw['completion_len']} tokens"
        out["generation"] = "no generation"
    if kw["trainable_params"] is not None:
        out["lora"] = f"{kw['trainable_params'] / 1e6:.1f} M trained parameters (LoRA)"
    if frozen:
        out["models"] = "beside the policy: " + ", ".join(frozen)
    return out


def print_estimate(model_config, device_gb, **kw):
    """What it assumes (one line), the per-phase table and, when over device_gb, the flags that
    bring it under."""
    est = estimate_memory(model_config, device_gb=device_gb, **kw)
    print("assumes: " + ", ".join(describe({**kw, "device_gb": device_gb}).values()))
    print(format_table(est, device_gb))
    if est["phases"][est["highest"]] > device_gb * GB:
        steps = knobs_to_fit(model_config, device_gb, **kw)
        fits = steps and steps[-1][1] <= device_gb
        print(
            (f"to fit in {device_gb:g} GiB per GPU, add: " if fits else "still over after: ")
            + (" ".join(flag for flag, _ in steps) or "no flag of this estimate helps")
            + (
                " (highest phase after each: " + ", ".join(f"{gb:.1f}" for _, gb in steps) + " GiB)"
                if steps
                else ""
            )
        )
    return est


if __name__ == "__main__":
    main()

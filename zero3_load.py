"""Models built already partitioned under ZeRO-3: each rank reads only its own shard of the
checkpoint, so no rank ever holds the whole model in host memory. Imports no sibling file.

    load_model(auto_class, path, dtype, ds_config=None, attn_implementation="sdpa", **config_kw)
    enable_gradient_checkpointing(model, offload=False)   # in the eval mode load_model returns

ds_config with ZeRO stage 3: the model is built under `deepspeed.zero.Init` (every parameter is
partitioned as soon as its module is built; weight init is skipped, the checkpoint overwrites
it), then each rank copies its own flat slice of every parameter out of the checkpoint's
safetensors files, a bounded chunk at a time. Any other ds_config (or None): plain
`from_pretrained`, every rank holding the full model, as before. Hand the result to
deepspeed.initialize (zero3_utils.frozen_engine for frozen models) with the same ds_config;
modules added afterwards (LoRA adapters, a value head) are partitioned by deepspeed.initialize.

Why not transformers' DeepSpeed integration (an HfDeepSpeedConfig alive before from_pretrained):
transformers 5.19 builds the model under zero.Init too, but then maps every checkpoint file into
one state dict on every rank and copies it in module by module under GatheredParameters (rank 0
reads and writes, all ranks re-partition): rank 0 touches the whole checkpoint and every rank
holds each gathered module on top of its shards. bench/partitioned_load.py measured its loading
peak at 1.62 x the model's bytes on rank 0 and 0.72 x on rank 1 (2 ranks; the full load: 1.52 x
on each; this file: 0.54 x on each). Why not zero.Init + GatheredParameters per parameter: the
same gathers (a 150k-token embedding is a quarter of Qwen2.5-0.5B) and rank 0's second copy
read from disk. Reading each rank's own slice needs no gather and no broadcast, at the price of
knowing DeepSpeed's partition layout (the `_ds_` functions, written for deepspeed 0.19.8).

The file's pages are counted in a process's resident memory while it is mapped, so each chunk
is read through its own short-lived `safe_open` (the mapping is dropped after every chunk).
Only safetensors checkpoints (a single file or an index of shards) load this way; every
parameter of the model must be in the checkpoint (under its own name, the base model's name or
without the base-model prefix); anything else is a ValueError saying so.
"""

import json
import math
import os
from contextlib import contextmanager

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.zero.partition_parameters import Init
from safetensors import safe_open
from transformers import AutoConfig, GenerationConfig
from transformers import initialization as hf_init

_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}  # DeepSpeed section: dtype
CHUNK_NUMEL = 2**22  # elements read per chunk: 16 MB of fp32 beside the shards


def is_stage3(ds_config):
    """True if the DeepSpeed config (a dict) partitions parameters (ZeRO stage 3)."""
    return bool(ds_config) and ds_config.get("zero_optimization", {}).get("stage", 0) == 3


def load_model(auto_class, path, dtype, ds_config=None, attn_implementation="sdpa", **config_kw):
    """`auto_class.from_pretrained(path, ...)`, built partitioned when ds_config is ZeRO-3.

    config_kw go to the model config (as `num_labels=1` to from_pretrained). Under ZeRO-3 every
    rank must call it (a collective, like zero.Init), in the same order. The model comes back in
    eval mode with its generation config, as from_pretrained returns it.
    """
    kw = dict(dtype=dtype, attn_implementation=attn_implementation)
    if not is_stage3(ds_config):
        return auto_class.from_pretrained(path, **kw, **config_kw)
    local = local_dir(path)
    files = checkpoint_files(local)
    config = AutoConfig.from_pretrained(local, **config_kw)
    # no_init_weights: a random init of every layer would only be overwritten (and under zero.Init
    # it would run on empty placeholders)
    # zero.Init's own `dtype` argument is ignored on a device without fp16 (deepspeed 0.19.8
    # _set_dtype picks bf16 on CPU), so the dtype goes in through the config's precision sections
    cfg = {
        **ds_config,
        **{k: {**ds_config.get(k, {}), "enabled": dtype == t} for k, t in _PRECISION.items()},
    }
    # tensor_overrides without `dtype`: zero.Init would otherwise turn every floating tensor that
    # a module's __init__ makes into the training dtype, buffers included: transformers computes
    # RoPE's inv_freq with torch.arange(..., dtype=torch.float), which came out bf16 (0.5 %
    # off, a rotary angle 0.5 rad off at position 512), where from_pretrained keeps it fp32.
    # from_config(dtype=...) already builds the parameters in the model's dtype, as
    # from_pretrained does; the device override stays (each module is built on this rank's device)
    on_device = deepspeed.zero.DeepSpeedTensorOverride.device
    init = deepspeed.zero.Init(config_dict_or_path=cfg, tensor_overrides=[on_device])
    with hf_init.no_init_weights(), _ds_no_init_broadcast(), init:
        model = auto_class.from_config(config, **kw)
    model.tie_weights()  # as from_pretrained does: a tied lm_head has no weights of its own
    load_partitions(model, files)
    if model.can_generate() and os.path.isfile(os.path.join(local, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(local)
    return model.eval()


def local_dir(path):
    """The directory of a model: `path` itself, or a hub id's snapshot in the local cache."""
    if os.path.isdir(path):
        return path
    from huggingface_hub import snapshot_download

    return snapshot_download(path, local_files_only=True)


def checkpoint_files(path):
    """{tensor name: safetensors file} of the checkpoint in directory `path`."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise ValueError(
        f"{path} has no safetensors weights (model.safetensors or model.safetensors.index.json); "
        "ZeRO-3 partitioned loading reads only safetensors: convert the checkpoint "
        "(save_pretrained writes safetensors) or pass --partitioned_loading False"
    )


def read_flat(file, name, start, end):
    """Elements [start, end) of tensor `name` flattened, reading only the rows that hold them."""
    with safe_open(file, framework="pt") as f:  # mapped for this read only
        sl = f.get_slice(name)
        shape = sl.get_shape()
        if not shape:  # a 0-d tensor
            return f.get_tensor(name).reshape(1)[start:end]
        row = math.prod(shape[1:])  # elements per index of dim 0
        r0, r1 = start // row, -(-end // row)
        return sl[r0:r1].reshape(-1)[start - r0 * row : end - r0 * row].clone()


@contextmanager
def _ds_no_init_broadcast():
    # deepspeed 0.19.8: Init._zero_init_param broadcasts every new parameter from rank 0 before
    # partitioning it, so that random inits agree. Here every value comes from the checkpoint
    # afterwards (load_partitions refuses a parameter it cannot fill), and the broadcast would
    # write each full parameter on the other ranks: the last one built (lm_head, as large as the
    # embedding) on top of every shard, 0.6 x the model's bytes on 2 ranks. Partition only.
    original = Init._zero_init_param

    def partition_only(self, param):
        self._convert_to_deepspeed_param(param)
        param.partition()

    Init._zero_init_param = partition_only
    try:
        yield
    finally:
        Init._zero_init_param = original


def _ds_fill_partition(param, read):
    # deepspeed 0.19.8 (Init._partition_param): rank r of param.ds_process_group holds the flat
    # elements [r * n, (r + 1) * n) of the parameter in param.ds_tensor, n = ds_tensor.ds_numel
    # (the same for every rank; the last rank's tail past ds_numel is padding).
    part = param.ds_tensor
    if getattr(part, "final_location", None) is not None or hasattr(part, "ds_quant_scale"):
        raise ValueError(
            "ZeRO-3 partitioned loading supports partitions in device or CPU memory, not NVMe "
            "offload or quantized frozen weights: pass --partitioned_loading False"
        )
    n = part.ds_numel
    start = n * dist.get_rank(group=param.ds_process_group)
    end = min(start + n, param.ds_numel)
    for a in range(start, end, CHUNK_NUMEL):
        b = min(a + CHUNK_NUMEL, end)
        part[a - start : b - start].copy_(read(a, b))


def _candidates(name, prefix):
    """Checkpoint names a model parameter may be stored under: its own, with the base-model prefix
    (a bare body loaded from a causal LM's checkpoint), without it."""
    return (name, f"{prefix}.{name}", name.removeprefix(f"{prefix}."))


@torch.no_grad()
def load_partitions(model, files):
    """Copy each rank's own slice of every ZeRO-3 parameter (and every buffer the checkpoint
    holds, whole) of `model` from the checkpoint `files` ({name: safetensors file})."""
    prefix = getattr(model, "base_model_prefix", "")
    aliases = {}  # a parameter -> all its names (tied embeddings have two)
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(p, []).append(name)
    missing = []
    for p, names in aliases.items():
        key = next((k for n in names for k in _candidates(n, prefix) if k in files), None)
        if key is None:
            missing.append(names[0])
        elif not hasattr(p, "ds_id"):
            raise ValueError(f"{names[0]} was not partitioned by zero.Init")
        else:
            _ds_fill_partition(p, lambda a, b, k=key: read_flat(files[k], k, a, b))
    for name, buf in model.named_buffers():
        key = next((k for k in _candidates(name, prefix) if k in files), None)
        if key is not None:
            buf.copy_(read_flat(files[key], key, 0, buf.numel()).view(buf.shape))
    if missing:
        raise ValueError(
            f"the checkpoint has no weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}"
            f" ({len(missing)} parameters); ZeRO-3 partitioned loading needs every parameter in "
            "the checkpoint: pass --partitioned_loading False to let transformers initialise them"
        )


def enable_gradient_checkpointing(model, offload=False):
    """Gradient checkpointing that works in eval mode. The loops train in eval mode, as load_model
    returns a model (no dropout: the update scores tokens exactly as the rollout did), but
    transformers checkpoints a layer only while that layer's `training` flag is set, so with
    gradient_checkpointing_enable() alone nothing is recomputed and every activation is kept.
    Here only the modules that checkpoint (the decoder layers, their stack) are flagged as
    training; their submodules (dropout, attention) stay in eval mode.

    offload (--activation_offload): each checkpoint (a layer's inputs, saved until its recompute
    in backward) goes to host memory (torch.autograd.graph.save_on_cpu around the checkpointed
    call), into pinned memory on a GPU, and comes back for the recompute: the same values, a copy
    each way. transformers' own gradient_checkpointing_enable(offload=True) does the same on an
    accelerator but asks for pinned memory on a CPU-only machine too, which torch 2.13 refuses;
    on a CPU the checkpoints already live in host memory and the hook keeps them as they are."""
    model.gradient_checkpointing_enable()
    for m in model.modules():
        if getattr(m, "gradient_checkpointing", False):
            m.training = True
            if offload and hasattr(m, "_gradient_checkpointing_func"):  # the decoder layers
                m._gradient_checkpointing_func = _on_host(m._gradient_checkpointing_func)


def _on_host(checkpoint):
    # save_on_cpu around the checkpoint: its hook packs what the checkpoint saves itself (the
    # layer's inputs); inside, the checkpoint's own hook drops the layer's activations as before
    pin = torch.cuda.is_available()

    def offloaded(function, *args, **kwargs):
        with torch.autograd.graph.save_on_cpu(pin_memory=pin):
            return checkpoint(function, *args, **kwargs)

    return offloaded

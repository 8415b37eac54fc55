"""DeepSpeed ZeRO-3 plumbing: gather, fetch hooks, streaming full weights, consolidated saves,
frozen-model engines and DeepSpeed JSON configs. Imports no sibling file; copy it on its own.

Under ZeRO-3 every rank holds 1/world of each parameter; a module's forward pre-hook gathers
its parameters and the post-hook frees them again. Everything below either works with that
(streaming, one bounded group at a time) or switches it off for a while (gathered generation).

Public API
    process_rank() / comm_device() / all_max(n)        this rank; the device collectives need (the
                                                       GPU under NCCL, else CPU); a max over ranks
    all_reduce_(t, op=SUM) -> t                        a tensor reduced over ranks in place,
                                                       through comm_device() (any device in)
    is_zero3(model_or_engine) -> bool                  parameters partitioned by ZeRO-3?
    is_sharded(model_or_engine) -> bool                ... and some are not gathered right now?
    gathered(params_or_module, enabled=True)           GatheredParameters; no-op off ZeRO-3
    remove_hooks(engine) / restore_hooks(engine)       ZeRO-3 per-module fetch hooks off / on
    without_hooks(engine)                              context manager: hooks off, back on any exit
    partially_gathered(engine, budget_bytes)           context manager: as many modules as fit in
                                                       the budget gathered and hook-free, the rest
                                                       sharded
    iter_full_params(model, max_numel=2**26)           yields (name, full tensor), gathering at
                                                       most max_numel elements (or one parameter)
                                                       at a time
    save_hf(engine_or_model, tokenizer, path)          consolidated HF checkpoint, written by rank 0
    save_adapter(engine_or_model, tokenizer, path)     a peft model's adapter as peft saves it
    frozen_config(ds_config, offload=False)            a frozen model's DeepSpeed config (ZeRO-3)
    frozen_engine(model, ds_config, offload=False)     reference/reward model, a ZeRO-3 inference
                                                       engine
    load_ds_config(path_or_dict, world_size=None, hidden_size=None, **overrides) -> dict

Every call into DeepSpeed internals sits in one function whose name starts with `_ds_` and
whose comment names the version it was written for (deepspeed 0.19.8). iter_full_params and
gathered are collectives: every rank must call them, in the same order.
"""

import copy
import json
import os
from contextlib import contextmanager, nullcontext

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus


# ---- The process group: this rank, and where collectives put their tensors --------------------
def process_rank():
    """This process's rank: the process group's, or before it exists torchrun's RANK (0 alone)."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def comm_device():
    """Where a collective's tensors must live: the current GPU under NCCL, else the CPU."""
    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


_DATA_GROUP = None  # set_data_group: the ranks holding different data; None: all of them


def set_data_group(group):
    """Sums and gathers over the batch (all_reduce_, all_cat) run over `group` from now on: under
    sequence parallelism the data-parallel group, one rank of each group of ranks that share
    their sequences (they hold the same numbers; over all ranks each would count S times). None:
    every rank. all_max stays over every rank: it keeps collectives in lockstep."""
    global _DATA_GROUP
    _DATA_GROUP = group


def all_max(n):
    """The largest of the integers `n` over all ranks (`n` itself without a process group)."""
    if not dist.is_initialized():
        return n
    everyone = dist.group.WORLD
    return int(all_reduce_(torch.tensor([n], dtype=torch.long), dist.ReduceOp.MAX, everyone).item())


def all_reduce_(t, op=None, group=None):
    """`t` reduced over the data's ranks (set_data_group; default every rank; `group` another) in
    place and returned (`t` itself without a process group); op: a dist.ReduceOp, default SUM.
    The project's one tensor all-reduce: it runs on a copy on comm_device() when `t` lives
    elsewhere (an NCCL group refuses CPU tensors) and copies the result back, so callers keep
    their tensors where they compute with them (tests/test_collectives.py keeps every other file
    off torch.distributed's collectives)."""
    if not dist.is_initialized():
        return t
    on = t.to(comm_device())
    group = _DATA_GROUP if group is None else group
    dist.all_reduce(on, op=dist.ReduceOp.SUM if op is None else op, group=group)
    if on is not t:
        t.copy_(on)
    return t


def from_rank0(obj):
    """A picklable `obj` as rank 0 holds it, on every rank (`obj` itself without a process
    group); every rank calls it."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=comm_device())
    return box[0]


def all_cat(t):
    """(B_r, ...) from every rank r of the data (set_data_group) -> (B_0 + B_1 + ..., ...) on the
    CPU, rank by rank: the rows may differ in number between ranks (the trailing shape may not);
    `t` itself, on the CPU, without a process group."""
    if not dist.is_initialized():
        return t.cpu()
    world, device, group = dist.get_world_size(_DATA_GROUP), comm_device(), _DATA_GROUP
    shapes = [torch.zeros(t.dim(), dtype=torch.long, device=device) for _ in range(world)]
    dist.all_gather(shapes, torch.tensor(t.shape, dtype=torch.long, device=device), group=group)
    shapes = [tuple(s.tolist()) for s in shapes]  # (B_r, ...) of each rank
    if any(s[1:] != shapes[0][1:] for s in shapes):
        raise ValueError(f"all_cat: the ranks' rows differ in shape: {[s[1:] for s in shapes]}")
    most = max(s[0] for s in shapes)
    padded = torch.zeros((most, *t.shape[1:]), dtype=t.dtype, device=device)  # (max B_r, ...)
    padded[: t.shape[0]] = t.to(device)
    parts = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[: s[0]] for p, s in zip(parts, shapes)]).cpu()


# ---- Modules inside engines, ZeRO-3 parameters ---------------------------------------------------
def _module(model_or_engine):
    """The nn.Module inside a DeepSpeedEngine (or the module itself)."""
    return (
        model_or_engine.module
        if isinstance(model_or_engine, deepspeed.DeepSpeedEngine)
        else model_or_engine
    )


def is_zero3(model_or_engine):
    """True if the parameters were partitioned by ZeRO-3 (they carry a `ds_id`)."""
    return any(hasattr(p, "ds_id") for p in _module(model_or_engine).parameters())


def is_sharded(model_or_engine):
    """True under ZeRO-3 while at least one parameter is not gathered (forward needs all ranks)."""
    return any(
        getattr(p, "ds_status", None) == ZeroParamStatus.NOT_AVAILABLE
        for p in _module(model_or_engine).parameters()
    )


def gathered(params_or_module, enabled=True):
    """Context manager: full parameters on every rank inside, partitioned again on exit.

    A no-op (nullcontext) when disabled or when no parameter is a ZeRO-3 parameter, so the
    same code runs under DDP, ZeRO-2 or on one process. Read-only: changes are not scattered back.
    """
    params = (
        list(params_or_module.parameters())
        if isinstance(params_or_module, torch.nn.Module)
        else list(params_or_module)
    )
    if not enabled or not any(hasattr(p, "ds_id") for p in params):
        return nullcontext()
    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


# ---------------------------------------------------------------- ZeRO-3 fetch hooks
def _ds_parameter_offload(engine):
    # deepspeed 0.19.8: the object holding the hooks is DeepSpeedZeRoOffload. A training engine
    # keeps it at engine.optimizer.parameter_offload (DeepSpeedZeroOptimizer_Stage3); an engine
    # built without an optimizer (frozen_engine) has it as engine.optimizer itself.
    opt = getattr(engine, "optimizer", None)
    offload = getattr(opt, "parameter_offload", opt)
    if offload is None or not hasattr(offload, "forward_hooks"):
        raise TypeError(
            "remove_hooks/restore_hooks need the DeepSpeedEngine returned by deepspeed.initialize "
            f"with ZeRO stage 3, got {type(engine).__name__}"
        )
    return offload


def _ds_remove_hooks(offload):
    # deepspeed 0.19.8 (DeepSpeedZeRoOffload._remove_module_hooks without dropping the root
    # start-of-forward hook, which only resets the step counter). Active-submodule bookkeeping
    # is cleared so a later GatheredParameters exit may release the parameters.
    for p in offload.module.parameters():
        p.ds_active_sub_modules.clear()
    for hook in offload.forward_hooks + offload.backward_hooks:
        hook.remove()
    offload.forward_hooks, offload.backward_hooks = [], []


def _ds_register_hooks(offload):
    # deepspeed 0.19.8: `_register_deepspeed_module` (called `_register_hooks_recursively` before
    # 0.16.4) walks the module tree and adds the fetch/release hooks. Its `count` default is a
    # shared mutable list, so pass a fresh one to give modules the same ds_id as at init.
    offload._register_deepspeed_module(offload.module, count=[0])


def remove_hooks(engine):
    """Remove ZeRO-3's per-module fetch/release hooks (call only with all parameters gathered)."""
    _ds_remove_hooks(_ds_parameter_offload(engine))


def restore_hooks(engine):
    """Re-register the hooks removed by remove_hooks (no-op if they are present)."""
    offload = _ds_parameter_offload(engine)
    if not offload.forward_hooks:
        _ds_register_hooks(offload)


@contextmanager
def without_hooks(engine):
    """Hooks off inside, back on when the block exits, by return or by exception."""
    remove_hooks(engine)
    try:
        yield
    finally:
        restore_hooks(engine)


def _ds_remove_hooks_of(offload, modules):
    # deepspeed 0.19.8: forward_hooks/backward_hooks hold torch RemovableHandles; hooks_dict_ref
    # points at the hook dict of the module a handle was registered on. Active-submodule
    # bookkeeping is cleared as in _ds_remove_hooks.
    for p in offload.module.parameters():
        p.ds_active_sub_modules.clear()
    dicts = {id(d) for m in modules for d in (m._forward_pre_hooks, m._forward_hooks)}

    def ours(h):  # a handle registered on one of `modules`
        return h.hooks_dict_ref() is not None and id(h.hooks_dict_ref()) in dicts

    for h in offload.forward_hooks + offload.backward_hooks:
        if ours(h):
            h.remove()
    offload.forward_hooks = [h for h in offload.forward_hooks if not ours(h)]
    offload.backward_hooks = [h for h in offload.backward_hooks if not ours(h)]


def resident_modules(model_or_engine, budget_bytes):
    """Modules (with their own parameters) that fit in budget_bytes of full parameters, in order.

    A parameter shared by several modules (tied embeddings) makes them all resident or none, so no
    hooked module can release a parameter a hook-less one still uses.
    """
    model = _module(model_or_engine)
    owners = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners.setdefault(p, []).append(m)
    chosen, used = [], 0
    for m in model.modules():
        if m in chosen or not list(m.parameters(recurse=False)):
            continue
        group = {o for p in m.parameters(recurse=False) for o in owners[p]}
        params = {p for o in group for p in o.parameters(recurse=False)}
        size = sum(p.ds_numel * p.element_size() for p in params)
        if used + size > budget_bytes:
            break
        chosen += [o for o in group if o not in chosen]
        used += size
    return chosen


@contextmanager
def partially_gathered(engine, budget_bytes):
    """Keep up to budget_bytes of parameters gathered (hooks off for their modules); the rest stay
    sharded and are fetched layer by layer as usual. Restored on every exit."""
    offload = _ds_parameter_offload(engine)
    modules = resident_modules(engine, budget_bytes)
    with gathered([p for m in modules for p in m.parameters(recurse=False)]):
        _ds_remove_hooks_of(offload, modules)
        try:
            yield modules
        finally:
            _ds_remove_hooks(offload)
            _ds_register_hooks(offload)


# ---------------------------------------------------------------- streaming full weights
def _groups(sized, max_numel):
    """Split [(item, numel)] into consecutive groups of <= max_numel elements (a larger item
    alone)."""
    group, size = [], 0
    for item, n in sized:
        if group and size + n > max_numel:
            yield group
            group, size = [], 0
        group.append((item, n))
        size += n
    if group:
        yield group


def _lora_units(model):
    """A peft LoRA model as [(name, [params], merge)] in named_parameters() order: each adapted
    linear is one unit named as in the base model (`...q_proj.weight`), merged as
    W + scaling * B @ A; every other parameter is a unit of its own under its base-model name.
    Returns None for a model without LoRA layers."""
    prefix = "base_model.model."
    merged, adapters = {}, set()  # id(base weight) -> unit; ids of lora_A / lora_B params
    for name, m in model.named_modules():
        if not (hasattr(m, "base_layer") and hasattr(m, "lora_A") and "default" in m.lora_A):
            continue
        A, B, W = m.lora_A["default"].weight, m.lora_B["default"].weight, m.base_layer.weight

        def merge(
            W, A, B, scale=m.scaling["default"]
        ):  # (out, in) + (out, r) @ (r, in), a new tensor
            return torch.addmm(W, B.to(W.dtype), A.to(W.dtype), alpha=scale)

        merged[id(W)] = (f"{name.removeprefix(prefix)}.weight", [W, A, B], merge)
        adapters.update(id(p) for p in (*m.lora_A.parameters(), *m.lora_B.parameters()))
    if not merged:
        return None
    return [
        merged[id(p)]
        if id(p) in merged
        else (name.removeprefix(prefix).replace(".base_layer.", "."), [p], None)
        for name, p in model.named_parameters()
        if id(p) not in adapters
    ]


def _units(model):
    """[(name, [params], merge)]: what iter_full_params yields, in its order."""
    units = _lora_units(model)
    return units if units is not None else [(n, [p], None) for n, p in model.named_parameters()]


def full_param_meta(model_or_engine):
    """[(name, dtype, full shape)] of what iter_full_params yields, in its order, without a
    gather (ZeRO-3 keeps each parameter's full shape in ds_shape; a LoRA merge has its base
    weight's)."""
    return [
        (name, params[0].dtype, tuple(getattr(params[0], "ds_shape", params[0].shape)))
        for name, params, _ in _units(_module(model_or_engine))
    ]


@torch.no_grad()
def iter_full_params(model_or_engine, max_numel=2**26):
    """Yield (name, full tensor) for every parameter, gathering one bounded group at a time.

    Under ZeRO-3 at most max(max_numel, largest parameter) elements are gathered at once, so the
    peak extra memory is one group, not the model. Names are the module's `named_parameters()`
    names (tied weights appear once), which transformers and vLLM loaders accept. A yielded tensor
    is valid until the next item: `.clone()` it to keep it. A collective under ZeRO-3: call on
    every rank. Off ZeRO-3 this just walks named_parameters().

    A peft LoRA model streams as its base model with the adapters merged in (W + scaling * B @ A,
    computed per layer; the trained weights are not touched), under the base model's names: what
    vLLM and `from_pretrained` load, so a LoRA run syncs and saves like a full fine-tune.
    """
    units = _units(_module(model_or_engine))
    for group in _groups(
        [(u, sum(p.ds_numel if hasattr(p, "ds_id") else p.numel() for p in u[1])) for u in units],
        max_numel,
    ):
        with gathered([p for (_, params, _), _ in group for p in params]):
            for (name, params, merge), _ in group:
                yield name, (params[0].data if merge is None else merge(*(p.data for p in params)))


def save_hf(engine_or_model, tokenizer, path, max_shard_bytes=2 * 2**30):
    """Write a consolidated Hugging Face checkpoint (safetensors shards + config + tokenizer).

    Every rank must call it (the weights are gathered group by group); only rank 0 writes and
    holds at most one shard (max_shard_bytes) of CPU copies. Loadable by `from_pretrained` and vLLM.
    """
    from safetensors.torch import save_file

    model = _module(engine_or_model)
    rank = process_rank()
    if rank == 0:
        os.makedirs(path, exist_ok=True)
    shards, shard, shard_bytes = [], {}, 0

    def flush():
        name = f"model-{len(shards) + 1:05d}.safetensors"
        save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
        shards.append((name, list(shard)))

    for name, tensor in iter_full_params(model):
        if rank != 0:
            continue
        if shard and shard_bytes + tensor.nbytes > max_shard_bytes:
            flush()
            shard, shard_bytes = {}, 0
        shard[name] = tensor.detach().to("cpu", copy=True).contiguous()
        shard_bytes += tensor.nbytes
    if rank == 0:
        if shard or not shards:
            flush()
        if len(shards) == 1:  # one file: the plain name every loader looks for first
            os.replace(os.path.join(path, shards[0][0]), os.path.join(path, "model.safetensors"))
        else:
            weight_map = {k: f for f, keys in shards for k in keys}
            with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
        model.config.save_pretrained(path)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(path)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
    if dist.is_initialized():
        dist.barrier()  # nobody reads the checkpoint before rank 0 has finished it


def save_adapter(engine_or_model, tokenizer, path):
    """A peft model's adapter as peft writes it (adapter_config.json, adapter_model.safetensors,
    and the tokenizer unless None): what `PeftModel.from_pretrained(base, path)` loads. Only the
    trained parameters (the adapters) are gathered under ZeRO-3; rank 0 writes. Every rank must
    call it."""
    model = _module(engine_or_model)
    with gathered([p for p in model.parameters() if p.requires_grad]):
        if process_rank() == 0:
            model.save_pretrained(path)
            if tokenizer is not None:
                tokenizer.save_pretrained(path)
    if dist.is_initialized():
        dist.barrier()  # nobody reads the adapter before rank 0 has written it


# ---------------------------------------------------------------- engines and configs
def frozen_config(ds_config, offload=False):
    """The DeepSpeed config of a frozen model (reference, reward): the training config (dict or
    path) without optimizer and scheduler, ZeRO stage 3, the parameter partitions in CPU memory
    with offload=True (fetched to the device layer by layer)."""
    cfg = copy.deepcopy(
        load_ds_config(ds_config) if isinstance(ds_config, (str, os.PathLike)) else ds_config
    )
    for key in ("optimizer", "scheduler"):
        cfg.pop(key, None)
    zero = cfg.setdefault("zero_optimization", {})
    zero["stage"] = 3
    zero.pop("offload_optimizer", None)
    if offload:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    else:
        zero.pop("offload_param", None)
    leftover = _auto_paths(cfg)
    if leftover:
        raise ValueError(
            f'frozen_engine: ds_config still has "auto" at {leftover}; pass it through '
            "load_ds_config first"
        )
    return cfg


def frozen_engine(model, ds_config, offload=False):
    """A frozen model (reference, reward) as a ZeRO-3 inference engine, sharded across ranks.

    ds_config: the training config (dict or path), made a frozen one by frozen_config. A model
    built partitioned (zero3_load.load_model with frozen_config(ds_config, offload)) stays as it
    is. Returns the engine in eval mode with requires_grad off.
    """
    model.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, config=frozen_config(ds_config, offload))
    engine.eval()
    return engine


def _auto_paths(cfg, prefix=""):
    out = []
    for k, v in cfg.items():
        if isinstance(v, dict):
            out += _auto_paths(v, f"{prefix}{k}.")
        elif v == "auto":
            out.append(prefix + k)
    return out


def _set(cfg, dotted, value):
    *parents, key = dotted.split(".")
    for p in parents:
        cfg = cfg.setdefault(p, {})
    old = cfg.get(key, "auto")
    if old not in ("auto", value):
        raise ValueError(
            f"DeepSpeed config sets {dotted}={old!r} but the script asks for {value!r}: "
            f'make them agree, or write "auto" in the JSON to take the script\'s value'
        )
    cfg[key] = value


def load_ds_config(path_or_dict, world_size=None, hidden_size=None, **overrides):
    """Read a DeepSpeed JSON, fill "auto" values, check the batch-size arithmetic.

    overrides: values from the training script, by DeepSpeed key; a dotted key reaches into a
    section (`**{"bf16.enabled": True}`). An override fills an "auto" or missing value; a
    different concrete value in the JSON is an error. hidden_size fills the ZeRO bucket sizes
    left at "auto". train_batch_size must equal train_micro_batch_size_per_gpu x
    gradient_accumulation_steps x world_size (any one of the three may be left out or "auto").
    """
    if isinstance(path_or_dict, dict):
        cfg = copy.deepcopy(path_or_dict)
    else:
        with open(path_or_dict) as f:
            cfg = json.load(f)
    for key, value in overrides.items():
        _set(cfg, key, value)
    zero = cfg.get("zero_optimization", {})
    if hidden_size:
        for key, value in (
            ("reduce_bucket_size", hidden_size * hidden_size),
            ("stage3_prefetch_bucket_size", int(0.9 * hidden_size * hidden_size)),
            ("stage3_param_persistence_threshold", 10 * hidden_size),
        ):
            if zero.get(key) == "auto":
                zero[key] = value
    if world_size is None:
        world_size = (
            dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
        )
    names = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
    micro, accum, total = (cfg.get(k) if cfg.get(k) != "auto" else None for k in names)
    if accum is None and (micro is None or total is None):
        accum = 1  # DeepSpeed's default when it cannot be derived
    if total is None:
        if micro is None or accum is None:
            raise ValueError(
                f"DeepSpeed config: set at least two of {names} (or pass them to load_ds_config)"
            )
        total = micro * accum * world_size
    elif micro is None:
        micro = total // (accum * world_size)
    elif accum is None:
        accum = total // (micro * world_size)
    if micro * accum * world_size != total or min(micro, accum) < 1:
        raise ValueError(
            f"DeepSpeed config: train_batch_size={total} but "
            f"train_micro_batch_size_per_gpu={micro} x "
            f"gradient_accumulation_steps={accum} x world_size={world_size} = "
            f"{micro * accum * world_size}; "
            f'set train_batch_size to "auto" or change the micro-batch size / accumulation steps'
        )
    cfg.update(zip(names, (micro, accum, total)))
    leftover = _auto_paths(cfg)
    if leftover:
        raise ValueError(
            f'DeepSpeed config leaves {leftover} at "auto"; pass values for them '
            f"(e.g. load_ds_config(path, **{{'{leftover[0]}': ...}})) or write them in the JSON"
        )
    return cfg

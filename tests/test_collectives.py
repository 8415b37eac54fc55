"""Every torch.distributed tensor collective in the project's top-level files goes through the few
helpers that put its tensors on zero3_utils.comm_device() (issue 37: envs.py all-reduced a CPU
tensor, which an NCCL group refuses, so every --env run failed at its first rollout on a GPU).

A reference counts, not only a call: `reduce = dist.all_reduce` then `reduce(t)` is the same
collective. Left out, on purpose:
- barrier and the *_object collectives (all_gather_object, broadcast_object_list, ...): they take
  no tensor of ours; torch pickles the objects into tensors on the device the group needs itself
  (distributed_c10d._get_object_coll_device: torch.cuda.current_device() under NCCL, which
  batching.init_distributed sets to LOCAL_RANK's GPU).
- methods of a process group object of our own (vllm_transfer.py's gloo group for the weight
  transfer: CPU tensors on a gloo group by design; on GPUs vLLM's own NCCL engine runs instead).
"""

import ast
import glob
import inspect
import os

import pytest
import torch.distributed.distributed_c10d as c10d

from conftest import ROOT

# (file, function) -> why it may call a collective: each puts the tensors on comm_device()
HELPERS = {
    ("zero3_utils.py", "all_reduce_"): "copies to comm_device() and back",
    ("zero3_utils.py", "all_cat"): "gathers on comm_device(), returns on the CPU",
    ("sequence_parallel.py", "forward"): "gathers slices where the model computes them (its GPU)",
}
NAMED = {
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_coalesced",
    "all_gather_single",
    "_all_gather_base",
    "broadcast",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
}


def tensor_collectives():
    """NAMED, and whatever else torch's distributed_c10d exports that takes a tensor argument (a
    collective a later torch adds is caught too); the *_object ones left out (see above)."""
    found = set(NAMED)
    for name in c10d.__all__:
        f = getattr(c10d, name, None)
        if not callable(f) or isinstance(f, type) or name.endswith(("_object", "_object_list")):
            continue
        try:
            params = inspect.signature(f).parameters
        except (TypeError, ValueError):  # builtins without a signature
            continue
        if any("tensor" in p for p in params):
            found.add(name)
    return found


COLLECTIVES = tensor_collectives()


def collective_uses(source):
    """[(function, line, name)] for every reference to a torch.distributed tensor collective in
    `source`: through `import torch.distributed as X`, `from torch import distributed`, the full
    `torch.distributed.name`, or `from torch.distributed import name`; function is the innermost
    enclosing def ("<module>" outside one)."""
    tree = ast.parse(source)
    modules, direct = set(), {}  # names bound to torch.distributed; local name -> collective
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed" and a.asname:
                    modules.add(a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                if node.module == "torch" and a.name == "distributed":
                    modules.add(a.asname or a.name)
                elif node.module.startswith("torch.distributed") and a.name in COLLECTIVES:
                    direct[a.asname or a.name] = a.name

    def is_dist(value):
        if isinstance(value, ast.Name):
            return value.id in modules
        # torch.distributed.<name> (also torch.distributed.distributed_c10d.<name>)
        text = ast.unparse(value)
        return text == "torch.distributed" or text.startswith("torch.distributed.")

    uses = []

    def visit(node, function):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES and is_dist(node.value):
            uses.append((function, node.lineno, node.attr))
        elif isinstance(node, ast.Name) and node.id in direct:
            uses.append((function, node.lineno, direct[node.id]))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, "<module>")
    return uses


def project_files():
    return sorted(glob.glob(os.path.join(ROOT, "*.py")))


def test_the_finder_sees_every_spelling():
    """The checker itself: each way of reaching a collective is found, in its function; barrier,
    the object collectives and a group's own methods are not."""
    source = """
import torch
import torch.distributed as dist
from torch import distributed as td
from torch.distributed import all_gather as ag, barrier

def a(t):
    dist.all_reduce(t, op=dist.ReduceOp.MAX)

def b(t):
    reduce = dist.all_reduce if dist.is_initialized() else (lambda x: x)
    reduce(t)

def c(t):
    torch.distributed.broadcast(t, 0)
    td.reduce_scatter_tensor(t, t)
    ag([t], t)

def d(group, t, objs):
    dist.barrier()
    barrier()
    dist.all_gather_object(objs, 1)
    group.broadcast(t, 0)
"""
    found = [(f, n) for f, _, n in collective_uses(source)]
    assert found == [
        ("a", "all_reduce"),
        ("b", "all_reduce"),
        ("c", "broadcast"),
        ("c", "reduce_scatter_tensor"),
        ("c", "all_gather"),
    ]


def test_collectives_only_in_the_comm_device_helpers():
    """No top-level file calls a torch.distributed tensor collective outside HELPERS; each HELPERS
    entry still exists and still is one."""
    offenders, seen = [], set()
    for path in project_files():
        name = os.path.basename(path)
        with open(path) as f:
            uses = collective_uses(f.read())
        for function, line, collective in uses:
            if (name, function) in HELPERS:
                seen.add((name, function))
            else:
                offenders.append(f"{name}:{line} {function}: dist.{collective}")
    assert not offenders, (
        "torch.distributed collectives outside the comm_device() helpers (an NCCL group refuses "
        "CPU tensors): use zero3_utils.all_reduce_ / all_max / all_cat or batching.all_sum:\n"
        + "\n".join(offenders)
    )
    assert seen == set(HELPERS), f"HELPERS entries that no longer call a collective: {HELPERS}"


@pytest.mark.parametrize("backend_device", ["cpu", "meta"])
def test_all_reduce_runs_on_comm_device_and_copies_back(monkeypatch, backend_device):
    """all_reduce_ hands the collective a tensor on comm_device() (here 'meta' stands in for the
    GPU an NCCL group needs) and leaves the result in the caller's tensor, on the caller's
    device."""
    import torch

    import zero3_utils

    seen = []

    def fake_all_reduce(t, op=None, group=None):
        seen.append(t.device.type)
        if t.device.type == "meta":
            return
        t.mul_(3)  # three ranks holding the same value

    monkeypatch.setattr(zero3_utils.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(zero3_utils.dist, "all_reduce", fake_all_reduce)
    monkeypatch.setattr(zero3_utils, "comm_device", lambda: torch.device(backend_device))
    t = torch.tensor([1.0, 2.0])
    if backend_device == "meta":
        # the copy back from a meta tensor has no data: only where the collective ran is checked
        monkeypatch.setattr(torch.Tensor, "copy_", lambda self, other: self)
    out = zero3_utils.all_reduce_(t)
    assert seen == [backend_device]
    assert out is t and t.device.type == "cpu"
    if backend_device == "cpu":
        assert t.tolist() == [3.0, 6.0]

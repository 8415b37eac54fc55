"""Every name a benchmark patches still exists where it patches it.

A bench that replaces `module.name` measures something else the day the module stops having that
name: the assignment just adds a new attribute nobody calls (bench/naive_grpo.py once patched
grpo.model_logps after grpo.py stopped importing it, and silently measured the fused path). This
reads bench/*.py with `ast` (nothing runs) and finds each patch: `X.name = ...` (X.Y.name too),
`setattr(X, "name", ...)`, and calls of the file's own helpers that setattr their first two
arguments (bench/vs_trl.py's `wrap(grpo, "generate_hf", ...)`), where X is a module or a name
imported from one anywhere in the file. Each target is imported and must have the name.
"""

import ast
import glob
import importlib
import os

import pytest

from conftest import ROOT

BENCHES = sorted(glob.glob(os.path.join(ROOT, "bench", "*.py")))


def imported_names(tree):
    """{local name: (module, attribute or None)} for every import in the file, at any depth."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    names[a.asname] = (a.name, None)
                else:  # `import a.b` binds `a`
                    names[a.name.split(".")[0]] = (a.name.split(".")[0], None)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                names[a.asname or a.name] = (node.module, a.name)
    return names


def setattr_helpers(tree):
    """Names of functions in the file whose body calls setattr(first param, second param, ...)."""
    out = {"setattr"}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and len(node.args.args) >= 2:
            first, second = (a.arg for a in node.args.args[:2])
            for call in ast.walk(node):
                if (
                    isinstance(call, ast.Call)
                    and isinstance(call.func, ast.Name)
                    and call.func.id == "setattr"
                    and [getattr(a, "id", None) for a in call.args[:2]] == [first, second]
                ):
                    out.add(node.name)
    return out


def dotted(node):
    """X.Y.Z -> ["X", "Y", "Z"]; anything but names and attributes -> None."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return None if base is None else base + [node.attr]
    return None


def patches(path):
    """(line, [target path...], patched name) for each patch in the file on an imported name."""
    tree = ast.parse(open(path).read(), path)
    names, helpers, out = imported_names(tree), setattr_helpers(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                chain = dotted(t) if isinstance(t, ast.Attribute) else None
                if chain and chain[0] in names:
                    out.append((node.lineno, chain[:-1], chain[-1]))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in helpers
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            chain = dotted(node.args[0])
            if chain and chain[0] in names:
                out.append((node.lineno, chain, node.args[1].value))
    return names, out


def resolve(names, chain):
    module, attr = names[chain[0]]
    obj = importlib.import_module(module)
    if attr is not None:
        obj = (
            getattr(obj, attr)
            if hasattr(obj, attr)
            else importlib.import_module(f"{module}.{attr}")
        )
    for part in chain[1:]:
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("path", BENCHES, ids=os.path.basename)
def test_bench_patches_names_that_exist(path, monkeypatch):
    # as the benches set it: the project first (bench/generation.py must not shadow generation.py)
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    monkeypatch.syspath_prepend(ROOT)
    names, found = patches(path)
    missing = [
        f"{os.path.basename(path)}:{line}: {'.'.join(chain)} has no {name!r}"
        for line, chain, name in found
        if not hasattr(resolve(names, chain), name)
    ]
    assert not missing, "a bench patches a name its target no longer has:\n" + "\n".join(missing)


def test_the_finder_sees_the_naive_benchs_patch():
    """The check above cannot pass by finding nothing: naive_grpo's one patch is seen."""
    _, found = patches(os.path.join(ROOT, "bench", "naive_grpo.py"))
    assert [(chain, name) for _, chain, name in found] == [(["batching"], "model_logps")]

"""The reader's walk: how often following a loop's `main` through this project's code moves
between files. The walk is the one a reader makes, measured on a real run, not by hand.

    python bench/walk.py grpo                # the default GRPO run, one step
    python bench/walk.py ppo -- --max_steps 2   # flags after -- go to the loop

One process (rank 0 of 1, gloo), the loop's `main` under `sys.setprofile`: every call of a
function defined in this project's top-level files is recorded with the project function it was
called from (calls through torch, DeepSpeed or transformers back into the project count as calls
from the nearest project frame). The walk reads the call tree depth first, in call order, each
function once: where it first runs it is read, and its callees with it; a later call of a function
already read is not a stop. A move is a step of the walk between two files: down into a callee in
another file, and back up when that callee is done. The report: stops (functions read), files,
moves, moves back up, and the stops before the first rollout (the loop's `rollout` function, or
its first sampling call). With --list the walk itself, one line per stop.

Writes bench/out/walk/<loop>.json.
"""

import json
import os
import socket
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# the first stop of each loop that begins its first rollout
ROLLOUT = {"grpo": "grpo.rollout", "ppo": "ppo.rollout", "rm": "rm.update"}


def project_file(path):
    """This project's top-level file's module name, else None (tests, benches, libraries)."""
    path = os.path.abspath(path)
    if os.path.dirname(path) != ROOT or not path.endswith(".py"):
        return None
    return os.path.basename(path)[:-3]


def record(main, argv):
    """main(argv) under a profiler: the call tree of project functions, as {parent: [children]}
    in first-call order, and the root's name."""
    children, names, stack = {}, {}, []  # frame id -> name; stack of (frame, name)
    seen_edges = set()

    def name_of(frame):
        code = frame.f_code
        module = project_file(code.co_filename)
        if module is None or code.co_name.startswith("<"):  # a genexpr, lambda: its caller's
            return None
        return f"{module}.{code.co_qualname}"

    def profile(frame, event, arg):
        if event == "call":
            name = name_of(frame)
            if name is None:
                return
            parent = None
            f = frame.f_back
            while f is not None:  # the nearest project frame that called it
                if id(f) in names:
                    parent = names[id(f)]
                    break
                f = f.f_back
            names[id(frame)] = name
            stack.append(frame)
            if parent is not None and (parent, name) not in seen_edges:
                seen_edges.add((parent, name))
                children.setdefault(parent, []).append(name)
        elif event == "return" and stack and stack[-1] is frame:
            stack.pop()
            names.pop(id(frame), None)

    sys.setprofile(profile)
    try:
        main(argv)
    finally:
        sys.setprofile(None)
    return children


def walk(children, root):
    """Depth first from root, each function once: [(depth, name)] in reading order."""
    read, order = set(), []

    def visit(name, depth):
        read.add(name)
        order.append((depth, name))
        for child in children.get(name, []):
            if child not in read:
                visit(child, depth + 1)

    visit(root, 0)
    return order


def moves(order):
    """(moves, moves back up): a step into a callee in another file, and the return from it."""
    down = up = 0
    path = []  # the names on the way down to the current stop
    for depth, name in order:
        while len(path) > depth:  # back up to this stop's caller
            done = path.pop()
            if path and done.split(".")[0] != path[-1].split(".")[0]:
                up += 1
        if path and name.split(".")[0] != path[-1].split(".")[0]:
            down += 1
        path.append(name)
    while len(path) > 1:
        done = path.pop()
        if done.split(".")[0] != path[-1].split(".")[0]:
            up += 1
    return down + up, up


def main():
    argv = sys.argv[1:]
    show = "--list" in argv
    argv = [a for a in argv if a != "--list"]
    loop, extra = argv[0], argv[argv.index("--") + 1 :] if "--" in argv else []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    module = __import__(loop)
    out = tempfile.mkdtemp(prefix="walk-")
    flags = ["--run_dir", out, "--max_steps", "1", "--save_model", "False"]
    children = record(module.main, flags + extra)
    order = walk(children, f"{loop}.main")
    total, up = moves(order)
    names = [n for _, n in order]
    first = names.index(ROLLOUT[loop]) if ROLLOUT[loop] in names else len(names)
    files = sorted({n.split(".")[0] for n in names})
    report = {
        "loop": loop,
        "flags": flags[2:] + extra,
        "stops": len(order),
        "files": len(files),
        "moves": total,
        "moves_back_up": up,
        "stops_before_first_rollout": first,
        "file_list": files,
        "walk": [f"{'  ' * d}{n}" for d, n in order],
    }
    if show:
        print("\n".join(report["walk"]))
    print(
        f"{loop}: {report['stops']} stops in {report['files']} files, {total} moves between "
        f"files ({up} back up), {first} stops before the first rollout"
    )
    os.makedirs(os.path.join(ROOT, "bench", "out", "walk"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "out", "walk", f"{loop}.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

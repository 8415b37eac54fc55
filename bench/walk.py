"""The reader's walk: how often following a loop's `main` through this project's code moves
between files. The walk is the one a reader makes, measured on a real run, not by hand.

    python bench/walk.py --loop grpo                 # the default GRPO run, one step
    python bench/walk.py --loop ppo --list True      # and the walk, one line per stop
    python bench/walk.py --loop grpo -- --beta 0.04  # flags after -- go to the loop

One process (rank 0 of 1, gloo), the loop's `main` under `sys.setprofile`: every call of a
function defined in this project's top-level files is recorded with the project function it was
called from (calls through torch, DeepSpeed or transformers back into the project count as calls
from the nearest project frame). The walk reads the call tree depth first, in call order, each
function once: where it first runs it is read, and its callees with it; a later call of a function
already read is not a stop. A move is a step of the walk from a stop to the next in another file
(back up: the next stop is also shallower). The report: stops (functions read), files, moves,
moves back up, the stops before the training loop (`run.steps()`, just before the first
rollout), and the moves under each call `main` makes. With --list True the walk itself, one line
per stop, indented by depth. Measured on the commit where grpo.py was 821 lines: grpo 178 stops
in 18 files, 87 moves; docs/changing.md has today's figures.

Writes <out_dir>/<loop>.json (the report and the walk).
"""

import json
import os
import socket
import sys
import tempfile
from dataclasses import dataclass, field

from transformers import HfArgumentParser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


@dataclass
class Args:
    loop: str = field(default="grpo", metadata={"help": "grpo, ppo or rm: the loop whose main"})
    list: bool = field(default=False, metadata={"help": "print the walk, one line per stop"})
    out_dir: str = field(default="bench/out/walk", metadata={"help": "where <loop>.json goes"})


LOOP = "harness.Run.steps"  # the training loop's first stop: every loop's `for step in run.steps()`


def project_file(path):
    """This project's top-level file's module name, else None (tests, benches, libraries)."""
    path = os.path.abspath(path)
    if os.path.dirname(path) != ROOT or not path.endswith(".py"):
        return None
    return os.path.basename(path)[:-3]


def record(main, argv):
    """main(argv) under a profiler: the call tree of project functions, as {parent: [children]}
    in first-call order."""
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
    """(moves, moves back up) of a walk [(depth, name)]: a move is the next stop in another file
    than this one; back up when that stop is also shallower (the reader returns to a caller's
    file, or to a sibling of the caller, before reading on)."""
    total = up = 0
    for (d0, a), (d1, b) in zip(order, order[1:]):
        if a.split(".")[0] != b.split(".")[0]:
            total += 1
            up += d1 < d0
    return total, up


def moves_by_call(order):
    """{stop main calls: moves} of a walk [(depth, name)]: each move counted under the call of
    `main` (a depth-1 stop) whose reading it is part of, the move into that call included. Where a
    reader's file changes concentrate: the pre-flight under `Run`, say, or the update."""
    by_call, call = {}, None
    for (_, a), (d1, b) in zip(order, order[1:]):
        call = b if d1 == 1 else call
        if a.split(".")[0] != b.split(".")[0]:
            by_call[call] = by_call.get(call, 0) + 1
    return by_call


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    (args,) = HfArgumentParser(Args).parse_args_into_dataclasses(argv)
    loop = args.loop
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
    first = names.index(LOOP) if LOOP in names else len(names)
    files = sorted({n.split(".")[0] for n in names})
    report = {
        "loop": loop,
        "flags": flags[2:] + extra,
        "stops": len(order),
        "files": len(files),
        "moves": total,
        "moves_back_up": up,
        "stops_before_the_loop": first,
        "moves_by_call": moves_by_call(order),
        "file_list": files,
        "walk": [f"{'  ' * d}{n}" for d, n in order],
    }
    if args.list:
        print("\n".join(report["walk"]))
    print(
        f"{loop}: {report['stops']} stops in {report['files']} files, {total} moves between "
        f"files ({up} back up), {first} stops before the training loop"
    )
    calls = sorted(report["moves_by_call"].items(), key=lambda kv: -kv[1])
    print("moves under each call of main: " + ", ".join(f"{c} {n}" for c, n in calls))
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, f"{loop}.json"), "w") as f:
        json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()

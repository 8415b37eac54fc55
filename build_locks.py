"""Stale torch-extension build locks: a run killed while DeepSpeed JIT-built an op (on CPU it
builds deepspeed_shm_comm on first use) leaves a `lock` file, and every later build waits on it
forever (torch's FileBaton: no timeout, no message). clear_stale_build_locks() runs on each node's
first rank before DeepSpeed starts (harness.Run). Imports exits.py (RunError).
"""

import glob
import os
import sys
import time

from exits import RunError


def build_locks():
    """The `lock` files in torch's extension build directories (TORCH_EXTENSIONS_DIR, else
    ~/.cache/torch_extensions/<python>_<accelerator>/), where DeepSpeed JIT-builds its ops
    (deepspeed_shm_comm on CPU, at init_distributed)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return sorted(glob.glob(os.path.join(root, "*", "lock")))
    from torch.utils.cpp_extension import get_default_build_root

    return sorted(glob.glob(os.path.join(get_default_build_root(), "*", "*", "lock")))


def lock_holders(path):
    """The pids on this machine with `path` open (a build in progress holds its lock open:
    torch's FileBaton), and whether every process could be looked at (another user's cannot)."""
    target, pids, seen_all = os.path.realpath(path), [], True
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except PermissionError:
            seen_all = False
            continue
        except FileNotFoundError:  # ended meanwhile
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    pids.append(int(pid))
            except OSError:  # closed meanwhile, or not ours to read
                continue
    return pids, seen_all


def clear_stale_build_locks(wait_s=60, say=print):
    """A build stopped midway (a run killed while DeepSpeed JIT-built an op) leaves its `lock`, and
    every later build waits on it forever (torch's FileBaton: no timeout, no message). Call before
    DeepSpeed's init_distributed, on each node's local rank 0. A lock that a process here holds
    open is a build in progress: left alone. One nobody here holds, on one node where every process
    could be looked at, is stale: removed, with one line. Otherwise (several nodes, whose home may
    be shared, or processes of other users) it gets wait_s seconds to go, then a RunError naming
    the file."""
    if not os.path.isdir("/proc"):  # not Linux: nothing to look at
        return
    nodes = int(os.environ.get("WORLD_SIZE", 1)) > int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    for path in build_locks():
        try:
            inode = os.stat(path).st_ino
        except FileNotFoundError:  # its build just finished
            continue
        holders, seen_all = lock_holders(path)
        if holders:
            continue
        if seen_all and not nodes:
            try:
                if os.stat(path).st_ino == inode:  # not a new build's lock taken meanwhile
                    os.remove(path)
                    say(
                        f"removed a stale build lock {path} (no process is building: a build was "
                        "stopped midway)",
                        file=sys.stderr,
                        flush=True,
                    )
            except FileNotFoundError:
                pass
            continue
        deadline = time.monotonic() + wait_s
        while os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(1)
        if os.path.exists(path) and not lock_holders(path)[0]:
            raise RunError(
                f"{path}: a build lock that no process on this machine holds, still there after "
                f"{wait_s} s (a build stopped midway leaves it, and DeepSpeed would wait on it "
                "forever): delete it if no run on another node is building that op, and run again"
            )

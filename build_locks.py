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
    torch's FileBaton), and the users some of whose processes could not be looked at (a non-root
    user cannot read another user's /proc/<pid>/fd; /proc/<pid> itself names the owner)."""
    target, pids, unseen = os.path.realpath(path), [], set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except PermissionError:
            try:
                unseen.add(os.stat(f"/proc/{pid}").st_uid)
            except FileNotFoundError:  # ended meanwhile
                pass
            continue
        except FileNotFoundError:  # ended meanwhile
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    pids.append(int(pid))
            except OSError:  # closed meanwhile, or not ours to read
                continue
    return pids, unseen


STALE_AGE_S = 1800  # DeepSpeed's ops build in minutes: a lock half an hour old is a leftover


def stale(st, unseen, nodes, stale_age_s):
    """Why a lock that no process looked at holds open is stale (None: it may be a build that
    cannot be seen). Torch's FileBaton creates the lock as the building process's user and holds
    it open, so on one node a lock whose owner's processes could all be looked at is stale
    (root sees all; a user sees their own). Else (another user's lock, or several nodes whose home
    may be shared) only its age tells: FileBaton never writes it, so its mtime is the build's
    start."""
    if not nodes and st.st_uid not in unseen:
        return "no process is building: a build was stopped midway"
    age = time.time() - st.st_mtime
    if age >= stale_age_s:
        return f"{age / 60:.0f} min old and no process here holds it: a build was stopped midway"
    return None


def clear_stale_build_locks(wait_s=60, stale_age_s=STALE_AGE_S, say=print):
    """A build stopped midway (a run killed while DeepSpeed JIT-built an op) leaves its `lock`, and
    every later build waits on it forever (torch's FileBaton: no timeout, no message). Call before
    DeepSpeed's init_distributed, on each node's local rank 0. A lock that a process here holds
    open is a build in progress: left alone. One that none holds is stale when every process of
    its owner could be looked at, on one node, or when it is stale_age_s old (stale()): removed,
    with one line. Otherwise (another user's lock, or several nodes) it gets wait_s seconds to go,
    then a RunError naming the file."""
    if not os.path.isdir("/proc"):  # not Linux: nothing to look at
        return
    nodes = int(os.environ.get("WORLD_SIZE", 1)) > int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    for path in build_locks():
        try:
            st = os.stat(path)
        except FileNotFoundError:  # its build just finished
            continue
        holders, unseen = lock_holders(path)
        if holders:
            continue
        why = stale(st, unseen, nodes, stale_age_s)
        if why is None:
            deadline = time.monotonic() + wait_s
            while os.path.exists(path) and time.monotonic() < deadline:
                time.sleep(1)
            if not os.path.exists(path) or lock_holders(path)[0]:
                continue
            why = stale(st, unseen, nodes, stale_age_s)  # it may have come of age meanwhile
        if why is None:
            raise RunError(
                f"{path}: a build lock that no process on this machine holds, still there after "
                f"{wait_s} s (a build stopped midway leaves it, and DeepSpeed would wait on it "
                "forever; it is another user's, or this run spans several nodes, and it is "
                f"younger than {stale_age_s / 60:.0f} min): delete it if no run on another node "
                "is building that op, and run again"
            )
        try:
            if os.stat(path).st_ino == st.st_ino:  # not a new build's lock taken meanwhile
                os.remove(path)
                say(f"removed a stale build lock {path} ({why})", file=sys.stderr, flush=True)
        except FileNotFoundError:
            pass
        except PermissionError as e:
            raise RunError(
                f"{path}: a stale build lock ({why}) that this user may not remove ({e.strerror}):"
                " ask its owner to delete it, or set TORCH_EXTENSIONS_DIR to a directory of "
                "your own, and run again"
            ) from None

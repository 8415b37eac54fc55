"""A stale torch-extensions `lock` (a run killed while DeepSpeed JIT-built an op) does not hang the
next run: clear_stale_build_locks removes one that no process holds open, leaves a build in
progress alone, and on several nodes stops after its wait with one message naming the file unless
the lock is STALE_AGE_S old. The "non-root" checks run as a user who cannot look at other users'
processes; the last test is a real run.sh run over a build directory holding such a lock."""

import ctypes
import os
import pickle
import pwd
import shutil
import tempfile
import time

import pytest

from build_locks import STALE_AGE_S, build_locks, clear_stale_build_locks, lock_holders
from conftest import run_sh, train_rows
from exits import RunError


@pytest.fixture
def lock(tmp_path, monkeypatch):
    """A lock in a build directory of its own (TORCH_EXTENSIONS_DIR), one node of one rank."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    build = tmp_path / "ext" / "deepspeed_shm_comm"
    build.mkdir(parents=True)
    (build / "lock").touch()
    return build / "lock"


def test_a_stale_lock_is_removed_with_one_line(lock, capsys):
    assert build_locks() == [str(lock)]
    clear_stale_build_locks(wait_s=0)
    assert not lock.exists()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"removed a stale build lock {lock}" in err, err


def test_a_lock_held_open_is_a_build_in_progress_and_stays(lock):
    fd = os.open(lock, os.O_RDONLY)  # as torch's FileBaton holds it while it builds
    try:
        clear_stale_build_locks(wait_s=0)
        assert lock.exists()
    finally:
        os.close(fd)


def test_several_nodes_wait_then_stop_naming_the_file(lock, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")  # 2 nodes: the lock may be another node's build
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(RunError, match=f"{lock}: a build lock that no process") as e:
        clear_stale_build_locks(wait_s=1)
    assert "after 1 s" in str(e.value) and lock.exists()


def test_several_nodes_remove_a_lock_past_its_age(lock, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    old = time.time() - STALE_AGE_S
    os.utime(lock, (old, old))
    said = []
    clear_stale_build_locks(wait_s=0, say=lambda line, **_: said.append(line))
    assert not lock.exists() and said == [
        f"removed a stale build lock {lock} (30 min old and no process here holds it: a build "
        "was stopped midway)"
    ], said


# ---- As a non-root user ---------------------------------------------------------------------
# A user cannot read another user's /proc/<pid>/fd: the lock's owner and its age decide. As root
# (CI), each check runs in a process forked and turned into `nobody`, the way a login makes a
# user's process (dumpable again after setuid); as another user, in a fork of this one.
def as_user(fn):
    """fn() run in a child process as a non-root user: its return value or RunError's text."""
    try:
        user = pwd.getpwnam("nobody") if os.geteuid() == 0 else None
    except KeyError:
        pytest.skip("running as root, and no user `nobody` to run the check as")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: become the user, run fn, hand back what it gave
        try:
            os.close(read)
            if user:
                os.setgroups([])
                os.setgid(user.pw_gid)
                os.setuid(user.pw_uid)
                ctypes.CDLL(None).prctl(4, 1)  # PR_SET_DUMPABLE, as after a login's exec
            try:
                out = fn()
            except RunError as e:
                out = f"RunError: {e}"
            except BaseException as e:  # noqa: BLE001 - handed to the parent to fail with
                out = f"{type(e).__name__}: {e}"
            with os.fdopen(write, "wb") as f:
                pickle.dump(out, f)
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    if not data:
        pytest.fail("the child run as a non-root user handed nothing back")
    return pickle.loads(data)


@pytest.fixture
def shared(monkeypatch):
    """A build directory both this process and the non-root child may write (pytest's tmp_path
    is root's alone), one node of one rank."""
    root = tempfile.mkdtemp(prefix="build-locks-")
    os.chmod(root, 0o777)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", root)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    build = os.path.join(root, "deepspeed_shm_comm")
    os.mkdir(build)
    os.chmod(build, 0o777)
    yield os.path.join(build, "lock")
    shutil.rmtree(root)


def cleared(lock, hold=False, wait_s=0):
    """As the user: the lock made (unless it is there), held open if `hold`, cleared. What
    clear_stale_build_locks said, whether the lock is left, and the users it could not see."""

    def check():
        if not os.path.exists(lock):
            open(lock, "x").close()
        fd = os.open(lock, os.O_RDONLY) if hold else None
        said = []
        try:
            clear_stale_build_locks(wait_s=wait_s, say=lambda line, **_: said.append(line))
        except RunError as e:
            said.append(f"RunError: {e}")
        unseen = lock_holders(lock)[1] if os.path.exists(lock) else None
        if fd is not None:
            os.close(fd)
        return {"said": said, "left": os.path.exists(lock), "uid": os.getuid(), "unseen": unseen}

    return as_user(check)


def test_a_users_own_stale_lock_is_removed_though_others_processes_are_unseen(shared):
    out = cleared(shared)
    assert out["uid"] != 0 and not out["left"], out
    assert out["said"] == [
        f"removed a stale build lock {shared} (no process is building: a build was stopped midway)"
    ], out
    # what the user could not look at: other users' processes (root's at least, when root ran
    # this test), which the old rule waited a minute on and then stopped
    seen = as_user(lambda: lock_holders("/")[1])
    assert os.geteuid() != 0 or 0 in seen, seen


def test_a_users_own_lock_held_open_stays(shared):
    out = cleared(shared, hold=True)
    assert out["left"] and out["said"] == [], out


def test_another_users_lock_waits_when_young_and_goes_when_old(shared):
    if os.geteuid() != 0:
        pytest.skip("needs root to make a lock another user owns")
    open(shared, "x").close()  # root's: a build of root's that nobody cannot look at
    young = cleared(shared, wait_s=1)
    assert young["left"] and len(young["said"]) == 1, young
    assert young["said"][0].startswith(f"RunError: {shared}: a build lock that no process"), young
    assert "another user's" in young["said"][0] and "after 1 s" in young["said"][0], young
    old = time.time() - STALE_AGE_S - 60
    os.utime(shared, (old, old))
    gone = cleared(shared)
    assert not gone["left"], gone
    assert gone["said"] == [
        f"removed a stale build lock {shared} (31 min old and no process "
        "here holds it: a build was stopped midway)"
    ], gone


def test_run_sh_runs_past_a_stale_lock(tmp_path):
    """The op already built (copied from torch's cache when it is there, else built here), its
    directory holding the lock a killed build leaves: the run finishes."""
    from torch.utils.cpp_extension import _get_build_directory

    ext = tmp_path / "ext"
    built = _get_build_directory("deepspeed_shm_comm", verbose=False)
    if os.path.exists(os.path.join(built, "deepspeed_shm_comm.so")):
        shutil.copytree(built, ext / "deepspeed_shm_comm", ignore=shutil.ignore_patterns("lock"))
    (ext / "deepspeed_shm_comm").mkdir(parents=True, exist_ok=True)
    (ext / "deepspeed_shm_comm" / "lock").touch()
    run = tmp_path / "run"
    out = run_sh(
        "grpo",
        *("--max_steps", "1", "--num_eval_prompts", "4", "--save_model", "False"),
        env={"TORCH_EXTENSIONS_DIR": str(ext), "RUN_DIR": str(run)},
        timeout=600,
    )
    assert f"removed a stale build lock {ext / 'deepspeed_shm_comm' / 'lock'}" in out
    assert [r["step"] for r in train_rows(run)] == [1]
    assert not (ext / "deepspeed_shm_comm" / "lock").exists()

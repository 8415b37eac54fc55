#!/usr/bin/env bash
# Install (if needed), lint, and run the whole test suite. Extra args go to pytest, e.g.
#   bash test.sh -k logprobs -x
#   bash test.sh --fast    # the unit tests only (no torchrun, run.sh, vLLM): after an edit
# (--fast and --gpu are tests/conftest.py's options; docs/testing.md)
set -euo pipefail
cd "$(dirname "$0")"
venv=$(bash install.sh test)   # .venv, or an environment of your own as it is (install.sh)
[[ -z $venv || ${VIRTUAL_ENV:-} == "$venv" ]] || source "$venv/bin/activate"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
# Lint and format first (settings in pyproject.toml): a violation fails the run before any test.
# Not for the GPU tier (--gpu, docs/gpu.md): a GPU node's environment need not have ruff.
if [[ " $* " != *" --gpu "* ]] && { ! ruff check . || ! ruff format --check .; }; then
  echo "test.sh: ruff found the violations above; \`ruff format . && ruff check --fix .\` fixes" \
       "most of them (long comments and strings: by hand)" >&2
  exit 1
fi
set +e
python -m pytest tests -q "$@"
rc=$?
# pytest exits 5 when it collected no tests: that is a broken suite, not a pass.
if [[ $rc == 5 ]]; then echo "test.sh: pytest collected no tests" >&2; rc=1; fi
exit $rc

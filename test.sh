#!/usr/bin/env bash
# Install (if needed) and run the whole test suite. Extra args go to pytest, e.g.
#   bash test.sh -k logprobs -x
set -euo pipefail
cd "$(dirname "$0")"
bash install.sh
[[ -n "${VIRTUAL_ENV:-}" ]] || source .venv/bin/activate
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=offline VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
set +e
python -m pytest tests -q "$@"
rc=$?
# pytest exits 5 when it collected no tests: that is a broken suite, not a pass.
if [[ $rc == 5 ]]; then echo "test.sh: pytest collected no tests" >&2; rc=1; fi
exit $rc

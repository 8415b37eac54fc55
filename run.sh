#!/usr/bin/env bash
# The main job: GRPO (default) or PPO through torchrun + a DeepSpeed JSON config.
#
#   bash run.sh                          # default task: a tiny model learns "largest digit" from scratch
#   bash run.sh grpo --max_steps 2       # extra args go to the script's Args (python grpo.py --help)
#   bash run.sh ppo                      # the PPO loop
#   MODEL=Qwen/Qwen2.5-0.5B-Instruct DATA=train.jsonl bash run.sh     # a real model on your data
#   DS_CONFIG=configs/zero3_offload.json bash run.sh                  # ZeRO-3 with CPU offload
#
# Environment:
#   NPROC        processes per node (default: the number of GPUs, or 2 on a CPU-only machine)
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT    several nodes: run this on each with its NODE_RANK
#                and the same RUN_DIR on a shared filesystem
#   DS_CONFIG    DeepSpeed JSON (default configs/zero3.json; also zero2.json, zero3_offload.json);
#                "auto" values in it are filled from the script's arguments
#   MODEL, DATA  hub id or path of the policy; JSONL of {"prompt": ..., "answer": ...}
#   RUN_DIR      where metrics, checkpoints and the final model go (default runs/<algo>-<time>);
#                resume with RUN_DIR=<that dir> bash run.sh grpo --resume True
#   PREFLIGHT    0 skips the one-process check of every input before torchrun (default 1)
#
# Exit codes: 2 bad input (from the pre-flight check, nothing ran); once torchrun runs, it exits 1
# when a rank fails and its summary shows the rank's code: 2 bad input (e.g. a reward function
# that raised), 3 training diverged (non-finite steps in a row), 4 out of memory (the message
# names the phase and the knob).
set -euo pipefail
cd "$(dirname "$0")"

bash install.sh                                   # first time: create .venv and install; later: a check
[[ -n "${VIRTUAL_ENV:-}" ]] || source .venv/bin/activate

ALGO=grpo
if [[ $# -gt 0 && ( $1 == grpo || $1 == ppo ) ]]; then ALGO=$1; shift; fi
[[ -f $ALGO.py ]] || { echo "run.sh: $ALGO.py not found" >&2; exit 1; }

GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
NPROC=${NPROC:-$(( GPUS > 0 ? GPUS : 2 ))}
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True   # less fragmentation with changing sequence lengths
export TOKENIZERS_PARALLELISM=false WANDB_MODE=${WANDB_MODE:-offline}
if [[ $GPUS == 0 ]]; then
  # CPU: split the cores between the processes instead of oversubscribing them; small vLLM KV cache.
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NPROC > 0 ? $(nproc) / NPROC : 1 ))}
  export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
fi

args=(--ds_config "${DS_CONFIG:-configs/zero3.json}" --run_dir "${RUN_DIR:-runs/$ALGO-$(date +%Y%m%d-%H%M%S)}")
[[ -n "${DATA:-}" ]] && args+=(--data "$DATA")
if [[ -n "${MODEL:-}" ]]; then
  args+=(--model "$MODEL")
  # A pretrained model: a small LR and longer answers (the defaults fit the from-scratch tiny task).
  [[ $ALGO == grpo ]] && args+=(--learning_rate 1e-6 --max_completion_length 256 --prompts_per_rank 4
                                --per_device_train_batch_size 4 --gradient_checkpointing True --eval_steps 100)
fi

# One process first: --help, --estimate_memory, and the pre-flight check of every input (data, model,
# tokenizer, rewards, DeepSpeed JSON vs arguments, resume), so bad input fails here with one message
# and exit code 2, before torchrun starts any rank. PREFLIGHT=0 skips the check.
for a in "$@"; do
  if [[ $a == -h || $a == --help || $a == --estimate_memory ]]; then
    WORLD_SIZE=$(( NPROC * ${NNODES:-1} )) exec python "$ALGO.py" "${args[@]}" "$@"
  fi
done
if [[ ${PREFLIGHT:-1} != 0 ]]; then
  WORLD_SIZE=$(( NPROC * ${NNODES:-1} )) python "$ALGO.py" "${args[@]}" "$@" --preflight True || exit $?
fi

set -x
exec python -m torch.distributed.run --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" \
  --nproc_per_node "$NPROC" --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29500}" \
  "$ALGO.py" "${args[@]}" "$@"

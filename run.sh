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
#   NPROC        processes per node (default: the number of GPUs (those in CUDA_VISIBLE_DEVICES when
#                it is set), or 2 on a CPU-only machine; more than the GPUs: exit 2); each gets
#                OMP_NUM_THREADS = the cores / NPROC unless it is set (CPU and GPU)
#   NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT    several nodes: run this on each with its NODE_RANK
#                and the same RUN_DIR on a shared filesystem. One node without MASTER_PORT: a free
#                port, so several runs share a machine; a MASTER_PORT already taken: exit 2
#   DS_CONFIG    DeepSpeed JSON (default configs/zero3.json; also zero2.json, zero3_offload.json);
#                "auto" values in it are filled from the script's arguments
#   MODEL, DATA  hub id or path of the policy (as --model: both add --recipe pretrained unless
#                --recipe is given); --data: a JSONL/JSON/CSV/parquet file of {"prompt": ...,
#                "answer": ...}, a datasets directory or a hub id (data.py). A relative path is
#                read from the directory you ran run.sh from, as --data, --model and the others
#   RUN_DIR      where metrics, checkpoints and the final model go (default runs/<algo>-<time>);
#                resume with RUN_DIR=<that dir> bash run.sh grpo --resume True; the default, a
#                relative one and --run_dir are under the directory you ran run.sh from
#   PYTHONPATH   where the modules of --reward_funcs and --env are found, beside the directory you
#                ran run.sh from (searched last); a relative entry (PYTHONPATH=.) is from there too
#   VLLM_DEVICES vLLM on devices of its own (--vllm_mode server): e.g. 6,7 starts one vLLM server on
#                GPUs 6 and 7 (tensor parallel over both) and torchrun on the other GPUs (NPROC
#                defaults to their number, CUDA_VISIBLE_DEVICES to their list); on a CPU-only machine
#                any value (say "cpu") starts one vLLM CPU process. Adds --use_vllm True --vllm_mode
#                server --vllm_server_url http://127.0.0.1:<free port>; the server's log is
#                <run dir>/vllm_server.log; it is stopped when the run ends, fails or is interrupted.
#                The server gets the trainer's dtype (GPU) and --max-model-len prompt + completion
#                from the pre-flight; VLLM_SERVER_ARGS: more `vllm serve` flags, after those (they win);
#                VLLM_START_TIMEOUT: seconds to wait for it to answer (default 600)
#   PREFLIGHT    0 skips the one-process check of every input before any rank begins (default 1)
#   TORCH_ELASTIC_SHUTDOWN_TIMEOUT  seconds the ranks get, after SIGTERM or Ctrl-C, to finish their
#                step and save a checkpoint before torchrun kills them (default here 300; torch's: 30)
#   MALLOC_MMAP_THRESHOLD_  CPU, with a recipe (MODEL, --model, --recipe): 65536 unless set (glibc
#                returns freed blocks from 64 KiB up to the system, so a rank's resident set holds
#                what it uses: the SmolLM2 recipes' figures in README and docs are measured with
#                it); set it to override
#   LEAN_RL_ENV  which Python runs the job: install.sh (auto: .venv, or an active environment that
#                has the stack; active: the active Python as it is; venv: .venv)
#
# Exit codes: 0 the run finished; 2 bad input (from the pre-flight check or a taken MASTER_PORT,
# no rank began); 5 stopped by SIGTERM or Ctrl-C after finishing a step and saving its checkpoint
# (continue with --resume True); 130 (Ctrl-C) or 143 (SIGTERM): stopped with no checkpoint of that
# step (a second Ctrl-C, or a signal before a step could finish);
# once torchrun runs, it exits 1 when a rank fails and its summary shows the rank's code: 2 bad input
# (e.g. a reward function that raised), 3 training diverged (non-finite steps in a row), 4 out of
# memory (the message names the phase and the knob); run.sh itself exits 4 when the kernel killed a
# rank (SIGKILL, torchrun's "Signal 9") inside a phase, with one message naming the phase and the
# knob. 6: the vLLM server (VLLM_DEVICES) did not answer or died; the message names its address and
# log file.
set -euo pipefail
# Paths are the user's: a relative DATA, MODEL, DS_CONFIG, --data, --model, --reward_model,
# --teacher_model or --ds_config that names something in the directory run.sh was run from is made
# absolute (one that does not, a hub id or a path from the repository, stays as given); a relative
# RUN_DIR or --run_dir, and the default run directory, are always under that directory. Then run.sh
# works from the repository.
here=$PWD
input_path() { if [[ -n $1 && $1 != /* && -e $here/$1 ]]; then echo "$here/$1"; else echo "$1"; fi; }
output_path() { if [[ -n $1 && $1 != /* ]]; then echo "$here/$1"; else echo "$1"; fi; }
user_args=()
prev=""
for a in "$@"; do
  case $prev in
    --data|--model|--reward_model|--teacher_model|--ds_config) a=$(input_path "$a") ;;
    --run_dir) a=$(output_path "$a") ;;
  esac
  case $a in
    --data=*|--model=*|--reward_model=*|--teacher_model=*|--ds_config=*)
      a=${a%%=*}=$(input_path "${a#*=}") ;;
    --run_dir=*) a=--run_dir=$(output_path "${a#*=}") ;;
  esac
  user_args+=("$a"); prev=$a
done
set -- ${user_args[@]+"${user_args[@]}"}
[[ -z ${DATA:-} ]] || DATA=$(input_path "$DATA")
[[ -z ${MODEL:-} ]] || MODEL=$(input_path "$MODEL")
[[ -z ${DS_CONFIG:-} ]] || DS_CONFIG=$(input_path "$DS_CONFIG")
[[ -z ${RUN_DIR:-} ]] || RUN_DIR=$(output_path "$RUN_DIR")
# Python modules are the user's too: a relative PYTHONPATH entry (PYTHONPATH=., or an empty one) is
# made absolute from here, and the directory run.sh was run from is searched last for the modules
# --reward_funcs and --env name (tasks.import_user_module), so `--reward_funcs mymod.myfunc` finds
# mymod.py beside the user, and never hides a module of the repository or an installed package.
if [[ -n ${PYTHONPATH:-} ]]; then
  IFS=: read -ra entries <<< "$PYTHONPATH:"; absolute=()
  for e in "${entries[@]}"; do [[ $e == /* ]] && absolute+=("$e") || absolute+=("$here/$e"); done
  PYTHONPATH=$(IFS=:; echo "${absolute[*]}")
fi
export LEAN_RL_USER_DIR=$here
cd "$(dirname "$0")"

# The environment: .venv (created and installed the first time, later a check), or one of your own
# that has the stack, used as it is (install.sh: LEAN_RL_ENV); install.sh prints what to activate.
venv=$(bash install.sh)
[[ -z $venv || ${VIRTUAL_ENV:-} == "$venv" ]] || source "$venv/bin/activate"

ALGO=grpo
if [[ $# -gt 0 && ( $1 == grpo || $1 == ppo || $1 == rm ) ]]; then ALGO=$1; shift; fi
[[ -f $ALGO.py ]] || { echo "run.sh: $ALGO.py not found" >&2; exit 1; }

GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [[ $GPUS -gt 0 && -n ${CUDA_VISIBLE_DEVICES+set} ]]; then   # torch sees only this list
  IFS=, read -ra visible <<< "$CUDA_VISIBLE_DEVICES"; GPUS=${#visible[@]}
fi
if [[ -n ${VLLM_DEVICES:-} && $GPUS -gt 0 ]]; then   # training keeps the GPUs the server does not take
  IFS=, read -ra all_devs <<< "${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $(( GPUS - 1 )))}"
  IFS=, read -ra server_devs <<< "$VLLM_DEVICES"
  train_devs=(); for d in "${all_devs[@]}"; do [[ ,$VLLM_DEVICES, == *,$d,* ]] || train_devs+=("$d"); done
  (( ${#train_devs[@]} > 0 )) || { echo "run.sh: VLLM_DEVICES=$VLLM_DEVICES leaves no GPU to train on" >&2; exit 2; }
  GPUS=${#train_devs[@]}
fi
NPROC=${NPROC:-$(( GPUS > 0 ? GPUS : 2 ))}
if [[ $GPUS -gt 0 && $NPROC -gt $GPUS ]]; then   # else rank $GPUS fails late, in set_device
  echo "run.sh: error: NPROC=$NPROC processes but $GPUS GPUs for training (one rank per GPU):" \
       "set NPROC to at most $GPUS, or make more GPUs visible (CUDA_VISIBLE_DEVICES, VLLM_DEVICES)" >&2
  exit 2
fi
# Split the cores between the processes instead of oversubscribing them, on GPU too: torchrun sets
# OMP_NUM_THREADS=1 when it is unset, which leaves DeepSpeedCPUAdam (configs/zero3_offload.json)
# stepping the offloaded optimizer on one core per rank.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NPROC > 0 ? $(nproc) / NPROC : 1 ))}
[[ $GPUS == 0 ]] ||
  echo "run.sh: $NPROC processes per node, $GPUS GPUs for training, $OMP_NUM_THREADS CPU threads each" >&2
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True   # less fragmentation with changing sequence lengths
export TOKENIZERS_PARALLELISM=false WANDB_MODE=${WANDB_MODE:-offline}
[[ $GPUS != 0 ]] || export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}   # CPU: a small KV cache

run_dir=${RUN_DIR:-$here/runs/$ALGO-$(date +%Y%m%d-%H%M%S)}   # under the directory run from
args=(--ds_config "${DS_CONFIG:-configs/zero3.json}" --run_dir "$run_dir")
model=${MODEL:-} recipe=""   # the last --model, --run_dir and --recipe given win
prev=""
for a in "$@"; do
  case $prev in --run_dir) run_dir=$a ;; --model) model=$a ;; --recipe) recipe=$a ;; esac
  case $a in
    --run_dir=*) run_dir=${a#*=} ;; --model=*) model=${a#*=} ;; --recipe=*) recipe=${a#*=} ;;
  esac
  prev=$a
done
[[ -n "${DATA:-}" ]] && args+=(--data "$DATA")
[[ -n "${MODEL:-}" ]] && args+=(--model "$MODEL")
# A pretrained model (MODEL or --model, the same run): the loop's `pretrained` recipe unless
# --recipe names one (python $ALGO.py --help lists their values; --recipe '' keeps the loop's own
# defaults), so `bash run.sh ppo --model X` is the run of `python ppo.py --model X --recipe
# pretrained`.
given_recipe=""; for a in "$@"; do [[ $a == --recipe || $a == --recipe=* ]] && given_recipe=1; done
if [[ -n $model && -z $given_recipe ]]; then
  args+=(--recipe pretrained) recipe=pretrained
fi
# CPU, a recipe's real model (MODEL, --model, --recipe): glibc hands freed blocks of 64 KiB and
# more back to the system at once; by default it keeps them in the resident set, which the memory
# ledger measures (and the kernel counts against the machine). The SmolLM2 recipes' figures in
# README and docs are measured with it. Not for the tiny built-in task, whose steps it slows (1.1-1.2
# s, not 0.7-0.8).
if [[ $GPUS == 0 && -n $recipe ]]; then
  export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-65536}
fi

if [[ -n ${VLLM_DEVICES:-} ]]; then   # server mode's flags, known to the pre-flight too
  port=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  url=http://127.0.0.1:$port
  args+=(--use_vllm True --vllm_mode server --vllm_server_url "$url")
fi

# One process: --help, --estimate_memory, and the pre-flight check of every input (data, model,
# tokenizer, rewards, DeepSpeed JSON vs arguments, resume), so bad input fails with one message and
# exit code 2 before any rank begins. PREFLIGHT=0 skips the check.
# --estimate_memory as the parser reads it: alone, "--estimate_memory True" or "=True" (yes, 1, ...)
one_process=""
argv=("$@")
for i in "${!argv[@]}"; do
  a=${argv[$i]} value=""
  case $a in
    -h|--help) one_process=1 ;;
    --estimate_memory=*) value=${a#*=} ;;
    --estimate_memory) value=${argv[$((i + 1))]:-true}; [[ $value == --* ]] && value=true ;;
  esac
  [[ ${value,,} =~ ^(true|t|yes|y|1)$ ]] && one_process=1
done
if [[ -n $one_process ]]; then
  LOCAL_WORLD_SIZE=$NPROC WORLD_SIZE=$(( NPROC * ${NNODES:-1} )) exec python "$ALGO.py" "${args[@]}" "$@"
fi
# The rendezvous port torchrun's store listens on (this node is the master when NODE_RANK is 0). One
# given in MASTER_PORT is checked here, before the pre-flight; without it, one node picks a free one
# just before torchrun starts, so two runs on one machine do not meet on torch's default 29500.
port_free() {   # SO_REUSEADDR as torch's store: a port left in TIME_WAIT by the last run is free
  python -c 'import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try: s.bind(("", int(sys.argv[1])))
except OSError: sys.exit(1)' "$1"
}
port_taken() {
  echo "run.sh: error: MASTER_PORT=$1 is taken on this machine (another run's rendezvous?): unset" \
       "MASTER_PORT to let run.sh pick a free port (one node), or set another" >&2
  exit 2
}
if [[ -n ${MASTER_PORT:-} && ${NODE_RANK:-0} == 0 ]]; then
  port_free "$MASTER_PORT" || port_taken "$MASTER_PORT"
fi
# The pre-flight runs beside torchrun: the ranks import torch, transformers and DeepSpeed while it
# checks, and begin once it passed (the file $beside exists: exits.wait_for_preflight); when it
# fails, torchrun is killed before any rank began and run.sh exits with its code. Server mode runs
# it first: the server starts from the model and the settings it writes.
preflight() {
  LOCAL_WORLD_SIZE=$NPROC WORLD_SIZE=$(( NPROC * ${NNODES:-1} )) python "$ALGO.py" "${args[@]}" "$@" --preflight True
}
beside=""
if [[ ${PREFLIGHT:-1} != 0 && -n ${VLLM_DEVICES:-} ]]; then
  preflight "$@" || exit $?
elif [[ ${PREFLIGHT:-1} != 0 ]]; then
  beside=$(mktemp -u "${TMPDIR:-/tmp}/lean-rl-preflight.XXXXXX")
  trap 'rm -f "$beside"' EXIT
fi

# Server mode: one vLLM server in a session of its own, started after the pre-flight (which builds the
# built-in task's model), stopped with its whole process group (API server, engine core, workers) on
# every way out of this script: the end of the run, a failure, a signal.
server=""
stop_server() {
  [[ -n $server ]] || return 0
  kill -TERM -- -"$server" 2>/dev/null
  for _ in $(seq 1 30); do kill -0 -- -"$server" 2>/dev/null || return 0; sleep 1; done
  kill -KILL -- -"$server" 2>/dev/null; return 0
}
if [[ -n ${VLLM_DEVICES:-} ]]; then
  [[ ${NNODES:-1} == 1 ]] || { echo "run.sh: VLLM_DEVICES runs its server beside a one-node run" >&2; exit 2; }
  model=${model:-$run_dir/model}   # the built-in task's model, built by the pre-flight
  server_log=$run_dir/vllm_server.log tp=1
  [[ $GPUS -gt 0 ]] && tp=${#server_devs[@]}
  mkdir -p "$run_dir"
  trap stop_server EXIT
  # The trainer's dtype and the run's longest sequence, from the pre-flight (checks.py,
  # write_server_settings); VLLM_SERVER_ARGS come after them, so a flag given there wins.
  settings=$run_dir/vllm_server.json serve_flags=()
  setting() { python -c 'import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$settings" "$1"; }
  if [[ -f $settings ]]; then
    serve_flags=(--max-model-len "$(setting max_model_len)")
    [[ $GPUS == 0 ]] || serve_flags+=(--dtype "$(setting dtype)")
  else
    echo "run.sh: PREFLIGHT=0: the vLLM server takes vLLM's own dtype and context length (set them in VLLM_SERVER_ARGS)" >&2
  fi
  # shellcheck disable=SC2086   # VLLM_SERVER_ARGS: several flags in one string
  if [[ $GPUS -gt 0 ]]; then
    CUDA_VISIBLE_DEVICES=$VLLM_DEVICES setsid python vllm_server.py "$model" "$port" 127.0.0.1 "$tp" "${serve_flags[@]}" ${VLLM_SERVER_ARGS:-} >"$server_log" 2>&1 &
    server=$!; export CUDA_VISIBLE_DEVICES; CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${train_devs[*]}")
  else   # CPU: fp32 as the CPU trainer (not the config's dtype); eager: starts without compiling
    setsid python vllm_server.py "$model" "$port" 127.0.0.1 1 --dtype float32 --enforce-eager "${serve_flags[@]}" ${VLLM_SERVER_ARGS:-} >"$server_log" 2>&1 &
    server=$!
  fi
  echo "$server" > "$run_dir/vllm_server.pid"
  echo "run.sh: vLLM server (pid $server) starting at $url on ${VLLM_DEVICES}; log: $server_log" >&2
  started=$(date +%s)
  until python -c "import urllib.request as u; u.urlopen('$url/v1/models', timeout=5)" 2>/dev/null; do
    if ! kill -0 "$server" 2>/dev/null || (( $(date +%s) - started > ${VLLM_START_TIMEOUT:-600} )); then
      echo "run.sh: the vLLM server at $url did not answer (it exited or took over" \
           "${VLLM_START_TIMEOUT:-600} s); its log: $server_log" >&2
      exit 6
    fi
    sleep 2
  done
  echo "run.sh: vLLM server answers at $url after $(( $(date +%s) - started )) s" >&2
fi

# Preemption: SIGTERM (what a scheduler sends before it kills a job) or Ctrl-C goes to torchrun, which
# passes it on to the ranks; they finish the step in progress, save its checkpoint and exit 5
# (checkpoint.StopOnSignal), and torchrun ends with 128 + the signal's number. This script then exits 5
# when that checkpoint was written, so a job script can requeue the run with --resume True, and else
# with torchrun's code (130 for SIGINT, 143 for SIGTERM).
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-300}
# Each rank's phase now (memory.MemoryLedger), read at the end: an old run's are cleared only once
# the pre-flight passed (bad input leaves the run directory as it was).
clear_phases() { rm -f "$run_dir"/memory_phase.rank*; }
[[ -n $beside ]] || clear_phases
if [[ -z ${MASTER_PORT:-} && ${NNODES:-1} == 1 ]]; then
  MASTER_PORT=$(python -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
elif [[ ${NODE_RANK:-0} == 0 ]]; then   # taken since the check above (a run started meanwhile)
  port_free "${MASTER_PORT:-29500}" || port_taken "${MASTER_PORT:-29500}"
fi
launch=(python -m torch.distributed.run --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}"
  --nproc_per_node "$NPROC" --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29500}"
  "$ALGO.py" "${args[@]}" "$@")
# torchrun's main as `python -m torch.distributed.run` runs it, less its own account of a stop: on
# SIGTERM or Ctrl-C it logs each signal it passes on and ends in a SignalException traceback, where
# the ranks' lines and this script's already say what happened. It exits 128 + the signal's number.
quiet_torchrun='import logging, sys
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main
said = {"Received %s death signal, shutting down workers", "Got termination signal: %s",
        "Sending process %s closing signal %s"}
for name in ("agent.server.api", "multiprocessing.api"):
    logger = logging.getLogger("torch.distributed.elastic." + name)
    logger.addFilter(lambda r: not (isinstance(r.msg, str) and r.msg in said))
try:
    main()
except SignalException as e:
    sys.exit(128 + int(e.sigval))'
# torchrun in a session of its own: a signal reaches it once, from the traps below
# the reward and disk lines: said once, by the pre-flight (PREFLIGHT_SAID: the ranks' pass is quiet)
said=0; [[ ${PREFLIGHT:-1} != 0 ]] && said=1
PREFLIGHT_PASSED=$beside PREFLIGHT_PARENT=$$ PREFLIGHT_SAID=$said setsid python -c "$quiet_torchrun" "${launch[@]:3}" &
pid=$! signal="" signal_at=0
trap 'signal=TERM signal_at=$(date +%s); kill -TERM $pid 2>/dev/null' TERM
trap 'signal=INT signal_at=$(date +%s); kill -INT $pid 2>/dev/null' INT
set +e
if [[ -n $beside ]]; then
  preflight "$@"; rc=$?
  if [[ $rc != 0 ]]; then   # the ranks are still waiting: they end with torchrun
    kill -KILL "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
    exit $rc
  fi
  clear_phases; touch "$beside"
fi
echo "+ ${launch[*]}" >&2   # what the ranks run, once they begin
wait $pid; rc=$?
while kill -0 $pid 2>/dev/null; do wait $pid; rc=$?; done   # a trap cuts `wait` short: wait again
latest=$run_dir/checkpoints/latest
if [[ -n $signal && -f $latest && $(stat -c %Y "$latest") -ge $signal_at ]]; then
  echo "run.sh: stopped by SIG$signal with a checkpoint ($(cat "$latest")); continue with" \
       "RUN_DIR=$run_dir bash run.sh $ALGO ... --resume True" >&2
  exit 5
fi
if [[ -n $signal && $rc != 0 ]]; then   # a second Ctrl-C, or a signal before a step could finish
  echo "run.sh: stopped by SIG$signal with no checkpoint of that step; --resume True continues" \
       "from the run's last one, if it saved any" >&2
  exit $rc
fi
# A rank the kernel killed (SIGKILL, torchrun: "Signal 9") could say nothing: its ledger's file still
# names the phase it was in (a rank that failed in Python closed its phase on the way out). On CPU
# that is the out-of-memory killer: one message with the phase and the knob, and exit 4.
for f in "$run_dir"/memory_phase.rank*; do
  [[ $rc != 0 && -s $f ]] || continue
  IFS=$'\t' read -r phase hint < "$f"
  echo "run.sh: rank ${f##*.rank} was killed (SIGKILL, torchrun's \"Signal 9\") in phase '$phase'" \
       "with no message of its own: most likely out of memory (the kernel's OOM killer); $hint." \
       "\`bash run.sh $ALGO ... --estimate_memory True\` predicts each phase's peak" >&2
  rc=4
done
if [[ -n $server && $rc != 0 ]] && ! kill -0 "$server" 2>/dev/null; then
  echo "run.sh: the vLLM server at $url died during the run; its log: $server_log" >&2
  exit 6
fi
exit $rc

"""Do finished runs exit 0, every time? Short 2-process ZeRO-3 runs of grpo.py and ppo.py, repeated
while other processes keep every core busy; counts the runs whose torchrun exit code is not 0.

    python bench/shutdown_stress.py --runs 30          # 15 GRPO + 15 PPO, 2 busy-loop loaders
    python bench/shutdown_stress.py --runs 10 --loops ppo --loaders 4

Each run trains 2 steps (tiny model, the built-in task, held-out eval and final save included, so
every exit path a finished run takes is exercised) through torchrun. A run that exits non-zero
keeps its log in --out (default bench/out/shutdown/) and its last lines are printed; the summary
line is `exits != 0: K of N` per loop. The loaders are plain Python busy loops: they take the
CPU from the ranks at random moments, which is what made a rare teardown race show up.
"""

import argparse
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = [
    "--ds_config",
    "configs/zero3.json",
    "--max_steps",
    "2",
    "--num_generations",
    "2",
    "--prompts_per_rank",
    "4",
    "--num_eval_prompts",
    "4",
    "--eval_steps",
    "0",
]
PER_LOOP = {
    "grpo": ["--per_device_train_batch_size", "4"],
    "ppo": ["--per_device_train_batch_size", "4"],
}


def busy():
    while True:
        pass


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(loop, run_dir, log_path, timeout):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        f"{loop}.py",
        *COMMON,
        *PER_LOOP[loop],
        "--run_dir",
        run_dir,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    with open(log_path, "w") as log:
        try:
            return subprocess.run(
                cmd,
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                start_new_session=True,
            ).returncode
        except subprocess.TimeoutExpired:
            return "timeout"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=30, help="runs in all, alternating the loops")
    p.add_argument("--loops", default="grpo,ppo", help="comma-separated: grpo, ppo")
    p.add_argument("--loaders", type=int, default=2, help="busy-loop processes beside the runs")
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "shutdown"))
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    loops = a.loops.split(",")
    loaders = [mp.Process(target=busy, daemon=True) for _ in range(a.loaders)]
    for proc in loaders:
        proc.start()
    bad = {loop: [] for loop in loops}
    done = {loop: 0 for loop in loops}
    try:
        for i in range(a.runs):
            loop = loops[i % len(loops)]
            log_path = os.path.join(a.out, f"{i:03d}-{loop}.log")
            t0 = time.time()
            rc = one_run(loop, os.path.join(a.out, f"run-{i:03d}"), log_path, a.timeout)
            done[loop] += 1
            print(f"run {i + 1}/{a.runs} {loop}: exit {rc} in {time.time() - t0:.0f}s", flush=True)
            if rc != 0:
                bad[loop].append(i)
                with open(log_path) as f:
                    print("".join(f.readlines()[-15:]), flush=True)
            else:
                os.remove(log_path)
            subprocess.run(["rm", "-rf", os.path.join(a.out, f"run-{i:03d}")])
    finally:
        for proc in loaders:
            proc.terminate()
    for loop in loops:
        print(
            f"{loop}: exits != 0: {len(bad[loop])} of {done[loop]}"
            + (f" (runs {bad[loop]}, logs in {a.out})" if bad[loop] else "")
        )
    return 1 if any(bad.values()) else 0


if __name__ == "__main__":
    sys.exit(main())

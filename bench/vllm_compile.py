"""A colocated vLLM engine on CPU, compiled (vLLM's default: torch.compile) against eager: seconds
to start the engine and seconds per generate call, alternating in one run, each engine in a
fresh process as a rank's would be.

    python bench/vllm_compile.py                  # SmolLM2-135M-Instruct, 3 rounds
    python bench/vllm_compile.py --calls 20

Each round starts the engine as grpo.py's colocated mode does (generation.VLLMGenerator: one
process, external_launcher, the run's CPU settings) from the SmolLM2 model smollm2.py converts,
then makes --calls generate calls of the smollm2-addition recipe's shape (16 prompts x 8
completions, 32 new tokens). The first round compiles into vLLM's cache (~/.cache/vllm); later
rounds load it, as a researcher's second run does. Prints the medians of the later rounds and the
number of calls after which compiling would have paid for its start; writes
bench/out/vllm_compile.json.
"""

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

from transformers import HfArgumentParser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Args:
    rounds: int = field(default=3, metadata={"help": "compiled + eager engines, this many times"})
    calls: int = field(default=5, metadata={"help": "generate calls per engine"})
    out: str = field(default="bench/out/vllm_compile.json", metadata={"help": "results"})


def engine(eager, calls):
    """In this (fresh) process: the engine's start and each generate call, in seconds."""
    sys.path.insert(0, ROOT)
    from generation import VLLMGenerator
    from smollm2 import model_dir

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # what run.sh sets on CPU
    t0 = time.time()
    gen = VLLMGenerator(model_dir(), max_model_len=512, dtype="float32", enforce_eager=eager)
    start = time.time() - t0
    tok = gen.llm.get_tokenizer()
    prompts = [tok(f"What is {i} + {2 * i + 7}?")["input_ids"] for i in range(16)]
    seconds = []
    for _ in range(calls):
        t0 = time.time()
        gen.generate(prompts, num_generations=8, max_new_tokens=32)
        seconds.append(time.time() - t0)
    return {"start": start, "calls": seconds}


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def one_engine(eager, calls):
    """engine() in a child process (a vLLM engine per process, as per rank)."""
    env = {**os.environ, "MASTER_PORT": free_port()}
    argv = [sys.executable, __file__, "--worker", "eager" if eager else "compiled", str(calls)]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
    result = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not result:
        raise SystemExit(f"engine (eager={eager}) exited {out.returncode}:\n{out.stderr[-3000:]}")
    return json.loads(result[-1][len("RESULT ") :])


def main():
    (args,) = HfArgumentParser(Args).parse_args_into_dataclasses()
    rounds = []
    for _ in range(args.rounds):
        r = {mode: one_engine(mode == "eager", args.calls) for mode in ("compiled", "eager")}
        rounds.append(r)
        brief = {
            m: {"start": round(v["start"], 1), "calls": [round(c, 2) for c in v["calls"]]}
            for m, v in r.items()
        }
        print(json.dumps(brief), flush=True)
    later = rounds[1:] or rounds  # the first round fills vLLM's compile cache
    med = {}
    for mode in ("compiled", "eager"):
        med[mode] = {
            "start": statistics.median(r[mode]["start"] for r in later),
            # each call after the first (the first also warms the kernels up)
            "call": statistics.median(c for r in later for c in r[mode]["calls"][1:]),
            "first_call": statistics.median(r[mode]["calls"][0] for r in later),
        }
    c, e = med["compiled"], med["eager"]
    gain = e["call"] - c["call"]  # seconds compiling saves per call (negative: none)
    cost = (c["start"] + c["first_call"]) - (e["start"] + e["first_call"])
    pays_after = f"{1 + cost / gain:.0f} calls" if gain > 0 else "never"
    print(
        f"compiled: start {c['start']:.1f} s, first call {c['first_call']:.2f} s, then "
        f"{c['call']:.2f} s/call; eager: start {e['start']:.1f} s, first call "
        f"{e['first_call']:.2f} s, then {e['call']:.2f} s/call; compiling pays for its start "
        f"after {pays_after} (medians of rounds 2-{args.rounds}: the cache warm)"
    )
    os.makedirs(os.path.dirname(os.path.join(ROOT, args.out)), exist_ok=True)
    with open(os.path.join(ROOT, args.out), "w") as f:
        json.dump({"args": vars(args), "rounds": rounds, "median": med}, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        result = engine(sys.argv[2] == "eager", int(sys.argv[3]))
        print("RESULT " + json.dumps(result), flush=True)
        os._exit(0)  # vLLM's engine and gloo threads: no interpreter teardown
    main()

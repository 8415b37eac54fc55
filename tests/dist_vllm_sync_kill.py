"""torchrun worker (2 CPU ZeRO-3 ranks, one vLLM CPU server started by the test): a weight sync
that works (weight version 1), then one during which rank 0 kills the server's engine process
(its worker) after sending 3 parameters. Run by tests/test_vllm_server.py; argv: model_dir url
server_pid. Rank 0 must end with the server error (exit 6), not hang; nothing prints DONE.
"""

import os
import signal
import sys

import torch
import torch.distributed as dist


def main(model_dir, url, server_pid):
    import deepspeed
    import psutil
    from transformers import AutoModelForCausalLM

    import vllm_transfer
    from vllm_server import ServerError, VLLMServerGenerator

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    gen = VLLMServerGenerator(url, sync_timeout=300)
    gen.sync_weights(engine, max_numel=20000)
    if rank == 0:
        print(f"OK first sync, weight version {gen.weight_version()}", flush=True)

    if rank == 0:
        stream = vllm_transfer.iter_full_params

        def killing(*args, **kwargs):
            for i, item in enumerate(stream(*args, **kwargs)):
                if i == 3:
                    for child in psutil.Process(int(server_pid)).children(recursive=True):
                        os.kill(child.pid, signal.SIGKILL)
                    print("killed the server's engine", flush=True)
                yield item

        vllm_transfer.iter_full_params = killing
    try:
        gen.sync_weights(engine, max_numel=20000)
    except ServerError as e:
        print(f"[rank {rank}] error: {e}\nrank {rank} exit 6", flush=True)
        sys.stdout.flush()
        os._exit(6)
    print(f"rank {rank} DONE", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])

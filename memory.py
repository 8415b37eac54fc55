"""Memory as measured: a per-phase ledger of peaks (estimate.py predicts them).

    from memory import MemoryLedger
    ledger = MemoryLedger(device)
    with ledger.phase("rollout"):          # peak bytes of this phase, recorded on exit
        ...
    ledger.line()           # "mem GB rollout 1.21 update 3.40*" (* = this step's highest)
    ledger.step_metrics()   # {"mem/rollout": 1.21, ...} for this step, then starts the next
    ledger.summary()        # {"highest": "update", "peak_gb": {...}, "text": ...} over the run

Measured: on CUDA, torch.cuda.max_memory_allocated (reset per phase: torch's own allocations
only, not the CUDA context). A colocated vLLM allocates its weights and KV cache through torch's
allocator, and its sleep unmaps that memory but keeps the tensors, so torch still counts it:
`not_resident` (VLLMGenerator.sleeping_bytes: what vLLM's start-up added to
torch.cuda.memory_allocated, while it sleeps) is subtracted from a phase vLLM sleeps through
(old/ref log-probs, update, optimizer step), not from the rollout or the weight sync, during
which it wakes or works. On CPU, the process's peak
resident set (Linux VmHWM, reset per phase through /proc/self/clear_refs; elsewhere the
never-reset ru_maxrss), which includes the ~0.5 GB Python/torch runtime and whatever is offloaded.
"""

import ctypes
import functools
import os
from contextlib import contextmanager

import torch

GB = 2**30


# ---- The ledger: measured peak per phase ------------------------------------------------------
def _proc_status_kib(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))


def release_free_heap():
    """Give the heap memory glibc holds freed back to the kernel (malloc_trim), on CPU at the start
    of every phase: freed tensors below glibc's mmap threshold (which rises after large frees, up
    to 32 MiB) stay resident otherwise, and a rank's resident set grows step after step with
    memory nothing uses. A no-op where libc has no malloc_trim."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:  # no C library to load (not Linux/glibc)
        return None


def is_out_of_memory(e):
    """CUDA's OutOfMemoryError, the CPU allocator's plain RuntimeError, or vLLM's cumem allocator
    mapping its sleeping memory back in `wake_up` (vLLM 0.32 csrc/cumem_allocator.cpp: a failed
    cuMemCreate is a RuntimeError "CUDA Error: out of memory at <file>:<line>")."""
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError)
        and (
            ("DefaultCPUAllocator" in str(e) and "allocate" in str(e))
            or str(e).startswith("CUDA Error: out of memory")
        )
    )


class MemoryLedger:
    """Peak memory per named phase, per step and over the run. Phases do not nest.

    Running out of memory inside a phase raises torch.OutOfMemoryError with a message naming the
    phase, its peak so far and `hints[phase]`: the knob that lowers that phase's peak (the loop
    knows its own knobs' names)."""

    def __init__(self, device, hints=None, not_resident=None, phase_file=None):
        self.device = torch.device(device)
        self.hints = hints or {}
        # () -> bytes the measure counts that hold no memory now: a sleeping vLLM's pool
        # (VLLMGenerator.sleeping_bytes), subtracted from a phase it sleeps through
        self.not_resident = not_resident or (lambda: 0)
        # phase_file: "<phase>\t<hint>" while a phase runs, empty between phases. A process the
        # kernel kills (SIGKILL: its out-of-memory killer) cannot say where it was; run.sh reads
        # the file it left and names the phase and the knob (a phase that ended is never named).
        self.phase_file = phase_file
        self.cuda = self.device.type == "cuda"
        self.linux = os.path.exists("/proc/self/clear_refs")
        self.step = {}  # phase -> peak bytes this step (max over repeats of the phase)
        self.run = {}  # phase -> peak bytes over the run
        self.rise = {}  # phase -> this step's peak minus the bytes in use when the phase began
        self._open = None

    def current(self):
        """Bytes in use now: allocated on CUDA, resident set on CPU."""
        if self.cuda:
            return torch.cuda.memory_allocated(self.device)
        return _proc_status_kib("VmRSS") * 1024 if self.linux else 0

    def reset_peak(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.linux:
            release_free_heap()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # "5" resets the high-water mark VmHWM to the current RSS

    def peak(self):
        """Peak bytes since the last reset_peak."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        if self.linux:
            return _proc_status_kib("VmHWM") * 1024
        import resource

        # KiB on Linux, never reset
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    @contextmanager
    def phase(self, name):
        if self._open is not None:
            raise RuntimeError(
                f"memory phase {name!r} opened inside {self._open!r}: phases do not nest"
            )
        self._open = name
        self._mark(f"{name}\t{self.hints.get(name, 'see README, Troubleshooting memory')}\n")
        self.reset_peak()
        asleep = self.not_resident()
        start = self.current() - asleep
        try:
            yield
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not is_out_of_memory(e):
                raise
            raise torch.OutOfMemoryError(self._oom_message(name, e)) from e
        finally:
            # vLLM asleep from start to end: its pool is not in this phase's peak; awake at
            # either end (weight_sync wakes it, rollout puts it to sleep): counted
            asleep = min(asleep, self.not_resident())
            self._mark("")
            peak, self._open = self.peak() - asleep, None
            self.step[name] = max(self.step.get(name, 0), peak)
            self.run[name] = max(self.run.get(name, 0), peak)
            self.rise[name] = max(self.rise.get(name, 0), peak - start)

    def _mark(self, text):
        if self.phase_file:
            with open(self.phase_file, "w") as f:
                f.write(text)

    def _oom_message(self, name, e):
        total = (
            f" of {torch.cuda.get_device_properties(self.device).total_memory / GB:.1f} GB"
            if self.cuda
            else " (process RSS)"
        )
        earlier = ", ".join(f"{k} {v / GB:.2f}" for k, v in self.run.items())
        return (
            f"out of memory in phase {name!r} on {self.device} (peak {self.peak() / GB:.2f} "
            f"GB{total}"
            + (f"; earlier steps' peaks GB: {earlier}" if earlier else "")
            + "): "
            + self.hints.get(name, "see docs/troubleshooting.md")
            + f". `--estimate_memory True` predicts each phase's peak. "
            f"({str(e).splitlines()[0][:160]})"
        )

    def line(self):
        """This step's peaks in one short line; * marks the highest."""
        top = max(self.step, key=self.step.get, default=None)
        return "mem GB " + " ".join(
            f"{k} {v / GB:.2f}{'*' if k == top else ''}" for k, v in self.step.items()
        )

    def step_metrics(self, prefix="mem/"):
        """{prefix + phase: GB} of this step, then clears the step (the run's peaks stay)."""
        out = {f"{prefix}{k}": v / GB for k, v in self.step.items()}
        self.step, self.rise = {}, {}
        return out

    def summary(self):
        """The run's peak per phase and the phase with the highest one."""
        if not self.run:
            return {"highest": None, "peak_gb": {}, "text": "mem: no phase recorded"}
        top = max(self.run, key=self.run.get)
        where = "allocated on " + str(self.device) if self.cuda else "peak RSS of this process"
        text = (
            f"peak memory ({where}): highest in {top} at {self.run[top] / GB:.2f} GB; "
            + ", ".join(f"{k} {v / GB:.2f}" for k, v in self.run.items())
        )
        return {"highest": top, "peak_gb": {k: v / GB for k, v in self.run.items()}, "text": text}

"""Rollouts made ahead of the trainer, with bounded staleness: asynchronous GRPO's producer.

A background thread on each rank calls produce(step) for step = start, start + 1, ... while the
main thread trains. Step s may start only once the trainer has finished step s - K - 1 (trained
on it and sent the weights), so a rollout started with weight version v is trained on at version
at most v + K: staleness (versions between the sampler's weights and the trainer's) <= K.
produce() must make no collective call (it runs beside the main thread's ZeRO-3 gathers): HTTP
requests to a vLLM server and reward functions only. Imports no sibling.

Public API
    Prefetcher(produce, start, stop, max_staleness, version, retryable=())
        produce(step) -> any; version() -> int, the weights the sampler holds now (read when
        produce starts); a `retryable` error is retried once, then raised by get()
        .get(step, version) -> (result, staleness, seconds waited)   main thread, in order;
            version: the trainer's now. A result more than max_staleness versions behind it is
            dropped and produced again here (counted in .dropped)
        .step_done()      the main thread finished a step and synced the weights: one more may start
        .idle_seconds()   seconds the producer waited for weights since the last call
        .close()          stop producing (in-flight work is dropped)
"""

import threading
import time


class Prefetcher:
    def __init__(self, produce, start, stop, max_staleness, version, retryable=()):
        self.produce, self.version, self.retryable = produce, version, retryable
        self.next, self.stop, self.max_staleness = start, stop, max_staleness
        self.done = start  # steps the trainer finished (their weights synced)
        self.results = {}  # step -> (result, version, None) or (None, None, error)
        self.idle, self.closed, self.dropped = 0.0, False, 0
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, daemon=True, name="prefetch")
        self.thread.start()

    def _run(self):
        while True:
            with self.cond:
                t0 = time.time()
                while not self.closed and self.next > self.done + self.max_staleness:
                    self.cond.wait()  # too far ahead: wait for newer weights
                self.idle += time.time() - t0
                if self.closed or self.next >= self.stop:
                    return
                step = self.next
                self.next += 1
            version = self.version()
            try:
                try:
                    out = (self.produce(step), version, None)
                except self.retryable:
                    version = self.version()
                    out = (self.produce(step), version, None)  # once more, then it is the error
            except Exception as e:  # handed to the main thread, which raises it
                out = (None, None, e)
            with self.cond:
                self.results[step] = out
                self.cond.notify_all()
                if out[2] is not None:
                    return

    def get(self, step, version):
        t0 = time.time()
        with self.cond:
            while step not in self.results:
                if not self.thread.is_alive() and step not in self.results:
                    raise RuntimeError(f"the rollout producer stopped before step {step + 1}")
                self.cond.wait(timeout=1.0)
            result, started, error = self.results.pop(step)
        if error is not None:
            raise error
        if version - started > self.max_staleness:  # never trained on: sampled again, now
            self.dropped += 1
            started = self.version()
            result = self.produce(step)
        return result, version - started, time.time() - t0

    def step_done(self):
        with self.cond:
            self.done += 1
            self.cond.notify_all()

    def idle_seconds(self):
        with self.cond:
            idle, self.idle = self.idle, 0.0
        return idle

    def close(self):
        with self.cond:
            self.closed = True
            self.cond.notify_all()

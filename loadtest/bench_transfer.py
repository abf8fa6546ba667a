"""Hand-off bandwidth between two processes, against memcpy measured in the same run.

* object store: actor A makes a ``nbytes`` numpy array and returns it; actor B receives the ref as an argument
  (Ray maps it from shared memory) and copies it into its own buffer, as a stage copies KV into its pool. Timed
  from B's call to its return, best of ``repeats``; the producer's fill is outside the timing.
* NIXL: a :class:`NixlTransport` in actor A publishes a ``nbytes`` KV payload (the prefill side); another in actor B
  READs it over UCX (DRAM to DRAM here). The first read between two agents pays the agents' start-up and
  is excluded (a warm-up read), as in serving, where agents live as long as the replicas.

Both need a running Ray (``ray.init`` by the caller).
"""

from __future__ import annotations

import time

import numpy as np
import ray

from loadtest.bench_decode import memcpy_bytes_per_s


@ray.remote(num_cpus=0)
class _Producer:
    def make(self, nbytes: int) -> np.ndarray:
        return np.ones(nbytes, dtype=np.uint8)

    def publish(self, nbytes: int):
        from common.kv.transport.nixl import NixlTransport
        from common.protocol.handoff import KVBlocks, PrefillOutput

        if not hasattr(self, "sender"):
            self.sender = NixlTransport()
        half = nbytes // 2 // 4  # float32 keys and values, each half of the payload
        shape = (1, half // (16 * 64), 1, 16, 64)
        kv = KVBlocks(16, shape[1] * 16, "float32", np.ones(shape, np.float32), np.ones(shape, np.float32))
        out = PrefillOutput(np.zeros(kv.num_tokens, np.int64), 0, kv, 0, "bench")
        return self.sender.publish(out, expires_at=time.time() + 120)

    def poll(self) -> int:
        return self.sender.release()


@ray.remote(num_cpus=0)
class _Consumer:
    def take(self, arr: np.ndarray, started: float) -> float:
        mine = np.empty_like(arr)
        np.copyto(mine, arr)
        return time.time() - started

    def fetch(self, remote) -> tuple[float, int]:
        from common.kv.transport.nixl import NixlTransport

        if not hasattr(self, "receiver"):
            self.receiver = NixlTransport(timeout_s=60)
        start = time.perf_counter()
        out = self.receiver.fetch(remote)
        return time.perf_counter() - start, int(out.kv.nbytes)


def object_store(nbytes: int = 64 << 20, repeats: int = 5) -> dict[str, float]:
    producer, consumer = _Producer.remote(), _Consumer.remote()
    times = []
    for _ in range(repeats):
        ref = producer.make.remote(nbytes)
        ray.wait([ref])  # produced and sealed: only the hand-off is timed
        times.append(ray.get(consumer.take.remote(ref, time.time())))
    return _versus_memcpy(nbytes, min(times))


def nixl(nbytes: int = 256 << 20, repeats: int = 3) -> dict[str, float]:
    producer, consumer = _Producer.remote(), _Consumer.remote()
    ray.get(consumer.fetch.remote(ray.get(producer.publish.remote(1 << 20))))  # warm-up: agent start-up
    results = []
    for _ in range(repeats):
        remote = ray.get(producer.publish.remote(nbytes))
        results.append(ray.get(consumer.fetch.remote(remote)))
        ray.get(producer.poll.remote())
    seconds, moved = min(results)
    return _versus_memcpy(moved, seconds)


def _versus_memcpy(nbytes: int, seconds: float) -> dict[str, float]:
    """A transfer's bandwidth beside memcpy of the same size, measured now."""
    memcpy = memcpy_bytes_per_s(nbytes)
    return {
        "bytes": nbytes,
        "seconds": seconds,
        "bytes_per_s": nbytes / seconds,
        "memcpy_bytes_per_s": memcpy,
        "fraction_of_memcpy": nbytes / seconds / memcpy,
    }

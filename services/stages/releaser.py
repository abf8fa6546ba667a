"""Frees what a sending stage's transport holds once it was read (or expired), without a poll while it holds nothing.

A stage that publishes hand-offs (prefill: KV; encode: visual embeddings) calls :meth:`Releaser.kick` after each
publish. While the transport holds anything, a task asks it to release every 20 ms — in a worker thread: NIXL reads
its notifications there — and stops once it holds nothing; the next publish starts it again. ``held`` is re-read on
the event loop, so a publish that landed while a release ran in its thread is not left to the next request.
"""

from __future__ import annotations

import asyncio

from common.kv.transport import KVTransport

POLL_S = 0.02


class Releaser:
    def __init__(self, transport: KVTransport) -> None:
        self.transport = transport
        self._task: asyncio.Task | None = None

    def kick(self) -> None:
        if self.transport.held and (self._task is None or self._task.done()):
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while await asyncio.to_thread(self.transport.release) or self.transport.held:
            await asyncio.sleep(POLL_S)

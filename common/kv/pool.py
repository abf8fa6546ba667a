"""Paged KV block pool with per-request leases.

Storage: one key and one value tensor per pool, ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]`` —
token-major inside a block, so gathering a sequence's blocks gives ``[tokens, heads, dim]`` rows that attention can
read through a transposed *view* (head-major blocks would need a second, permuting copy every step; measured 2×
slower on CPU). The hand-off layout (:class:`KVBlocks`) is the same, so a hand-off lands in its blocks by plain
copies of contiguous runs (:mod:`common.kv.landing`), or by a transport's transfer straight into the pool's memory
(:meth:`arrays` is what it registers, once); :meth:`load_tokens` gives a prefix-cache hit back in transformers'
head-major layout.

Accounting, as queues:

* A request first takes a **lease**: a reservation of the blocks it may need (prompt + max output). A lease is
  capped at ``max_lease_fraction`` of the pool; a bigger request is refused at once (400 ``kv_lease_exceeded``),
  since it could never run. A lease that does not fit now waits in a queue; leases are granted in the queue's order
  (below) as blocks free up, and the head is never overtaken while it waits for blocks, so a large request cannot be
  starved by a stream of small ones (and it always fits eventually: it is at most a fraction of the pool).
* Inside its lease a request **allocates** blocks (reference count 1) — as one contiguous run when it can, so
  attention reads its KV through a view with no copy — or **shares** an existing block (a prefix-cache hit, or the
  prompt's full blocks that a request's ``n`` choices read alike: reference count +1, no new capacity used).
* The queue is shared between tenants as every stage budget's is (:class:`common.fair.FairQueue`, in
  blocks — prompt *and* output, so a tenant of many long generations is charged for them): each tenant's leases wait
  in *rank* order — arrival order unless a lease carries a rank (the decode stage's reservations: arrival, plus
  ``admission.batch_delay_s`` for batch-class traffic); one without a rank ranks by the time it asked — and the head
  of the tenant with the least service so far (blocks ÷ its weight) goes next, interactive before batch. A lone tenant
  is served in rank order, as fast as blocks free. Nothing is granted past that head while it does not fit (a lease
  already held may still grow into blocks that are available: it is older than everything waiting); the head changes
  only to a tenant with less service (one that arrives, or was idle), and every grant raises its tenant's tag, so no
  lease starves.
* A lease may be taken before its request's KV exists (the decode stage reserves it before prefill computes, on an
  estimate) and resized when the KV arrives (:meth:`resize_lease`): a smaller need gives the difference back at once;
  a larger one takes the difference if it is available, or gives the lease back (its charge refunded) and waits for
  the whole first among its tenant's leases (never holding part of it while it waits: no deadlock); a lease still
  waiting keeps its place.
* :meth:`release` (finish, cancel, timeout, error — the caller does not care which) drops every reference the lease
  holds, the unused reservation or its place in the queue, then grants waiting leases that now fit. When the head of
  the queue does not fit, the pool first asks its reclaimer (the prefix cache) to give back blocks only the cache
  still references.

:meth:`check_no_leaks` verifies that everything not held by an external owner (the prefix cache) is free.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from common.errors import InvalidRequestError
from common.fair import FairQueue, Waiter
from common.kv import aligned
from common.protocol.vector import choices_blocks


class LeaseTooLarge(InvalidRequestError):
    default_code = "kv_lease_exceeded"


@dataclass
class Lease:
    request_id: str
    reserved: int
    """Blocks this request may newly allocate."""
    blocks: list[int] = field(default_factory=list)
    """Blocks this request references, in sequence order (allocated or shared)."""
    allocated: int = 0
    tenant: str = ""
    """Whose lease it is (the fair order charges it; a lease given back to grow waits again as that tenant's)."""
    weight: float = 1.0
    batch: bool = False


class KVPool:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        kv_shape: tuple[int, int, int],
        dtype: torch.dtype,
        max_lease_fraction: float = 0.5,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0 or not 0 < max_lease_fraction <= 1:
            raise ValueError("num_blocks, block_size > 0 and 0 < max_lease_fraction ≤ 1")
        layers, heads, head_dim = kv_shape
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_shape = kv_shape
        self.dtype = dtype
        # (page-aligned, as every region a hand-off copies between: common/kv/aligned.py says why)
        shape = (layers, num_blocks, block_size, heads, head_dim)
        self.keys, self.values = aligned.tensor(shape, dtype), aligned.tensor(shape, dtype)
        self.max_lease_blocks = max(1, int(num_blocks * max_lease_fraction))
        self._refs = np.zeros(num_blocks, dtype=np.int64)
        self._is_free = np.ones(num_blocks, dtype=bool)
        self._leases: dict[str, Lease] = {}
        self._waiting: dict[str, Waiter] = {}  # the queued leases, by request id
        self._fair = FairQueue()  # their order
        self._seq = itertools.count()
        self.clock = clock
        self._reclaimer: Callable[[int], int] | None = None
        self.freed_total = 0
        """Capacity given back since the pool was made, in blocks: blocks that became free, and reservations released
        or shrunk unused (a drain rate is measured from it)."""

    def set_reclaimer(self, reclaim: Callable[[int], int]) -> None:
        """``reclaim(n)`` frees up to n blocks held only by a cache; called when a lease would not fit."""
        self._reclaimer = reclaim

    # ---- data -----------------------------------------------------------------------------------------------
    def store_blocks(self, blocks: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write hand-off-layout blocks ``[layers, n, block_size, kv_heads, head_dim]`` into pool ``blocks``."""
        index = torch.tensor(blocks, dtype=torch.long)
        self.keys[:, index] = keys.to(self.dtype)
        self.values[:, index] = values.to(self.dtype)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The keys and values storage as numpy views (bfloat16 as its raw ``uint16`` bits, as hand-offs carry it):
        where hand-offs land, and what a transport registers once."""
        if self.dtype == torch.bfloat16:
            return self.keys.view(torch.uint16).numpy(), self.values.view(torch.uint16).numpy()
        return self.keys.numpy(), self.values.numpy()

    def load_tokens(self, blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy ``blocks`` out as ``[layers, kv_heads, n * block_size, head_dim]`` keys and values."""
        index = torch.tensor(blocks, dtype=torch.long)
        layers, _, bs, heads, dim = self.keys.shape

        def tokens(store: torch.Tensor) -> torch.Tensor:
            return store[:, index].reshape(layers, len(blocks) * bs, heads, dim).transpose(1, 2).contiguous()

        return tokens(self.keys), tokens(self.values)

    # ---- capacity -------------------------------------------------------------------------------------------
    @property
    def free_blocks(self) -> int:
        return int(self._is_free.sum())

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    @property
    def shared_blocks(self) -> int:
        """Blocks referenced more than once (a prompt's full blocks that its choices read alike, prefix-cache hits)."""
        return int((self._refs > 1).sum())

    def _take(self, blocks: np.ndarray) -> list[int]:
        if not self._is_free[blocks].all():
            raise RuntimeError("KV pool handed out a block that is not free")
        self._is_free[blocks] = False
        self._refs[blocks] = 1
        return [int(b) for b in blocks]

    def _lowest_free(self, n: int) -> np.ndarray:
        return np.flatnonzero(self._is_free)[:n]

    def _free_run(self, n: int) -> int | None:
        """Start of the first run of ``n`` contiguous free blocks (first fit), if any."""
        edges = np.diff(np.concatenate(([0], self._is_free.astype(np.int8), [0])))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        fits = np.flatnonzero(ends - starts >= n)
        return int(starts[fits[0]]) if len(fits) else None

    @property
    def _unallocated_reservations(self) -> int:
        return sum(lease.reserved - lease.allocated for lease in self._leases.values())

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def blocks_for_choices(self, prompt_tokens: int, max_tokens: int, n: int = 1) -> int:
        """What a request's lease needs: :func:`choices_blocks` in this pool's blocks."""
        return choices_blocks(self.block_size, prompt_tokens, max_tokens, n)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block ``src``'s keys and values into block ``dst`` (a choice's own copy of a shared partial block)."""
        self.keys[:, dst] = self.keys[:, src]
        self.values[:, dst] = self.values[:, src]

    # ---- leases ---------------------------------------------------------------------------------------------
    def request_lease(
        self,
        request_id: str,
        blocks: int,
        rank: float | None = None,
        tenant: str = "",
        weight: float = 1.0,
        batch: bool = False,
    ) -> Lease | None:
        """Grant a lease now, or queue it (``None``) as ``tenant``'s, by ``rank`` (default: now, on the pool's clock);
        raise :class:`LeaseTooLarge` if it can never be granted."""
        if request_id in self._leases or request_id in self._waiting:
            raise ValueError(f"request {request_id} already holds or awaits a lease")
        self._check_size(blocks)
        self._enqueue(request_id, blocks, self.clock() if rank is None else rank, tenant, weight, batch)
        self._grant_waiting()
        return self._leases.get(request_id)

    def _enqueue(self, request_id: str, blocks: int, rank: float, tenant: str, weight: float, batch: bool) -> None:
        waiter = Waiter(rank, next(self._seq), blocks, tenant=tenant, weight=weight, batch=batch, key=request_id)
        self._waiting[request_id] = waiter
        self._fair.push(waiter)

    def lease(self, request_id: str) -> Lease | None:
        return self._leases.get(request_id)

    def granted(self, request_id: str) -> bool:
        """The request holds its lease (it is not waiting for one)."""
        return request_id in self._leases

    def resize_lease(self, request_id: str, blocks: int) -> list[str]:
        """Make a lease that has allocated nothing yet (a reservation, held or waiting) ``blocks`` in all; returns the
        request ids granted meanwhile (:meth:`granted` says whether this one is among the holders). Waiting: the new
        amount keeps its place in the queue. Held and smaller: the difference goes back at once. Held and larger: the
        difference is granted if it is available now; otherwise the lease is given back and the whole amount queued
        ahead of every lease of its tenant that never held one (behind earlier give-backs) — it is older than they
        are, and a
        request that waits holding nothing cannot deadlock with others that wait holding part of what they need.
        Raise :class:`LeaseTooLarge` past the per-request limit, ``KeyError`` if unknown, ``ValueError`` for a lease
        that has allocated blocks."""
        self._check_size(blocks)
        lease = self._leases.get(request_id)
        if lease is None:
            if request_id not in self._waiting:
                raise KeyError(request_id)
            self._waiting[request_id].amount = blocks
        elif lease.allocated:
            raise ValueError(f"request {request_id} has allocated blocks; its lease cannot be resized")
        elif blocks <= lease.reserved or blocks - lease.reserved <= self.available_blocks:
            self.freed_total += max(0, lease.reserved - blocks)
            lease.reserved = blocks
        else:
            del self._leases[request_id]
            self.freed_total += lease.reserved
            self._fair.refund(lease.tenant, lease.reserved, lease.weight)  # (charged again, whole, when re-granted)
            # (first of its tenant's, behind only others that gave their lease back)
            self._enqueue(request_id, blocks, -math.inf, lease.tenant, lease.weight, lease.batch)
        return self._grant_waiting()

    def blocks_ahead(
        self, rank: float = math.inf, tenant: str | None = None, weight: float = 1.0, blocks: int = 0
    ) -> int:
        """Blocks a lease would wait behind: with no ``tenant``, all the leases queued at or before ``rank`` ask for
        (the whole queue by default); for a lease of ``tenant`` (``blocks``, ranked ``rank``), what the fair order
        grants before it (:meth:`FairQueue.ahead_of`)."""
        if tenant is not None:
            return self._fair.ahead_of(tenant, weight, blocks, None if rank == math.inf else rank)
        return sum(w.amount for w in self._waiting.values() if w.rank <= rank)

    def holds_wait_share(self, tenant: str | None, weight: float, places: int) -> bool:
        """Whether ``tenant``'s queued leases fill its weighted share of ``places`` queue places (always, with no
        tenant named)."""
        if tenant is None:
            return True
        return self._fair.waiting_of(tenant) >= self._fair.place_share(tenant, weight, places)

    def served_blocks(self) -> dict[str, float]:
        """Blocks each tenant's leases were granted since the pool was made (its share of the decode stage)."""
        return dict(self._fair.service)

    @property
    def waiting_blocks(self) -> int:
        """Blocks the queued leases ask for."""
        return self.blocks_ahead()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def committed_blocks(self) -> int:
        """Blocks in use plus those leases have reserved and not allocated yet."""
        return self.used_blocks + self._unallocated_reservations

    @property
    def available_blocks(self) -> int:
        """Free blocks no lease has reserved (what the head of the queue could be granted now)."""
        return self.free_blocks - self._unallocated_reservations

    def _check_size(self, blocks: int) -> None:
        if blocks > self.max_lease_blocks:
            raise LeaseTooLarge(
                f"request needs {blocks} KV blocks ({blocks * self.block_size} tokens of prompt + output); "
                f"the per-request limit is {self.max_lease_blocks} blocks ({self.max_lease_blocks * self.block_size} "
                f"tokens)",
                param="max_tokens",
            )

    def waiting_in_rank_order(self) -> list[str]:
        """The queued leases' request ids by rank (the order they are granted in while one tenant waits)."""
        return [w.key for w in sorted(self._waiting.values())]

    def is_waiting(self, request_id: str) -> bool:
        return request_id in self._waiting

    def _grant_waiting(self) -> list[str]:
        granted = []
        while (head := self._fair.head()) is not None:
            short = head.amount - self.available_blocks
            if short > 0 and self._reclaimer is not None:
                self._reclaimer(short)
                short = head.amount - self.available_blocks
            if short > 0:
                break  # nobody overtakes the head, and each grant raises its tenant's tag: no lease starves
            self._fair.pop(head)  # (charges its tenant)
            rid = head.key
            del self._waiting[rid]
            self._leases[rid] = Lease(rid, head.amount, tenant=head.tenant, weight=head.weight, batch=head.batch)
            granted.append(rid)
        return granted

    def allocate(self, lease: Lease, n: int = 1) -> list[int]:
        if lease.allocated + n > lease.reserved:
            raise RuntimeError(f"request {lease.request_id} allocates past its lease of {lease.reserved} blocks")
        blocks = self._lowest_free(n)
        if len(blocks) < n:
            raise RuntimeError(f"KV pool has {len(blocks)} free blocks, lease {lease.request_id} needs {n}")
        out = self._take(blocks)
        lease.allocated += n
        lease.blocks.extend(out)
        return out

    def allocate_run(self, lease: Lease, n: int) -> list[int] | None:
        """Like :meth:`allocate`, but ``n`` contiguous blocks (so attention can read them as one view), or
        ``None`` — allocating nothing — when free space is too fragmented."""
        if lease.allocated + n > lease.reserved:
            raise RuntimeError(f"request {lease.request_id} allocates past its lease of {lease.reserved} blocks")
        start = self._free_run(n)
        if start is None:
            return None
        out = self._take(np.arange(start, start + n))
        lease.allocated += n
        lease.blocks.extend(out)
        return out

    def take_unreserved(self, n: int) -> list[int]:
        """Up to ``n`` blocks outside any lease (reference count 1), only from capacity no lease has reserved —
        caches use this, so they never eat into what a running request was promised."""
        spare = self.available_blocks - self.waiting_blocks
        return self._take(self._lowest_free(max(0, min(n, spare))))

    def share(self, lease: Lease, blocks: list[int]) -> None:
        """Reference existing (prefix-cached) blocks; costs no reservation."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise RuntimeError(f"block {b} is free and cannot be shared")
            self._refs[b] += 1
        lease.blocks.extend(blocks)

    def release(self, request_id: str) -> list[str]:
        """Drop a request's lease or its place in the queue; returns request ids whose leases got granted."""
        waiter = self._waiting.pop(request_id, None)
        if queued := waiter is not None:
            waiter.gone = True  # (the fair queue skips it)
        lease = self._leases.pop(request_id, None)
        if lease is None and not queued:
            return []
        if lease is not None:
            self.freed_total += lease.reserved - lease.allocated  # (the allocated part counts as its blocks free)
            self.unref(lease.blocks)
        return self._grant_waiting()

    # ---- references held by other owners (prefix cache) -------------------------------------------------------
    def ref(self, blocks: list[int]) -> None:
        for b in blocks:
            self._refs[b] += 1

    def unref(self, blocks: list[int]) -> None:
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] < 0:
                raise RuntimeError(f"block {b} released twice")
            if self._refs[b] == 0:
                self._is_free[b] = True
                self.freed_total += 1

    def refcount(self, block: int) -> int:
        return int(self._refs[block])

    def check_no_leaks(self, externally_held: int = 0) -> None:
        """Raise unless no lease is open or waiting and only ``externally_held`` blocks are in use."""
        problems = []
        if self._leases:
            problems.append(f"open leases: {sorted(self._leases)}")
        if self._waiting:
            problems.append(f"waiting leases: {list(self._waiting)}")
        if self.used_blocks != externally_held:
            problems.append(f"{self.used_blocks} blocks in use, expected {externally_held}")
        if np.any(self._is_free != (self._refs == 0)):
            problems.append("free map and reference counts disagree")
        if problems:
            raise AssertionError("KV pool leak: " + "; ".join(problems))

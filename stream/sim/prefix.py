"""A model of one model server's prefix cache (KV blocks), as vLLM v1 keeps it.

Written from the rules of vLLM's ``vllm/v1/core/block_pool.py``,
``vllm/v1/core/kv_cache_utils.py`` and the full-attention path of
``vllm/v1/core/kv_cache_manager.py`` / ``single_type_kv_cache_manager.py``, and proven
against vLLM's own ``BlockPool`` by ``tests/unit/test_vllm_prefix_differential.py``:

- KV memory is ``num_blocks`` blocks of ``block_size`` tokens (16 by default:
  ``CacheConfig.DEFAULT_BLOCK_SIZE`` in ``vllm/config/cache.py``); block 0 is the null
  block, never handed out.
- A *full* block of a request is cached under a chained hash: its parent's hash, its
  token content, and extra keys naming each multimodal item overlapping the block with
  the item's offset from the block's start (``("mm", identifier, offset)``). So the
  same image at the same place hits; the same placeholder tokens of another image miss.
- A new request hits the longest run of cached leading blocks, never its last token (at
  most ``num_tokens - 1`` tokens), and only whole blocks.
- Blocks are reference counted. A block whose count falls to 0 joins the free queue,
  still cached: at its tail if it has a hash (evicted last, least recently freed first),
  at its head if not. A request frees its blocks tail first, so its last blocks go before
  its first ones. A hit on a free block takes it out of the queue again.
- New blocks are taken from the head of the free queue; a cached one loses its hash
  then (an eviction).

``BlockPool`` is the pool (free queue, hash map, reference counts); ``PrefixCache`` does
what the KV cache manager does on top of it (hits, slots for new tokens, caching full
blocks, freeing a request) and works over any pool with the same operations, which is
how the differential test drives vLLM's pool with this manager.

Pure and deterministic: block hashes are the same in every process (``chain_hashes``).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["DEFAULT_BLOCK_SIZE", "BlockPool", "Pool", "PrefixCache", "Run", "chain_hashes"]

DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class Run:
    """A run of prompt tokens: text (token ``j`` of key ``k`` is the same token in every
    request) or the placeholder tokens of the multimodal item ``key``."""

    key: str
    tokens: int
    item: bool = False


def chain_hashes(runs: Sequence[Run], block_size: int, num_tokens: int,
                 known: Sequence[int] = ()) -> list[int]:
    """The hashes of the full blocks among the first ``num_tokens`` tokens of ``runs``,
    continuing ``known`` (the hashes already computed for the leading blocks).

    A block's hash covers its parent's hash and, per run overlapping it, the run's key
    with the token range it covers: for text the range inside the run (token ``j`` of a
    key is the same token everywhere), for an item its offset from the block's start and
    its token count there (its placeholder tokens are all alike; the key and offset are
    vLLM's extra keys). Keys enter as the first 8 bytes of their BLAKE2b digest and the
    chain as CPython's hash of a tuple of ints, which is the same in every process
    (no string is hashed); 64 bits make a false hit vanishingly rare."""
    hashes = list(known)
    end = min(num_tokens, sum(run.tokens for run in runs)) // block_size
    if len(hashes) >= end:
        return hashes
    names = [_key_id(run.key) * (-1 if run.item else 1) for run in runs]
    index, start = 0, 0  # the run holding the block's first token, and where it starts
    parent = hashes[-1] if hashes else 0
    for block in range(len(hashes), end):
        lo, hi = block * block_size, (block + 1) * block_size
        while start + runs[index].tokens <= lo:
            start += runs[index].tokens
            index += 1
        if start + runs[index].tokens >= hi:  # the block lies inside one run
            parent = hash((parent, names[index], start - lo if runs[index].item else lo - start))
        else:
            parts: list[int] = [parent]
            i, at = index, start
            while at < hi:
                run = runs[i]
                first, last = max(lo, at), min(hi, at + run.tokens)
                parts += (names[i], at - lo, last - first) if run.item else (names[i], first - at, last - at)
                at += run.tokens
                i += 1
            parent = hash(tuple(parts))
        hashes.append(parent)
    return hashes


def _key_id(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") | 1


class Pool(Protocol):
    """The block-pool operations the manager needs (vLLM's ``BlockPool`` has them)."""

    def cached_block(self, block_hash: int) -> Hashable | None:
        """The first block cached under the hash, or None."""

    def is_evictable(self, block: Hashable) -> bool:
        """Whether the block is unreferenced (in the free queue)."""

    def num_free(self) -> int:
        """Blocks in the free queue (cached or not)."""

    def new_blocks(self, count: int) -> list[Hashable]:
        """Take blocks from the head of the free queue, evicting their hashes."""

    def touch(self, blocks: Sequence[Hashable]) -> None:
        """One more reference each (a hit)."""

    def cache_blocks(self, blocks: Sequence[Hashable], hashes: Sequence[int],
                     first: int, end: int) -> None:
        """Cache blocks ``first`` to ``end`` of a request under their hashes."""

    def free_blocks(self, ordered: Iterable[Hashable]) -> None:
        """One reference less each, in eviction order."""


@dataclass(slots=True)
class BlockPool:
    """``num_blocks`` KV blocks, their reference counts, hashes and free queue.

    Invariants: a block is in ``free_queue`` exactly when its count is 0 (the null block
    0 never is); ``cached[h]`` lists the blocks holding hash ``h`` in insertion order
    and ``block_hash[b] == h`` for each; ``evicted`` collects the hashes removed since
    the caller last emptied it.
    """

    num_blocks: int
    enable_caching: bool = True
    refs: list[int] = field(default_factory=list)
    block_hash: list[int | None] = field(default_factory=list)
    free_queue: OrderedDict[int, None] = field(default_factory=OrderedDict)
    cached: dict[int, dict[int, None]] = field(default_factory=dict)
    evicted: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_blocks < 2:
            raise ValueError("a KV cache needs at least 2 blocks (block 0 is the null block)")
        self.refs = [0] * self.num_blocks
        self.block_hash = [None] * self.num_blocks
        self.free_queue = OrderedDict.fromkeys(range(1, self.num_blocks))

    def cached_block(self, block_hash: int) -> int | None:
        """The first block cached under the hash, or None."""
        blocks = self.cached.get(block_hash)
        return next(iter(blocks)) if blocks else None

    def is_evictable(self, block: Hashable) -> bool:
        """Whether the block is unreferenced (in the free queue)."""
        return self.refs[block] == 0  # type: ignore[index]

    def num_free(self) -> int:
        """Blocks in the free queue (cached or not)."""
        return len(self.free_queue)

    def new_blocks(self, count: int) -> list[int]:
        """Take ``count`` blocks from the head of the free queue, evicting their hashes."""
        if count > len(self.free_queue):
            raise ValueError(f"cannot take {count} blocks: {len(self.free_queue)} free")
        taken = []
        for _ in range(count):
            block, _ = self.free_queue.popitem(last=False)
            digest = self.block_hash[block]
            if digest is not None:
                holders = self.cached[digest]
                del holders[block]
                if not holders:
                    del self.cached[digest]
                self.block_hash[block] = None
                self.evicted.append(digest)
            self.refs[block] = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Sequence[Hashable]) -> None:
        """A hit: one more reference each, out of the free queue if it was there."""
        for block in blocks:
            if self.refs[block] == 0:  # type: ignore[index]
                del self.free_queue[block]  # type: ignore[arg-type]
            self.refs[block] += 1  # type: ignore[index]

    def cache_blocks(self, blocks: Sequence[Hashable], hashes: Sequence[int],
                     first: int, end: int) -> None:
        """Give blocks ``first`` to ``end`` of a request the hashes of its full blocks."""
        if not self.enable_caching:
            return
        for index in range(first, end):
            block, digest = blocks[index], hashes[index]
            if self.block_hash[block] is not None:  # type: ignore[index]
                continue  # a hit block: already cached under this hash
            self.block_hash[block] = digest  # type: ignore[index]
            self.cached.setdefault(digest, {})[block] = None  # type: ignore[index]

    def free_blocks(self, ordered: Iterable[Hashable]) -> None:
        """Drop one reference each; blocks left unreferenced join the free queue, hashless
        ones at its head (reused first) and cached ones at its tail, in this order."""
        first: list[int] = []
        last: list[int] = []
        for block in ordered:
            self.refs[block] -= 1  # type: ignore[index]
            if self.refs[block] == 0:  # type: ignore[index]
                (last if self.block_hash[block] is not None else first).append(block)  # type: ignore[index, arg-type]
        for block in reversed(first):
            self.free_queue[block] = None
            self.free_queue.move_to_end(block, last=False)
        for block in last:
            self.free_queue[block] = None


@dataclass(slots=True)
class PrefixCache:
    """The KV cache manager of one server over a block ``pool``.

    ``blocks[r]`` are the blocks request ``r`` holds, in token order; ``cached_count[r]``
    how many of them are cached (set once the request caches a full block).
    """

    pool: Pool
    block_size: int = DEFAULT_BLOCK_SIZE
    enable_caching: bool = True
    blocks: dict[Hashable, list[Hashable]] = field(default_factory=dict)
    cached_count: dict[Hashable, int] = field(default_factory=dict)

    def longest_hit(self, hashes: Sequence[int], num_tokens: int) -> list[Hashable]:
        """The cached blocks a new request of ``num_tokens`` tokens can use: its leading
        run of cached full blocks, leaving at least its last token to compute."""
        if not self.enable_caching:
            return []
        hit: list[Hashable] = []
        for digest in hashes[: (num_tokens - 1) // self.block_size]:
            block = self.pool.cached_block(digest)
            if block is None:
                break
            hit.append(block)
        return hit

    def allocate(self, request_id: Hashable, num_tokens: int, cacheable_tokens: int,
                 hashes: Sequence[int], hit: Sequence[Hashable] = (), whole_tokens: int = 0) -> bool:
        """Slots for the request's first ``num_tokens`` tokens (the computed ones and those
        scheduled now), ``hit`` the blocks of a new request's prefix hit. False, changing
        nothing, when the free queue is too short, or too short for ``whole_tokens`` (the
        admission of a waiting request: its whole sequence must fit, vLLM's
        ``scheduler_reserve_full_isl``, on by default); else the blocks are taken and the
        full blocks among the first ``cacheable_tokens`` tokens cached."""
        held = self.blocks.get(request_id, [])
        for tokens in (whole_tokens, num_tokens) if whole_tokens else (num_tokens,):
            if self._blocks_needed(request_id, tokens, held, hit) > self.pool.num_free():
                return False
        held = self.blocks.setdefault(request_id, held)
        if hit:
            self.pool.touch(hit)
            held.extend(hit)
            self.cached_count[request_id] = len(held)  # hit blocks are cached already
        required = -(-num_tokens // self.block_size)
        if required > len(held):
            held.extend(self.pool.new_blocks(required - len(held)))
        self.cache(request_id, cacheable_tokens, hashes)
        return True

    def _blocks_needed(self, request_id: Hashable, num_tokens: int, held: Sequence[Hashable],
                       hit: Sequence[Hashable]) -> int:
        """Free blocks taken by slots for ``num_tokens`` tokens: the new ones, and the hit
        blocks that are in the free queue now."""
        required = -(-num_tokens // self.block_size)
        if request_id in self.cached_count:
            return max(required - len(held), 0)
        need = max(required - len(hit) - len(held), 0)
        return need + sum(1 for block in hit if self.pool.is_evictable(block))

    def cache(self, request_id: Hashable, cacheable_tokens: int, hashes: Sequence[int]) -> None:
        """Cache the request's full blocks among its first ``cacheable_tokens`` tokens that
        it holds and has not cached yet (``KVCacheManager.cache_blocks``)."""
        held = self.blocks.get(request_id)
        if not held:
            return
        cached = self.cached_count.get(request_id, 0)
        full = min(cacheable_tokens // self.block_size, len(hashes), len(held))
        if cached < full:
            self.pool.cache_blocks(held, hashes, cached, full)
            self.cached_count[request_id] = full

    def free(self, request_id: Hashable) -> None:
        """Return the request's blocks, its last block first."""
        held = self.blocks.pop(request_id, [])
        self.cached_count.pop(request_id, None)
        self.pool.free_blocks(reversed(held))

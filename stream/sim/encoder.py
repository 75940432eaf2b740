"""A model of one model server's encoder cache, following the rules of vLLM v1.

This is the *truth* the simulator scores the affinity signal against. Written from the
rules of vLLM's ``vllm/v1/core/encoder_cache_manager.py`` (not from its code), and
proven against that very class by ``tests/unit/test_vllm_encoder_differential.py``:

- The budget is counted in encoder embeddings (``size``), not in items.
- An entry referenced by a running request is pinned: it is never evicted. A request
  holds one reference per entry however many of its inputs (turns of a conversation)
  carry the item; the reference drops when the last of those inputs is freed.
- When its last reference is dropped it becomes *freeable* but stays resident; a later
  request for the same hash reuses it (a hit) and pins it again.
- Space is made by evicting freeable entries, the least recently freed first, at the
  moment an input is found to fit (``can_allocate``), counting the embeddings the same
  request already has scheduled in this step. An input larger than the step's encoder
  compute budget left does not fit.
- Evicted hashes are reported once per step (``take_freed``), less those allocated again
  in the same step (their tensors are kept).

The scheduler (``stream.sim.engine``, which the fleet runs) calls these item-level
operations as vLLM's scheduler calls the manager's. ``admit``/``release`` keep the older
whole-request view on top of them, for ``stream.sim.tune`` only: it replays placements,
not steps, so a request's missing items are stored together or the request waits. That
view is not vLLM's rule (it disagrees with vLLM's class on 265 of 600 requests in
``tests/unit/test_vllm_encoder_differential.py``); the fleet does not use it.

Pure and deterministic: no clock, no randomness; the caller says when references drop.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["Admission", "EncoderCache"]


@dataclass(frozen=True, slots=True)
class Admission:
    """What one whole-request admission attempt did.

    ``status`` is ``admitted``, ``waiting`` (nothing changed: not enough free plus
    freeable space now) or ``too_large`` (nothing changed: an item to encode exceeds the
    per-step budget, so the request can never run). ``hits`` are the request's items
    found resident, ``added`` those encoded and stored, ``evicted`` the hashes removed to
    make room, ``pinned`` whether the request holds references that ``release`` drops.
    """

    status: Literal["admitted", "waiting", "too_large"]
    hits: tuple[tuple[str, int], ...] = ()
    added: tuple[tuple[str, int], ...] = ()
    evicted: tuple[str, ...] = ()
    pinned: bool = False


_WAITING = Admission("waiting")
_TOO_LARGE = Admission("too_large")


@dataclass(slots=True)
class EncoderCache:
    """One server's encoder cache of ``size`` embeddings.

    Invariants: ``free + sum(resident sizes) == size``; an entry is freeable exactly when
    it has no referencing request; ``freeable`` is ordered by the time each entry was
    freed, oldest first; ``inputs[r]`` maps the input ids request ``r`` holds to their
    hashes, ``input_ids[r]`` is the same ids as a set (its iteration order is the order
    vLLM frees them in, a set built by the same additions and removals), and ``r`` is
    in ``refs[h]`` while one of them has hash ``h``.
    """

    size: int
    budget: int = 0
    free: int = 0
    sizes: dict[str, int] = field(default_factory=dict)
    refs: dict[str, set[Hashable]] = field(default_factory=dict)
    freeable: dict[str, int] = field(default_factory=dict)
    freeable_space: int = 0
    inputs: dict[Hashable, dict[int, str]] = field(default_factory=dict)
    input_ids: dict[Hashable, set[int]] = field(default_factory=dict)
    freed: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError("encoder cache size must be at least 1 embedding")
        # an item larger than the cache could never be held either (vLLM raises the
        # cache to the largest item instead)
        self.budget = self.size if self.budget < 1 else min(self.budget, self.size)
        self.free = self.size

    def __contains__(self, digest: object) -> bool:
        """Whether an entry is resident (pinned or freeable)."""
        return digest in self.sizes

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def used(self) -> int:
        """Embeddings held by resident entries."""
        return self.size - self.free

    # -- item-level operations, as vLLM's scheduler makes them -------------------------

    def resident(self, digest: str) -> int | None:
        """The embeddings of the resident entry ``digest``, or None."""
        return self.sizes.get(digest)

    def lookup(self, request_id: Hashable, input_id: int, digest: str) -> bool:
        """Whether ``digest`` is resident; if so input ``input_id`` of the request
        references it (a freeable entry is pinned again)."""
        holders = self.refs.get(digest)
        if holders is None:
            return False
        if not holders:
            self.freeable_space -= self.freeable.pop(digest)
        holders.add(request_id)
        self._hold(request_id, input_id, digest)
        return True

    def can_allocate(self, request_id: Hashable, input_id: int, embeddings: int,
                     compute_budget: int, scheduled: int = 0) -> bool:
        """Whether an input of ``embeddings`` fits this step.

        It must fit the ``compute_budget`` left and, beside the ``scheduled`` embeddings
        the same request already has allocated for in this step, the cache: freeable
        entries are evicted, least recently freed first, when the free space alone is
        too small. (``request_id`` and ``input_id`` only name the input asked about.)
        """
        if embeddings > compute_budget:
            return False
        need = embeddings + scheduled
        if need <= self.free:
            return True
        if need > self.free + self.freeable_space:
            return False
        self._make_room(need)
        return True

    def allocate(self, request_id: Hashable, input_id: int, digest: str, embeddings: int) -> None:
        """Store the request's input ``input_id``; ``can_allocate`` made the room."""
        if digest in self.sizes:
            raise ValueError(f"{digest} is resident: look it up instead")
        if self.free < embeddings:
            raise ValueError(f"no room for {digest}: {embeddings} embeddings, {self.free} free")
        self.sizes[digest] = embeddings
        self.refs[digest] = {request_id}
        self._hold(request_id, input_id, digest)
        self.free -= embeddings

    def cached_inputs(self, request_id: Hashable) -> tuple[int, ...]:
        """The input ids of the request that hold a reference, in the order they are
        freed in (a set's)."""
        return tuple(self.input_ids.get(request_id, ()))

    def free_input(self, request_id: Hashable, input_id: int) -> None:
        """Drop input ``input_id`` of the request; when it was the request's last input
        of that hash the request's reference drops, and an entry left with none becomes
        freeable, as the most recently freed."""
        held = self.inputs.get(request_id)
        if held is None or input_id not in held:
            return
        digest = held.pop(input_id)
        self.input_ids[request_id].discard(input_id)
        if not held:
            del self.inputs[request_id]
            del self.input_ids[request_id]
        if digest in held.values():
            return
        self._drop_reference(request_id, digest)

    def free_request(self, request_id: Hashable) -> None:
        """Drop every input the request holds (it finished or was preempted)."""
        for input_id in self.cached_inputs(request_id):
            self.free_input(request_id, input_id)

    def take_freed(self) -> list[str]:
        """The hashes evicted since the last call, less those stored again since."""
        freed = [digest for digest in self.freed if digest not in self.sizes]
        self.freed = []
        return freed

    # -- the whole-request view ----------------------------------------------------------

    def admit(self, request_id: Hashable, items: Sequence[tuple[str, int]]) -> Admission:
        """Try to start request ``request_id`` with its distinct ``(hash, size)`` items:
        all of its missing items are stored together, or nothing changes."""
        sizes, freeable = self.sizes, self.freeable
        missing = [(digest, size) for digest, size in items if digest not in sizes]
        if any(size > self.budget for _, size in missing):
            return _TOO_LARGE
        need = sum(size for _, size in missing)
        hits = tuple((digest, sizes[digest]) for digest, _ in items if digest in sizes)
        if need + sum(size for _, size in hits) > self.size:
            return self._admit_streamed(request_id, hits, missing)
        # space reusable now: free plus freeable, less the freeable hits this request pins
        reusable = self.free + self.freeable_space - sum(s for d, s in hits if d in freeable)
        if need > reusable:
            return _WAITING
        for input_id, (digest, _) in enumerate(items):
            if digest in sizes:
                self.lookup(request_id, input_id, digest)
        evicted = self._make_room(need)
        for input_id, (digest, size) in enumerate(items):
            if (digest, size) in missing:
                self.allocate(request_id, input_id, digest, size)
        self.take_freed()
        return Admission("admitted", hits, tuple(missing), evicted, pinned=True)

    def _admit_streamed(self, request_id: Hashable, hits: tuple[tuple[str, int], ...],
                        missing: list[tuple[str, int]]) -> Admission:
        """A request too big to pin at once: its items go in one by one, each freed as
        soon as it is stored; its hits are used without being pinned."""
        if not missing:
            return Admission("admitted", hits, (), (), pinned=False)
        if max(size for _, size in missing) > self.free + self.freeable_space:
            return _WAITING
        evicted: list[str] = []
        for input_id, (digest, size) in enumerate(missing):
            evicted.extend(self._make_room(size))
            self.allocate(request_id, input_id, digest, size)
            self.free_input(request_id, input_id)
        self.take_freed()
        # an entry added and evicted within the request is not resident at the end
        gone = set(evicted)
        return Admission("admitted", hits, tuple(a for a in missing if a[0] not in gone),
                         tuple(evicted), pinned=False)

    def release(self, request_id: Hashable, hashes: Iterable[str]) -> None:
        """Drop the request's references to ``hashes``; an entry left with none becomes
        freeable, as the most recently freed."""
        wanted = set(hashes)
        for input_id, digest in tuple(self.inputs.get(request_id, {}).items()):
            if digest in wanted:
                self.free_input(request_id, input_id)

    # -- internals -----------------------------------------------------------------------

    def _hold(self, request_id: Hashable, input_id: int, digest: str) -> None:
        held = self.inputs.setdefault(request_id, {})
        if input_id not in held:
            held[input_id] = digest
            self.input_ids.setdefault(request_id, set()).add(input_id)

    def _drop_reference(self, request_id: Hashable, digest: str) -> None:
        holders = self.refs.get(digest)
        if not holders or request_id not in holders:
            return  # evicted meanwhile, or never held
        holders.discard(request_id)
        if not holders:
            size = self.sizes[digest]
            self.freeable[digest] = size
            self.freeable_space += size

    def _make_room(self, need: int) -> tuple[str, ...]:
        """Evict freeable entries, least recently freed first, until ``need`` is free."""
        evicted: list[str] = []
        freeable = self.freeable
        while self.free < need:
            digest = next(iter(freeable))
            size = freeable.pop(digest)
            self.freeable_space -= size
            del self.sizes[digest]
            del self.refs[digest]
            self.free += size
            evicted.append(digest)
        self.freed.extend(evicted)
        return tuple(evicted)

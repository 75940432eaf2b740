"""A model of one model server's multimodal processor cache, as vLLM v1 keeps it.

vLLM's front end preprocesses each multimodal item (decoding, resizing, the HF
processor) on the CPU before the request reaches the scheduler; the processed inputs are
kept in an LRU cache bounded in bytes, ``mm_processor_cache_gb`` GiB (default 4:
``vllm/config/multimodal.py``; the LRU by ``get_item_size`` is ``MultiModalCache``
in ``vllm/multimodal/cache/base.py``, used by ``vllm/multimodal/cache/lru.py``). A hit
skips the preprocessing of that item; an item larger than the whole cache is served
uncached. A lookup refreshes the item's recency, a miss inserts it. What an item weighs
is its processed input's bytes (``processed_bytes``): the simulator's workload and
``tune`` both weigh items here.

Pure and deterministic.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = ["DEFAULT_BYTES_PER_EMBEDDING", "DEFAULT_PROCESSOR_CACHE_BYTES", "ProcessorCache",
           "processed_bytes"]

DEFAULT_PROCESSOR_CACHE_BYTES = 4 * 2**30  # mm_processor_cache_gb = 4 GiB

# Bytes of processed input per encoder embedding, by modality: Qwen2/2.5-VL in bf16.
# vLLM casts the HF processor's floating-point tensors to the model's dtype before they
# are cached (``InputProcessingContext._postprocess_output`` in
# ``vllm/multimodal/processing/context.py``), and Qwen2-VL runs in bf16. An image or
# video embedding is one 2x2 merge of patches, each patch 3 channels x 2 frames x 14 x 14
# pixels = 1,176 values (``Qwen2VisionPatchEmbed`` in
# ``vllm/model_executor/models/qwen2_vl.py``): 4 x 1,176 x 2 bytes = 9,408. An audio
# embedding (Qwen2-Audio) is 4 frames of 128 mel bins x 2 bytes = 1,024. Other models
# differ (LLaVA-1.5: 3 x 336 x 336 x 2 bytes over 576 embeddings = 1,176 per image
# embedding; Qwen3-VL's 16-pixel patches: 12,288; a model served in float32: twice
# these), hence ``tune --bytes-per-embedding``.
DEFAULT_BYTES_PER_EMBEDDING: Mapping[str, int] = MappingProxyType(
    {"image": 9408, "video": 9408, "audio": 1024})


def processed_bytes(embeddings: int, modality: str,
                    per_embedding: Mapping[str, int] = DEFAULT_BYTES_PER_EMBEDDING) -> int:
    """The bytes an item's processed input takes in the processor cache: its embeddings
    times its modality's bytes per embedding (a modality not named weighs as an image)."""
    image = per_embedding.get("image", DEFAULT_BYTES_PER_EMBEDDING["image"])
    return embeddings * per_embedding.get(modality, image)


@dataclass(slots=True)
class ProcessorCache:
    """An LRU of processed items bounded by ``capacity`` bytes (0 disables it).

    Invariant: ``used == sum(entries.values()) <= capacity``; ``entries`` runs from
    the least to the most recently used.
    """

    capacity: int = DEFAULT_PROCESSOR_CACHE_BYTES
    entries: OrderedDict[str, int] = field(default_factory=OrderedDict)
    used: int = 0

    def __contains__(self, digest: object) -> bool:
        return digest in self.entries

    def lookup(self, digest: str, nbytes: int) -> bool:
        """Whether the processed item is cached (a hit saves its preprocessing); either
        way it is the most recently used afterwards, if it fits at all."""
        entries = self.entries
        if digest in entries:
            entries.move_to_end(digest)
            return True
        if nbytes > self.capacity:
            return False
        while self.used + nbytes > self.capacity:
            _, size = entries.popitem(last=False)
            self.used -= size
        entries[digest] = nbytes
        self.used += nbytes
        return False

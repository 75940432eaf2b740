"""A per-endpoint capacity derived from the model servers' encoder cache size.

The Go plugin guesses 2 MiB per item (2,048 MiB -> 1,024 items). A vLLM v1 server's
encoder cache holds ``encoder_cache_size`` *embeddings* (by default its
``max_num_batched_tokens``: 2,048 or 8,192, raised to the largest item), i.e. a handful
of images, so an index of 1,024 items per endpoint predicts entries that are long gone
(docs/simulation.md measures it: precision ~0.1). Sizing the index to the real cache:

- items carry their embedding counts (the ``tokenized`` source): size mode with the
  encoder cache size itself;
- they do not (``generate``, ``chat_completions``: every size is 1): items mode with the
  encoder cache size over the mean embeddings per item.
"""

from __future__ import annotations

from stream.core.cache import Capacity

__all__ = ["capacity_for_encoder_cache"]


def capacity_for_encoder_cache(encoder_cache_size: int,
                               mean_item_embeddings: float | None = None) -> Capacity:
    """Size mode of ``encoder_cache_size`` when item sizes are known (no mean given);
    else items mode of ``encoder_cache_size / mean_item_embeddings`` (at least 1)."""
    if encoder_cache_size < 1:
        raise ValueError("encoder_cache_size must be at least 1 embedding")
    if mean_item_embeddings is None:
        return Capacity("size", encoder_cache_size)
    if mean_item_embeddings <= 0:
        raise ValueError("mean_item_embeddings must be positive")
    return Capacity("items", max(1, int(encoder_cache_size // mean_item_embeddings)))

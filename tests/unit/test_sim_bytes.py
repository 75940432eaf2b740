"""One bytes-per-embedding model for the simulator and tune: the workload's items weigh in
the fleet's processor caches exactly what tune weighs them in its replayed ones, and the
default is Qwen2/2.5-VL's processed input in bf16 (vLLM casts the processor's floats to
the model's dtype): 2x2 patches of 3 channels x 2 frames x 14 x 14 pixels x 2 bytes."""

from __future__ import annotations

from stream.core.items import Item
from stream.sim.processor import DEFAULT_BYTES_PER_EMBEDDING, processed_bytes
from stream.sim.tune import ItemModel
from stream.sim.workload import WorkloadSpec, generate, item_segment

QWEN2_VL_BF16 = 4 * (3 * 2 * 14 * 14) * 2


def test_the_default_is_qwen2_vl_in_bf16_and_audio_its_own():
    assert DEFAULT_BYTES_PER_EMBEDDING["image"] == DEFAULT_BYTES_PER_EMBEDDING["video"] == QWEN2_VL_BF16 == 9408
    assert DEFAULT_BYTES_PER_EMBEDDING["audio"] == 4 * 128 * 2
    assert processed_bytes(1000, "point-cloud") == 1000 * 9408  # a modality not named weighs as an image


def test_the_workload_and_tune_weigh_every_item_alike():
    items = [Item("i", 1200, "image"), Item("v", 4000, "video"), Item("a", 300, "audio"), Item("x", 7, "other")]
    for item in items:
        assert item_segment(item).nbytes == ItemModel().nbytes(item) == processed_bytes(item.size, item.modality)
    custom = {"image": 1176}
    assert item_segment(items[0], custom).nbytes == ItemModel(bytes_per_embedding=custom).nbytes(items[0]) == 1200 * 1176


def test_a_generated_workload_weighs_its_items_by_the_shared_constant():
    requests = generate(WorkloadSpec(requests=40, seed=3))
    segments = [s for r in requests for s in r.segments if s.embeddings]
    assert segments
    assert all(s.nbytes == s.embeddings * 9408 for s in segments)

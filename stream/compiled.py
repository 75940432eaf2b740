"""Which modules of the core run compiled, and whether a compiled copy is older than its
source.

``setup.py`` compiles the modules of ``[tool.mmcache] compiled`` (pyproject.toml, the same
list as :data:`MODULES`; tests/unit/test_compiled.py holds them equal) when it can, and
installs the pure-Python core when it cannot. An extension built in place (``pip install
-e .``) is imported instead of its ``.py`` even after that source changed: ``serve`` warns
(:func:`warn_stale`), and ``python -m stream.compiled`` (run by the Makefile after its
install) tells which copy runs.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import sys
from pathlib import Path

MODULES = ("stream.core.items", "stream.core.lru", "stream.core.fold", "stream.core.index",
           "stream.core.loading", "stream.core.digests", "stream.core.render")

# A source checkout: the extensions sit beside a source that may change after the build.
# An installed wheel holds copies written together, whose times say nothing.
PROJECT = Path(__file__).resolve().parents[1]


def _origin(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)  # finds the file the import takes, runs nothing
    return Path(spec.origin) if spec is not None and spec.origin else None


def _is_extension(path: Path) -> bool:
    return any(path.name.endswith(suffix) for suffix in importlib.machinery.EXTENSION_SUFFIXES)


def pure_python() -> list[str]:
    """The modules of :data:`MODULES` that run from their ``.py`` source."""
    return [name for name in MODULES if (origin := _origin(name)) is None or not _is_extension(origin)]


def stale(project: Path = PROJECT) -> list[tuple[str, Path, Path]]:
    """(module, extension, source) for every extension under ``project`` (a source
    checkout, with its setup.py) that is older than its ``.py`` source, or that is no
    longer compiled at all (a module that left :data:`MODULES`: its old build would
    still be imported instead of the source)."""
    if not (project / "setup.py").exists():
        return []
    found = []
    for built in sorted((project / "stream").rglob("*")):
        if not _is_extension(built):
            continue
        stem = built.name.split(".", 1)[0]
        source = built.with_name(stem + ".py")
        name = ".".join(source.relative_to(project).with_suffix("").parts)
        if source.exists() and (name not in MODULES or source.stat().st_mtime > built.stat().st_mtime):
            found.append((name, built, source))
    return found


def warn_stale(log: logging.Logger) -> list[str]:
    """Log one warning for each compiled module older than its source; return them."""
    names = []
    for name, built, source in stale():
        log.warning("%s runs from %s, which is older than its source %s or no longer compiled: "
                    "the compiled copy runs, not the source's changes; rebuild with `pip install "
                    "-e .` (or delete the .so to run the source)", name, built.name, source)
        names.append(name)
    return names


def main() -> int:
    """Tell which copy of the core runs (after an install): one line, on stderr for the
    pure-Python fallback and for stale extensions."""
    plain, old = pure_python(), stale()
    if plain:
        print(f"WARNING: mmcache runs the pure-Python core for {', '.join(plain)} (not compiled: "
              "no C compiler or no Cython at install); same answers, 1.01-1.12x slower", file=sys.stderr)
    for _name, built, source in old:
        print(f"WARNING: {built} is older than {source} or no longer compiled: rebuild with "
              "`pip install -e .`, or delete it", file=sys.stderr)
    if not plain and not old:
        print(f"mmcache: compiled core ({', '.join(MODULES)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The compiled core is optional (issue 15, 8d): without a C compiler, or without Cython,
the install succeeds with one warning and the package runs its pure-Python modules; an
in-place extension older than its source is found (and ``serve`` warns of it).

Each test builds a copy of the project in a temp dir, with no network
(``--no-build-isolation --no-deps``): the interpreter's own setuptools and Cython build it.
Nothing is installed: an install would replace the work tree's editable install.
"""

from __future__ import annotations

import importlib.machinery
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from stream import compiled

ROOT = Path(__file__).resolve().parents[2]
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]
WARNING = "WARNING: mmcache: "


def project_copy(tmp_path: Path) -> Path:
    """The files a build reads, without any extension; Cython's C files come along (with
    their times) so that only what changed is translated again."""
    copy = tmp_path / "project"
    copy.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, copy / name)
    shutil.copytree(ROOT / "stream", copy / "stream",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd"))
    if (ROOT / "build" / "cython").is_dir():
        shutil.copytree(ROOT / "build" / "cython", copy / "build" / "cython")
    return copy


def pip(copy: Path, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pip", "-v", "--no-input", *args, "--no-build-isolation",
                           "--no-deps", "--no-index"], cwd=copy, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=300)


def run_python(code: str, path: Path) -> str:
    """``code`` in a fresh interpreter that imports ``stream`` from ``path`` (first on its
    path, before the editable install of the work tree)."""
    done = subprocess.run([sys.executable, "-c", code], cwd=path, env={**os.environ, "PYTHONPATH": str(path)},
                          capture_output=True, text=True, timeout=60, check=True)
    return done.stdout + done.stderr


WHERE = ("import stream.core.items, stream.core.cache, stream.core.render as r, stream.compiled as c; "
         "print([m.__file__ for m in (stream.core.items, stream.core.cache, r)]); print(c.pure_python()); "
         "c.main()")


def test_without_a_c_compiler_the_wheel_holds_the_pure_python_core(tmp_path):
    pytest.importorskip("Cython", reason="the compiler's failure is reached only with Cython (dev extra)")
    copy = project_copy(tmp_path)
    built = pip(copy, "wheel", "-w", str(tmp_path / "wheels"), ".", env={"CC": "/bin/false"})
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    output = built.stdout + built.stderr
    assert output.count(WARNING) == 1, output[-3000:]
    assert "the C compiler failed" in output and "installed the pure-Python core" in output
    wheel, = (tmp_path / "wheels").glob("mmcache-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        assert not [name for name in names if name.endswith((".so", ".pyd"))]
        assert "stream/core/items.py" in names
        archive.extractall(tmp_path / "site")
    ran = run_python(WHERE, tmp_path / "site")
    assert str(tmp_path / "site" / "stream" / "core" / "items.py") in ran
    assert str(list(compiled.MODULES)) in ran  # pure_python(): all three
    assert "runs the pure-Python core" in ran


def test_without_cython_an_editable_build_falls_back_and_drops_the_stale_extension(tmp_path):
    copy = project_copy(tmp_path)
    hidden = tmp_path / "hidden" / "Cython"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('Cython is hidden by this test')\n")
    stale = copy / "stream" / "core" / f"items{SUFFIX}"
    stale.write_bytes(b"an extension built from an older items.py")
    # what `pip install -e .` asks of the build backend, without installing anything (an
    # install, even with --prefix, would replace the work tree's own editable install)
    built = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                            "print(build_meta.build_editable(sys.argv[1]))", str(tmp_path / "wheels")],
                           cwd=copy, env={**os.environ, "PYTHONPATH": str(hidden.parent)},
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    output = built.stdout + built.stderr
    assert output.count(WARNING) == 1, output[-3000:]
    assert "Cython is not installed" in output
    assert not stale.exists(), "an older extension would be imported instead of the source"
    ran = run_python(WHERE, copy)
    assert str(copy / "stream" / "core" / "items.py") in ran


def test_an_extension_older_than_its_source_is_found_and_serve_warns_of_it(tmp_path):
    built = [ROOT / "stream" / "core" / f"{module}{SUFFIX}" for module in ("items", "render")]
    if not all(path.exists() for path in built):
        pytest.skip("the work tree's core is not compiled: no extension to age")
    copy = project_copy(tmp_path)
    core = copy / "stream" / "core"
    for path in built:
        shutil.copy(path, core / path.name)  # written now: newer than its source
    os.utime(core / f"items{SUFFIX}", (1_000_000, 1_000_000))  # built long before items.py changed
    ran = run_python("import logging, sys; logging.basicConfig(stream=sys.stdout); "
                     "from stream.compiled import warn_stale; print(warn_stale(logging.getLogger('mmcache')))",
                     copy)
    assert "stream.core.items runs from " + f"items{SUFFIX}" in ran
    assert "older than its source" in ran and "rebuild with `pip install -e .`" in ran
    assert "['stream.core.items']" in ran  # render's extension is newer than its source: not stale
    # serve says so first thing: here it then refuses a file as its data dir, and stops
    (tmp_path / "a-file").write_text("")
    env = {key: value for key, value in os.environ.items() if not key.startswith("MMCACHE_")}
    served = subprocess.run([sys.executable, "-c", "from stream.cli import main; main()", "serve",
                             "--data-dir", str(tmp_path / "a-file")], cwd=copy,
                            env={**env, "PYTHONPATH": str(copy)}, capture_output=True, text=True, timeout=60)
    assert served.returncode != 0 and "is a file, not a directory" in served.stderr, served.stderr
    assert f"WARNING mmcache: stream.core.items runs from items{SUFFIX}, which is older than its source" \
        in served.stderr, served.stderr


def test_an_installed_copy_is_not_checked_against_times(tmp_path):
    assert compiled.stale(tmp_path) == []  # no setup.py beside the package: a wheel's copies


def test_an_extension_of_a_module_no_longer_compiled_is_found_whatever_its_time(tmp_path):
    (tmp_path / "setup.py").write_text("")
    core = tmp_path / "stream" / "core"
    core.mkdir(parents=True)
    (core / "cache.py").write_text("")
    (core / f"cache{SUFFIX}").write_bytes(b"")  # newer than its source, but left from an older list
    (core / "items.py").write_text("")
    os.utime(core / "items.py", (1, 1))
    (core / f"items{SUFFIX}").write_bytes(b"")  # compiled and up to date: not stale
    assert compiled.stale(tmp_path) == [("stream.core.cache", core / f"cache{SUFFIX}", core / "cache.py")]

"""Compile the hot modules with Cython, each from its own ``.py`` source, when it can.

The source stays the readable reference: ``tests/unit/test_compiled.py`` holds every
compiled module to it. The list is ``[tool.mmcache] compiled`` in ``pyproject.toml``,
which also holds the project's metadata.

The compiled copies are an optimisation (1.01-1.12x on the hot paths, issue 12), not a
requirement: without Cython or without a working C compiler the install goes on with
the pure-Python core and says so once (``tests/unit/test_install_fallback.py``). An
in-place extension that could not be rebuilt is removed, so that the older compiled copy
does not shadow newer source.
"""

import os
import sys
import tomllib

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, CompileError, ExecError, LinkError, PlatformError

with open("pyproject.toml", "rb") as file:
    COMPILED = tomllib.load(file)["tool"]["mmcache"]["compiled"]

# Python's semantics, unchanged: annotations stay annotations (as C types they would
# refuse, say, a bytearray where ``bytes`` is written), and the checks Cython can turn
# off (bounds, negative indexes, division by zero) are left at their defaults, on.
DIRECTIVES = {"language_level": 3, "annotation_typing": False}

# What a compiler that is missing or broken raises from build_ext (OSError: a CC that
# cannot be executed at all).
BUILD_ERRORS = (CCompilerError, CompileError, ExecError, LinkError, PlatformError, OSError)

# The one warning, also the text tests/unit/test_install_fallback.py looks for.
FALLBACK = ("WARNING: mmcache: {why}: installed the pure-Python core instead of compiling "
            "{modules} (same answers, 1.01-1.12x slower on the hot paths)")

ROOT = os.path.dirname(os.path.abspath(__file__))

try:
    from Cython.Build import cythonize
except ImportError:
    cythonize = None


class BuildCore(build_ext):
    """build_ext that falls back to the pure-Python module for every extension it cannot
    build, with one warning for all of them."""

    def run(self) -> None:
        """Build, falling back when no compiler can even be set up."""
        self.in_place = self.inplace  # setuptools' run() clears inplace while it builds
        try:
            super().run()
        except PlatformError as exc:  # no compiler at all for this platform
            self.fall_back(list(self.extensions), str(exc))

    def build_extensions(self) -> None:
        """Build each extension; those that fail fall back together."""
        if cythonize is None:
            self.fall_back(list(self.extensions), "Cython is not installed")
            return
        self.check_extensions_list(self.extensions)
        failed, why = [], ""
        for ext in self.extensions:
            try:
                self.build_extension(ext)
            except BUILD_ERRORS as exc:
                failed.append(ext)
                detail = str(exc).strip() or type(exc).__name__
                why = why or f"the C compiler failed ({detail[:200]}{'...' if len(detail) > 200 else ''})"
        if failed:
            self.fall_back(failed, why)

    def fall_back(self, failed: list[Extension], why: str) -> None:
        """Install ``failed`` as their pure-Python source, with one warning."""
        self.extensions = [ext for ext in self.extensions if ext not in failed]
        for ext in failed:
            stale = os.path.join(ROOT, self.get_ext_filename(ext.name))
            if getattr(self, "in_place", self.inplace) and os.path.exists(stale):
                os.remove(stale)  # an older build would be imported instead of the source
        sys.stderr.write(FALLBACK.format(why=why, modules=", ".join(ext.name for ext in failed)) + "\n")
        sys.stderr.flush()


if cythonize is not None:
    EXTENSIONS = cythonize([name.replace(".", "/") + ".py" for name in COMPILED],
                           build_dir="build/cython", compiler_directives=DIRECTIVES)
else:  # placeholders: BuildCore builds none of them and says so
    EXTENSIONS = [Extension(name, sources=[]) for name in COMPILED]
for extension in EXTENSIONS:
    extension.optional = True  # setuptools then copies in place only what was built

setup(ext_modules=EXTENSIONS, cmdclass={"build_ext": BuildCore})

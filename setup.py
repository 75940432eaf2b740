"""Compile the hot modules with Cython, each from its own ``.py`` source.

The source stays the readable reference: ``tests/unit/test_compiled.py`` holds every
compiled module to it. The list is ``[tool.mmcache] compiled`` in ``pyproject.toml``,
which also holds the project's metadata.
"""

import tomllib

from Cython.Build import cythonize
from setuptools import setup

with open("pyproject.toml", "rb") as file:
    COMPILED = tomllib.load(file)["tool"]["mmcache"]["compiled"]

# Python's semantics, unchanged: annotations stay annotations (as C types they would
# refuse, say, a bytearray where ``bytes`` is written), and the checks Cython can turn
# off (bounds, negative indexes, division by zero) are left at their defaults, on.
DIRECTIVES = {"language_level": 3, "annotation_typing": False}

setup(ext_modules=cythonize([name.replace(".", "/") + ".py" for name in COMPILED],
                            build_dir="build/cython", compiler_directives=DIRECTIVES))

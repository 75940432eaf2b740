"""Lets the registry's torchvision import beside a CPU torch, in the e2e environment only.

The torchvision wheels on the package registries are CUDA builds: with a CPU torch their
compiled ops do not load (the library links libtorch_cuda), and ``import torchvision``
then fails in ``_meta_registrations`` (``operator torchvision::nms does not exist``), which
registers fake kernels for two ops without checking they exist, as it does for the
others. vLLM 0.32's Qwen2-VL imports transformers' torchvision image processor, which
only needs torchvision's Python transforms.

``make e2e`` copies this module into ``.venv-vllm``'s site-packages with a ``.pth`` line
that imports it at every start of that interpreter (vLLM's engine and helper processes
included). It only adds an import hook: when ``torchvision`` is first imported with a
CPU torch, the two ops' schemas are defined first (without kernels: calling them raises,
and nothing in vLLM's CPU path calls them).
"""

from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder
from typing import Any

__all__: list[str] = []

_LIBRARIES: list[Any] = []  # a torch.library.Library drops its definitions when collected
SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
           "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


class _DefineOpsFirst(MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch

        if torch.version.cuda is None:
            library = torch.library.Library("torchvision", "FRAGMENT")
            for schema in SCHEMAS:
                library.define(schema)
            _LIBRARIES.append(library)
        return None  # the usual finders import torchvision itself


sys.meta_path.insert(0, _DefineOpsFirst())

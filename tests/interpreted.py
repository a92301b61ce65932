"""Triton kernels under test: without CUDA they run under TRITON_INTERPRET=1, which must be
set before triton is first imported (importing this module does it), and a kernel module
that something imported compiled before is reloaded interpreted."""
from __future__ import annotations

import importlib
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")
INTERP = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERP else "cuda"


def interpreted(*modules_and_kernels) -> None:
    """(module, kernel name), ...: reload the modules whose kernel is compiled, in order
    (a module that imports another comes after it)."""
    if not INTERP:
        return
    from triton.runtime.interpreter import InterpretedFunction
    for module, kernel in modules_and_kernels:
        if not isinstance(getattr(module, kernel), InterpretedFunction):
            importlib.reload(module)

"""The bare name ``kernels``, handed to Hugging Face's hub-kernels package when it is installed.

Only a process started in a checkout's root imports this folder as ``kernels`` (the root is
on ``sys.path``); pagedq itself always says ``pagedq.kernels``. transformers (>= 5.25)
depends on hub-kernels and imports it by that name whenever its metadata says it is
installed; from a checkout's root this folder would shadow it and transformers would fail
(``cannot import name 'CUDAProperties' from 'kernels'``). ``hand_over`` makes
``sys.modules["kernels"]`` the hub package, which the running ``import kernels`` then
returns (the import system returns whatever ``sys.modules`` holds when the package's
``__init__`` ends). Without hub-kernels the folder stays what ``import kernels`` finds.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from importlib.machinery import ModuleSpec, PathFinder

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout's root


def hub_spec() -> ModuleSpec | None:
    """The spec of a ``kernels`` package on the path outside this checkout, if any."""
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]
    return PathFinder.find_spec("kernels", path)


def hand_over() -> None:
    spec = hub_spec()
    if spec is None or spec.loader is None:
        return
    ours = sys.modules["kernels"]
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module  # before exec: its own `from kernels.x import` needs it
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules["kernels"] = ours
        raise

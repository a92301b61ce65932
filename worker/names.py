"""The name a worker serves its model under (its jobs stream's name)."""
from __future__ import annotations

import os


def served_name(model: str, explicit: str | None) -> str:
    """``explicit`` if given, else the model's name: a bundled name as it is, a folder's or
    file's name without ``.gguf``."""
    if explicit:
        return explicit
    base = os.path.basename(os.path.normpath(model))
    return base[:-5] if base.endswith(".gguf") else base

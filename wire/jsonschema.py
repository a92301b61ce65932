"""JSON Schemas of the wire models, for clients in other languages (docs/schema/).

    python -m pagedq.wire.jsonschema           # (re)write docs/schema/<Name>.schema.json
    python -m pagedq.wire.jsonschema --check   # exit 1, listing the files that differ

The files are generated from wire/schema.py (pydantic's ``model_json_schema()``) and
checked by tests/test_docs.py: edit the models, then run the first command.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .schema import FinalEvent, JobRecord, JobRequest, TokenEvent

MODELS = (JobRequest, JobRecord, TokenEvent, FinalEvent)
SCHEMA_DIR = Path(__file__).resolve().parent.parent / "docs" / "schema"


DIALECT = "https://json-schema.org/draft/2020-12/schema"  # what pydantic writes


def schemas() -> dict[str, dict[str, Any]]:
    """Model name -> its JSON Schema, declaring its dialect (``$schema``)."""
    return {m.__name__: {"$schema": DIALECT, **m.model_json_schema()} for m in MODELS}


def rendered() -> dict[str, str]:
    """File name -> file text (sorted keys, 2-space indent, trailing newline)."""
    return {f"{name}.schema.json": json.dumps(schema, indent=2, sort_keys=True,
                                              ensure_ascii=False) + "\n"
            for name, schema in schemas().items()}


def stale(directory: Path = SCHEMA_DIR) -> list[str]:
    """Names of the files in ``directory`` that are missing or differ from the models."""
    out = []
    for name, text in rendered().items():
        path = directory / name
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            out.append(name)
    return out


def write(directory: Path = SCHEMA_DIR) -> list[str]:
    """Write every schema file; return the names of those that changed."""
    directory.mkdir(parents=True, exist_ok=True)
    changed = stale(directory)
    for name, text in rendered().items():
        if name in changed:
            (directory / name).write_text(text, encoding="utf-8")
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pagedq.wire.jsonschema",
                                 description="Write or check docs/schema/*.schema.json.")
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 if a file is missing or differs")
    ap.add_argument("--dir", type=Path, default=SCHEMA_DIR, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.check:
        bad = stale(args.dir)
        for name in bad:
            print(f"out of date: {args.dir / name} (run python -m pagedq.wire.jsonschema)",
                  file=sys.stderr)
        return 1 if bad else 0
    for name in write(args.dir):
        print(f"wrote {args.dir / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""docs/configuration.md's "Every setting" tables, made from the declarations: the engine's
and the worker process's fields (wire/engine_config.py, worker/settings.py) and the
service's (wire/settings.py), in the order and sections of worker/config.py ``sections()``.

    python -m pagedq.worker.config_doc           # (re)write the tables in the doc
    python -m pagedq.worker.config_doc --check   # exit 1 if the doc differs

tests/test_docs.py runs the check: change a declaration, then run the first command.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pagedq.wire.declared import Declared, allowed
from pagedq.wire.settings import Settings
from pagedq.worker.config import env_name, flag_name, sections
from pagedq.worker.config_show import _text
from pagedq.worker.settings import DECLARED

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
BEGIN = "<!-- settings: made by `python -m pagedq.worker.config_doc` from the declarations -->"
END = "<!-- end of settings -->"


def meaning(d: Declared) -> str:
    """A declared setting's table cell: what it is, what it takes, what its default means."""
    s, text = d.setting, d.setting.help
    if what := allowed(d):
        text += f"; {'one of ' if s.choices else ''}{what}"
    if s.default_help:
        text += f"; `{_text(d.worker_default)}`: {s.default_help}"
    return text


def row(key: str, name: str) -> str:
    d = DECLARED.get(name)
    if d is not None:
        default, what = d.worker_default, meaning(d)
        boolean = d.base is bool
    else:
        f = Settings.model_fields[name]
        default, what, boolean = f.default, f.description, f.annotation is bool
    default = list(default) if isinstance(default, tuple) else default
    flag = flag_name(name)
    flags = "-" if flag is None else f"`{flag}`" + (
        f", `--no-{flag[2:]}`" if boolean else "")
    return f"| `{key}` | `{env_name(name)}` | {flags} | `{_text(default)}` | {what} |"


def tables() -> str:
    out = []
    for sec, keys in sections().items():
        out += [f"### `{sec}:`", "", "| YAML key | environment | flag | default | meaning |",
                "|---|---|---|---|---|"]
        out += [row(f"{sec}.{key}", name) for key, name in keys.items()]
        out.append("")
    return "\n".join(out)


def render(doc: str) -> str:
    """``doc`` with the tables between its markers made anew."""
    head, sep, rest = doc.partition(BEGIN + "\n")
    _, sep2, tail = rest.partition(END)
    if not (sep and sep2):
        raise ValueError(f"{DOC.name} lost its markers {BEGIN!r} ... {END!r}")
    return head + sep + "\n" + tables() + "\n" + END + tail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pagedq.worker.config_doc",
                                 description="Write (or --check) docs/configuration.md's "
                                             "tables of every setting.")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if the doc differs from the declarations (default: write)")
    ap.add_argument("--doc", type=Path, default=DOC, help=f"the file (default: {DOC})")
    args = ap.parse_args(argv)
    text = args.doc.read_text(encoding="utf-8")
    new = render(text)
    if args.check:
        if new != text:
            print(f"out of date: {args.doc} (run python -m pagedq.worker.config_doc)",
                  file=sys.stderr)
            return 1
        return 0
    args.doc.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

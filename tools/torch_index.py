"""Where `make` installs torch from: the pip arguments for TORCH_INDEX (Makefile).

    python tools/torch_index.py auto|default|URL     prints the pip arguments, one a line

* a URL: ``--index-url URL`` (e.g. https://download.pytorch.org/whl/cu128 for CUDA 12.8);
* ``default``: nothing, pip's configured index (PyPI unless pip is configured otherwise);
* ``auto`` (the default): the CPU build's index, https://download.pytorch.org/whl/cpu, on
  Linux x86_64, where PyPI's torch is the multi-GB CUDA build, unless pip is configured
  with package sources of its own (index-url other than PyPI, extra-index-url or
  find-links, in a pip config file or PIP_* variables: a mirror or an offline index,
  which the machine's owner chose and which may be all it can reach); elsewhere
  ``default``: PyPI's torch for macOS, Windows and Linux on ARM is the CPU build.

Why it chose goes to stderr, so `make` shows it. Run it with the Python whose pip installs
(it asks that pip for its configuration).
"""
from __future__ import annotations

import platform
import subprocess
import sys

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PYPI = ("https://pypi.org/simple", "https://pypi.python.org/simple")
SOURCE_KEYS = ("index-url", "extra-index-url", "find-links")


def pip_sources() -> list[str]:
    """``key=value`` of each package source pip is configured with (files and PIP_*),
    PyPI itself left out."""
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], text=True,
                             capture_output=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    found = []
    for line in out.splitlines():
        key, _, value = line.partition("=")
        name = key.rpartition(".")[2]
        value = value.strip().strip("'\"")
        if name in SOURCE_KEYS and value and value.rstrip("/") not in PYPI \
                and f"{name}={value}" not in found:
            found.append(f"{name}={value}")
    return found


def choose(value: str) -> tuple[list[str], str]:
    """(pip arguments, why)."""
    if value not in ("auto", "default"):
        return ["--index-url", value], f"TORCH_INDEX={value}"
    if value == "default":
        return [], "TORCH_INDEX=default: pip's configured index"
    system, machine = platform.system(), platform.machine().lower()
    if (system, machine) not in (("Linux", "x86_64"), ("Linux", "amd64")):
        return [], f"{system} {machine}: PyPI's torch is the CPU build here"
    if sources := pip_sources():
        return [], ("pip is configured with its own package sources (" + ", ".join(sources)
                    + "): using them; TORCH_INDEX=" + CPU_INDEX + " to use the CPU index")
    return ["--index-url", CPU_INDEX], f"Linux x86_64: the CPU build from {CPU_INDEX}"


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0]:
        print("usage: torch_index.py auto|default|URL", file=sys.stderr)
        return 2
    args, why = choose(argv[0])
    print(f"torch source: {why}", file=sys.stderr)
    print("\n".join(args))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

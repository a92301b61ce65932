"""Import directions of docs/design.md and the `kernels` name clash guard."""
from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code: str) -> None:
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": ROOT})


def test_producer_and_cli_client_path_do_not_import_torch():
    _run("import sys, producer, producer.client, producer.aio, producer.cli, worker.cli\n"
         "worker.cli.build_parser()\n"
         "bad = [m for m in ('torch', 'engine', 'transformers') if m in sys.modules]\n"
         "assert not bad, bad")


def test_engine_never_imports_redis():
    _run("import sys, engine.llm_engine, engine.block_manager, engine.scheduler\n"
         "assert 'redis' not in sys.modules and 'producer' not in sys.modules\n"
         "assert 'worker' not in sys.modules")


def test_scheduler_and_block_manager_do_not_import_torch():
    _run("import sys, engine.scheduler, engine.block_manager\nassert 'torch' not in sys.modules")


def test_kernels_import_nothing_from_engine():
    for name in os.listdir(os.path.join(ROOT, "kernels")):
        if name.endswith(".py"):
            src = open(os.path.join(ROOT, "kernels", name)).read()
            assert not re.search(r"^\s*(from|import)\s+engine\b", src, re.M), name


def test_transformers_does_not_mistake_our_kernels_package_for_hub_kernels():
    _run("import kernels\nassert not hasattr(kernels, '__version__')\n"
         "from transformers.utils import is_kernels_available\n"
         "assert is_kernels_available() is False")

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


def test_gateway_imports_producer_only():
    """The gateway (FastAPI app, CLI, every module) never imports torch, the engine or the
    worker; `pagedq -h` (worker.cli's parser, which registers `pagedq gateway`) imports no
    web framework."""
    _run("import sys, pkgutil, importlib, gateway\n"
         "for m in pkgutil.iter_modules(gateway.__path__):\n"
         "    importlib.import_module('gateway.' + m.name)\n"
         "gateway.app.create_app()\n"
         "bad = [m for m in sys.modules if m.split('.')[0] in "
         "('torch', 'engine', 'worker', 'transformers')]\n"
         "assert not bad, bad")
    _run("import sys, worker.cli\nworker.cli.build_parser()\n"
         "bad = [m for m in ('fastapi', 'starlette', 'uvicorn') if m in sys.modules]\n"
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


def _project_imports() -> dict[str, set[str]]:
    """module -> project modules it imports (anywhere in the file, TYPE_CHECKING and
    function-level imports included: a circle there is still a circle)."""
    import ast

    graph: dict[str, set[str]] = {}
    for pkg in ("pagedq", "producer", "worker", "engine", "kernels", "gateway"):
        for dirpath, _dirs, files in os.walk(os.path.join(ROOT, pkg)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                mod = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                mod = mod.removesuffix(".__init__")
                pkg_of = mod if name == "__init__.py" else mod.rpartition(".")[0]
                deps = graph.setdefault(mod, set())
                for node in ast.walk(ast.parse(open(path).read())):
                    if isinstance(node, ast.Import):
                        deps.update(a.name for a in node.names)
                    elif isinstance(node, ast.ImportFrom):
                        base = node.module or ""
                        if node.level:
                            parts = pkg_of.split(".")
                            parts = parts[:len(parts) - node.level + 1]
                            base = ".".join(parts + ([base] if base else []))
                        deps.add(base)
                        deps.update(f"{base}.{a.name}" for a in node.names)
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


def test_no_import_circles_between_project_modules():
    graph = _project_imports()
    assert "worker.service" in graph and "worker.intake" in graph["worker.service"]
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    circles = []

    def visit(mod: str, path: list[str]) -> None:
        state[mod] = 1
        for dep in sorted(graph[mod]):
            if state.get(dep) == 1:
                circles.append(path[path.index(dep):] + [dep] if dep in path else [mod, dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [mod])
    # a package's __init__ re-exporting its own submodules is not a circle of modules
    circles = [c for c in circles if not any(b.startswith(a + ".") for a, b in zip(c, c[1:], strict=False))]
    assert not circles, circles

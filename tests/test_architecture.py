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


# folders of pagedq.<name>
PACKAGES = ("wire", "producer", "batch", "admin", "worker", "engine", "kernels", "gateway")


def _loaded(code: str, *, prefixes: tuple[str, ...]) -> None:
    """Runs `code`, then fails if any module under one of `prefixes` was imported, or any
    top-level module named like one of pagedq's folders and loaded from the checkout (a stray
    `import engine` would load a second copy of the package; Hugging Face's `kernels` from
    site-packages is not ours)."""
    _run(code + "\nimport sys\n"
         f"bad = [m for m, mod in list(sys.modules.items()) if any("
         f"m == p or m.startswith(p + '.') for p in {prefixes!r}) or ("
         f"m.split('.')[0] in {PACKAGES!r}"
         f" and (getattr(mod, '__file__', None) or '').startswith({ROOT + os.sep!r}"
         f" + m.split('.')[0]))]\n"
         "assert not bad, bad")


def test_producer_and_cli_client_path_do_not_import_torch():
    _loaded("import pagedq, pagedq.producer.client, pagedq.producer.aio, pagedq.client_cli\n"
            "import pagedq.cli\npagedq.cli.build_parser()",
            prefixes=("torch", "pagedq.engine", "transformers"))


def test_gateway_imports_producer_only():
    """The gateway (FastAPI app, CLI, every module) never imports torch, the engine or the
    worker; `pagedq -h` (pagedq.cli's parser, which registers `pagedq gateway`)
    imports no web framework."""
    _loaded("import pkgutil, importlib, pagedq.gateway\n"
            "for m in pkgutil.iter_modules(pagedq.gateway.__path__):\n"
            "    importlib.import_module('pagedq.gateway.' + m.name)\n"
            "pagedq.gateway.app.create_app()",
            prefixes=("torch", "pagedq.engine", "pagedq.worker", "transformers"))
    _loaded("import pagedq.cli\npagedq.cli.build_parser()",
            prefixes=("fastapi", "starlette", "uvicorn"))


def test_engine_never_imports_redis():
    _loaded("import pagedq.engine.llm_engine, pagedq.engine.block_manager\n"
            "import pagedq.engine.scheduler",
            prefixes=("redis", "pagedq.producer", "pagedq.worker"))


# Who may import whom (docs/design.md "Layout"), package by package: the wire contract is
# the only code the worker and the clients share; the CLI root (pagedq/) imports them all,
# and of its modules the packages' own commands import pagedq.exits alone.
MAY_IMPORT = {
    "wire": {"wire"},
    "producer": {"wire", "producer"},
    "batch": {"wire", "producer", "batch"},
    "admin": {"wire", "producer", "admin"},
    "gateway": {"wire", "producer", "batch", "gateway"},
    "worker": {"wire", "engine", "kernels", "worker"},
    "engine": {"engine", "kernels", "wire"},  # of wire: ENGINE_WIRE alone
    "kernels": {"kernels"},
}
CLI_ROOT_SHARED = {"pagedq.exits"}  # the exit codes and their error wrapper
# what the engine takes from the wire package: declarations in plain Python, no redis
ENGINE_WIRE = {"pagedq.wire", "pagedq.wire.declared", "pagedq.wire.engine_config",
               "pagedq.wire.guided",
               "pagedq.wire.sampling"}


def _package(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in PACKAGES else "pagedq"


def test_every_package_imports_only_what_its_layer_may():
    assert set(MAY_IMPORT) == set(PACKAGES)
    bad = []
    for mod, deps in sorted(_project_imports().items()):
        pkg = _package(mod)
        if pkg == "pagedq":
            continue  # the CLI root and the lazy public names: every package
        for dep in sorted(deps):
            to = _package(dep)
            if to == "pagedq" and dep not in CLI_ROOT_SHARED | {"pagedq"}:
                bad.append(f"{mod} -> {dep}")
            elif to != "pagedq" and to not in MAY_IMPORT[pkg]:
                bad.append(f"{mod} -> {dep}")
            elif pkg == "engine" and to == "wire" and dep not in ENGINE_WIRE:
                bad.append(f"{mod} -> {dep}")
    assert not bad, bad


def test_the_worker_and_the_clients_share_only_the_wire_contract():
    """Imported for real (not only as written): the worker's modules bring in no client,
    batch, admin or gateway module; the clients' bring in no worker module."""
    _loaded("import pkgutil, importlib, pagedq.worker\n"
            "for m in pkgutil.iter_modules(pagedq.worker.__path__):\n"
            "    importlib.import_module('pagedq.worker.' + m.name)",
            prefixes=("pagedq.producer", "pagedq.batch", "pagedq.admin", "pagedq.gateway",
                      "pagedq.cli", "pagedq.client_cli"))
    _loaded("import pkgutil, importlib, pagedq.producer, pagedq.wire\n"
            "for p in (pagedq.producer, pagedq.wire):\n"
            "    for m in pkgutil.iter_modules(p.__path__):\n"
            "        importlib.import_module(p.__name__ + '.' + m.name)",
            prefixes=("pagedq.worker", "pagedq.engine", "pagedq.batch", "pagedq.admin",
                      "pagedq.gateway", "torch"))


def _sources() -> list[tuple[str, str]]:
    """(path, text) of every module of pagedq's packages and its root."""
    out = []
    for pkg in ("pagedq", *PACKAGES):
        for dirpath, _dirs, files in os.walk(os.path.join(ROOT, pkg)):
            out += [(os.path.relpath(os.path.join(dirpath, n), ROOT),
                     open(os.path.join(dirpath, n)).read()) for n in files if n.endswith(".py")]
    return out


def test_every_lua_script_is_a_file_of_wire_lua_run_one_way():
    """No Lua inside Python strings; every .lua file of wire/lua/ is a declared script (or
    a prelude) and every declared script has its file; nothing but pagedq.wire.script
    sends a script (EVALSHA) or makes redis-py Script objects."""
    from pagedq.wire import lua

    inline = [p for p, text in _sources() if "redis.call(" in text and "KEYS[" in text]
    assert not inline, inline
    files = {n[:-4] for n in os.listdir(os.path.join(ROOT, "wire", "lua")) if n.endswith(".lua")}
    preludes = {s.prelude for s in lua.SCRIPTS.values()} - {None}
    assert files == set(lua.SCRIPTS) | preludes, files ^ (set(lua.SCRIPTS) | preludes)
    runs = [p for p, text in _sources() if p != os.path.join("wire", "script.py")
            and re.search(r"register_script\(|evalsha\(|command\(\s*\"EVAL|\.eval\(\s*[A-Z_]", text)]
    assert not runs, runs


def test_scheduler_and_block_manager_do_not_import_torch():
    _loaded("import pagedq.engine.scheduler, pagedq.engine.block_manager", prefixes=("torch",))


def test_guided_spec_validation_imports_no_torch():
    """The client side and the gateway can refuse a bad guided spec at submit: the check
    (and its library, llguidance) imports no torch, transformers or numpy."""
    _loaded("from pagedq.wire.guided import GuidedSpec, validate_guided\n"
            "validate_guided(GuidedSpec('json_schema', '{\"type\": \"object\"}'))\n"
            "validate_guided(GuidedSpec('regex', '[0-9]+'))\n"
            "try:\n    validate_guided(GuidedSpec('regex', 'a('))\n"
            "except ValueError:\n    pass\nelse:\n    raise AssertionError('a( compiled')",
            prefixes=("torch", "transformers", "numpy"))


def test_kernels_import_nothing_from_engine():
    for name in os.listdir(os.path.join(ROOT, "kernels")):
        if name.endswith(".py"):
            src = open(os.path.join(ROOT, "kernels", name)).read()
            assert not re.search(r"^\s*(from|import)\s+pagedq\.engine\b", src, re.M), name


def test_every_import_of_the_project_goes_through_pagedq():
    """Sources, tests and benches import pagedq.<package>, never the bare folder name (which
    works only from a checkout, and would load a second copy of the module there)."""
    bare = re.compile(rf"^\s*(from|import)\s+({'|'.join(PACKAGES)})\b", re.M)
    found = []
    for dirpath, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                found += [f"{os.path.relpath(path, ROOT)}: {m.group(0).strip()}"
                          for m in bare.finditer(open(path).read())]
    assert not found, found


def test_transformers_does_not_mistake_our_kernels_package_for_hub_kernels():
    """transformers imports Hugging Face's hub-kernels by its import name, `kernels`, when it
    is installed (transformers >= 5.25 depends on it). From the checkout's root our kernels/
    folder comes first on the path: it hands the name over, so transformers' integration
    imports and pagedq.kernels is still ours."""
    _run("import importlib.metadata as md, os, kernels, pagedq.kernels\n"
         f"root = {os.path.join(ROOT, 'kernels')!r}\n"
         "assert pagedq.kernels.__file__.startswith(root)\n"
         "assert not hasattr(pagedq.kernels, '__version__')\n"
         "try:\n"
         "    md.distribution('kernels')\n"
         "except md.PackageNotFoundError:\n"
         "    assert kernels.__file__.startswith(root) and not hasattr(kernels, '__version__')\n"
         "    from transformers.utils import is_kernels_available\n"
         "    assert is_kernels_available() is False\n"
         "else:\n"
         "    assert not kernels.__file__.startswith(root), kernels.__file__\n"
         "    import transformers.integrations.hub_kernels  # imports names of hub-kernels\n"
         "import sys\n"
         "assert 'kernels._hub' not in sys.modules")


def test_our_kernels_folder_hands_its_bare_name_to_another_kernels_package(tmp_path):
    """Both sides of the hand-over, whatever this environment has installed: with a
    `kernels` package later on the path, the bare name is that package (and its own
    submodule imports work); with none, it is the folder, without __version__."""
    hub = tmp_path / "kernels"
    hub.mkdir()
    (hub / "__init__.py").write_text("from kernels.part import MARK\n__version__ = '9.9'\n")
    (hub / "part.py").write_text("MARK = 'hub'\n")
    code = ("import sys\n"
            f"sys.path[:] = [{ROOT!r}] + [p for p in sys.path if 'site-packages' not in p]"
            " + EXTRA\n"
            "import kernels\n")
    _run(code.replace("EXTRA", repr([str(tmp_path)]))
         + "assert kernels.MARK == 'hub' and kernels.__version__ == '9.9'")
    _run(code.replace("EXTRA", "[]")
         + f"assert kernels.__file__.startswith({os.path.join(ROOT, 'kernels')!r}) and not hasattr(kernels, '__version__')")


def _project_imports() -> dict[str, set[str]]:
    """module -> project modules it imports (anywhere in the file, TYPE_CHECKING and
    function-level imports included: a circle there is still a circle)."""
    import ast

    graph: dict[str, set[str]] = {}
    for pkg in ("pagedq", *PACKAGES):
        for dirpath, _dirs, files in os.walk(os.path.join(ROOT, pkg)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                mod = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                mod = mod.removesuffix(".__init__")
                mod = mod if pkg == "pagedq" else "pagedq." + mod
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
    assert "pagedq.worker.service" in graph and "pagedq.worker.intake" in graph["pagedq.worker.service"]
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


def test_no_bench_script_is_named_after_a_module_anyone_imports():
    """`python bench/x.py` puts bench/ first on sys.path, so bench/x.py answers every
    `import x` in that process: a bench named after a module someone imports (the standard
    library's, an installed distribution's, or one the GPU machine has that this one may not;
    bench/kernels.py once answered transformers' probe for Hugging Face's `kernels`) breaks
    the process that runs it."""
    from importlib.metadata import packages_distributions
    taken = set(packages_distributions()) | set(sys.stdlib_module_names)
    taken |= {"kernels", "pagedq", "torch", "triton", "transformers", "redis", "rq", "jax",
              "cupy", "numpy", "pytest", "accelerate", "safetensors", "tokenizers"}
    stems = {f[:-3] for f in os.listdir(os.path.join(ROOT, "bench")) if f.endswith(".py")}
    assert stems and not stems & taken, sorted(stems & taken)

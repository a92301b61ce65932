"""The installed distribution has one import root: the wheel holds `pagedq` (and its
dist-info) alone, and works from a folder whose own producer.py, worker.py, engine.py,
kernels.py and gateway.py would break any import of those bare names."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# installed as pagedq.<name>
FOLDERS = {"wire", "producer", "batch", "admin", "worker", "engine", "kernels", "gateway"}


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_the_package_list_is_every_folder_of_the_tree():
    """pyproject lists its packages (a package-dir mapping cannot be found automatically):
    the list must name every folder with an __init__.py, or the wheel would lack it."""
    tool = _setuptools()
    assert tool["package-dir"] == {f"pagedq.{f}": f for f in FOLDERS}
    folders = {"pagedq"}
    for top in FOLDERS:
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT)
            folders.add("pagedq." + ".".join(rel.parts))
    assert set(tool["packages"]) == folders
    for pkg in ("pagedq", "wire", "producer", "batch", "engine", "worker"):
        assert (ROOT / pkg / "py.typed").is_file(), pkg


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from the tracked files (a copy, so no build/ lands in the checkout)."""
    src = tmp_path_factory.mktemp("src")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(src)], check=True,
                   timeout=300)
    (whl,) = out.glob("pagedq-*.whl")
    return whl


def test_the_wheel_holds_pagedq_alone(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    tops = {n.split("/")[0] for n in names}
    version = wheel.name.split("-")[1]
    assert tops == {"pagedq", f"pagedq-{version}.dist-info"}, tops
    # every folder's modules and the Lua scripts are inside pagedq/
    for inside in ("pagedq/wire/lua/finish.lua", "pagedq/engine/llm_engine.py",
                   "pagedq/kernels/decode_attention.py", "pagedq/worker/cli.py",
                   "pagedq/gateway/app.py", "pagedq/producer/py.typed", "pagedq/cli.py"):
        assert inside in names, inside


def test_installed_wheel_works_beside_files_named_like_our_folders(wheel, tmp_path,
                                                                  redis_server):
    """A fresh venv gets the wheel (its dependencies come from this interpreter's
    site-packages through a .pth line, read as a plain path: the editable install there is
    not loaded). What the install added to site-packages is `pagedq` alone; from a folder
    whose producer.py, worker.py, engine.py, kernels.py and gateway.py raise, `import
    pagedq`, every module of it, `pagedq --version` and a client call all work."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], capture_output=True, text=True,
                               check=True).stdout.strip())
    before = set(os.listdir(site))
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, timeout=300)
    added = set(os.listdir(site)) - before
    version = wheel.name.split("-")[1]
    assert added == {"pagedq", f"pagedq-{version}.dist-info"}, added
    (site / "outer.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    user = tmp_path / "user_project"
    user.mkdir()
    for name in (*FOLDERS, "pagedq_test_marker"):
        (user / f"{name}.py").write_text(f"raise ImportError('the user\\'s own {name}.py')\n")
    env = {**os.environ, "PYTHONPATH": str(user)}
    env.pop("PAGEDQ_REDIS_URL", None)

    def run(*argv: str) -> str:
        r = subprocess.run(argv, cwd=user, env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, (argv, r.stdout, r.stderr)
        return r.stdout

    code = ("import importlib, pkgutil, sys, pagedq\n"
            f"assert pagedq.__file__.startswith({str(site)!r}), pagedq.__file__\n"
            "skip = ('__main__',)\n"
            "mods = [m.name for m in pkgutil.walk_packages(pagedq.__path__, 'pagedq.')\n"
            "        if not m.name.endswith(skip)]\n"
            "for m in mods:\n"
            "    importlib.import_module(m)\n"
            f"stray = [m for m in sys.modules if m.split('.')[0] in {sorted(FOLDERS)!r}]\n"
            "assert not stray, stray\n"
            "assert len(mods) > 100, len(mods)\n"
            "print(len(mods))\n")
    assert int(run(str(py), "-c", code)) > 100
    assert run(str(venv / "bin" / "pagedq"), "--version").strip() == f"pagedq {version}"
    assert run(str(py), "-m", "pagedq", "--version").strip() == f"pagedq {version}"
    job = run(str(venv / "bin" / "pagedq"), "--redis-url", redis_server.url, "submit",
              "hello", "--model", "m", "--max-tokens", "4").strip()
    client = ("import sys, pagedq\n"
              f"with pagedq.Client({redis_server.url!r}) as c:\n"
              f"    assert c.status({job!r}).status.value == 'queued'\n"
              "    other = c.submit('hi', model='m', max_tokens=2)\n"
              "    print(c.status(other).status.value)\n")
    assert run(str(py), "-c", client).strip() == "queued"

"""Issue 39: what users type is visible to their type checkers. mypy, run over a small
caller as a user's CI would, sees JobRequest's sampling fields with their types (declared
once, in wire/sampling.py's SamplingParams) and submit()'s keywords (declared once, in
producer/submit_params.SubmitOptions, for both clients): a wrong type or a misspelt name
is an error there, not at run time."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("wire", "producer", "batch", "admin", "worker", "engine", "kernels", "gateway")

CALLER = '''
import asyncio
from pagedq import AsyncClient, Client, JobRequest

req = JobRequest(prompt="x")
reveal_type(req.temperature)
reveal_type(req.max_tokens)
reveal_type(req.stop)
reveal_type(req.priority)
c = Client()
c.submit("x", temperature=0.0, max_tokens=8, seed=1, lane="batch")
c.submit("x", temperature="hot")
c.submit("x", max_tokenz=3)
asyncio.run(AsyncClient().submit("x", n="two"))
'''


def _installed_layout(tmp_path: Path) -> Path:
    """The checkout as the wheel installs it (pyproject.toml's package-dir), by symlinks."""
    pkg = tmp_path / "site" / "pagedq"
    pkg.mkdir(parents=True)
    for f in (ROOT / "pagedq").iterdir():
        if f.suffix in (".py", ".typed"):
            (pkg / f.name).symlink_to(f)
    for name in PACKAGES:
        (pkg / name).symlink_to(ROOT / name, target_is_directory=True)
    return pkg.parent


def test_mypy_sees_the_request_fields_and_submit_keywords(tmp_path):
    pytest.importorskip("mypy")
    site = _installed_layout(tmp_path)
    (tmp_path / "caller.py").write_text(CALLER)
    r = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental",
                        "--follow-imports=silent", "--ignore-missing-imports",
                        "--cache-dir", str(tmp_path / "cache"), "caller.py"],
                       cwd=tmp_path, env={"MYPYPATH": str(site), "PATH": "/usr/bin:/bin"},
                       capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    revealed = re.findall(r'Revealed type is "([^"]+)"', out)
    assert [t.removeprefix("builtins.").replace("builtins.", "") for t in revealed] == \
        ["float", "int", "list[str]", "int"], out
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert len(errors) == 3, out
    assert 'Argument "temperature" to "submit" of "Client"' in errors[0], out
    assert 'Unexpected keyword argument "max_tokenz"' in errors[1], out
    assert 'Argument "n" to "submit" of "AsyncClient"' in errors[2], out

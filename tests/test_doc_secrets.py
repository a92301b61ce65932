"""Secrets that documented commands write stay out of git: every `pagedq acl` line of a
command block in README.md and docs/*.md runs, as written, in this checkout's root, and
`git status` then shows none of the files it wrote (password files, ACL files). What the
commands write is removed after; a target that exists already (someone's real secrets) is
left alone and its line skipped."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_BLOCK = re.compile(r"^```(?:bash|sh)\n(.*?)^```$", re.M | re.S)


def acl_lines() -> list[tuple[str, str]]:
    """(document, command) of every `pagedq acl` line in a bash block."""
    out = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in _BLOCK.finditer(doc.read_text(encoding="utf-8")):
            for line in m[1].splitlines():
                cmd = line.split("#", 1)[0].strip()
                if cmd.startswith("pagedq acl "):
                    out.append((doc.name, cmd))
    return out


def _targets(cmd: str) -> tuple[Path | None, Path | None]:
    argv = shlex.split(cmd)
    val = lambda flag: argv[argv.index(flag) + 1] if flag in argv else None  # noqa: E731
    sdir, output = val("--secrets-dir"), val("-o") or val("--output")
    return (ROOT / sdir if sdir else None,
            ROOT / output if output and output != "/dev/null" else None)


def test_documented_acl_commands_write_only_what_git_ignores():
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    lines = acl_lines()
    assert any(doc == "gateway.md" for doc, _ in lines), lines  # the tenant block
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for var in ("PAGEDQ_REDIS_PASSWORD", "PAGEDQ_REDIS_PASSWORD_FILE"):
        env.pop(var, None)
    ran = 0
    for doc, cmd in lines:
        sdir, output = _targets(cmd)
        before = set(sdir.iterdir()) if sdir and sdir.is_dir() else set()
        if (output and output.exists()) or any(p.name != ".gitignore" for p in before):
            continue  # someone's own secrets: not ours to overwrite or remove
        made_dir = sdir is not None and not sdir.exists()
        argv = [sys.executable, "-m", "pagedq", *shlex.split(cmd)[1:]]
        try:
            r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                               timeout=60)
            assert r.returncode == 0, (doc, cmd, r.stderr)
            written = ([p for p in sdir.iterdir() if p not in before] if sdir else []) + \
                      ([output] if output else [])
            assert written and all(p.exists() for p in written), (doc, cmd)
            status = subprocess.run(
                ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=all",
                 "--", *(str(p.relative_to(ROOT)) for p in written)],
                capture_output=True, text=True, check=True).stdout
            assert status == "", f"{doc}: `{cmd}` wrote files git would add:\n{status}"
            ran += 1
        finally:
            if made_dir:
                shutil.rmtree(sdir, ignore_errors=True)
            elif sdir and sdir.is_dir():
                for p in set(sdir.iterdir()) - before:
                    p.unlink()
            if output and output.exists():
                output.unlink()
    assert ran, "every documented acl command's targets exist here already"

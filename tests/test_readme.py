"""Every command block of README.md runs, as written, and prints what its comments say.

The rule (documented in docs/first-steps.md, "README blocks"): each ```bash, ```sh and
```python block runs, in README order, in one bash session, unless the line before it is

* ``<!-- not-run: REASON -->``: needs what a test machine lacks (a GPU, Docker), installs
  packages, or runs a server in the foreground; REASON says which;
* ``<!-- NAME: tests/FILE.py runs this block -->``: another test runs it (FILE names NAME).

A comment with an arrow, ``# -> TEXT`` (or ``# what -> TEXT``), says what the block prints:
TEXT must appear in the block's output. The session is a sandbox folder whose
``.venv/bin/activate`` puts a ``pagedq`` of this checkout first on PATH, with ``docs``
linked in, against a redis-server of the test (PAGEDQ_REDIS_URL); what the blocks start in
the background (``pagedq worker &``) is stopped with the session's process group.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RUN_LANGS = ("bash", "sh", "python")
_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)
_NOT_RUN = re.compile(r"^<!-- not-run: (\S.*?) -->$")
_RUN_BY = re.compile(r"^<!-- ([\w-]+): (tests/[\w/]+\.py) runs this block -->$")
_EXPECT = re.compile(r"#[^\n]*?->\s+(\S[^\n]*?)\s*$", re.M)


@dataclass
class Block:
    lang: str
    code: str
    marker: str  # the HTML comment on the line before, or ""
    line: int

    @property
    def runs(self) -> bool:
        return not self.marker

    def expected(self) -> list[str]:
        return _EXPECT.findall(self.code)


def blocks(doc: Path = README) -> list[Block]:
    """The bash, sh and python blocks of ``doc`` (tests/test_doc_blocks.py reads docs/)."""
    text = doc.read_text(encoding="utf-8")
    out = []
    for m in _BLOCK.finditer(text):
        if m[1] not in RUN_LANGS:
            continue
        before = text[:m.start()].rstrip("\n").rpartition("\n")[2]
        marker = before if before.startswith("<!--") else ""
        out.append(Block(m[1], m[2], marker, text[:m.start()].count("\n") + 1))
    return out


def test_every_block_runs_or_says_why_not():
    bs = blocks()
    assert len(bs) >= 8
    for b in bs:
        if not b.marker:
            continue
        if m := _RUN_BY.match(b.marker):
            assert m[1] in (ROOT / m[2]).read_text(encoding="utf-8"), b.marker
        else:
            assert _NOT_RUN.match(b.marker), f"README.md:{b.line}: unknown marker {b.marker}"
    runs = [b for b in bs if b.runs]
    assert {b.lang for b in runs} >= {"bash", "python"}
    assert sum(len(b.expected()) for b in runs) >= 4


def test_make_demo_is_the_first_command():
    first = blocks()[0]
    assert first.code.split()[:2] == ["make", "demo"], first.code
    assert "installs" in first.marker  # not run here: it would pip install
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^demo: \$\(WORKER_STAMP\)$", makefile, re.M)
    assert "TORCH_INDEX" in README.read_text(encoding="utf-8")


def _sandbox(tmp: Path) -> None:
    bin_dir = tmp / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    pagedq = bin_dir / "pagedq"
    pagedq.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m pagedq "$@"\n')
    pagedq.chmod(0o755)
    (tmp / "docs").symlink_to(ROOT / "docs")


def _script(runs: list[Block]) -> str:
    lines = ["set -e", 'trap \'echo "@@@ failed at: $BASH_COMMAND"\' ERR']
    for i, b in enumerate(runs):
        lines.append(f"echo '@@@ block {i} start'")
        if b.lang == "python":
            lines += ['"$README_PYTHON" - <<\'README_PY_EOF\'', b.code.rstrip("\n"),
                      "README_PY_EOF"]
        else:
            lines.append(b.code.rstrip("\n"))
        lines.append(f"echo '@@@ block {i} ok'")
    return "\n".join(lines) + "\n"


def test_readme_blocks_run_and_print_what_they_say(redis_server, tmp_path):
    runs = [b for b in blocks() if b.runs]
    _sandbox(tmp_path)
    (tmp_path / "session.sh").write_text(_script(runs))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDQ_")}
    env.update(PYTHONPATH=str(ROOT), PAGEDQ_REDIS_URL=redis_server.url,
               README_PYTHON=sys.executable)
    log = tmp_path / "session.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(["bash", "session.sh"], cwd=tmp_path, env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=540)
        finally:
            _stop_group(proc.pid)
    text = log.read_text(errors="replace")
    assert rc == 0, text[-6000:]
    for i, b in enumerate(runs):
        assert f"@@@ block {i} ok" in text, f"README.md:{b.line} did not run through\n{text}"
        out = text.split(f"@@@ block {i} start", 1)[1].split(f"@@@ block {i} ok", 1)[0]
        for want in b.expected():
            assert want in out, f"README.md:{b.line}: no {want!r} in its output:\n{out}"
    assert "pagedq: ready in " in text  # the worker's start line


def _stop_group(pgid: int) -> None:
    """SIGTERM the session's process group (the workers drain), then SIGKILL what is left."""
    for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)

"""docs/batches.md's Python block runs as written (its ``batches-python`` marker) against a
real redis-server, a pagedq worker serving the tiny model and a real `pagedq batch worker`,
and prints what its arrow comment says; nothing in it raises (a cancel or retry of the
ended batch would be BatchStateError). The one change: the bundled model's name becomes
the tiny model's (the block reads its Redis from $PAGEDQ_REDIS_URL)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from pagedq.worker.redis_server import RedisServer
from tests.test_batch_e2e import PREFIX, RqWorker, write_input
from tests.tiny_service import MODEL
from tests.worker_proc import ROOT, WorkerProc


def block() -> str:
    text = Path(ROOT, "docs/batches.md").read_text(encoding="utf-8")
    found, = re.findall(r"<!-- batches-python\b[^\n]*-->\n```python\n(.*?)\n```$", text,
                        re.M | re.S)
    return found


def test_the_python_block_of_docs_batches_runs(tiny_dir, tmp_path):
    code = block()
    assert 'model="smollm2"' in code
    srv = RedisServer().start()
    w = WorkerProc(srv.url, PREFIX, model=tiny_dir, extra=["--served-name", MODEL])
    rq = None
    try:
        w.start()
        rq = RqWorker(srv.url, tmp_path / "batches").start()
        valid, _ = write_input(tmp_path / "requests.jsonl", 4, bad=False, max_tokens=2)
        env = {**os.environ, "PYTHONPATH": ROOT, "PAGEDQ_REDIS_URL": srv.url,
               "PAGEDQ_PREFIX": PREFIX, "PAGEDQ_BATCH_DIR": str(tmp_path / "batches")}
        res = subprocess.run([sys.executable, "-c", code.replace('"smollm2"', f'"{MODEL}"')],
                             cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
        lines = res.stdout.splitlines()
        assert lines[-1].startswith("completed ['batch_"), res.stdout  # -> completed
        assert {line.split()[0] for line in lines if line.startswith("req-")} == valid
        assert len((tmp_path / "out.jsonl").read_text().splitlines()) == len(valid)
    finally:
        if rq:
            rq.stop()
        w.kill()
        w.stop()
        srv.cleanup()

"""A batch file's limits in bytes (issue 43): each line is read with a cap, so a line far
past PAGEDQ_BATCH_MAX_LINE_BYTES never grows a process by its size (peak RSS, VmHWM, of a
real child process and of a real gateway), and the gateway refuses an upload whose
Content-Length is past PAGEDQ_BATCH_MAX_BYTES before it reads the body (413)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from pagedq.batch import BatchSettings
from pagedq.worker.redis_server import RedisServer
from tests.test_gateway import Gateway, make_key
from tests.worker_proc import ROOT

MiB = 1024 * 1024
LINE_CAP = MiB  # PAGEDQ_BATCH_MAX_LINE_BYTES in these tests
BIG_LINE = 48 * MiB
RSS_BOUND = 16 * MiB  # a process may grow this much reading the file; the line is 3x that


def vm_hwm(pid: int | str = "self") -> int:
    """Peak resident memory of a process, bytes."""
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        if row.startswith("VmHWM:"):
            return int(row.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def request_line(cid: str, prompt: str) -> bytes:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": prompt, "max_tokens": 2}}).encode() + b"\n"


def write_big(path: Path) -> Path:
    with open(path, "wb") as f:
        f.write(request_line("a", "short"))
        f.write(request_line("big", "x" * BIG_LINE))
        f.write(request_line("c", "short"))
    return path


CHILD = """
import sys
from pathlib import Path
from pagedq.batch import files as F, lines as L
from pagedq.wire.errors import InvalidRequest
from tests.test_batch_limits import vm_hwm, LINE_CAP
src = Path(sys.argv[1])
base = vm_hwm()
try:
    F.copy_input(src, src.with_name("copy.jsonl"), 10**9, 100, LINE_CAP)
    copied = "copied"
except InvalidRequest as e:
    copied = str(e)
check = L.Validator("batch_x", "tiny")
with open(src, "rb") as f:
    codes = [getattr(check.check(raw, n, LINE_CAP), "code", "ok")
             for n, _, raw in L.read_lines(f, max_bytes=LINE_CAP)]
print(vm_hwm() - base, copied, ",".join(codes), sep="\\n")
"""


def test_a_long_line_is_refused_without_being_held(tmp_path):
    """copy_input (the CLI's submit) refuses the file naming the line; the ingest's
    validation reports that line line_too_long and the others valid; neither holds it."""
    src = write_big(tmp_path / "in.jsonl")
    res = subprocess.run([sys.executable, "-c", CHILD, str(src)], cwd=ROOT, text=True,
                         capture_output=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert res.returncode == 0, res.stderr
    grew, copied, codes = res.stdout.strip().splitlines()
    assert "line 2 is" in copied and "PAGEDQ_BATCH_MAX_LINE_BYTES" in copied
    assert codes == "ok,line_too_long,ok"
    print(f"child peak RSS grew {int(grew) / MiB:.1f} MiB over a {BIG_LINE // MiB} MiB line")
    assert int(grew) < RSS_BOUND, f"the child grew {int(grew) / MiB:.1f} MiB"


def test_file_limits_are_openai_bytes():
    assert BatchSettings().batch_max_bytes == 200_000_000  # OpenAI's 200 MB, not MiB


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    srv = RedisServer().start()
    gw = None
    try:
        gw = Gateway(srv.url, tmp_path_factory.mktemp("gw-limits"),
                     env={"PAGEDQ_BATCH_MAX_BYTES": str(60_000_000),
                          "PAGEDQ_BATCH_MAX_LINE_BYTES": str(LINE_CAP)})
        gw.wait_ready()
        yield gw, {"Authorization": f"Bearer {make_key(srv.url, '--name', 'limits')}"}
    finally:
        if gw is not None:
            gw.stop()
        srv.cleanup()


def upload(gw, headers, path: Path) -> httpx.Response:
    with open(path, "rb") as f:
        return httpx.post(gw.base + "/v1/files", headers=headers, timeout=120,
                          data={"purpose": "batch"}, files={"file": ("in.jsonl", f)})


def test_gateway_refuses_a_long_line_without_holding_it(gateway, tmp_path):
    gw, headers = gateway
    small = tmp_path / "small.jsonl"
    small.write_bytes(request_line("a", "hello"))
    assert upload(gw, headers, small).status_code == 200  # (warms the upload path up)
    base = vm_hwm(gw.proc.pid)
    r = upload(gw, headers, write_big(tmp_path / "big.jsonl"))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "line_too_long" and "line 2" in err["message"]
    grew = vm_hwm(gw.proc.pid) - base
    print(f"gateway peak RSS grew {grew / MiB:.1f} MiB over a {BIG_LINE // MiB} MiB line")
    assert grew < RSS_BOUND, f"the gateway grew {grew / MiB:.1f} MiB"


def test_gateway_refuses_an_oversized_upload_from_its_content_length(gateway, tmp_path):
    """413 (the _store path answers 400): refused on the header, before the form is read."""
    gw, headers = gateway
    big = tmp_path / "over.jsonl"
    with open(big, "wb") as f:
        row = request_line("r", "y" * 1000)
        for i in range(60_000_000 // len(row) + 100):
            f.write(row.replace(b'"r"', f'"r{i}"'.encode()))
    r = upload(gw, headers, big)
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["code"] == "file_too_large" and "60000000 bytes" in err["message"]
    assert err["type"] == "invalid_request_error" and err["param"] == "file"

"""docs/ is complete and true.

* The JSON Schemas in docs/schema/ are those the models generate.
* Nothing in the repository points outside it (the design notes live in docs/).
* The Lua scripts reproduced in docs/protocol.md are the code's.
* The doc's redis-cli session runs, as written, against a real worker.
* A client written from docs/protocol.md alone (raw redis-py commands, the documented
  function names on Redis >= 7, no import from producer/ or worker/) submits, streams,
  resumes, cancels and reads results from a real worker.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
import redis

from tests.worker_proc import WorkerProc

ROOT = Path(__file__).resolve().parent.parent
PROTOCOL = ROOT / "docs" / "protocol.md"
PREFIX = "pagedq"  # the doc's default prefix: the redis-cli session uses it as written
MODEL = "smollm2"
TERMINAL = {"finished", "failed", "cancelled", "expired"}


def doc_text() -> str:
    return PROTOCOL.read_text(encoding="utf-8")


def lua_blocks(text: str) -> dict[str, str]:
    """The ``~~~lua NAME`` blocks of the doc: name -> script text."""
    return {m[1]: m[2] for m in re.finditer(r"^~~~lua (\w+)\n(.*?)\n~~~$", text, re.M | re.S)}


def session_block(text: str) -> str:
    """The ```sh block that follows the redis-cli-session marker."""
    m = re.search(r"<!-- redis-cli-session\b[^\n]*-->\n```sh\n(.*?)\n```$", text, re.M | re.S)
    assert m, "docs/protocol.md lost its redis-cli session block (or its marker)"
    return m[1]


# ---------------------------------------------------------------- JSON Schemas

def _jsonschema(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedq.wire.jsonschema", *args], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=120)


def test_json_schema_files_are_up_to_date():
    res = _jsonschema("--check")
    assert res.returncode == 0, res.stderr
    names = sorted(p.name for p in (ROOT / "docs" / "schema").glob("*.schema.json"))
    assert names == ["FinalEvent.schema.json", "JobRecord.schema.json",
                     "JobRequest.schema.json", "TokenEvent.schema.json"]
    for name in names:
        text = (ROOT / "docs" / "schema" / name).read_text(encoding="utf-8")
        schema = json.loads(text)
        assert text.endswith("}\n") and schema["type"] == "object"
        # the dialect the docs name, and one jsonschema checks documents against
        assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
        jsonschema.validators.validator_for(schema).check_schema(schema)


def test_json_schema_check_fails_on_an_edited_or_missing_file(tmp_path):
    from pagedq.wire import jsonschema

    for p in (ROOT / "docs" / "schema").glob("*.schema.json"):
        shutil.copy(p, tmp_path / p.name)
    assert jsonschema.stale(tmp_path) == []
    edited = tmp_path / "JobRequest.schema.json"
    schema = json.loads(edited.read_text(encoding="utf-8"))
    schema["properties"]["max_tokens"]["maximum"] = 1
    edited.write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (tmp_path / "TokenEvent.schema.json").unlink()
    assert jsonschema.stale(tmp_path) == ["JobRequest.schema.json", "TokenEvent.schema.json"]
    res = _jsonschema("--check", "--dir", str(tmp_path))
    assert res.returncode == 1
    assert "JobRequest.schema.json" in res.stderr and "TokenEvent.schema.json" in res.stderr
    assert "JobRecord.schema.json" not in res.stderr
    res = _jsonschema("--dir", str(tmp_path))  # regenerating repairs both
    assert res.returncode == 0 and jsonschema.stale(tmp_path) == []


def test_json_schema_generator_does_not_import_torch():
    code = ("import sys, pagedq.wire.jsonschema\n"
            "assert 'torch' not in sys.modules and 'engine' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})


# ---------------------------------------------------------------- configuration.md

def test_configuration_doc_tables_are_made_from_the_declarations(tmp_path):
    """docs/configuration.md's tables are what worker/config_doc.py makes of the settings'
    declarations; --check fails on an edited copy and writing repairs it."""
    run = [sys.executable, "-m", "pagedq.worker.config_doc"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([*run, "--check"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    copy = tmp_path / "configuration.md"
    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    copy.write_text(text.replace("| `64` | sequences in one engine step",
                                 "| `32` | sequences in one engine step"), encoding="utf-8")
    res = subprocess.run([*run, "--check", "--doc", str(copy)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "configuration.md" in res.stderr
    subprocess.run([*run, "--doc", str(copy)], cwd=ROOT, env=env, check=True, timeout=120)
    assert copy.read_text(encoding="utf-8") == text


# ---------------------------------------------------------------- no links outside

# built from parts, so that this file does not match itself
_OUTSIDE = [".." + "/shared", "/" + "work/", "/" + "home/", "/" + "Users/"] + [
    name + ".md" for name in ("DESIGN", "BENCHMARKS", "ENVIRONMENT", "STYLE", "KINDS")]
_MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
_UP_PATH = re.compile(r"(?<![\w./-])((?:\.\./)+[\w.-][\w./-]*)")


def _repo_files() -> list[Path]:
    """Every file git tracks, plus new files it does not ignore (not yet committed)."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / name for name in out.decode().split("\0") if name]


def _inside(path: Path) -> bool:
    return path.resolve().is_relative_to(ROOT)


def test_no_file_points_outside_the_repository():
    bad = []
    files = [p for p in _repo_files() if p.is_file()]
    assert any(p.name == "protocol.md" for p in files)
    for path in files:
        data = path.read_bytes()
        if b"\0" in data:  # binary
            continue
        text = data.decode("utf-8", "replace")
        rel = path.relative_to(ROOT)
        for lineno, line in enumerate(text.splitlines(), 1):
            bad += [f"{rel}:{lineno}: {s!r}" for s in _OUTSIDE if s in line]
            for m in _UP_PATH.finditer(line):
                if not _inside(path.parent / m[1]):
                    bad.append(f"{rel}:{lineno}: {m[1]!r} leaves the repository")
            if path.suffix == ".md":
                for m in _MD_LINK.finditer(line):
                    target = m[1].split("#", 1)[0]
                    if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target):
                        continue  # an anchor in the same file, or a URL
                    dest = (path.parent / target)
                    if not (_inside(dest) and dest.exists()):
                        bad.append(f"{rel}:{lineno}: link {m[1]!r} leads nowhere in the repo")
    assert not bad, "\n".join(bad)


def with_scripts(text: str, scripts: dict[str, str]) -> str:
    """``text`` with each ``~~~lua NAME`` block replaced by ``scripts[NAME]``."""
    for name, code in scripts.items():
        text = re.sub(rf"(^~~~lua {name}\n).*?(\n~~~$)",
                      lambda m, code=code: m[1] + code.strip("\n") + m[2], text,
                      count=1, flags=re.M | re.S)
    return text


def test_protocol_doc_carries_the_scripts_verbatim():
    """The doc's copies are the text the Python client sends. After changing a script,
    ``PAGEDQ_UPDATE_DOCS=1 pytest tests/test_docs.py -k verbatim`` rewrites them."""
    from pagedq.wire.lua import source

    code = {"SUBMIT_LUA": source("submit"), "CANCEL_LUA": source("cancel")}
    if os.environ.get("PAGEDQ_UPDATE_DOCS") == "1":
        PROTOCOL.write_text(with_scripts(doc_text(), code), encoding="utf-8")
    blocks = lua_blocks(doc_text())
    assert blocks.keys() == code.keys()
    for name, text in code.items():
        assert blocks[name] == text.strip("\n"), (
            f"docs/protocol.md's copy of {name} differs from its wire/lua/ source; "
            f"PAGEDQ_UPDATE_DOCS=1 pytest tests/test_docs.py -k verbatim rewrites it")


# ---------------------------------------------------------------- against a real worker

@pytest.fixture(scope="module")
def service():
    from pagedq.worker.redis_server import RedisServer

    srv = RedisServer().start()  # its own server: the doc's session uses the default prefix
    w = WorkerProc(srv.url, PREFIX, model=MODEL, extra=["--max-num-seqs", "8"]).start()
    yield srv
    w.stop()
    srv.cleanup()


def test_redis_cli_session_of_the_protocol_doc_runs(service, tmp_path):
    missing = [t for t in ("redis-cli", "sha1sum", "bash") if not shutil.which(t)]
    if missing:
        pytest.skip(f"the doc's redis-cli session needs {', '.join(missing)} on PATH")
    block = session_block(doc_text())
    job_id = re.search(r"^ID=(\S+)$", block, re.M)[1]
    (tmp_path / "docs").mkdir()
    shutil.copy(PROTOCOL, tmp_path / "docs" / "protocol.md")  # the session reads the doc
    res = subprocess.run(["bash", "-e", "-c", block], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PORT": str(service.port)})
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "queued", res.stdout  # the FCALL's reply (raw: one value per line)
    r = redis.Redis(port=service.port, decode_responses=True)
    job = r.hgetall(f"{{{PREFIX}}}:job:{job_id}")
    events = [f for _id, f in r.xrange(f"{{{PREFIX}}}:out:{job_id}")]
    r.close()
    assert job["status"] == "finished" and job["finish_reason"] in ("stop", "length"), job
    assert events[0]["t"] == "token" and events[-1]["t"] == "final"
    assert "".join(e["d"] for e in events[:-1]) == job["text"] == events[-1]["text"]
    assert job["text"].strip() and int(job["completion_tokens"]) <= 8
    assert "token" in lines and "final" in lines and "finished" in lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs"]  # it leaves no files


class DocClient:
    """A client written from docs/protocol.md alone: raw commands, FCALL of the functions
    the doc names (the test's Redis is >= 7: the worker loaded them)."""

    def __init__(self, port: int, prefix: str = PREFIX) -> None:
        self.port, self.base = port, "{" + prefix + "}"
        self.r = redis.Redis(port=port, decode_responses=True)

    def key(self, kind: str, name: str = "") -> str:
        return f"{self.base}:{kind}:{name}" if name else f"{self.base}:{kind}"

    def submit(self, job_id: str, prompt: str, *, model: str = MODEL, require_worker: bool,
               lane: str = "interactive", **params) -> list[str]:
        body = json.dumps({"id": job_id, "model": model, "prompt": prompt, **params})
        max_tokens = params.get("max_tokens", 128)
        ml = f"{model}:{lane}"
        keys = [self.key("job", job_id), self.key("inbox", ml), self.key("qtokens", ml),
                self.key("out", job_id), self.key("qjobs", ml), self.key("serving", model),
                self.key("models"), self.key("wake", model)]
        argv = [job_id, body, hashlib.sha1(body.encode()).hexdigest(), model,
                len(prompt) // 4 + max_tokens, "", 0, 0, "workers", 1,
                1 if require_worker else 0, lane]
        return self.r.fcall("pagedq_submit", len(keys), *keys, *argv)

    def cancel(self, job_id: str) -> str:
        return self.r.fcall("pagedq_cancel", 3, self.key("job", job_id),
                            self.key("out", job_id), self.key("cancel"), job_id, 600,
                            self.key("chan", job_id), self.base + ":qtokens:",
                            self.base + ":qjobs:")

    def read(self, job_id: str, k: int, count: int, block_ms: int = 5000,
             conn: redis.Redis | None = None) -> list[tuple[str, dict[str, str]]]:
        """Events k, k+1, ... (at most ``count``): XREAD from cursor 0-k."""
        resp = (conn or self.r).xread({self.key("out", job_id): f"0-{k}"}, count=count,
                                      block=block_ms)
        return resp[0][1] if resp else []

    def events_until_final(self, job_id: str, events: list[dict[str, str]],
                           conn: redis.Redis | None = None, timeout: float = 240.0) -> None:
        """Read on from len(events), each event once, until the final event."""
        deadline = time.monotonic() + timeout
        while not events or events[-1]["t"] != "final":
            assert time.monotonic() < deadline, f"no final event for {job_id}: {events[-3:]}"
            got = self.read(job_id, len(events), 1000, conn=conn)
            if not got:  # between blocking reads, re-check the job hash
                assert (conn or self.r).exists(self.key("job", job_id)), "job record gone"
            for entry_id, fields in got:
                assert entry_id == f"0-{len(events) + 1}" and fields["i"] == str(len(events))
                events.append(fields)


def _check_log(events: list[dict[str, str]], record: dict[str, str]) -> str:
    """Indexes 0..n-1 once each, one final event last, deltas concatenate to its text."""
    assert [int(e["i"]) for e in events] == list(range(len(events)))
    assert [e["t"] for e in events] == ["token"] * (len(events) - 1) + ["final"]
    final, text = events[-1], "".join(e["d"] for e in events[:-1])
    assert text == final["text"] == record["text"]
    tokens = sum(len(e["ids"].split(",")) for e in events[:-1])
    assert tokens == int(final["ct"]) == int(record["completion_tokens"])
    assert final["status"] == record["status"] and final["fr"] == record["finish_reason"]
    assert int(final["pt"]) == int(record["prompt_tokens"]) > 0
    return text


def test_client_written_from_the_protocol_doc(service):
    c = DocClient(service.port)
    a, b = f"doc-a-{time.time_ns()}", f"doc-b-{time.time_ns()}"
    assert c.submit(a, "Count from one to forty.", max_tokens=32, temperature=0,
                    ignore_eos=True, require_worker=True)[0] == "queued"
    assert c.submit(b, "Write a very long story about the sea.", max_tokens=2000,
                    temperature=0.8, seed=7, ignore_eos=True, require_worker=True)[0] == "queued"
    again = c.submit(a, "Count from one to forty.", max_tokens=32, temperature=0,
                     ignore_eos=True, require_worker=True)
    assert again[0] == "exists"  # same id, same body: idempotent

    # stream A from index 0, one event per read; disconnect after three
    first = redis.Redis(port=service.port, decode_responses=True)
    events: list[dict[str, str]] = []
    while len(events) < 3:
        for entry_id, fields in c.read(a, len(events), 1, block_ms=60000, conn=first):
            assert entry_id == f"0-{len(events) + 1}"
            events.append(fields)
    first.close()
    assert all(e["t"] == "token" for e in events), "A ended before the reader disconnected"

    # cancel B while it runs: wait for its first token, then CANCEL_LUA
    b_events: list[dict[str, str]] = []
    while not b_events:
        b_events += [f for _id, f in c.read(b, 0, 1, block_ms=60000)]
    assert c.r.hget(c.key("job", b), "status") == "running"
    assert c.cancel(b) == "requested"
    c.events_until_final(b, b_events)
    b_rec = c.r.hgetall(c.key("job", b))
    assert b_rec["status"] == "cancelled" and b_rec["finish_reason"] == "cancelled", b_rec
    _check_log(b_events, b_rec)
    assert 0 < int(b_rec["completion_tokens"]) < 2000
    assert not c.r.sismember(c.key("cancel"), b)
    assert c.cancel(b) == "terminal"

    # resume A from the cursor with a new connection: every event exactly once
    second = redis.Redis(port=service.port, decode_responses=True)
    c.events_until_final(a, events, conn=second)
    second.close()
    a_rec = c.r.hgetall(c.key("job", a))
    assert a_rec["status"] == "finished" and a_rec["finish_reason"] == "length", a_rec
    text = _check_log(events, a_rec)
    assert text and int(a_rec["completion_tokens"]) == 32
    assert c.r.ttl(c.key("job", a)) > 0 and c.r.ttl(c.key("out", a)) > 0
    for model in (MODEL,):  # nothing left counted as queued
        assert int(c.r.get(c.key("qjobs", model + ":interactive")) or 0) == 0
        assert int(c.r.get(c.key("qtokens", model + ":interactive")) or 0) == 0
    c.r.close()


def test_client_from_the_doc_cancels_a_queued_job_and_is_refused_without_a_worker(service):
    c = DocClient(service.port)
    job = f"doc-q-{time.time_ns()}"
    # no worker serves model "nobody": refused when a worker is required, else queued
    assert c.submit(job, "Hello there.", model="nobody", max_tokens=8,
                    require_worker=True) == ["no_worker", "nobody"]
    assert not c.r.exists(c.key("job", job))
    assert c.submit(job, "Hello there.", model="nobody", max_tokens=8,
                    require_worker=False)[0] == "queued"
    assert c.r.get(c.key("qjobs", "nobody:interactive")) == "1"
    assert c.r.get(c.key("qtokens", "nobody:interactive")) == str(len("Hello there.") // 4 + 8)
    other_body = c.submit(job, "Hello here.", model="nobody", max_tokens=8,
                          require_worker=False)
    assert other_body == ["conflict", ""]
    # CANCEL checks its arguments: no TTL, or counters of another key space, change nothing
    good = [c.key("job", job), c.key("out", job), c.key("cancel"), job, 86400,
            c.key("chan", job), c.base + ":qtokens:", c.base + ":qjobs:"]
    for i, bad_value in ((4, 0), (4, "1.5"), (6, "{other}:qtokens:"), (7, "{other}:qjobs:"),
                         (3, "another-job"), (5, c.key("chan", "another-job"))):
        args = list(good)
        args[i] = bad_value
        with pytest.raises(redis.ResponseError, match="pagedq CANCEL"):
            c.r.fcall("pagedq_cancel", 3, *args)
    assert c.r.hget(c.key("job", job), "status") == "queued"
    assert c.r.get(c.key("qjobs", "nobody:interactive")) == "1" and c.r.ttl(c.key("job", job)) < 0
    assert c.cancel(job) == "cancelled"
    assert not c.r.exists(c.key("out", job))  # never ran: the record is the result
    rec = c.r.hgetall(c.key("job", job))
    assert 0 < c.r.ttl(c.key("job", job)) <= 600  # the client's cancelled_ttl_s
    assert rec["status"] == "cancelled" and rec["finish_reason"] == "cancelled"
    assert c.r.get(c.key("qjobs", "nobody:interactive")) == "0"
    assert c.r.get(c.key("qtokens", "nobody:interactive")) == "0"
    assert c.cancel(job) == "terminal" and c.cancel("never-submitted") == "missing"
    bad = c.submit("bad{id}", "Hi.", max_tokens=8, require_worker=False)
    assert bad[0] == "invalid"
    c.r.close()

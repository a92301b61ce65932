"""`pagedq batch ...` parsing and exit codes (a real redis-server where Redis is needed;
the commands that do work end to end are in tests/test_batch_e2e.py)."""
from __future__ import annotations

import json
import uuid

import pytest

import pagedq.client_cli as client_cli
from pagedq.batch import cli as batch_cli
from pagedq.cli import build_parser, main
from tests.test_cli_client import options_without_default, parsers

SUBCOMMANDS = ("submit", "status", "results", "cancel", "retry", "list", "worker")


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pagedq: ") and "Traceback" not in err, err
    return lines[0]


def test_exit_codes_are_the_client_commands_numbers():
    assert (batch_cli.EXIT_OK, batch_cli.EXIT_ERROR, batch_cli.EXIT_INVALID,
            batch_cli.EXIT_NOT_FOUND, batch_cli.EXIT_TIMEOUT, batch_cli.EXIT_FAILED,
            batch_cli.EXIT_CANCELLED, batch_cli.EXIT_EXPIRED) == (
        client_cli.EXIT_OK, client_cli.EXIT_ERROR, client_cli.EXIT_INVALID,
        client_cli.EXIT_NOT_FOUND, client_cli.EXIT_TIMEOUT, client_cli.EXIT_JOB_FAILED,
        client_cli.EXIT_JOB_CANCELLED, client_cli.EXIT_JOB_EXPIRED)


def test_batch_group_and_every_option_states_its_default():
    progs = {p.prog for p in parsers(build_parser())}
    assert {f"pagedq batch {c}" for c in SUBCOMMANDS} <= progs
    assert options_without_default(build_parser()) == []


@pytest.mark.parametrize("argv", [
    ["--redis-url", "redis://a", "--prefix", "p", "batch", "status", "X"],
    ["batch", "--redis-url", "redis://a", "--prefix", "p", "status", "X"],
    ["batch", "status", "X", "--redis-url", "redis://a", "--prefix", "p"],
    ["--redis-url", "redis://z", "batch", "--prefix", "q", "status", "--redis-url",
     "redis://a", "X", "--prefix", "p"],
])
def test_common_options_in_any_position_the_last_wins(argv):
    from pagedq.cli import build_parser as pagedq_parser

    for parser in (build_parser(), pagedq_parser()):
        args = parser.parse_args(argv)
        assert (args.redis_url, args.prefix, args.id) == ("redis://a", "p", "X")


def test_subcommand_options_in_any_position(tmp_path):
    a = build_parser().parse_args(["batch", "submit", "--detach", "f.jsonl", "--model", "m",
                                   "--completion-window", "1h", "--metadata", "k=v"])
    assert (a.file, a.detach, a.model, a.completion_window, a.metadata) == (
        "f.jsonl", True, "m", "1h", ["k=v"])


@pytest.mark.parametrize("argv", [
    ["batch"], ["batch", "nope"], ["batch", "status"], ["batch", "submit"],
    ["batch", "submit", "f", "--timeout", "abc"], ["batch", "list", "--limit", "x"],
    ["batch", "worker", "--log-level", "loud"],
])
def test_usage_errors_exit_2(capsys, argv):
    assert run(capsys, *argv)[0] == 2


@pytest.fixture
def where(shared_redis_server, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDQ_BATCH_DIR", str(tmp_path / "batches"))
    monkeypatch.setenv("PAGEDQ_CLIENT_RETRY_S", "0")
    return ["--redis-url", shared_redis_server.url, "--prefix", "c" + uuid.uuid4().hex[:10]]


def good_file(tmp_path, n: int = 2):
    p = tmp_path / "in.jsonl"
    p.write_text("".join(json.dumps({"custom_id": f"c{i}", "method": "POST",
                                     "url": "/v1/completions", "body": {"prompt": "hi"}}) + "\n"
                         for i in range(n)))
    return str(p)


@pytest.mark.parametrize("extra, words", [
    (["--completion-window", "1y"], "completion_window"),
    (["--completion-window", "8d"], "longer than 7 days"),
    (["--metadata", "novalue"], "KEY=VALUE"),
    (["--model", "bad model"], "invalid model"),
])
def test_bad_values_exit_2_one_line_nothing_created(capsys, where, tmp_path, extra, words):
    code, out, err = run(capsys, *where, "batch", "submit", good_file(tmp_path), *extra)
    assert code == 2 and out == "" and words in one_line(err)
    assert not (tmp_path / "batches").exists() or not any((tmp_path / "batches").iterdir())


def test_bad_files_exit_2(capsys, where, tmp_path, monkeypatch):
    code, _, err = run(capsys, *where, "batch", "submit", str(tmp_path / "missing.jsonl"))
    assert code == 2 and "cannot read the input file" in one_line(err)
    monkeypatch.setenv("PAGEDQ_BATCH_MAX_LINES", "1")
    code, _, err = run(capsys, *where, "batch", "submit", good_file(tmp_path, 2))
    assert code == 2 and "more than the limit of 1 lines" in one_line(err)
    monkeypatch.setenv("PAGEDQ_LANES", "interactive")
    code, _, err = run(capsys, *where, "batch", "submit", good_file(tmp_path, 1))
    assert code == 2 and "no 'batch' lane" in one_line(err)
    code, out, _ = run(capsys, *where, "batch", "list")
    assert (code, out) == (0, "")  # nothing was created


@pytest.mark.parametrize("cmd", [["status", "batch_nope"], ["cancel", "batch_nope"],
                                 ["retry", "batch_nope"], ["results", "batch_nope"]])
def test_unknown_batch_exits_3(capsys, where, cmd):
    code, _, err = run(capsys, *where, "batch", *cmd)
    assert code == 3 and "batch not found: batch_nope" in one_line(err)


def test_list_limit_must_be_positive(capsys, where):
    code, _, err = run(capsys, *where, "batch", "list", "--limit", "0")
    assert code == 2 and "--limit" in one_line(err)


def test_redis_away_exits_1_with_one_line(capsys, monkeypatch):
    monkeypatch.setenv("PAGEDQ_CLIENT_RETRY_S", "0")
    code, _, err = run(capsys, "--redis-url", "redis://127.0.0.1:1/0", "batch", "status", "b")
    assert code == 1 and "ConnectionError" in one_line(err)
    code, _, err = run(capsys, "--redis-url", "redis://127.0.0.1:1/0", "batch", "worker")
    assert code == 1 and "ConnectionError" in one_line(err)

"""The job commands of the `pagedq` command: submit, status, result, cancel, watch.

``register(subparsers, parents)`` adds them to the root parser (pagedq/cli.py). The root
options ``--redis-url`` and ``--prefix`` come with ``parents``; unset (None) means "from
Settings()", i.e. the environment (PAGEDQ_REDIS_URL, PAGEDQ_PREFIX) or the built-in default.
Each subparser sets ``func`` = handler(args) -> exit code.

Exit codes (of submit --wait/--stream, result, status and cancel):

   0  finished: the job ended normally (or the command did what it was asked)
   1  Redis or another error; also cancel of a job that had already ended
   2  invalid input: nothing was enqueued (also command-line usage errors)
   3  job not found (never submitted, or its record expired after the result TTL)
   4  client-side wait timeout (--timeout ran out; the job goes on)
   5  refused: queue overloaded, or the job id exists with another request body
   6  job failed (the error is printed on stderr)
   7  job cancelled
   8  job expired, or ended by its own deadline (timeout_s ran out: a record with
      status "finished" and finish_reason "deadline"; the partial text is printed)
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable

import redis

from pagedq.exits import (  # noqa: F401 - the exit codes are this module's public names too
    EXIT_ERROR,
    EXIT_INVALID,
    EXIT_JOB_CANCELLED,
    EXIT_JOB_EXPIRED,
    EXIT_JOB_FAILED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_TIMEOUT,
    guarded,
)
from pagedq.producer.client import Client
from pagedq.wire.schema import FinalEvent, FinishReason, JobRecord, JobRequest, Status, TokenEvent
from pagedq.wire.settings import Settings

# The table above, for --help epilogs.
EXIT_CODES_HELP = "exit codes of the client commands:\n" + __doc__.split(
    "Exit codes (of submit --wait/--stream, result, status and cancel):\n\n", 1)[1]


def _client(args: argparse.Namespace) -> Client:
    return Client(getattr(args, "redis_url", None), prefix=getattr(args, "prefix", None),
                  model=getattr(args, "model", None))


def exit_code_of(status: Status | str, finish_reason: str) -> int:
    """Exit code of a job in a terminal state (see the table in the module docstring)."""
    status = Status(status)
    if status == Status.finished:
        return EXIT_JOB_EXPIRED if finish_reason == FinishReason.deadline else EXIT_OK
    return {Status.failed: EXIT_JOB_FAILED, Status.cancelled: EXIT_JOB_CANCELLED,
            Status.expired: EXIT_JOB_EXPIRED}.get(status, EXIT_ERROR)


def _report(job_id: str, status: Status, error: str, reason: str) -> int:
    """Exit code of a terminal job; anything but a normal finish is explained on stderr."""
    code = exit_code_of(status, reason)
    if code == EXIT_OK:
        return code
    if status == Status.finished:  # finish_reason "deadline"
        what = "ended by its deadline (timeout_s): the text is partial"
    else:
        what = f"{Status(status).value}: {error or reason or 'no detail'}"
    print(f"pagedq: job {job_id} {what}", file=sys.stderr)
    return code


def _read(flag: str, path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag} {path}: cannot read it ({getattr(e, 'strerror', None) or e})"
                         ) from None


def guided_of_args(args: argparse.Namespace) -> dict | None:
    """The wire's ``guided`` object of submit's --json-schema/--json-object/--regex/
    --choice/--grammar (one of them: argparse's group); ValueError naming the option."""
    if args.json_schema is not None:
        try:
            schema = json.loads(_read("--json-schema", args.json_schema))
        except json.JSONDecodeError as e:
            raise ValueError(f"--json-schema {args.json_schema}: not JSON ({e})") from None
        return {"json_schema": schema}
    if args.json_object:
        return {"json_object": True}
    if args.regex is not None:
        return {"regex": args.regex}
    if args.choice is not None:
        return {"choice": args.choice}
    if args.grammar is not None:
        return {"grammar": _read("--grammar", args.grammar)}
    return None


def logit_bias_of(values: list[str] | None) -> dict[int, float] | None:
    """--logit-bias ID=BIAS ... -> {id: bias}; ValueError naming the bad one."""
    if not values:
        return None
    out: dict[int, float] = {}
    for v in values:
        tid, sep, bias = v.partition("=")
        try:
            if not sep or not tid.strip().isdigit():
                raise ValueError
            out[int(tid)] = float(bias)
        except ValueError:
            raise ValueError(f"--logit-bias {v!r}: expected TOKEN_ID=BIAS, e.g. 50256=-100"
                             ) from None
    return out


def cmd_submit(args: argparse.Namespace) -> int:
    text = sys.stdin.read() if args.text == "-" else args.text
    body = {"messages": [{"role": "user", "content": text}]} if args.chat else {"prompt": text}
    body.update({k: v for k in ("lane", "priority") if (v := getattr(args, k)) is not None})
    body.update(guided=guided_of_args(args), logit_bias=logit_bias_of(args.logit_bias))
    with _client(args) as c:
        job_id = c.submit(**body, max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop,
                          job_id=args.id)
        if not (args.stream or args.wait):
            print(job_id)
            return EXIT_OK
        print(job_id, file=sys.stderr)  # stdout carries only the generated text
        if args.wait:
            rec = c.result(job_id, timeout=args.timeout)
            print(rec.text)
            return _report(job_id, rec.status, rec.error, rec.finish_reason)
        sent = 0
        for ev in c.stream(job_id, timeout=args.timeout):
            if isinstance(ev, TokenEvent):
                sys.stdout.write(ev.delta)
                sent += len(ev.delta)
            elif isinstance(ev, FinalEvent):
                sys.stdout.write(ev.text[sent:] + "\n")
                sys.stdout.flush()
                return _report(job_id, ev.status, ev.error, ev.finish_reason)
            sys.stdout.flush()
        return EXIT_ERROR  # stream() always ends with a final event


def cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as c:
        rec = c.status(args.id)
        print(rec.model_dump_json())
        if rec.status == Status.queued and not _served(c, rec.model):
            print(f"pagedq: no worker serves model {rec.model!r}: the job waits, and expires "
                  "if none comes within PAGEDQ_UNSERVED_TIMEOUT_S", file=sys.stderr)
    return EXIT_OK


def _served(c: Client, model: str) -> bool:
    """Whether a live worker serves ``model``; True when this user may not ask (a reader
    user runs no scripts: docs/security.md)."""
    try:
        return model in c.served_models()
    except redis.RedisError as e:
        denied = redis.exceptions.NoPermissionError
        if isinstance(e, denied) or isinstance(e.__cause__, denied):
            return True
        raise


def cmd_result(args: argparse.Namespace) -> int:
    with _client(args) as c:
        rec: JobRecord = c.result(args.id, timeout=args.timeout)
    print(rec.text)
    return _report(args.id, rec.status, rec.error, rec.finish_reason)


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client(args) as c:
        if c.cancel(args.id):
            print(c.status(args.id).status.value)  # "cancelled", or "running" until it stops
            return EXIT_OK
        print(f"pagedq: job {args.id} already {c.status(args.id).status.value}",
              file=sys.stderr)
        return EXIT_ERROR


def register(subparsers: argparse._SubParsersAction,
             parents: Iterable[argparse.ArgumentParser]) -> None:
    """Add submit/status/result/cancel and watch. ``parents``: parsers whose options every
    subcommand also takes (the root's --redis-url and --prefix)."""
    parents = list(parents)
    req = JobRequest.model_fields

    def add(name: str, help: str) -> argparse.ArgumentParser:
        return subparsers.add_parser(name, help=help, description=help, parents=parents,
                                     epilog=EXIT_CODES_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)

    p = add("submit", "enqueue one generation job, print its id")
    p.add_argument("text", metavar="TEXT", help="the prompt ('-' reads stdin)")
    p.add_argument("--chat", action="store_true",
                   help="send TEXT as one user chat message (default: a plain prompt)")
    p.add_argument("--model", help="served model name = jobs stream "
                                   f"(default: $PAGEDQ_MODEL or {Settings.model_fields['model'].default})")
    p.add_argument("--max-tokens", type=int, metavar="N",
                   help=f"most tokens to generate (default: {req['max_tokens'].default})")
    p.add_argument("--temperature", type=float, metavar="T",
                   help=f"sampling temperature, 0 = greedy (default: {req['temperature'].default})")
    p.add_argument("--top-p", type=float, metavar="P",
                   help=f"nucleus sampling mass (default: {req['top_p'].default} = off)")
    p.add_argument("--top-k", type=int, metavar="K",
                   help=f"sample among the K likeliest tokens (default: {req['top_k'].default} = off)")
    p.add_argument("--seed", type=int,
                   help="sampling seed of this job (default: none, the worker's noise stream)")
    p.add_argument("--stop", action="append", metavar="STR",
                   help="stop string, repeatable (default: none)")
    p.add_argument("--lane", metavar="LANE",
                   help="the lane (jobs stream) to queue on, one of $PAGEDQ_LANES; workers "
                        "take from the higher lanes first (default: interactive)")
    p.add_argument("--priority", type=int, metavar="N",
                   help="order inside a worker's batch, -1000..1000, higher first "
                        f"(default: {req['priority'].default})")
    guide = p.add_argument_group(
        "guided decoding", "the output must match one of these (a spec that cannot compile "
        "is refused, exit 2, nothing queued; default: none, free text)")
    one = guide.add_mutually_exclusive_group()
    one.add_argument("--json-schema", metavar="FILE",
                     help="a JSON value valid against the JSON Schema in FILE (default: none)")
    one.add_argument("--json-object", action="store_true",
                     help="a JSON object, any keys (default: off)")
    one.add_argument("--regex", metavar="RE",
                     help="text the regular expression RE (Rust regex syntax) matches whole "
                          "(default: none)")
    one.add_argument("--choice", action="append", metavar="STR",
                     help="exactly one of the strings given, repeatable (default: none)")
    one.add_argument("--grammar", metavar="FILE",
                     help="the context-free grammar in FILE: Lark (start rule 'start') or "
                          "GBNF (root rule 'root') (default: none)")
    p.add_argument("--logit-bias", action="append", metavar="ID=BIAS",
                   help="add BIAS (-100..100) to token ID's logit, repeatable (default: none)")
    p.add_argument("--id", help="job id (default: a new uuid4 hex); resubmitting is idempotent")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--stream", action="store_true",
                      help="print tokens as they arrive, the job id goes to stderr "
                           "(default: off, print the job id and return)")
    mode.add_argument("--wait", action="store_true",
                      help="print the final text, the job id goes to stderr "
                           "(default: off, print the job id and return)")
    p.add_argument("--timeout", type=float, metavar="S",
                   help="--stream: most seconds without a token; --wait: most seconds in all "
                        "(default: none, wait forever); exit 4 when it runs out")
    p.set_defaults(func=guarded(cmd_submit))

    p = add("status", "print a job's record as JSON")
    p.add_argument("id", metavar="ID")
    p.set_defaults(func=guarded(cmd_status))

    p = add("result", "wait for a job to end, print its final text; the exit code "
                      "tells how it ended")
    p.add_argument("id", metavar="ID")
    p.add_argument("--timeout", type=float, metavar="S",
                   help="most seconds to wait (default: none, wait forever); exit 4 when it "
                        "runs out")
    p.set_defaults(func=guarded(cmd_result))

    p = add("cancel", "cancel a queued or running job; prints its status after the request "
                      "(cancelled, or running until it stops); exit 1 if it had already ended")
    p.add_argument("id", metavar="ID")
    p.set_defaults(func=guarded(cmd_cancel))
    from pagedq import watch  # `pagedq watch JOB_ID`
    watch.register(subparsers, parents, guarded(lambda a: watch.cmd_watch(a, _report)),
                   EXIT_CODES_HELP)

"""Client subcommands: submit, status, result, cancel.

``register(subparsers)`` adds them to a root parser that defines ``--redis-url`` and
``--prefix`` (worker/cli.py, or ``main`` below for client-only use); None means "from
Settings()". Each subparser sets ``func`` = handler(args) -> exit code.

Exit codes: 0 ok; 1 the job failed/was cancelled/expired (or cancel found it already
ended), or Redis/another error; 2 invalid input (nothing enqueued); 3 job not found;
4 timeout; 5 refused (queue overloaded, or the job id exists with another body).
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import redis

from .client import Client
from .errors import InvalidRequest, JobConflict, JobNotFound, Overloaded, PagedqError, ResultTimeout
from .schema import FinalEvent, JobRecord, Status, TokenEvent

EXIT_OK, EXIT_FAILED, EXIT_INVALID, EXIT_NOT_FOUND, EXIT_TIMEOUT, EXIT_REFUSED = 0, 1, 2, 3, 4, 5


def _client(args: argparse.Namespace) -> Client:
    return Client(getattr(args, "redis_url", None), prefix=getattr(args, "prefix", None),
                  model=getattr(args, "model", None))


def _guarded(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Typed errors -> message on stderr + exit code, never a traceback."""
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except (InvalidRequest, ValueError) as e:  # ValueError: bad --prefix/--model
            code, msg = EXIT_INVALID, str(e)
        except JobNotFound as e:
            code, msg = EXIT_NOT_FOUND, f"job not found: {e.args[0] if e.args else ''}"
        except ResultTimeout as e:
            code, msg = EXIT_TIMEOUT, str(e)
        except (Overloaded, JobConflict) as e:
            code, msg = EXIT_REFUSED, str(e)
        except (PagedqError, redis.RedisError) as e:
            code, msg = EXIT_FAILED, f"{type(e).__name__}: {e}"
        print(f"pagedq: {msg}", file=sys.stderr)
        return code
    return run


def _report(job_id: str, status: Status, error: str, reason: str) -> int:
    """Exit code of a terminal job; a non-finished status is explained on stderr."""
    if status == Status.finished:
        return EXIT_OK
    print(f"pagedq: job {job_id} {status.value}: {error or reason or 'no detail'}",
          file=sys.stderr)
    return EXIT_FAILED


def cmd_submit(args: argparse.Namespace) -> int:
    text = sys.stdin.read() if args.text == "-" else args.text
    body = {"messages": [{"role": "user", "content": text}]} if args.chat else {"prompt": text}
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
        return EXIT_FAILED  # stream() always ends with a final event


def cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as c:
        print(c.status(args.id).model_dump_json())
    return EXIT_OK


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
        return EXIT_FAILED


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("submit", help="enqueue one generation job, print its id")
    p.add_argument("text", metavar="TEXT", help="the prompt ('-' reads stdin)")
    p.add_argument("--chat", action="store_true", help="send TEXT as one user chat message")
    p.add_argument("--model", help="served model name (default: PAGEDQ_MODEL)")
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", metavar="STR", help="stop string (repeatable)")
    p.add_argument("--id", help="job id (default: a new uuid4 hex); resubmitting is idempotent")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--stream", action="store_true",
                      help="print tokens as they arrive (the job id goes to stderr)")
    mode.add_argument("--wait", action="store_true",
                      help="print the final text (the job id goes to stderr)")
    p.add_argument("--timeout", type=float,
                   help="--stream: max seconds without a token; --wait: max seconds in all")
    p.set_defaults(func=_guarded(cmd_submit))

    p = subparsers.add_parser("status", help="print a job's record as JSON")
    p.add_argument("id", metavar="ID")
    p.set_defaults(func=_guarded(cmd_status))

    p = subparsers.add_parser("result", help="wait for a job and print its final text")
    p.add_argument("id", metavar="ID")
    p.add_argument("--timeout", type=float)
    p.set_defaults(func=_guarded(cmd_result))

    p = subparsers.add_parser("cancel", help="cancel a queued or running job; prints its status "
                               "after the request (cancelled, or running until it stops)")
    p.add_argument("id", metavar="ID")
    p.set_defaults(func=_guarded(cmd_cancel))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedq-client", description=__doc__.split("\n")[0])
    parser.add_argument("--redis-url", help="default: PAGEDQ_REDIS_URL")
    parser.add_argument("--prefix", help="key prefix (default: PAGEDQ_PREFIX)")
    register(parser.add_subparsers(dest="command", required=True))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Client-only entry point: ``python -m producer.cli [--redis-url U] submit ...``."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse: usage error (2) or --help (0)
        return int(e.code or 0)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

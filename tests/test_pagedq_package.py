"""`import pagedq`: the documented entry point (torch-free until the engine is asked for),
its version, PEP 561 markers, and submit()'s parameters: one typed keyword per JobRequest
field, the same in both clients, each documented."""
from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
import typing
from pathlib import Path
from typing import Unpack

import pytest

import pagedq
from pagedq.producer import AsyncClient, Client, JobRequest
from pagedq.producer.submit_params import SUBMIT_FIELDS, SubmitOptions
from tests.queue_helpers import inbox

ROOT = Path(__file__).resolve().parent.parent
# JobRequest fields submit() names differently or not at all: the schema version, and the
# id (submit's job_id); prompt, messages and model are submit()'s own parameters
NOT_KEYWORDS = {"v", "id", "prompt", "messages", "model"}


def test_import_pagedq_is_light_and_the_engine_loads_on_first_use():
    code = ("import sys, pagedq\n"
            "assert 'torch' not in sys.modules and 'pagedq.engine.llm_engine' not in sys.modules\n"
            "names = ['Client', 'AsyncClient', 'JobRequest', 'Settings', 'Batches',\n"
            "         'PagedqError', 'NoWorker', 'Overloaded', 'ResultTimeout', 'JobNotFound']\n"
            "assert all(hasattr(pagedq, n) for n in names)\n"
            "assert pagedq.SamplingParams(max_tokens=3).max_tokens == 3\n"
            "assert 'torch' not in sys.modules\n"
            "assert pagedq.LLMEngine.__name__ == 'LLMEngine' and 'torch' in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)


def test_names_and_version():
    assert set(pagedq.__all__) <= set(dir(pagedq)) | {"LLMEngine", "SamplingParams"}
    assert issubclass(pagedq.NoWorker, pagedq.PagedqError)
    assert pagedq.Client is Client and pagedq.AsyncClient is AsyncClient
    r = subprocess.run([sys.executable, "-m", "pagedq", "--version"], capture_output=True,
                       text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == f"pagedq {pagedq.__version__}", r


def test_submit_names_every_request_field_typed_and_documented():
    """One declaration of submit()'s keywords (producer/submit_params.SubmitOptions) for
    both clients, with every JobRequest field, each documented in Client.submit."""
    fields = set(JobRequest.model_fields) - NOT_KEYWORDS
    assert SUBMIT_FIELDS == fields, "producer/submit_params.py: SUBMIT_FIELDS vs JobRequest"
    hints = typing.get_type_hints(SubmitOptions)
    missing = fields - set(hints)
    assert not missing, f"SubmitOptions lacks JobRequest fields {sorted(missing)}"
    for client in (Client, AsyncClient):
        params = inspect.signature(client.submit).parameters
        assert list(params) == ["self", "prompt", "options"], client
        assert typing.get_type_hints(client.submit)["options"] == Unpack[SubmitOptions]
    doc = inspect.getdoc(Client.submit)
    adoc = inspect.getdoc(AsyncClient.submit)
    for name in hints:
        assert re.search(rf"(?<!\w){name}[:, (]", doc), f"Client.submit's doc lacks {name}"
        assert name in adoc, f"AsyncClient.submit's docstring lacks {name}"


def test_submit_keywords_reach_the_request(redis_server):
    with pagedq.Client(redis_server.url, prefix="pkg", model="m") as c:
        job = c.submit("hi", min_p=0.05, logprobs=2, priority=7, metadata={"team": "a"},
                       repetition_penalty=1.1, stop_token_ids=[5], ignore_eos=True,
                       min_tokens=1, n=2, lane="batch", max_tokens=4, presence_penalty=0.5,
                       frequency_penalty=0.25, top_k=3, top_p=0.9, temperature=0.7, seed=1,
                       stop="\n", timeout_s=60)
        (entry,) = inbox(c.redis, c.keys, "m", "batch")
    req = JobRequest.model_validate_json(entry["body"])
    assert req.id == job and req.prompt == "hi"
    assert (req.min_p, req.logprobs, req.priority, req.metadata) == (0.05, 2, 7, {"team": "a"})
    assert (req.repetition_penalty, req.stop_token_ids, req.ignore_eos, req.min_tokens,
            req.n, req.lane) == (1.1, [5], True, 1, 2, "batch")
    assert (req.presence_penalty, req.frequency_penalty, req.top_k, req.top_p,
            req.temperature, req.seed, req.stop, req.timeout_s) == \
        (0.5, 0.25, 3, 0.9, 0.7, 1, ["\n"], 60)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pagedq.Client(redis_server.url, prefix="pkg", model="m") as c:
        c.submit(messages=[{"role": "user", "content": "hi"}], tools=[tool], tool_choice="auto",
                 parallel_tool_calls=False, guided={"json_object": True}, logit_bias={7: -1})
        (entry,) = inbox(c.redis, c.keys, "m", "interactive")
    req = JobRequest.model_validate_json(entry["body"])
    assert req.tools[0].model_dump(exclude_none=True) == tool and req.tool_choice == "auto"
    assert (req.parallel_tool_calls, req.guided.kind, req.logit_bias) == \
        (False, "json_object", {7: -1.0})


def test_the_wire_and_the_engine_take_the_same_sampling_values():
    """One declaration (wire/sampling.py): JobRequest has SamplingParams' fields, and each
    value one of them refuses the other refuses too; the worker's parameters of a request
    (not validated twice) equal SamplingParams built and checked from the same values."""
    import dataclasses

    from pagedq.wire.sampling import WIRE_FIELDS, SamplingParams, fan_out

    fields = dataclasses.fields(SamplingParams)
    names = [f.name for f in fields if f.metadata.get("wire", True)]
    assert list(WIRE_FIELDS) == names and set(names) <= set(JobRequest.model_fields)
    # the engine-only fields (metadata wire=False) stay off the wire
    engine_only = {f.name for f in fields} - set(names)
    assert not engine_only & set(JobRequest.model_fields)
    for field, bad in (("repetition_penalty", 10.5), ("temperature", 101.0), ("n", 17),
                       ("max_tokens", 40000), ("stop", [""]), ("stop_token_ids", [-1]),
                       ("seed", 2**63), ("top_p", 0.0), ("logprobs", 21), ("min_p", 1.5)):
        with pytest.raises(ValueError):
            SamplingParams(**{field: bad})
        with pytest.raises(ValueError):
            JobRequest(prompt="x", **{field: bad})
    for body in ({"prompt": "x"}, {"prompt": "x", "stop": "\n", "seed": 2**63 - 1, "n": 3,
                                   "temperature": 0.5, "logprobs": 2, "min_tokens": 2}):
        req = JobRequest.model_validate(body)
        base = SamplingParams.of_request(req)
        for k, (rid, got) in enumerate(fan_out("job", base)):
            assert rid == ("job" if req.n == 1 else f"job#{k}")
            want = {**{n: getattr(req, n) for n in names}, "n": 1,
                    "seed": None if req.seed is None else (req.seed + k) % 2**63}
            assert got == SamplingParams(**want), (body, k)

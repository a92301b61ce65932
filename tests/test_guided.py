"""Guided decoding through LLMEngine on the CPU: the bundled SmolLM2 for real text (JSON
Schema, regex, choice, Lark and GBNF grammars, JSON mode, logit_bias, crash resume, bad
specs), a tiny random model for the async pipeline (guided rows stay asynchronous and give
the synchronous engine's tokens) and the grammar cache."""
from __future__ import annotations

import json
import random
import re
import shutil
import threading

import jsonschema
import pytest

from pagedq.engine import LLMEngine, SamplingParams
from pagedq.engine.guided import GrammarCache
from pagedq.wire.guided import GuidedSpec, validate_guided

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "color"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "color": {"enum": ["red", "green", "blue"]}}}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
ANSWER_LARK = 'start: "The answer is " answer "."\nanswer: NUMBER | "unknown"\nNUMBER: /[0-9]{1,4}/'
YES_NO_GBNF = 'root ::= ("yes" | "no") ", because " [a-z ]{1,30} "."'


@pytest.fixture(scope="module")
def smol():
    return LLMEngine("smollm2", device="cpu", dtype="float32", num_kv_blocks=384,
                     max_model_len=1024)


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def run(eng: LLMEngine, reqs: list[tuple], after_step=None) -> dict[str, dict]:
    """Add (id, messages, params[, resume ids]) requests, step to the end; per request its
    new token ids, text and finish reason."""
    for rid, msgs, p, *resume in reqs:
        eng.add_request(rid, messages=msgs, params=p,
                        resume_token_ids=resume[0] if resume else None)
    out: dict[str, dict] = {}
    while eng.has_unfinished():
        for o in eng.step():
            d = out.setdefault(o.request_id, dict(ids=[], text="", reason=None))
            assert d["reason"] is None, f"{o.request_id}: output after it finished"
            d["ids"] += o.new_token_ids
            d["text"] += o.delta
            d["reason"] = o.finish_reason if o.finished else None
        if after_step:
            after_step(eng)
    return out


def test_fifty_json_schema_outputs_validate_beside_unchanged_unguided(smol):
    spec = GuidedSpec.of("json_schema", PERSON)
    guided = [(f"g{i}", chat(f"Invent person number {i} and describe them as JSON."),
               SamplingParams(max_tokens=40, temperature=0.0 if i % 2 else 0.7, seed=100 + i,
                              guided=spec)) for i in range(50)]
    plain = [(f"u{i}", chat(q), SamplingParams(max_tokens=12, temperature=0.0 if i < 2 else 0.8,
                                               seed=i))
             for i, q in enumerate(["What is the capital of France?", "Name three fruits.",
                                    "Write a haiku about rain.", "Why is the sky blue?"])]
    cache = smol.guided.cache
    compiles, hits = (cache.compiles, cache.hits) if cache is not None else (0, 0)
    mixed = run(smol, guided[:25] + plain[:2] + guided[25:] + plain[2:])
    for i in range(50):
        got = mixed[f"g{i}"]
        assert got["reason"] == "stop", got  # the grammar ended it, not max_tokens
        jsonschema.validate(json.loads(got["text"]), PERSON)
    assert len({mixed[f"g{i}"]["text"] for i in range(0, 50, 2)}) > 5  # sampled rows differ
    alone = run(smol, plain)
    for rid in alone:  # greedy and seeded rows: the same tokens with or without guided rows
        assert mixed[rid]["ids"] == alone[rid]["ids"] and mixed[rid]["text"] == alone[rid]["text"]
    cache = smol.guided.cache  # compiled at most once (once per module if it ran first)
    assert cache.compiles - compiles <= 1 and cache.hits - hits >= 49
    assert not smol.guided  # every matcher left with its request


def test_regex_choice_grammars_and_json_object(smol):
    choices = ["cat", "dog", "bird"]
    reqs = [("re", chat("Give me a phone number."),
             SamplingParams(max_tokens=20, temperature=0.0, guided=GuidedSpec("regex", PHONE))),
            ("ch", chat("Which animal barks?"),
             SamplingParams(max_tokens=8, temperature=0.0, guided=GuidedSpec.of("choice", choices))),
            ("lark", chat("How many legs does a spider have?"),
             SamplingParams(max_tokens=16, temperature=0.0,
                            guided=GuidedSpec("grammar", ANSWER_LARK))),
            ("gbnf", chat("Is water wet?"),
             SamplingParams(max_tokens=24, temperature=0.7, seed=3,
                            guided=GuidedSpec("grammar", YES_NO_GBNF))),
            ("obj", chat("Describe a cat as a JSON object with its name and age."),
             SamplingParams(max_tokens=40, temperature=0.0, guided=GuidedSpec("json_object")))]
    out = run(smol, reqs)
    assert re.fullmatch(PHONE, out["re"]["text"]) and out["re"]["reason"] == "stop"
    assert out["ch"]["text"] in choices and out["ch"]["reason"] == "stop"
    assert re.fullmatch(r"The answer is ([0-9]{1,4}|unknown)\.", out["lark"]["text"])
    assert re.fullmatch(r"(yes|no), because [a-z ]{1,30}\.", out["gbnf"]["text"]), out["gbnf"]
    assert out["obj"]["reason"] == "stop" and isinstance(json.loads(out["obj"]["text"]), dict)
    assert all(o["reason"] == "stop" for o in out.values())


def test_logit_bias_pushes_and_bans_tokens(smol):
    tok = smol.tokenizer
    q = chat("What is the capital of France?")
    base = run(smol, [("b", q, SamplingParams(max_tokens=3, temperature=0.0))])["b"]["ids"]
    banned = run(smol, [("x", q, SamplingParams(max_tokens=3, temperature=0.0,
                                                logit_bias={base[0]: -100.0}))])["x"]["ids"]
    assert banned[0] != base[0]
    star = tok.encode("*")[0]
    pushed = run(smol, [("y", q, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                                logit_bias={star: 100.0}))])["y"]["ids"]
    assert pushed == [star] * 4
    # a bias on one request leaves the others of its batch alone
    both = run(smol, [("p", q, SamplingParams(max_tokens=3, temperature=0.0)),
                      ("q", q, SamplingParams(max_tokens=3, temperature=0.0,
                                              logit_bias={base[0]: -100.0}))])
    assert both["p"]["ids"] == base and both["q"]["ids"] == banned
    with pytest.raises(ValueError, match=r"logit_bias token ids must be in \[0, 49152\)"):
        smol.add_request("z", messages=q, params=SamplingParams(logit_bias={49152: 1.0}))
    with pytest.raises(ValueError, match=r"logit_bias\.1: Input should be less than or equal to 100"):
        SamplingParams(logit_bias={1: 101.0})
    with pytest.raises(ValueError, match=r"logit_bias\.-1: Input should be greater than or equal to 0"):
        SamplingParams(logit_bias={-1: 1.0})
    assert not smol.has_unfinished()


def test_a_resumed_request_continues_through_its_grammar(smol):
    """The worker re-adds a reclaimed job with the tokens it already streamed: its grammar
    consumes them at add_request, so the rest continues the same JSON (a matcher started
    afresh would open a new object after them)."""
    spec = GuidedSpec.of("json_schema", PERSON)
    q = chat("Invent a person and describe them as JSON.")
    p = SamplingParams(max_tokens=40, temperature=0.8, seed=7, guided=spec)
    full = run(smol, [("f", q, p)])["f"]
    ids = full["ids"]
    assert full["reason"] == "stop" and len(ids) > 8
    for cut in (3, len(ids) // 2, len(ids) - 1):
        rest = run(smol, [(f"r{cut}", q, p, ids[:cut])])[f"r{cut}"]
        text = smol.tokenizer.decode(ids[:cut] + rest["ids"])
        assert rest["reason"] == "stop"
        jsonschema.validate(json.loads(text), PERSON)
    done = run(smol, [("d", q, p, ids)])["d"]  # every token streamed: only EOS may follow
    assert done["reason"] == "stop" and done["text"] == ""
    bad = smol.tokenizer.encode("Hello")
    with pytest.raises(ValueError, match="guided json_schema: the resumed tokens do not follow"):
        smol.add_request("bad", messages=q, params=p, resume_token_ids=bad)
    assert not smol.has_unfinished() and not smol.guided


@pytest.mark.parametrize("kind,text,message", [
    ("json_schema", json.dumps({"type": "objekt"}), "guided json_schema: Invalid type: objekt"),
    ("json_schema", "{oops", "guided json_schema: text is not JSON"),
    ("regex", "a(", "guided regex: .*unclosed group"),
    ("grammar", "start: foo", 'guided grammar: .*unknown name: "foo"'),
    ("choice", "[]", "guided choice: text must be a JSON array of non-empty strings"),
])
def test_a_spec_that_cannot_compile_is_a_clear_error(smol, kind, text, message):
    spec = GuidedSpec(kind, text)
    for check in (lambda: validate_guided(spec),
                  lambda: smol.add_request("e", "Hi", SamplingParams(guided=spec, n=2))):
        with pytest.raises(ValueError, match=message) as err:
            check()
        assert "\n" not in str(err.value)
    assert not smol.has_unfinished() and not smol.guided
    smol.add_request("e", "Hi", SamplingParams(max_tokens=1))  # the id was not taken
    run(smol, [])


def test_a_model_without_a_tokenizer_refuses_guided_requests(tiny_model_dir, tmp_path):
    shutil.copy(tiny_model_dir("LlamaForCausalLM") / "config.json", tmp_path)
    eng = LLMEngine(str(tmp_path), load_format="dummy", device="cpu", num_kv_blocks=16)
    assert eng.tokenizer is None
    with pytest.raises(ValueError, match="guided decoding needs the model's fast"):
        eng.add_request("g", [1, 2, 3], SamplingParams(guided=GuidedSpec("regex", "a+")))
    with pytest.raises(ValueError, match="guided decoding needs"):
        eng.guided.prepare()
    assert not eng.has_unfinished()


def test_spec_construction_errors():
    with pytest.raises(ValueError, match="guided kind must be one of json_schema, json_object"):
        GuidedSpec("xml", "<a/>")
    with pytest.raises(ValueError, match="guided regex: text is empty"):
        GuidedSpec("regex")
    with pytest.raises(ValueError, match="guided json_object takes no text"):
        GuidedSpec("json_object", "{}")
    with pytest.raises(ValueError, match="guided: must be an object with one key, the kind"):
        SamplingParams(guided="json")
    # the wire's shape is taken too, and a spec comes back as the wire writes it
    assert SamplingParams(guided={"json_schema": {"type": "object"}}).guided == \
        GuidedSpec("json_schema", '{"type": "object"}')
    assert SamplingParams(guided=GuidedSpec("json_schema", '{"type":"object"}')).guided == \
        GuidedSpec("json_schema", '{"type": "object"}')
    assert GuidedSpec.of("choice", ["a", "b"]) == GuidedSpec("choice", '["a", "b"]')
    validate_guided(GuidedSpec.of("choice", ['say "hi"', "café", "back\\slash"]))


def test_async_guided_rows_stay_in_flight_and_equal_sync(tiny_model_dir):
    """Async scheduling: a guided row's mask needs its previous token, read off the step in
    flight while the next forward runs; steps stay in flight and the tokens are the
    synchronous engine's (greedy, seeded, n = 2, beside unguided rows, under preemption)."""
    folder = str(tiny_model_dir("Qwen3ForCausalLM"))
    schema = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
              "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                             "b": {"enum": ["x", "yy"]}}}
    rng = random.Random(0)
    prompts = [rng.choices(range(250), k=rng.randint(3, 30)) for _ in range(6)]
    params = [SamplingParams(max_tokens=40, temperature=0.0, guided=GuidedSpec.of("json_schema", schema)),
              SamplingParams(max_tokens=12, temperature=0.9, seed=5, n=2,
                             guided=GuidedSpec("regex", "[a-f]{3,8}-[0-9]+")),
              SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.0, guided=GuidedSpec.of("choice", ["ab", "cd"])),
              SamplingParams(max_tokens=9, temperature=0.7, seed=2, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.8, seed=9, guided=GuidedSpec("json_object"))]
    in_flight = []

    def collect(eng: LLMEngine) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for k, (ids, p) in enumerate(zip(prompts, params, strict=True)):
            eng.add_request(f"r{k}", ids, p)
        while eng.has_unfinished():
            for o in eng.step():
                d = out.setdefault(o.request_id, dict(ids=[], reason=None))
                d["ids"] += o.new_token_ids
                d["reason"] = o.finish_reason
            in_flight.append(eng.pipeline.inflight is not None and bool(eng.guided))
        return out

    cfg = dict(device="cpu", dtype="float32", block_size=8, num_kv_blocks=24,
               max_num_batched_tokens=32, max_num_seqs=4)  # chunked prefill, preemption
    sync = collect(LLMEngine(folder, async_scheduling=False, **cfg))
    assert not any(in_flight)
    eng = LLMEngine(folder, async_scheduling=True, **cfg)
    assert collect(eng) == sync
    assert sum(in_flight) >= 10  # steps with guided rows were left in flight
    tok = eng.tokenizer
    texts = {rid: tok.decode(d["ids"], skip_special_tokens=True) for rid, d in sync.items()}
    jsonschema.validate(json.loads(texts["r0"]), schema)
    for rid in ("r1#0", "r1#1"):
        assert re.fullmatch(r"[a-f]{3,8}-[0-9]+", texts[rid]) or (
            sync[rid]["reason"] == "length" and re.fullmatch(r"[a-f]{3,8}-[0-9]*", texts[rid]))
    assert texts["r3"] in ("ab", "cd")
    assert sync["r5"]["reason"] == "length" or isinstance(json.loads(texts["r5"]), dict)


def test_grammar_cache_is_bounded_lru_and_thread_safe():
    import llguidance

    from tests.model_fixtures import tiny_tokenizer
    hf = tiny_tokenizer()
    tok = llguidance.LLTokenizer(hf.backend_tokenizer.to_str(), n_vocab=512, eos_token=256)
    a_id = hf.encode("a")[0]
    specs = [GuidedSpec("regex", f"[a-c]{{{k}}}") for k in range(1, 6)]
    cache = GrammarCache(tok, capacity=3)
    for s in specs[:3]:
        cache.matcher(s)
    cache.matcher(specs[0])  # now the most recent: specs[1] goes first
    cache.matcher(specs[3])
    assert len(cache) == 3 and cache.compiles == 4 and cache.hits == 1
    cache.matcher(specs[0])
    assert cache.hits == 2
    cache.matcher(specs[1])
    assert cache.compiles == 5  # it had been dropped
    a, b = cache.matcher(specs[4]), cache.matcher(specs[4])
    assert a.consume_tokens(hf.encode("ab")) and not a.is_stopped()
    assert b.consume_tokens(hf.encode("abcab")) and b.is_stopped()  # copies: a's is its own
    errors: list[BaseException] = []

    def hammer(seed: int) -> None:
        r = random.Random(seed)
        try:
            for _ in range(100):
                m = cache.matcher(r.choice(specs))
                assert m.consume_token(a_id)
        except BaseException as e:  # noqa: BLE001  (reported below)
            errors.append(e)
    threads = [threading.Thread(target=hammer, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(cache) == 3
    assert cache.hits + cache.compiles == 800 + 9

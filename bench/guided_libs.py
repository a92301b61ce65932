"""The two grammar libraries side by side (bench/guided.py libs): llguidance and xgrammar,
with the bundled SmolLM2 tokenizer (49,152 tokens), on this machine's CPU.

Per grammar (three JSON schemas, a regex, a choice list, a Lark grammar):
  * compile: llguidance builds the matcher (its token masks are computed lazily, per
    step); xgrammar compiles the grammar against the vocabulary (its cache off);
  * first mask: the first step's token mask right after compiling;
  * mask, 1 row: mean time of a step's mask along a valid output's tokens (HF's
    tokenization of an instance), the matcher advanced by each token (not timed);
  * mask, 32 rows: the same for 32 matchers at once, each library's own batch call on
    every core (llguidance's LLExecutor, xgrammar's BatchGrammarMatcher);
  * memory: C-heap bytes added per grammar while 16 variants of the nested schema
    (distinct property names) are compiled, kept, and stepped through their instance;
    for xgrammar also its own count of a compiled grammar's bytes.
Also each library's import cost, whether its import pulls in torch (the client side and
the gateway validate specs without torch), and what its tokenizer set-up costs.
"""
from __future__ import annotations

import ctypes
import importlib.metadata
import json
import statistics
import subprocess
import sys
import time

SMALL = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
         "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
NESTED = {
    "type": "object", "additionalProperties": False, "required": ["customer", "items", "status"],
    "properties": {
        "customer": {"type": "object", "additionalProperties": False, "required": ["id", "email"],
                     "properties": {"id": {"type": "integer", "minimum": 1},
                                    "email": {"type": "string", "format": "email"}}},
        "items": {"type": "array", "minItems": 1, "maxItems": 8, "items": {
            "type": "object", "additionalProperties": False, "required": ["sku", "qty"],
            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                           "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                           "size": {"enum": ["S", "M", "L", "XL"]}}}},
        "status": {"enum": ["new", "paid", "shipped", "cancelled"]},
        "notes": {"type": ["string", "null"], "maxLength": 200},
    },
}


def _tool(name: str, props: dict, required: list[str]) -> dict:
    return {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": name},
                           "arguments": {"type": "object", "additionalProperties": False,
                                         "properties": props, "required": required}}}


# what a gateway builds from `tools` with parallel_tool_calls: a list of calls of any tool
TOOLS = {"type": "array", "minItems": 1, "items": {"anyOf": [
    _tool("get_weather", {"city": {"type": "string"},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city"]),
    _tool("search_flights", {"origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                             "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                             "date": {"type": "string", "format": "date"},
                             "passengers": {"type": "integer", "minimum": 1}},
          ["origin", "destination", "date"]),
    _tool("send_email", {"to": {"type": "array", "items": {"type": "string"}},
                         "subject": {"type": "string"}, "body": {"type": "string"}},
          ["to", "subject", "body"]),
]}}
LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""
REGEX = r"\(\d{3}\) \d{3}-\d{4}"
CHOICES = ["positive", "negative", "neutral", "mixed feelings"]

# (name, kind, text, a valid output)
CASES = [
    ("json small", "json_schema", json.dumps(SMALL), json.dumps({"name": "Bob", "age": 42})),
    ("json nested", "json_schema", json.dumps(NESTED), json.dumps(
        {"customer": {"id": 17, "email": "ann@example.com"},
         "items": [{"sku": "ABC-1234", "qty": 2, "size": "M"}, {"sku": "XYZ-0001", "qty": 1}],
         "status": "paid", "notes": None})),
    ("json tools", "json_schema", json.dumps(TOOLS), json.dumps(
        [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
         {"name": "search_flights", "arguments": {"origin": "CDG", "destination": "JFK",
                                                  "date": "2027-01-15", "passengers": 2}}])),
    ("regex", "regex", REGEX, "(555) 123-4567"),
    ("choice", "choice", json.dumps(CHOICES), "mixed feelings"),
    ("lark", "grammar", LARK, "(12+3)*4-5/6"),
]


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def heap_bytes() -> int:
    """Bytes the C heap holds allocated (glibc's mallinfo2: small blocks + mmapped ones);
    both libraries allocate through it (Rust's and C++'s default allocators)."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def import_cost(module: str) -> tuple[float, bool]:
    """(seconds, torch imported) of a fresh interpreter importing module."""
    code = (f"import sys, time; t = time.perf_counter(); import {module}; "
            f"print(time.perf_counter() - t, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    return float(out[0]), out[1] == "True"


class Llg:
    name = "llguidance"

    def __init__(self, tok, threads: int) -> None:
        import llguidance
        self.lib = llguidance
        backend = tok.backend_tokenizer
        t = time.perf_counter()
        self.tok = llguidance.LLTokenizer(backend.to_str(), n_vocab=len(tok),
                                          eos_token=tok.eos_token_id)
        self.setup_s = time.perf_counter() - t
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.vocab = len(tok)
        self.words = (self.vocab + 31) // 32
        self.version = importlib.metadata.version("llguidance")

    def grammar(self, kind: str, text: str) -> str:
        m = self.lib.LLMatcher
        if kind == "json_schema":
            return m.grammar_from_json_schema(text)
        if kind == "regex":
            return m.grammar_from_regex(text)
        if kind == "choice":
            return self.lib.grammar_from("choice", text)
        return m.grammar_from_lark(text)

    def validate(self, kind: str, text: str) -> float:
        """Seconds of the tokenizer-free check (wire/guided.validate_guided's)."""
        t = time.perf_counter()
        if self.lib.LLMatcher.validate_grammar(self.grammar(kind, text)):
            raise ValueError(f"{kind} does not compile")
        return time.perf_counter() - t

    def compile(self, kind: str, text: str):
        m = self.lib.LLMatcher(self.tok, self.grammar(kind, text))
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, matchers, mask) -> None:
        import torch  # noqa: F401  (mask is a torch tensor)
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)],
                                              mask.data_ptr(), self.words * 4, mask.shape[0])

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def nbytes(self, compiled) -> int | None:
        return None


class Xgr:
    name = "xgrammar"

    def __init__(self, tok, threads: int) -> None:
        import xgrammar
        self.lib = xgrammar
        t = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
        self.setup_s = time.perf_counter() - t
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=threads)
        self.vocab = len(tok)
        self.words = (self.vocab + 31) // 32
        self.version = importlib.metadata.version("xgrammar")

    def compile(self, kind: str, text: str):
        c = self.compiler
        if kind == "json_schema":
            return c.compile_json_schema(text)
        if kind == "regex":
            return c.compile_regex(text)
        if kind == "choice":
            return c.compile_regex("|".join(_re_escape(s) for s in json.loads(text)))
        return c.compile_lark(text)

    def matcher(self, compiled):
        return self.lib.GrammarMatcher(compiled)

    def fill(self, matchers, mask) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(mask, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, mask)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def nbytes(self, compiled) -> int | None:
        return compiled.memory_size_bytes


def _re_escape(s: str) -> str:
    import re
    return re.escape(s)


def _walk(lib, compiled, tokens: list[int], rows: int) -> tuple[float, float]:
    """(first mask s, mean later mask s) of ``rows`` matchers stepping through tokens."""
    import torch
    mask = torch.full((rows, lib.words), -1, dtype=torch.int32)
    ms = [lib.matcher(compiled) for _ in range(rows)]
    times = []
    for tok in tokens:
        t = time.perf_counter()
        lib.fill(ms, mask)
        times.append(time.perf_counter() - t)
        for m in ms:
            if not lib.accept(m, tok):
                raise RuntimeError(f"{lib.name} refused token {tok}")
    return times[0], statistics.fmean(times[1:])


def _memory(lib, tok, variants: int = 16) -> tuple[float, int | None]:
    """Heap bytes added per compiled grammar (kept, with a matcher stepped through its
    instance), and the library's own count."""
    inst = json.loads(CASES[1][3])
    keep, own = [], []
    before = heap_bytes()
    for v in range(variants):
        schema = json.loads(json.dumps(NESTED).replace('"status"', f'"status{v}"'))
        doc = {(f"status{v}" if k == "status" else k): x for k, x in inst.items()}
        compiled = lib.compile("json_schema", json.dumps(schema))
        _walk(lib, compiled, tok.encode(json.dumps(doc)), 1)
        keep.append(compiled)  # held until the end: its bytes stay counted
        own.append(lib.nbytes(compiled))
    per = (heap_bytes() - before) / variants
    return per, (int(statistics.fmean(own)) if own[0] is not None else None)


def measure(tok, threads: int, repeat: int) -> list[dict]:
    rows = []
    for cls, module in ((Llg, "llguidance"), (Xgr, "xgrammar")):
        imp_s, pulls_torch = import_cost(module)
        lib = cls(tok, threads)
        row = dict(library=lib.name, version=lib.version, import_s=imp_s,
                   import_pulls_torch=pulls_torch, tokenizer_setup_s=lib.setup_s, cases={})
        for name, kind, text, instance in CASES:
            tokens = tok.encode(instance)
            try:
                compile_s, first, one, batch = [], [], [], []
                for _ in range(repeat):
                    t = time.perf_counter()
                    compiled = lib.compile(kind, text)
                    compile_s.append(time.perf_counter() - t)
                    f1, m1 = _walk(lib, compiled, tokens, 1)
                    first.append(f1)
                    one.append(m1)
                    batch.append(_walk(lib, compiled, tokens, 32)[1])
                # compile and first mask: the first (cold) repetition; masks: the best
                row["cases"][name] = dict(
                    supported=True, tokens=len(tokens), compile_ms=compile_s[0] * 1e3,
                    first_mask_ms=first[0] * 1e3, mask_1row_us=min(one) * 1e6,
                    mask_32rows_us=min(batch) * 1e6,
                    validate_ms=(min(lib.validate(kind, text) for _ in range(repeat)) * 1e3
                                 if hasattr(lib, "validate") else None))
            except Exception as e:  # noqa: BLE001  (a feature the library lacks is a result)
                row["cases"][name] = dict(supported=False, error=str(e).splitlines()[0][:120])
        row["heap_per_grammar_kib"], own = _memory(lib, tok)
        row["heap_per_grammar_kib"] /= 1024
        row["own_bytes_per_grammar_kib"] = own / 1024 if own is not None else None
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| grammar | library | compile ms | first mask ms | mask 1 row us | "
             "mask 32 rows us | check, no tokenizer ms |", "|---|---|---|---|---|---|---|"]
    for name, *_ in CASES:
        for r in rows:
            c = r["cases"][name]
            if not c["supported"]:
                lines.append(f"| {name} | {r['library']} | not supported: {c['error']} "
                             f"| | | | |")
                continue
            check = "-" if c["validate_ms"] is None else f"{c['validate_ms']:.2f}"
            lines.append(f"| {name} ({c['tokens']} tokens) | {r['library']} | "
                         f"{c['compile_ms']:.2f} | {c['first_mask_ms']:.2f} | "
                         f"{c['mask_1row_us']:.0f} | {c['mask_32rows_us']:.0f} | {check} |")
    lines += ["", "| library | version | import s | import pulls torch | tokenizer set-up s | "
              "heap per grammar KiB | own count KiB |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        own = r["own_bytes_per_grammar_kib"]
        lines.append(f"| {r['library']} | {r['version']} | {r['import_s']:.2f} | "
                     f"{'yes' if r['import_pulls_torch'] else 'no'} | "
                     f"{r['tokenizer_setup_s']:.2f} | {r['heap_per_grammar_kib']:.0f} | "
                     f"{'-' if own is None else f'{own:.0f}'} |")
    return "\n".join(lines)

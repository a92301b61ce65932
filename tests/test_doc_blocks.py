"""The command blocks of docs/*.md, by test_readme.py's rule: each runs in a test (its
marker names the test file, which names the marker) or says why it cannot
(``<!-- not-run: REASON -->``: Docker, a GPU, a cluster, a server in the foreground,
installs). And in README.md and docs/*.md alike, what a newcomer copies works as copied:
no optional argument in literal brackets, and every example that generates with the
bundled model is greedy (at temperature 1.0 the 135M model answers nonsense)."""
from __future__ import annotations

import re

import pytest

from tests.test_readme import _NOT_RUN, _RUN_BY, README, ROOT, Block, blocks

DOCS = sorted((ROOT / "docs").glob("*.md"))


def all_blocks() -> list[tuple[str, Block]]:
    return [(doc.name, b) for doc in [README, *DOCS] for b in blocks(doc)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_docs_block_runs_in_a_test_or_says_why_not(doc):
    for b in blocks(doc):
        where = f"docs/{doc.name}:{b.line}"
        assert b.marker, f"{where}: a block no test runs and no marker explains"
        if m := _RUN_BY.match(b.marker):
            assert m[1] in (ROOT / m[2]).read_text(encoding="utf-8"), (where, b.marker)
        else:
            assert _NOT_RUN.match(b.marker), f"{where}: unknown marker {b.marker}"


def test_no_optional_argument_in_literal_brackets():
    for doc, b in all_blocks():
        for line in b.code.splitlines():
            assert not re.search(r"\[--?\w", line.split("#", 1)[0]), f"{doc}:{b.line}: {line}"


_GENERATES = re.compile(r'"(messages|prompt|input)"')
_BUNDLED = ("smollm2", "$MODEL")  # the curl blocks' ${MODEL:-smollm2}


def test_bundled_model_examples_are_greedy():
    checked = 0
    for doc, b in all_blocks():
        if b.lang == "python":
            continue  # the SDK and client examples: run by tests that check their answers
        for line in b.code.splitlines():
            cmd = line.split(" #", 1)[0]
            if re.search(r"\bpagedq (--\S+ \S+ )*submit ", cmd):
                assert "--temperature" in cmd, f"{doc}:{b.line}: {line}"
                checked += 1
            elif _GENERATES.search(cmd) and any(m in cmd for m in _BUNDLED) \
                    and '"max_tokens": 0' not in cmd:
                assert '"temperature"' in cmd, f"{doc}:{b.line}: {line}"
                checked += 1
    assert checked >= 8

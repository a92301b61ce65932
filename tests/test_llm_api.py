"""``from pagedq import LLM, SamplingParams``: vLLM's offline API over LLMEngine
(engine/llm.py). The README's snippet, vLLM's with only the import changed, runs as written
on the bundled SmolLM2; the rest on a tiny random model: every prompt form, chat, n samples
and logprobs, each against the engine's own generate() (the one owner of prompts and
samples), and the constructor's vLLM arguments."""
from __future__ import annotations

import contextlib
import io
import re
import warnings
from pathlib import Path

import pytest

import pagedq
from pagedq import LLM, SamplingParams
from pagedq.engine.llm import TRUST_REMOTE_CODE_WARNING
from pagedq.engine.llm_engine import LLMEngine
from tests.model_fixtures import make_tiny_chat_model

pytest_plugins = ["tests.model_fixtures"]
README = Path(__file__).resolve().parent.parent / "README.md"


def readme_block(name: str) -> str:
    text = README.read_text(encoding="utf-8")
    m = re.search(rf"<!-- {name}: tests/test_llm_api.py runs this block -->\n```python\n"
                  r"(.*?)^```$", text, re.M | re.S)
    assert m, name
    return m[1]


def test_the_vllm_snippet_runs_with_only_the_import_changed():
    code = readme_block("vllm-snippet")
    first, _, rest = code.partition("\n")
    assert first.startswith("from pagedq import LLM, SamplingParams")
    # vLLM's own snippet: the same text with vLLM's import
    assert "from vllm import" not in rest and "dtype='half'" in rest
    out = io.StringIO()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(out):
        warnings.simplefilter("always")
        scope: dict = {}
        exec(compile(code, "README.md:vllm-snippet", "exec"), scope)  # noqa: S102
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines
    for line, prompt in zip(lines, ("Hello, my name is", "The capital of France is"),
                            strict=True):
        m = re.fullmatch(r"Prompt: (.*), Generated text: (.*)", line)
        assert m and m[1] == repr(prompt), line
        assert len(m[2]) > 3, line  # a non-empty repr
    llm = scope["llm"]
    assert str(llm.llm_engine.runner.dtype) == "torch.float16"  # dtype='half'
    for o in scope["outputs"]:
        (c,) = o.outputs
        assert c.token_ids and c.finish_reason in ("stop", "length")
        assert len(c.token_ids) <= 16 and o.prompt_token_ids == llm.get_tokenizer().encode(
            o.prompt)
    trc = [w for w in caught if issubclass(w.category, UserWarning)
           and str(w.message) == TRUST_REMOTE_CODE_WARNING]
    assert len(trc) == 1 and "\n" not in TRUST_REMOTE_CODE_WARNING
    llm.close()


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
    return str(make_tiny_chat_model(tmp_path_factory.mktemp("chat")))


@pytest.fixture(scope="module")
def llm(tiny_chat):
    with LLM(model=tiny_chat, dtype="float32", max_num_seqs=8, seed=3,
             enable_prefix_caching=True, quantization=None, max_model_len=128,
             device="cpu") as m:
        yield m


def test_every_prompt_form_matches_the_engine(llm, tiny_chat):
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    tok = llm.get_tokenizer()
    ids = tok.encode("abc")
    forms = ["abc", ["abc", "xyz"], ids, [ids, tok.encode("xyz")], {"prompt": "abc"},
             {"prompt_token_ids": ids}, [{"prompt": "abc"}, {"prompt_token_ids": ids}]]
    with LLMEngine(tiny_chat, device="cpu", max_model_len=128) as eng:
        want = {p: eng.generate([p], greedy, use_tqdm=False)[0].text for p in ("abc", "xyz")}
    for form in forms:
        outs = llm.generate(form, greedy, use_tqdm=False)
        assert outs and all(o.finished for o in outs), form
        for o in outs:
            text = o.prompt if o.prompt is not None else tok.decode(o.prompt_token_ids)
            assert o.outputs[0].text == want[text], form
            assert o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 6
            assert o.prompt_token_ids == tok.encode(text)
        if form is ids or (isinstance(form, dict) and "prompt_token_ids" in form):
            assert [o.prompt for o in outs] == [None]  # token ids: no text, as vLLM
    assert [o.request_id for o in llm.generate(["a", "b", "c"], greedy, use_tqdm=False)] == \
        ["0", "1", "2"]


def test_chat_renders_the_template_and_n_samples_follow_the_engine(llm):
    chat = [{"role": "user", "content": "hi"}]
    p = SamplingParams(max_tokens=5, temperature=1.0, seed=11, n=3, logprobs=2,
                       ignore_eos=True)
    (o,) = llm.chat(chat, p, use_tqdm=False)
    assert o.prompt == "user: hi\nassistant: "
    assert o.prompt_token_ids == llm.get_tokenizer().encode(o.prompt)
    assert [c.index for c in o.outputs] == [0, 1, 2]
    # sample k draws from seed + k (the engine's rule): the same as one sample of that seed
    for k, c in enumerate(o.outputs):
        one = SamplingParams(max_tokens=5, temperature=1.0, seed=11 + k, logprobs=2,
                             ignore_eos=True)
        (alone,) = llm.generate(chat, one, use_tqdm=False)
        assert alone.outputs[0].token_ids == c.token_ids
        assert len(c.logprobs) == len(c.token_ids) == 5
        for tok, entry in zip(c.token_ids, c.logprobs, strict=True):
            assert tok in entry and 2 <= len(entry) <= 3  # the sampled one and the top 2
            ranks = sorted(lp.rank for lp in entry.values())
            assert ranks[0] >= 1 and all(lp.logprob <= 0 for lp in entry.values())
            assert entry[tok].decoded_token == llm.get_tokenizer().decode([tok])
        assert c.cumulative_logprob == pytest.approx(
            sum(entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs, strict=True)))
    # two chats in one call; generate() takes a chat too
    two = llm.chat([chat, chat + [{"role": "assistant", "content": "yo"}]],
                   SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert [o.prompt.count("\n") for o in two] == [1, 2]
    assert llm.generate(chat, SamplingParams(max_tokens=2, temperature=0),
                        use_tqdm=False)[0].outputs[0].text == two[0].outputs[0].text
    assert o.outputs[0].logprobs is not None
    plain = llm.generate("x", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None


def test_bad_arguments_are_clear_errors(llm, tiny_chat):
    with pytest.raises(TypeError, match="unexpected keyword arguments swap_space"):
        LLM(model=tiny_chat, swap_space=4)
    with pytest.raises(ValueError, match="dtype must be one of"):
        LLM(model=tiny_chat, dtype="float8")
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(model=tiny_chat, quantization="bitsandbytes")
    with pytest.raises(ValueError, match="non-empty list"):
        llm.generate([])
    with pytest.raises(ValueError, match="a prompt is a text"):
        llm.generate([3.5])
    with pytest.raises(ValueError, match="chat\\(\\) takes"):
        llm.chat(["hi"])
    with pytest.raises(ValueError, match="one SamplingParams, or one per prompt"):
        llm.generate(["a", "b"], [SamplingParams()])


def test_llm_and_sampling_params_load_lazily():
    assert {"LLM", "SamplingParams", "LLMEngine"} <= set(pagedq.__all__)
    assert pagedq.LLM is LLM

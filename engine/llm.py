"""``LLM``: vLLM's offline API (``from vllm import LLM``) over ``LLMEngine``, so that vLLM's
snippet runs with only its import changed:

    from pagedq import LLM, SamplingParams

    llm = LLM(model="smollm2", trust_remote_code=True, tensor_parallel_size=1, dtype="half",
              kv_cache_dtype="auto")
    for output in llm.generate(["Hello, my name is"], SamplingParams(max_tokens=32)):
        print(output.prompt, output.outputs[0].text)

Everything runs through ``LLMEngine.generate`` (engine/offline.py): the prompts, the
``n`` samples of a request and their seeds are the engine's; this module only names the
constructor's arguments as vLLM does and shapes the outputs as vLLM's ``RequestOutput``
(``.prompt``, ``.prompt_token_ids``, ``.outputs[i]`` with ``.text``, ``.token_ids``,
``.finish_reason``, ``.logprobs``). pagedq never runs a checkpoint's own code:
``trust_remote_code=True`` is accepted with a warning that it changes nothing.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

from pagedq.engine.config import EngineConfig
from pagedq.engine.llm_engine import LLMEngine
from pagedq.engine.outputs import RequestOutput
from pagedq.engine.sampling_params import SamplingParams

ENGINE_OPTIONS = frozenset(f.name for f in dataclasses.fields(EngineConfig))
TRUST_REMOTE_CODE_WARNING = ("trust_remote_code has no effect: pagedq never runs a "
                             "checkpoint's own code (its models are its own: docs/design.md)")


@dataclass(slots=True)
class Logprob:
    """One token's log probability under the model's raw distribution, its rank (1 = the
    most likely) and its text (vLLM's ``Logprob``)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request (vLLM's ``CompletionOutput``). ``logprobs``: per output
    token, token id -> Logprob of the sampled token and the ``SamplingParams.logprobs``
    most likely ones; None unless asked for."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class LLMOutput:
    """A finished request (vLLM's ``RequestOutput``). ``prompt`` is None for a prompt
    given as token ids; a chat's is its rendered chat template."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True


class LLM:
    """A model loaded for offline generation: vLLM's ``LLM``. Every engine option of
    ``EngineConfig`` (docs/configuration.md) is a keyword argument; ``quantization=None``
    means "as the checkpoint is" (``auto``); ``dtype`` takes ``half``/``float16``,
    ``bfloat16``, ``float``/``float32``, ``auto`` or a torch dtype. Unknown arguments are a
    TypeError naming them. ``close()`` (or ``with LLM(...) as llm:``) frees the device."""

    def __init__(self, model: str = "smollm2", *, tensor_parallel_size: int = 1,
                 dtype: Any = "auto", kv_cache_dtype: str = "auto",
                 gpu_memory_utilization: float = 0.9, max_model_len: int | None = None,
                 max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                 enable_prefix_caching: bool | None = None, quantization: str | None = None,
                 seed: int = 0, trust_remote_code: bool = False, **engine_options: Any) -> None:
        if trust_remote_code:
            warnings.warn(TRUST_REMOTE_CODE_WARNING, UserWarning, stacklevel=2)
        unknown = sorted(set(engine_options) - ENGINE_OPTIONS)
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword arguments {', '.join(unknown)}: "
                            f"pagedq's engine options are {', '.join(sorted(ENGINE_OPTIONS))}")
        named = {"tensor_parallel_size": tensor_parallel_size,
                 "dtype": str(dtype).removeprefix("torch."), "kv_cache_dtype": kv_cache_dtype,
                 "gpu_memory_utilization": gpu_memory_utilization,
                 "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
                 "max_num_batched_tokens": max_num_batched_tokens,
                 "enable_prefix_caching": enable_prefix_caching,
                 "quantization": "auto" if quantization is None else quantization,
                 "seed": seed}
        options = {k: v for k, v in named.items() if v is not None}
        if max_num_seqs is not None and max_num_batched_tokens is None:
            # vLLM's rule: the step's token budget holds at least one token per sequence
            options["max_num_batched_tokens"] = max(max_num_seqs,
                                                    EngineConfig().max_num_batched_tokens)
        self.llm_engine = LLMEngine(model, **options, **engine_options)

    # ---- lifetime --------------------------------------------------------------------
    def close(self) -> None:
        """Free the device now (LLMEngine.close)."""
        self.llm_engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    # ---- generation ------------------------------------------------------------------
    def generate(self, prompts: Any, sampling_params: SamplingParams | list[SamplingParams]
                 | None = None, use_tqdm: bool = True) -> list[LLMOutput]:
        """Outputs in prompt order. ``prompts``: a text, a list of token ids, one chat
        (a list of ``{"role", "content"}`` messages), ``{"prompt": text}`` or
        ``{"prompt_token_ids": ids}``, or a list of any of these. ``sampling_params``: one
        for every prompt, or one per prompt (default: ``SamplingParams()``)."""
        items = [self._prompt(p) for p in _as_list(prompts)]
        done = self.llm_engine.generate([ids for _, ids in items], sampling_params, use_tqdm)
        return [self._output(str(k), text, r) for k, ((text, _), r)
                in enumerate(zip(items, done, strict=True))]

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[LLMOutput]:
        """One chat (a list of messages) or a list of chats, each rendered by the model's
        chat template with the assistant's turn opened, then generated."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("chat() takes a list of messages, or a list of such lists")
        chats = [messages] if _is_chat(messages) else messages
        if not all(_is_chat(c) for c in chats):
            raise ValueError("chat() takes a list of {'role', 'content'} messages, or a list "
                             "of such lists")
        return self.generate(chats, sampling_params, use_tqdm)

    def _prompt(self, p: Any) -> tuple[str | None, list[int]]:
        """(the prompt's text, or None for token ids; its token ids)."""
        eng = self.llm_engine
        if isinstance(p, dict) and "prompt_token_ids" in p:
            return None, eng.encode(p["prompt_token_ids"])
        if isinstance(p, dict) and "prompt" in p:
            p = p["prompt"]
        if isinstance(p, str):
            return p, eng.encode(p)
        if _is_chat(p):
            ids = eng.encode(messages=p)
            return eng.tokenizer.decode(ids), ids
        if isinstance(p, list):
            return None, eng.encode(p)
        raise ValueError(f"a prompt is a text, token ids, a chat or a dict with 'prompt' or "
                         f"'prompt_token_ids', not {type(p).__name__}")

    def _output(self, rid: str, prompt: str | None, r: RequestOutput) -> LLMOutput:
        samples = r.samples or [r]
        return LLMOutput(rid, prompt, list(r.prompt_token_ids),
                         [self._sample(k, s) for k, s in enumerate(samples)])

    def _sample(self, index: int, s: RequestOutput) -> CompletionOutput:
        lps = None
        cumulative = None
        if s.logprobs is not None:
            decode = self.llm_engine.tokenizer.decode
            lps = []
            for tok, lp in zip(s.token_ids, s.logprobs, strict=True):
                entry = {tok: Logprob(lp.logprob, lp.rank, decode([tok]))}
                for rank, (tid, value) in enumerate(lp.top, start=1):
                    entry.setdefault(tid, Logprob(value, rank, decode([tid])))
                lps.append(entry)
            cumulative = sum(lp.logprob for lp in s.logprobs)
        reason = None if s.finish_reason is None else str(s.finish_reason)
        return CompletionOutput(index, s.text, list(s.token_ids), cumulative, lps, reason)


def _is_chat(p: Any) -> bool:
    return isinstance(p, list) and bool(p) and all(
        isinstance(m, dict) and "role" in m for m in p)


def _as_list(prompts: Any) -> list[Any]:
    """The prompts as a list of single prompts: a text, a token-id list, a chat and a dict
    are one prompt each."""
    if isinstance(prompts, str | dict) or _is_chat(prompts):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]
    if isinstance(prompts, list | tuple) and prompts:
        return list(prompts)
    raise ValueError("generate() needs a prompt or a non-empty list of prompts")

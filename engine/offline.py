"""The offline ``generate()`` API, written on LLMEngine's public step API."""
from __future__ import annotations

from typing import Any

from pagedq.engine.errors import EngineClosed
from pagedq.engine.outputs import RequestOutput
from pagedq.engine.sampling_params import SamplingParams, fan_out


class OfflineMixin:
    """``generate()`` for LLMEngine (needs encode, add_request, step, has_unfinished)."""

    def generate(self, prompts: list[str] | list[list[int]] | str,
                 params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order. EngineClosed if the engine
        is closed, before or during the call (close() from another thread)."""
        try:
            return self._generate(prompts, params, use_tqdm)
        except EngineClosed:
            raise EngineClosed("generate") from None

    def _generate(self, prompts, params, use_tqdm: bool) -> list[RequestOutput]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        ids = [f"gen-{i}" for i in range(len(prompts))]
        state: dict[str, dict[str, Any]] = {}
        for rid, prompt, p in zip(ids, prompts, params, strict=True):
            token_ids = self.encode(prompt)
            self.add_request(rid, token_ids, p)
            for sid, _ in fan_out(rid, p):  # the engine's names of its samples
                state[sid] = {"text": [], "ids": [], "lp": [], "reason": None,
                              "prompt": list(token_ids), "plp": None}
        bar = _progress(len(state), use_tqdm)
        while self.has_unfinished():
            for o in self.step():
                st = state.get(o.request_id)
                if st is None:  # a request added through add_request, not ours
                    continue
                st["text"].append(o.delta)
                st["ids"].extend(o.new_token_ids)
                if o.logprobs:
                    st["lp"].extend(o.logprobs)
                if o.prompt_logprobs is not None:
                    st["plp"] = o.prompt_logprobs
                if o.finished:
                    st["reason"] = o.finish_reason
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()

        def out(sid: str) -> RequestOutput:
            st = state[sid]
            return RequestOutput(sid, st["prompt"], "".join(st["text"]), st["ids"],
                                 st["reason"], st["lp"] or None, prompt_logprobs=st["plp"])

        results = []
        for rid, p in zip(ids, params, strict=True):
            if p.n == 1:
                results.append(out(rid))
            else:
                samples = [out(sid) for sid, _ in fan_out(rid, p)]
                first = samples[0]
                results.append(RequestOutput(rid, first.prompt_token_ids, first.text,
                                             first.token_ids, first.finish_reason,
                                             first.logprobs, samples, first.prompt_logprobs))
        return results


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="generate", unit="req")

"""Token sampling for one engine step, vectorised over the batch (vLLM v1 order).

Per row: raw logprobs (log_softmax of the model's logits, what ``params.logprobs`` reports)
-> repetition / presence / frequency penalties -> min_tokens masking of stop ids and EOS
(not EOS under ignore_eos, as vLLM) -> temperature (below ``SAMPLING_EPS``: greedy argmax of
the penalised, masked logits) -> top_k -> top_p -> min_p -> exponential race (Gumbel-max:
argmax(logits - log E), E ~ Exp(1), samples softmax(logits) exactly).

Reproducibility: a seeded row's noise is the counter-based stream ``seeded_uniforms`` keyed by
``row_seed(params.seed, seq.num_output_tokens)``, so the token at output index i is a function
of (seed, i, logits) alone: batch position, other rows, preemption (recompute), crash resume
(``num_output_tokens`` counts resumed output) and CPU vs CUDA (up to float rounding of the
logits) do not change it. Unseeded rows
share one torch generator per device seeded with ``default_seed``.
The input logits are never modified in place.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from engine.sequence import Sequence

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (as vLLM)
_MASK64 = (1 << 64) - 1
_TINY = torch.finfo(torch.float32).tiny  # exponential_ may return 0; log(0) would be -inf
_GAMMA, _C1, _C2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _splitmix64(z: int) -> int:
    z = (z + _GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * _C1) & _MASK64
    z = ((z ^ (z >> 27)) * _C2) & _MASK64
    return z ^ (z >> 31)


def row_seed(seed: int, index: int) -> int:
    """Key (63 bits) of the noise for output index ``index`` of a request seeded with ``seed``."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ index) >> 1


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


def _lsr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical shift right of int64 (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def seeded_uniforms(keys: torch.Tensor, n: int) -> torch.Tensor:
    """float64 [R, n] in (0, 1): the first n SplitMix64 outputs of each int64 key, top 52 bits.

    A counter-based stream in plain int64 torch ops (multiplication wraps mod 2**64), so a
    seeded row's noise is bit-identical on CPU and CUDA, for any batch, with no per-row
    generator launches.
    """
    z = keys.unsqueeze(1) + torch.arange(1, n + 1, device=keys.device) * _signed(_GAMMA)
    z = (z ^ _lsr(z, 30)) * _signed(_C1)
    z = (z ^ _lsr(z, 27)) * _signed(_C2)
    z = z ^ _lsr(z, 31)
    return (_lsr(z, 12).double() + 0.5) * 2.0**-52


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float  # of the sampled token under the raw distribution
    rank: int  # 1 + number of tokens with a strictly larger raw logprob
    top: list[tuple[int, float]]  # the params.logprobs most likely (token_id, logprob), best first


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def apply_penalties(
    logits: torch.Tensor,
    seen: torch.Tensor,
    counts: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """Penalised copy of ``logits`` [R, V].

    ``seen`` bool [R, V]: token occurs in prompt or output (repetition penalty: positive
    logits divided, negative multiplied). ``counts`` [R, V]: occurrences in the output only
    (logit -= frequency * count + presence * (count > 0)). Penalty vectors are [R].
    """
    rep = repetition.unsqueeze(1)
    scaled = torch.where(logits > 0, logits / rep, logits * rep)
    out = torch.where(seen, scaled, logits)
    return out - frequency.unsqueeze(1) * counts - presence.unsqueeze(1) * (counts > 0).to(out.dtype)


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    k_bound: int | None = None,
) -> torch.Tensor:
    """Mask to -inf what top_k [R] (int, V = off) and top_p [R] (> 1 = off) remove.

    Both keep a prefix of the descending order, expressed as a logit threshold, so tokens
    tied with the last kept one are kept too (independent of sort tie-breaking). top_p keeps
    a token iff the probability mass strictly before it (after top_k) is < p. ``k_bound``
    (a Python int >= every top_k) lets top_k rows sort only their k_bound largest logits.
    """
    V = logits.shape[1]
    if top_k is not None and k_bound is not None and k_bound < V:
        srt = logits.topk(k_bound, dim=-1).values
    else:
        srt = logits.sort(dim=-1, descending=True).values
    neg_inf = float("-inf")
    if top_k is not None:
        kth = srt.gather(1, (top_k - 1).clamp(0, srt.shape[1] - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, neg_inf)
        srt = srt.masked_fill(srt < kth, neg_inf)
    if top_p is not None:
        probs = srt.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs
        n_keep = (before < top_p.unsqueeze(1)).sum(dim=1).clamp_min(1)
        cutoff = srt.gather(1, (n_keep - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < cutoff, neg_inf)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Remove tokens with prob < min_p * max prob, i.e. logit < max logit + log(min_p)."""
    thresh = logits.amax(dim=1, keepdim=True) + torch.log(min_p).unsqueeze(1)
    return logits.masked_fill(logits < thresh, float("-inf"))


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: set[int], default_seed: int = 0) -> None:
        if vocab_size < 1:
            raise ValueError("vocab_size must be >= 1")
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(t for t in eos_token_ids if 0 <= t < vocab_size)
        self.default_seed = default_seed
        self._gens: dict[str, torch.Generator] = {}  # unseeded rows' generator, per device
        self._prompt_ids: dict[Sequence, torch.Tensor] = {}

    def _gen(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._gens:
            self._gens[key] = torch.Generator(device=device)
            self._gens[key].manual_seed(self.default_seed)
        return self._gens[key]

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        V = self.vocab_size
        if logits.dim() != 2 or logits.shape[0] != len(seqs) or logits.shape[1] < V:
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(seqs)} rows x {V}")
        raw = logits[:, :V].float()  # columns past vocab_size are lm_head padding
        dev = raw.device

        # per-row parameters (a Python loop over rows only, never over the vocab)
        pen_rows: list[int] = []
        mask_r: list[int] = []
        mask_t: list[int] = []
        rand_rows: list[int] = []
        lp_rows: list[int] = []
        for i, s in enumerate(seqs):
            p = s.params
            if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
                pen_rows.append(i)
            if s.num_output_tokens < p.min_tokens:  # under ignore_eos, EOS stops nothing
                eos = frozenset() if p.ignore_eos else self.eos_token_ids
                banned = eos.union(t for t in p.stop_token_ids if 0 <= t < V)
                mask_r.extend([i] * len(banned))
                mask_t.extend(banned)
            if p.temperature >= SAMPLING_EPS:
                rand_rows.append(i)
            if p.logprobs is not None:
                lp_rows.append(i)

        if not (pen_rows or mask_r or rand_rows):
            tokens = raw.argmax(dim=-1)  # fast path: all greedy, nothing to modify
        else:
            x = raw.clone()
            if pen_rows:
                x[_t(pen_rows, dev)] = self._penalised(x, seqs, pen_rows)
            if mask_r:
                x[_t(mask_r, dev), _t(mask_t, dev)] = float("-inf")
            tokens = x.argmax(dim=-1)
            if rand_rows:
                idx = _t(rand_rows, dev)
                tokens[idx] = self._sample(x[idx], [seqs[i] for i in rand_rows])

        ids = tokens.tolist()
        out_lp: list[TokenLogprobs | None] = [None] * len(seqs)
        if lp_rows:
            self._logprobs(raw, tokens, ids, seqs, lp_rows, out_lp)
        return SamplerOutput(token_ids=ids, logprobs=out_lp)

    def _penalised(self, x: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> torch.Tensor:
        V, dev = self.vocab_size, x.device
        R = len(rows)
        cache: dict[Sequence, torch.Tensor] = {}
        prompts: list[torch.Tensor] = []
        out_ids: list[int] = []
        out_len: list[int] = []
        for i in rows:
            s = seqs[i]
            pr = self._prompt_ids.get(s)
            if pr is None or pr.device != dev:
                pr = _t(s.token_ids[: s.num_prompt_tokens], dev)
            cache[s] = pr
            prompts.append(pr)
            out = s.output_token_ids
            out_ids += out
            out_len.append(len(out))
        # the prompt ids stay on the device while a sequence keeps being penalised
        self._prompt_ids = cache
        prompt_len = [len(t) for t in prompts]
        ar = torch.arange(R, device=dev)
        # flattened (row, token) pairs; ids outside the vocab land in a spare column V that is
        # dropped (a where(), not a boolean mask: no device sync)
        pr_t = _in_vocab(torch.cat(prompts), V)
        pr_r = ar.repeat_interleave(_t(prompt_len, dev))
        out_t = _in_vocab(_t(out_ids, dev), V)
        out_r = ar.repeat_interleave(_t(out_len, dev))
        counts = torch.zeros(R, V + 1, device=dev)
        counts.index_put_((out_r, out_t), torch.ones(1, device=dev), accumulate=True)
        seen = counts > 0
        seen[pr_r, pr_t] = True
        counts, seen = counts[:, :V], seen[:, :V]
        params = [seqs[i].params for i in rows]
        rep = torch.tensor([p.repetition_penalty for p in params], device=dev)
        pres = torch.tensor([p.presence_penalty for p in params], device=dev)
        freq = torch.tensor([p.frequency_penalty for p in params], device=dev)
        return apply_penalties(x[_t(rows, dev)], seen, counts, rep, pres, freq)

    def _sample(self, x: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        V, dev = self.vocab_size, x.device
        ps = [s.params for s in seqs]
        x = x / torch.tensor([p.temperature for p in ps], device=dev).unsqueeze(1)
        ks = [p.top_k if 0 < p.top_k < V else V for p in ps]
        tps = [p.top_p if p.top_p < 1.0 else 2.0 for p in ps]
        sub = [j for j in range(len(ps)) if ks[j] < V or tps[j] <= 1.0]
        if sub:  # only rows that use top_k / top_p pay for the sort
            k_sub, p_sub = [ks[j] for j in sub], [tps[j] for j in sub]
            idx = _t(sub, dev)
            x[idx] = apply_top_k_top_p(
                x[idx],
                _t(k_sub, dev) if min(k_sub) < V else None,
                torch.tensor(p_sub, device=dev) if min(p_sub) <= 1.0 else None,
                k_bound=max(k_sub),
            )
        if any(p.min_p > 0 for p in ps):
            x = apply_min_p(x, torch.tensor([p.min_p for p in ps], device=dev))
        return (x + self._gumbel(seqs, V, dev)).argmax(dim=-1)

    def _gumbel(self, seqs: list[Sequence], V: int, dev: torch.device) -> torch.Tensor:
        """Gumbel noise -log(E), E ~ Exp(1); argmax(logits + noise) samples softmax(logits)."""
        unseeded = [j for j, s in enumerate(seqs) if s.params.seed is None]
        seeded = [j for j, s in enumerate(seqs) if s.params.seed is not None]
        g = torch.empty(len(seqs), V, device=dev)
        if unseeded:
            e = torch.empty(len(unseeded), V, device=dev).exponential_(generator=self._gen(dev))
            g[_t(unseeded, dev)] = e.clamp_min_(_TINY).log_().neg_()
        if seeded:
            keys = [row_seed(seqs[j].params.seed, seqs[j].num_output_tokens) for j in seeded]
            u = seeded_uniforms(_t(keys, dev), V)
            g[_t(seeded, dev)] = u.log_().neg_().float().log_().neg_()
        return g

    def _logprobs(self, raw: torch.Tensor, tokens: torch.Tensor, ids: list[int],
                  seqs: list[Sequence], rows: list[int], out: list[TokenLogprobs | None]) -> None:
        idx = _t(rows, raw.device)
        lp = torch.log_softmax(raw[idx], dim=-1)
        chosen = tokens[idx].unsqueeze(1)
        chosen_lp = lp.gather(1, chosen)
        ranks = ((lp > chosen_lp).sum(dim=1) + 1).tolist()
        chosen_l = chosen_lp.squeeze(1).tolist()
        kmax = min(max(seqs[i].params.logprobs or 0 for i in rows), self.vocab_size)
        top_v: list[list[float]] = [[] for _ in rows]
        top_i: list[list[int]] = [[] for _ in rows]
        if kmax:
            tv, ti = lp.topk(kmax, dim=-1)
            top_v, top_i = tv.tolist(), ti.tolist()
        for j, i in enumerate(rows):
            k = seqs[i].params.logprobs or 0
            top = list(zip(top_i[j][:k], top_v[j][:k], strict=True))
            out[i] = TokenLogprobs(ids[i], chosen_l[j], ranks[j], top)


def _in_vocab(ids: torch.Tensor, V: int) -> torch.Tensor:
    return torch.where((ids >= 0) & (ids < V), ids, V)


def _t(values: list[int], device: torch.device) -> torch.Tensor:
    if len(values) < 512:
        return torch.tensor(values, dtype=torch.long, device=device)
    # array -> frombuffer is ~5x faster than torch.tensor(list) for long token lists
    return torch.frombuffer(array("q", values), dtype=torch.long).to(device)


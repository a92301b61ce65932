"""Device inputs of one step (input ids, positions, slots, attention metadata), built with
as little host work as possible.

Block tables persist on the device: each sequence the runner has seen owns a row of
``self.tables`` [rows, ceil(max_model_len / block_size)] int32, and only block ids
appended since the last step are copied. This relies on an invariant of the block
manager: a ``seq.block_table`` list only grows by appending; freeing a sequence replaces
the list object (so a new list object means "re-sync the whole row"). Rows of sequences
no longer in a batch are reclaimed lazily when the rows run out, so correctness never
depends on being told that a sequence finished. Row contents beyond a sequence's blocks
are stale; the kernels read only the blocks covering seq_lens.

Everything the host computes travels in two pinned buffers (int64, int32) with one
non-blocking copy each, so building a step never waits for the device. The last input
token of a sampling row whose sequence is a row of the step still in flight (its
placeholder, engine/pipeline.py) is gathered on the device from that step's sampled-token
tensor.

Building is two halves: ``pack`` (host only: the arrays and the row bookkeeping) and
``unpack`` (the copies and device work). Tensor parallelism: only the driver packs; it
sends the ``Packed`` step to the other ranks, and every rank unpacks it into its own
``tables`` (so the ranks' tables stay identical: same updates, same growth).
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from pagedq.engine.batch import ScheduledBatch
from pagedq.engine.config import EngineConfig
from pagedq.engine.layers.attention import AttentionMetadata
from pagedq.engine.sequence import Sequence


@dataclass(slots=True)
class Packed:
    """One step's inputs as host arrays (what the driver sends the other ranks).
    big (int64) = ids[T] + positions[T] + slots[T] + sample rows[S] (the sampling rows,
    then the rows of prompt positions scored: engine/prompt_logprobs.py) + table rows[B] +
    table updates' flat indices[U] + placeholder destinations[P] + their sources[P];
    small (int32) = seq_lens[B] + cu_seqlens_q[B+1] + table updates' values[U]."""

    big: array
    small: array
    T: int
    B: int
    S: int
    U: int
    P: int
    max_blocks: int
    max_seqlen_q: int
    num_rows: int  # rows ``tables`` must have (it only grows)


class InputBuilder:
    def __init__(self, device: torch.device, config: EngineConfig, max_model_len: int) -> None:
        self.device = device
        self.config = config  # block_size is read from here
        self.max_model_len = max_model_len
        self.width = -(-max_model_len // config.block_size)
        num_rows = 2 * config.max_num_seqs  # to start with: grows when a batch needs more
        self.num_rows = num_rows  # pack's view; unpack grows ``tables`` to match
        self.tables = torch.zeros(num_rows, self.width, dtype=torch.int32, device=device)
        # seq -> [row, the block_table list object synced, number of its blocks synced]
        self._rows: dict[Sequence, list] = {}
        self._free = list(range(num_rows - 1, -1, -1))

    def _assign(self, seq: Sequence, batch_seqs: list[Sequence]) -> list:
        entry = self._rows.get(seq)
        if entry is not None:  # the sequence got a new block table (preempted, re-admitted)
            entry[1], entry[2] = seq.block_table, 0
            return entry
        if not self._free:
            keep = set(batch_seqs)
            for s in [s for s in self._rows if s not in keep]:
                self._free.append(self._rows.pop(s)[0])
        if not self._free:  # more sequences in one batch than rows: grow (unpack's cat)
            n = self.num_rows
            self.num_rows = 2 * n
            self._free = list(range(2 * n - 1, n - 1, -1))
        entry = self._rows[seq] = [self._free.pop(), seq.block_table, 0]
        return entry

    def build(self, batch: ScheduledBatch, pending: dict[Sequence, int] | None = None,
              prev_tokens: torch.Tensor | None = None):
        """(input_ids [T], positions [T], AttentionMetadata, sample_rows [N]).

        ``pending`` maps each sequence that sampled in the step still in flight to its row
        in ``prev_tokens`` (that step's device tensor): a sampling row whose sequence is
        in it takes its last token from there (the host holds a placeholder)."""
        return self.unpack(self.pack(batch, pending), prev_tokens)

    def pack(self, batch: ScheduledBatch, pending: dict[Sequence, int] | None = None) -> Packed:
        """The host half of ``build``: a placeholder's input id is left as it is on the
        host (``unpack`` overwrites it from the device)."""
        bs, width, max_len = self.config.block_size, self.width, self.max_model_len
        rows = self._rows
        pending_row = pending.get if pending else None
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        lens: list[int] = []
        cu = [0]
        samples: list[int] = []
        row_ids: list[int] = []
        upd_at: list[int] = []  # flat index into self.tables
        upd_val: list[int] = []
        dst: list[int] = []  # input_ids index <- prev_tokens[src]
        src: list[int] = []
        t = max_blocks = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            c, bt, toks = seq.num_computed_tokens, seq.block_table, seq.token_ids
            end = c + n
            if n < 1 or end > len(toks) or end > max_len or len(bt) * bs < end:
                _bad_row(seq, n, bs, max_len)
            if n == 1:  # decode
                ids.append(toks[c])
                pos.append(c)
                slots.append(bt[c // bs] * bs + c % bs)
            else:
                ids += toks[c:end]
                pos += range(c, end)
                slots += [bt[p // bs] * bs + p % bs for p in range(c, end)]
            lens.append(end)
            t += n
            cu.append(t)
            if end == len(toks):
                samples.append(t - 1)
                if pending_row is not None:
                    j = pending_row(seq)
                    if j is not None:
                        dst.append(t - 1)
                        src.append(j)
            entry = rows.get(seq)
            if entry is None or entry[1] is not bt:
                entry = self._assign(seq, batch.seqs)
            r, nb = entry[0], len(bt)
            if nb > entry[2]:
                base = r * width
                upd_at += range(base + entry[2], base + nb)
                upd_val += bt[entry[2]:nb]
                entry[2] = nb
            row_ids.append(r)
            need = (end + bs - 1) // bs
            if need > max_blocks:
                max_blocks = need

        samples += batch.score_rows  # prompt positions scored (engine/prompt_logprobs.py)
        return Packed(array("q", ids + pos + slots + samples + row_ids + upd_at + dst + src),
                      array("i", lens + cu + upd_val), t, len(lens), len(samples), len(upd_at),
                      len(dst), max_blocks, max(batch.num_new_tokens), self.num_rows)

    @torch.inference_mode()  # in-place updates of self.tables, whichever mode made it
    def unpack(self, p: Packed, prev_tokens: torch.Tensor | None = None):
        """The device half of ``build``. Without ``prev_tokens`` (a rank that does not
        sample) placeholder input ids keep their host value: the caller overwrites them."""
        T, B, S, U, P = p.T, p.B, p.S, p.U, p.P
        if self.tables.shape[0] < p.num_rows:
            grow = p.num_rows - self.tables.shape[0]
            self.tables = torch.cat([self.tables, self.tables.new_zeros(grow, self.width)])
        big = self._to_device(p.big, torch.int64)
        small = self._to_device(p.small, torch.int32)
        o = 3 * T
        input_ids, positions, slot_mapping = big[:T], big[T:2 * T], big[2 * T:o]
        sample_rows, row_t = big[o:o + S], big[o + S:o + S + B]
        o += S + B
        if U:
            self.tables.view(-1).index_copy_(0, big[o:o + U], small[2 * B + 1:])
        if P and prev_tokens is not None:
            o += U
            input_ids.index_copy_(0, big[o:o + P], prev_tokens.index_select(0, big[o + P:]))
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=self.tables.index_select(0, row_t)[:, :p.max_blocks],
            seq_lens=small[:B],
            cu_seqlens_q=small[B:2 * B + 1],
            max_seqlen_q=p.max_seqlen_q,
            is_decode_only=T == B,
            positions=positions,
        )
        return input_ids, positions, meta, sample_rows

    def _to_device(self, values: array, dtype: torch.dtype) -> torch.Tensor:
        """One host->device copy; from pinned memory and non-blocking on CUDA."""
        host = torch.frombuffer(values, dtype=dtype) if len(values) else torch.empty(0, dtype=dtype)
        if self.device.type != "cuda":
            return host
        pinned = torch.empty(host.shape, dtype=dtype, pin_memory=True)
        pinned.copy_(host)
        return pinned.to(self.device, non_blocking=True)


def _bad_row(seq: Sequence, n: int, bs: int, max_len: int) -> None:
    c, end = seq.num_computed_tokens, seq.num_computed_tokens + n
    if n < 1 or end > seq.num_tokens:
        raise ValueError(f"{seq.request_id}: cannot compute tokens [{c}, {end}) of "
                         f"{seq.num_tokens}")
    if end > max_len:
        raise ValueError(f"{seq.request_id}: length {end} > max_model_len {max_len}")
    raise ValueError(f"{seq.request_id}: block table covers {len(seq.block_table) * bs} "
                     f"tokens, needs {end}")

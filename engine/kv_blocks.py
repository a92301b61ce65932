"""KV blocks and the O(1) free queue of the block manager (engine/block_manager.py)."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None  # set iff this block is the entry cached[block_hash]
    parent_hash: int | None = None  # stored with token_ids to verify hits
    token_ids: bytes | None = None  # its ids as int64 bytes (block_manager.block_bytes)
    prev: KVBlock | None = None  # free-queue links; both None iff not in the queue
    next: KVBlock | None = None


class FreeBlockQueue:
    """Doubly linked list with sentinels: O(1) append, popleft and remove-from-the-middle."""

    __slots__ = ("head", "tail", "size")

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self.head, self.tail = KVBlock(-1), KVBlock(-1)
        self.head.next, self.tail.prev = self.tail, self.head
        self.size = 0
        for b in blocks:
            self.append(b)

    def __len__(self) -> int:
        return self.size

    def __del__(self) -> None:
        # the links are reference cycles: unlinked here, the blocks go with the queue (its
        # block manager, its engine) by reference counting, not at some later gc pass
        b = self.head
        while b is not None:
            b.prev, b.next, b = None, None, b.next

    def append(self, b: KVBlock) -> None:
        last = self.tail.prev
        b.prev, b.next = last, self.tail
        last.next = self.tail.prev = b
        self.size += 1

    def remove(self, b: KVBlock) -> None:
        if b.prev is None or b.next is None:
            raise RuntimeError(f"block {b.block_id} is not in the free queue")
        b.prev.next, b.next.prev = b.next, b.prev
        b.prev = b.next = None
        self.size -= 1

    def popleft(self) -> KVBlock:
        if not self.size:
            raise RuntimeError("no free KV block")
        b = self.head.next
        self.remove(b)
        return b

    def __iter__(self):
        b = self.head.next
        while b is not self.tail:
            yield b
            b = b.next

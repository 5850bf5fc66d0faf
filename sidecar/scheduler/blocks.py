"""KV block accounting for the reference scheduler: ref-counted blocks and a hash-chained prefix cache.

Plain Python, no MLX. The scheduler owns block ids; the worker only writes K/V where the block
tables it is sent point (docs/protocol.md, execute_model). A block joins the prefix cache once it is full and its
tokens are computed; its hash chains the parent block's hash, so a hit on block i implies the
whole prefix up to block i matches (K/V depends on every earlier token, not just the block's own),
and takes the identifiers of the images inside it, so a hit also implies the same images.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol


class SeqLike(Protocol):
    """What the block manager needs of a sequence (the scheduler's Request provides it)."""

    block_table: list[int]
    block_hashes: list[bytes]  # hashes of the full blocks of known tokens, grown lazily
    num_cached_blocks: int  # leading table entries already registered in the prefix cache
    num_computed_tokens: int

    @property
    def all_token_ids(self) -> list[int]: ...


# An image's placeholder in a prompt: (offset, length, identifier).
Span = tuple[int, int, str]


def hash_block(parent: bytes | None, token_ids: Sequence[int], images: Sequence[str] = ()) -> bytes:
    """`images`: the identifiers of the images whose placeholders overlap the block. Their
    placeholder tokens are the same for every image, so the K/V they hold depends on which image
    (as vLLM's block hashes take the items' hashes as extra keys). A text block hashes as before."""
    # sha256 rather than hash(): a collision would silently serve another prompt's K/V.
    h = hashlib.sha256(parent or b"")
    h.update(array("q", token_ids).tobytes())
    for identifier in images:
        h.update(b"\0image\0" + identifier.encode())
    return h.digest()


def chain_hashes(hashes: list[bytes], tokens: Sequence[int], n: int, block_size: int,
                 spans: Sequence[Span] = ()) -> list[bytes]:
    """Grow `hashes` (a sequence's chained block hashes, in place) to its first n full blocks of
    `tokens`; return those n."""
    while len(hashes) < n:
        lo, hi = len(hashes) * block_size, (len(hashes) + 1) * block_size
        images = [identifier for off, length, identifier in spans if off < hi and off + length > lo]
        hashes.append(hash_block(hashes[-1] if hashes else None, tokens[lo:hi], images))
    return hashes[:n]


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set once full and computed; cleared when evicted for reuse
    token_ids: tuple[int, ...] = ()  # the tokens it was hashed with; hits are checked against them
    parent: bytes | None = None  # the hash of the block before it in its chain (None: a head)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks, evicted from the front. Freed cached blocks go to the back (LRU); empty ones
        # to the front, since reusing them first keeps cached content alive longer.
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[bytes, int] = {}  # block hash -> block id

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_blocks) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------------

    def _hashes(self, seq: SeqLike, n: int) -> list[bytes]:
        """The hashes of seq's first n full blocks (n must not exceed its full blocks of known tokens)."""
        return chain_hashes(seq.block_hashes, seq.all_token_ids, n, self.block_size, getattr(seq, "mm_spans", ()))

    def cached_prefix(self, seq: SeqLike) -> list[int]:
        """Cached blocks holding the longest prefix of seq's known tokens (a lookup: nothing changes).

        Never covers the last known token: at least one token must be computed so the worker
        samples from fresh logits (as vLLM does).
        """
        if not self.enable_prefix_caching:
            return []
        tokens, bs = seq.all_token_ids, self.block_size
        hits: list[int] = []
        for i, h in enumerate(self._hashes(seq, (len(tokens) - 1) // bs)):
            bid = self.cached.get(h)
            if bid is None or self.blocks[bid].token_ids != tuple(tokens[i * bs : (i + 1) * bs]):
                break
            hits.append(bid)
        return hits

    def cache_blocks(self, seq: SeqLike) -> None:
        """Register seq's blocks that are now full and computed, so later sequences can hit them."""
        if not self.enable_prefix_caching:
            return
        n = seq.num_computed_tokens // self.block_size
        if n <= seq.num_cached_blocks:
            return
        hashes, tokens, bs = self._hashes(seq, n), seq.all_token_ids, self.block_size
        for i in range(seq.num_cached_blocks, n):
            block = self.blocks[seq.block_table[i]]
            # Same content computed concurrently by another sequence: keep the first copy only.
            if hashes[i] not in self.cached:
                block.hash, block.token_ids = hashes[i], tuple(tokens[i * bs : (i + 1) * bs])
                block.parent = hashes[i - 1] if i else None
                self.cached[hashes[i]] = block.block_id
        seq.num_cached_blocks = n

    # -- allocation ---------------------------------------------------------------------------

    def _take(self, bid: int) -> None:
        block = self.blocks[bid]
        assert block.hash is not None, f"block {bid} is not cached"
        if block.ref_count == 0:
            del self.free_blocks[bid]
        block.ref_count += 1

    def _pop_free(self, seq: SeqLike | None = None, table: list[int] | None = None) -> int:
        """A free block for entry len(table) of seq's table: the block right after its last one
        when that is free and holds nothing cached, or exactly the tokens seq puts there (the
        same prompt's next block, which a hit stops short of and seq recomputes as it was), so
        a table grows as one run of consecutive ids and the worker reads it in place instead of
        gathering it every step. Otherwise the least recently used free block."""
        if table and table[-1] + 1 < self.num_blocks and table[-1] + 1 in self.free_blocks:
            bid = table[-1] + 1
            nxt = self.blocks[bid]
            if nxt.hash is None or (seq is not None and self._continues(seq, table, nxt)):
                del self.free_blocks[bid]
                return self._claim(bid)
        bid, _ = self.free_blocks.popitem(last=False)
        return self._claim(bid)

    def _continues(self, seq: SeqLike, table: list[int], block: Block) -> bool:
        """Whether cached `block` holds exactly seq's next block: same chain, same tokens."""
        prev = self.blocks[table[-1]].hash
        if prev is None or block.parent != prev:
            return False
        i, bs = len(table), self.block_size
        return block.token_ids == tuple(seq.all_token_ids[i * bs : (i + 1) * bs])

    def _claim(self, bid: int) -> int:
        block = self.blocks[bid]
        if block.hash is not None:  # evict its cached content
            if self.cached.get(block.hash) == bid:
                del self.cached[block.hash]
            block.hash, block.token_ids, block.parent = None, (), None
        block.ref_count = 1
        return bid

    def can_allocate(self, num_tokens: int, cached_blocks: Iterable[int] = ()) -> bool:
        """Whether a table covering num_tokens positions, starting with cached_blocks, fits now."""
        cached_blocks = list(cached_blocks)
        fresh = self.blocks_for(num_tokens) - len(cached_blocks)
        revived = sum(self.blocks[b].ref_count == 0 for b in cached_blocks)  # they leave the free list too
        return fresh + revived <= len(self.free_blocks)

    def allocate(self, seq: SeqLike, num_tokens: int, cached_blocks: Sequence[int] = ()) -> bool:
        """Give a sequence without blocks a table covering num_tokens positions, reusing
        cached_blocks (from cached_prefix) for its prefix. False, and nothing changes, if it doesn't fit."""
        assert not seq.block_table, "sequence already has blocks"
        if not self.can_allocate(num_tokens, cached_blocks):
            return False
        for bid in cached_blocks:  # take the hits first so allocating fresh blocks can't evict them
            self._take(bid)
        fresh = self.blocks_for(num_tokens) - len(cached_blocks)
        table = list(cached_blocks)
        for _ in range(fresh):
            table.append(self._pop_free(seq, table))
        seq.block_table = table
        seq.num_cached_blocks = len(cached_blocks)
        return True

    def append_slots(self, seq: SeqLike, num_new_tokens: int) -> bool:
        """Grow seq's table to cover the positions it writes next. False, nothing changed, if out of blocks."""
        need = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need > len(self.free_blocks):
            return False
        for _ in range(need):
            seq.block_table.append(self._pop_free(seq, seq.block_table))
        return True

    def free(self, seq: SeqLike) -> None:
        # Tail blocks first, so a prompt's later blocks are evicted before its (more shared) head.
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[bid] = None
                if block.hash is None:
                    self.free_blocks.move_to_end(bid, last=False)
        seq.block_table = []
        seq.num_cached_blocks = 0

    def check(self, seqs: Iterable[SeqLike]) -> None:
        """Assert the accounting is consistent with the live sequences' tables (for tests)."""
        refs = [0] * self.num_blocks
        for seq in seqs:
            for bid in seq.block_table:
                refs[bid] += 1
        for block in self.blocks:
            bid = block.block_id
            assert block.ref_count == refs[bid], f"block {bid}: ref count {block.ref_count}, held {refs[bid]} times"
            assert (block.ref_count == 0) == (bid in self.free_blocks), f"block {bid}: free list"
        for h, bid in self.cached.items():
            assert self.blocks[bid].hash == h, f"cache entry for block {bid} is stale"
        assert sum(b.hash is not None for b in self.blocks) == len(self.cached), "hashed blocks not in the cache"

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from sidecar.scheduler.blocks import BlockManager, hash_block


@dataclass(eq=False)
class Seq:
    tokens: list[int]
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    mm_spans: list[tuple[int, int, str]] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        return self.tokens


def computed(bm: BlockManager, tokens: list[int], n: int | None = None) -> Seq:
    """A sequence allocated from scratch whose first n (default all) tokens are computed and registered."""
    seq = Seq(list(tokens))
    assert bm.allocate(seq, len(tokens))  # no prefix lookup: a fresh copy
    seq.num_computed_tokens = len(tokens) if n is None else n
    bm.cache_blocks(seq)
    return seq


def test_allocate_append_free_roundtrip():
    bm = BlockManager(num_blocks=6, block_size=4)
    seq = Seq(list(range(10)))
    assert bm.allocate(seq, 5)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 4
    seq.num_computed_tokens = 5
    assert bm.append_slots(seq, 3)  # positions 5..7 fit in block 1
    assert len(seq.block_table) == 2
    assert bm.append_slots(seq, 4)  # positions 5..8 need a third block
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    bm.check([seq])
    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 6
    bm.check([])


def test_out_of_blocks_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=2)
    a, b = Seq([1, 2, 3, 4]), Seq([5, 6, 7, 8])
    assert bm.allocate(a, 4)
    assert not bm.allocate(b, 3)
    assert b.block_table == [] and bm.num_free_blocks == 1
    a.num_computed_tokens = 4
    assert not bm.append_slots(a, 3)  # needs 2 more blocks, 1 free
    assert len(a.block_table) == 2 and bm.num_free_blocks == 1
    assert bm.append_slots(a, 2)
    assert bm.num_free_blocks == 0
    bm.check([a, b])


def test_prefix_hit_requires_the_whole_chain():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = computed(bm, list(range(12)))
    assert a.num_cached_blocks == 3
    same_head = Seq(list(range(8)) + [99, 98, 97])
    assert bm.cached_prefix(same_head) == a.block_table[:2]
    # Block 1's tokens match but block 0 doesn't: K/V of block 1 depends on block 0, so no hit.
    other_head = Seq([50, 51, 52, 53] + list(range(4, 12)) + [7])
    assert bm.cached_prefix(other_head) == []
    assert hash_block(None, [4, 5, 6, 7]) != hash_block(hash_block(None, [0, 1, 2, 3]), [4, 5, 6, 7])


def test_image_blocks_hash_their_images_and_text_before_them_is_shared():
    """Blocks overlapping an image's placeholder take its identifier: the same placeholder tokens
    with another image are no hit; the text before the first image is (as vLLM's block hashes)."""
    bm = BlockManager(num_blocks=32, block_size=4)
    tokens = [1, 2, 3, 4, 5, 9, 9, 9, 9, 9, 6, 7, 8, 10, 11]  # the image at [5, 10): blocks 1 and 2
    a = Seq(list(tokens), mm_spans=[(5, 5, "sea")])
    assert bm.allocate(a, len(tokens))
    a.num_computed_tokens = len(tokens)
    bm.cache_blocks(a)
    assert bm.cached_prefix(Seq(list(tokens), mm_spans=[(5, 5, "sea")])) == a.block_table[:3]
    assert bm.cached_prefix(Seq(tokens[:13] + [0, 0], mm_spans=[(5, 5, "sea")])) == a.block_table[:3]
    assert bm.cached_prefix(Seq(list(tokens), mm_spans=[(5, 5, "storm")])) == a.block_table[:1]
    assert bm.cached_prefix(Seq(list(tokens))) == a.block_table[:1]  # the same tokens without the image
    assert hash_block(None, [9] * 4, ["sea"]) != hash_block(None, [9] * 4, ["storm"]) != hash_block(None, [9] * 4)
    assert hash_block(None, [1, 2]) == hash_block(None, [1, 2], [])  # text blocks hash as they always did


def test_hit_never_covers_the_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = computed(bm, list(range(8)))
    assert bm.cached_prefix(Seq(list(range(8)))) == a.block_table[:1]  # 8 known tokens: 4 hit, 4 computed
    assert bm.cached_prefix(Seq(list(range(8)) + [0])) == a.block_table[:2]  # 9: 8 hit, 1 computed
    assert bm.cached_prefix(Seq(list(range(4)))) == []


def test_only_full_computed_blocks_are_cached():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = computed(bm, list(range(12)), n=7)  # block 1 is full of known tokens but only 3/4 computed
    assert a.num_cached_blocks == 1
    assert bm.cached_prefix(Seq(list(range(12)) + [1])) == a.block_table[:1]
    a.num_computed_tokens = 8
    bm.cache_blocks(a)
    assert bm.cached_prefix(Seq(list(range(12)) + [1])) == a.block_table[:2]
    bm.check([a])


def test_caching_disabled_never_hits():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    computed(bm, list(range(12)))
    assert bm.cached_prefix(Seq(list(range(12)) + [1])) == []
    assert bm.cached == {}


def test_shared_blocks_are_refcounted():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = computed(bm, list(range(9)))
    b = Seq(list(range(8)) + [42, 43])
    hits = bm.cached_prefix(b)
    assert hits == a.block_table[:2]
    assert bm.allocate(b, 10, hits)
    assert b.block_table[:2] == hits and b.num_cached_blocks == 2
    assert bm.blocks[hits[0]].ref_count == 2
    bm.check([a, b])
    bm.free(a)
    assert all(bid not in bm.free_blocks for bid in hits)  # b still holds them
    bm.check([b])
    bm.free(b)
    assert bm.num_free_blocks == 8
    bm.check([])


def test_can_allocate_counts_revived_free_hits():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = computed(bm, [1, 2, 3, 4])
    bm.free(a)  # its 2 blocks stay cached, on the free list
    b = Seq([1, 2, 3, 4, 5, 6, 7])
    hits = bm.cached_prefix(b)
    assert len(hits) == 2 and bm.num_free_blocks == 4
    assert bm.can_allocate(8, hits)  # 2 revived + 2 fresh = the 4 free blocks
    assert not bm.can_allocate(9, hits)  # 2 revived + 3 fresh
    assert not bm.allocate(b, 9, hits) and b.block_table == []
    assert bm.allocate(b, 8, hits)
    assert bm.num_free_blocks == 0
    bm.check([b])


def test_duplicate_content_is_cached_once():
    bm = BlockManager(num_blocks=8, block_size=2)
    a = computed(bm, [1, 2, 3])
    b = computed(bm, [1, 2, 3])  # computed concurrently: no hit, same content
    assert len(bm.cached) == 1 and bm.cached[a.block_hashes[0]] == a.block_table[0]
    bm.check([a, b])
    bm.free(a)
    bm.free(b)
    bm.check([])
    assert bm.num_free_blocks == 8


def test_eviction_is_lru_with_empty_blocks_first_and_tails_before_heads():
    bm = BlockManager(num_blocks=6, block_size=2)
    old = computed(bm, [1, 2, 3, 4])  # 2 cached blocks
    new = computed(bm, [5, 6, 7, 8, 9])  # 2 cached blocks + a partial one
    old_t, new_t = list(old.block_table), list(new.block_table)
    bm.free(old)
    bm.free(new)
    # Front: new's partial block and the never-used one; then old (tail, head), then new (tail, head).
    assert list(bm.free_blocks) == [new_t[2], 5, old_t[1], old_t[0], new_t[1], new_t[0]]
    probe_old = Seq([1, 2, 3, 4, 0])
    probe_new = Seq([5, 6, 7, 8, 0])
    taker = Seq(list(range(100, 110)))
    assert bm.allocate(taker, 4)  # the 2 empty blocks: no cached content lost
    assert len(bm.cached_prefix(probe_old)) == 2 and len(bm.cached_prefix(probe_new)) == 2
    taker.num_computed_tokens = 4
    assert bm.append_slots(taker, 2)  # evicts old's tail block, the least recently used
    assert len(bm.cached_prefix(probe_old)) == 1 and len(bm.cached_prefix(probe_new)) == 2
    assert bm.append_slots(taker, 6)  # then old's head, then new's tail
    assert bm.cached_prefix(probe_old) == [] and len(bm.cached_prefix(probe_new)) == 1
    bm.check([taker])


def test_evicted_block_is_reused_clean():
    bm = BlockManager(num_blocks=2, block_size=2)
    a = computed(bm, [1, 2, 3, 4])
    bm.free(a)
    b = Seq([9, 9, 9, 9])
    assert bm.allocate(b, 4)  # evicts both cached blocks
    assert bm.cached == {} and all(blk.hash is None for blk in bm.blocks)
    assert bm.cached_prefix(Seq([1, 2, 3, 4, 5])) == []
    bm.check([b])


def test_check_catches_inconsistency():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = Seq([1, 2, 3])
    assert bm.allocate(a, 3)
    with pytest.raises(AssertionError):
        bm.check([])  # a's blocks are unaccounted for: a leak
    bm.blocks[a.block_table[0]].ref_count += 1
    with pytest.raises(AssertionError):
        bm.check([a])


def test_rejects_bad_sizes():
    with pytest.raises(ValueError):
        BlockManager(0, 4)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


def test_hash_collision_is_not_a_hit(monkeypatch):
    import sidecar.scheduler.blocks as blocks

    monkeypatch.setattr(blocks, "hash_block", lambda parent, token_ids, images=(): b"same")  # every block collides
    bm = BlockManager(num_blocks=8, block_size=2)
    a = computed(bm, [1, 2, 3])
    assert bm.cached_prefix(Seq([1, 2, 3])) == a.block_table[:1]
    assert bm.cached_prefix(Seq([4, 5, 6])) == []  # same hash, other tokens


def test_tables_grow_as_runs_without_evicting_other_content():
    """A table takes the block after its last one when that holds nothing cached, or exactly its
    own next block (a hit stops short of the last token); never another sequence's content."""
    bm = BlockManager(num_blocks=16, block_size=2)
    a = computed(bm, [1, 2, 3, 4, 5, 6, 7, 8])  # blocks 0-3, all cached
    assert a.block_table == [0, 1, 2, 3]
    bm.free(a)
    # The same prompt again: the hit covers 3 blocks (never the last token); its 4th block is
    # the cached copy of itself right after them (LRU order would give the never-used 4).
    b = Seq([1, 2, 3, 4, 5, 6, 7, 8])
    hits = bm.cached_prefix(b)
    assert hits == [0, 1, 2]
    assert bm.allocate(b, 8, hits) and b.block_table == [0, 1, 2, 3]
    b.num_computed_tokens = 8
    assert bm.append_slots(b, 3) and b.block_table == [0, 1, 2, 3, 4, 5]  # never used: next in line
    bm.check([b])
    bm.free(b)
    # Same chain, other tokens (a sibling branch): that cached block is left alone.
    c = Seq([1, 2, 3, 4, 9, 9, 9, 9])
    hits = bm.cached_prefix(c)
    assert hits == [0, 1]
    assert bm.allocate(c, 8, hits)
    assert c.block_table[2] != 2 and len(bm.cached_prefix(Seq([1, 2, 3, 4, 5, 6, 0]))) == 3
    bm.check([c])

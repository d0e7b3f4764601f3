"""Block pool and KV-cache manager: allocation, ref counts, prefix hits, LRU, sharing."""

from __future__ import annotations

from jaxserve.engine.kv_cache import NONE_HASH, BlockPool, KVCacheManager, hash_block
from jaxserve.engine.request import Request, Sequence
from jaxserve.sampling_params import SamplingParams


def make_seq(tokens: list[int], seq_id: str = "r", salt: str | None = None) -> Sequence:
    request = Request(seq_id, None, tokens, SamplingParams(), 0.0, cache_salt=salt)
    seq = Sequence(seq_id, request, 0, seed=0)
    request.seqs.append(seq)
    return seq


def test_pool_allocates_and_frees_with_ref_counts() -> None:
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert pool.num_free == 1 and all(pool.ref_counts[b] == 1 for b in a)
    pool.touch(a[0])
    pool.release(a)
    assert pool.num_free == 3 and pool.ref_counts[a[0]] == 1
    pool.release([a[0]])
    assert pool.num_free == 4


def test_hash_chain_depends_on_parent_tokens_and_salt() -> None:
    h1 = hash_block(NONE_HASH, [1, 2])
    assert h1 == hash_block(NONE_HASH, [1, 2])
    assert h1 != hash_block(NONE_HASH, [1, 3])
    assert hash_block(h1, [5, 6]) != hash_block(hash_block(NONE_HASH, [1, 3]), [5, 6])
    assert h1 != hash_block(NONE_HASH, [1, 2], "tenant-a")
    assert len(h1) == 32  # SHA-256


def test_prefix_hit_reuses_blocks_and_keeps_last_token_uncomputed() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    first = make_seq(list(range(12)), "a")
    assert kv.allocate(first, 12)
    kv.free(first)
    # Same 12 tokens: only 2 full blocks may hit (the last token is always recomputed).
    second = make_seq(list(range(12)), "b")
    hits = kv.find_cached_prefix(second)
    assert len(hits) == 2
    assert kv.prefix_hits == 8 and kv.prefix_queries == 12
    # A longer prompt sharing the first 8 tokens hits 2 blocks; a different one hits none.
    assert len(kv.find_cached_prefix(make_seq(list(range(8)) + [99] * 8, "c"))) == 2
    assert kv.find_cached_prefix(make_seq([7] * 12, "d")) == []
    # A tenant salt separates caches.
    assert kv.find_cached_prefix(make_seq(list(range(12)), "e", salt="t1")) == []


def test_hit_blocks_are_taken_out_of_the_free_list() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    a = make_seq(list(range(9)), "a")
    assert kv.allocate(a, 9)  # 3 blocks
    kv.free(a)
    assert kv.pool.num_free == 4
    b = make_seq(list(range(9)), "b")
    hits = kv.find_cached_prefix(b)
    assert len(hits) == 2
    assert kv.allocate(b, 1, hits)  # the last token goes into a fresh third block
    assert kv.pool.num_free == 1
    assert b.block_ids[:2] == hits


def test_lru_evicts_least_recently_freed_first() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=2, enable_prefix_caching=True)
    a, b = make_seq([1, 2, 3], "a"), make_seq([5, 6, 7], "b")
    assert kv.allocate(a, 3) and not kv.allocate(b, 3)
    kv.free(a)
    assert kv.allocate(b, 3)  # evicts a's blocks
    kv.free(b)
    assert kv.find_cached_prefix(make_seq([1, 2, 3], "a2")) == []
    assert len(kv.find_cached_prefix(make_seq([5, 6, 7], "b2"))) == 1


def test_allocation_fails_without_side_effects() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    seq = make_seq(list(range(12)))
    assert not kv.allocate(seq, 12)
    assert seq.block_ids == [] and kv.pool.num_free == 2


def test_share_prefix_is_copy_on_write_of_full_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    parent = make_seq(list(range(10)), "p")
    assert kv.allocate(parent, 10)  # 3 blocks, the last one partial
    child = Sequence("p#1", parent.request, 1, seed=1)
    shared = kv.share_prefix(child, parent)
    assert shared == 8 and child.block_ids == parent.block_ids[:2]
    assert all(kv.pool.ref_counts[b] == 2 for b in child.block_ids)
    child.num_computed_tokens = shared
    assert kv.allocate(child, 2)  # its own copy of the partial block
    assert child.block_ids[2] != parent.block_ids[2]
    kv.free(parent)
    kv.free(child)
    assert kv.pool.num_free == 8

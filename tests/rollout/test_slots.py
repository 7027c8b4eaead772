"""SlotPool: which KV-cache slots are free, and which finished ones hold a sequence worth reusing (the native
engine's prefix cache; tests/rollout/test_prefix_cache.py runs it inside the engine)."""

from __future__ import annotations

from relayrl.rollout import slots
from relayrl.rollout.slots import PREFIX_STRIDE, SlotPool, prefix_hashes


def test_prefix_hashes_are_the_documented_polynomial():
    # h[L] = h[L-1] * 1_000_003 + token + 1 (masked to 60 bits), h[0] = 0
    assert prefix_hashes([1, 2, 3], 2) == [0, 2, 2 * 1_000_003 + 3]
    assert prefix_hashes([1, 2, 3], 0) == [0]
    big = prefix_hashes([2**40] * 3, 3)[-1]
    assert 0 <= big <= 0xFFFFFFFFFFFFFFF
    assert prefix_hashes([0], 1) != prefix_hashes([1], 1)  # token 0 still moves the hash (+1)


def test_slot_pool_bookkeeping():
    pool = SlotPool(3, min_prefix_tokens=4)
    a, b, c = pool.take(), pool.take(), pool.take()
    assert (a, b, c) == (0, 1, 2) and pool.available() == 0
    seq = list(range(100, 130))  # 30 tokens
    pool.park(b, seq)
    pool.park(a, [7, 7, 7])  # shorter than min_prefix_tokens: freed, not parked
    assert pool.available() == 2 and list(pool.parked) == [b]
    # a next turn extends the whole parked sequence: all of it is reused
    assert pool.match([*seq, 1, 2, 3]) == (b, len(seq))
    # a repeat of a prefix: the longest indexed length below the prompt's last token
    hit = pool.match(seq[:21])
    assert hit is not None and hit[0] == b and 20 - PREFIX_STRIDE < hit[1] <= 20
    assert pool.match([100, 101, 102, 999, 104]) is None  # diverges before min_prefix_tokens
    assert pool.match([5, *seq]) is None
    # empty slots first (lowest id), then the least recently parked one
    pool.park(c, list(range(200, 210)))
    assert pool.take() == a
    assert pool.take() == b and pool.match([*seq, 1]) is None  # evicted: no longer matched
    pool.drop_parked()
    assert not pool.parked and not pool.index and pool.free == [c]


def test_indexed_lengths_are_every_stride_from_the_minimum_and_the_full_length():
    pool = SlotPool(2, min_prefix_tokens=4)
    assert PREFIX_STRIDE == 8
    assert pool._lengths(21) == [4, 12, 20, 21]
    assert pool._lengths(20) == [4, 12, 20]
    assert pool._lengths(3) == []  # shorter than the minimum: nothing indexed


def test_a_match_leaves_at_least_one_prompt_token_to_prefill():
    pool = SlotPool(1, min_prefix_tokens=2)
    slot = pool.take()
    pool.park(slot, [5, 6, 7, 8])
    # indexed lengths 2 and 4; the prompt's last token must be prefilled (its logits sample the next one)
    assert pool.match([5, 6, 7, 8, 9]) == (slot, 4)
    assert pool.match([5, 6, 7, 8]) == (slot, 2)  # 4 would leave nothing to prefill, 3 is not indexed
    assert pool.match([5, 6]) is None  # m = 1 < min_prefix_tokens


def test_a_hash_collision_is_caught_by_comparing_the_tokens(monkeypatch):
    monkeypatch.setattr(slots, "prefix_hashes", lambda tokens, upto: [0] * (min(upto, len(tokens)) + 1))
    pool = SlotPool(2, min_prefix_tokens=2)
    slot = pool.take()
    pool.park(slot, [1, 2, 3])
    assert pool.match([9, 9, 9, 9]) is None  # every hash collides, no token matches
    assert pool.match([1, 2, 3, 4]) == (slot, 3)


def test_with_the_cache_off_a_finished_slot_is_freed():
    pool = SlotPool(2, prefix_cache=False, min_prefix_tokens=1)
    a = pool.take()
    pool.park(a, list(range(50)))
    assert not pool.parked and not pool.index and sorted(pool.free) == [0, 1]
    assert pool.match(list(range(60))) is None


def test_claiming_one_of_two_slots_with_the_same_prefix_keeps_the_other_indexed():
    pool = SlotPool(2, min_prefix_tokens=2)
    a, b = pool.take(), pool.take()
    pool.park(a, [1, 2, 3, 4])
    pool.park(b, [1, 2, 3, 9])
    assert pool.index[(2, prefix_hashes([1, 2], 2)[2])] == {a, b}
    pool.claim(a)
    assert pool.match([1, 2, 3, 4, 5]) == (b, 2)  # the shared length-2 prefix, now only in b
    assert list(pool.parked) == [b] and pool.available() == 1

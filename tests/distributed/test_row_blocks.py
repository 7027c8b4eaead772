"""How many objects the driver puts a record's rows in (relayrl.distributed.launch.rows.block_rows): at most
MAX_BLOCKS, and no fewer than MIN_BLOCK_BYTES of rows each, so a step's few MB go in a handful of `ray.put`
calls (each has a fixed cost) while a big record still splits into 64 blocks (a rank over-reads at most two)."""

from __future__ import annotations

from relayrl.distributed.launch import rows


def _blocks(n: int, row_bytes: int = 0) -> int:
    per = rows.block_rows(n, row_bytes=row_bytes)
    return -(-n // per)


def test_blocks_are_at_least_a_mib_and_at_most_64():
    assert rows.MIN_BLOCK_BYTES == 2**20 and rows.MAX_BLOCKS == 64
    assert _blocks(1024) == 64 and rows.block_rows(1024) == 16  # no byte count: the row rule alone
    # the batch of a 1,024-sample step 276 tokens wide (int64 ids, bool masks, fp32 log-probs: 14 B a token)
    assert _blocks(1024, 276 * 14) == 3
    assert _blocks(1024, 276 * 4) == 1  # the experience's own fields (advantages [B, T] fp32): 1.1 MB
    assert _blocks(2048, 276 * 14) == 7
    assert _blocks(7, 10) == 1 and rows.block_rows(7, row_bytes=10) == 7  # a tiny record: one object
    assert _blocks(100_000, 32_768 * 14) == 64  # 45 GB: the 64-object cap, as before
    assert _blocks(50, 2**21) == 50  # rows bigger than the floor: one object each, up to 64


def test_no_floor_keeps_the_row_rule(monkeypatch):
    monkeypatch.setattr(rows, "MIN_BLOCK_BYTES", 0)
    assert rows.block_rows(1024, row_bytes=276 * 14) == 16 and rows.block_rows(150, row_bytes=202) == 3

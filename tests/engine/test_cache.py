"""Static KV cache: sizes, explicit-position writes, position masks, the windowed ring buffer."""

from __future__ import annotations

import torch

from engine.cache import KVCache, WindowedKVCache, visibility_mask
from engine.scheduler import DecodeEngine


def test_bytes_per_token(tiny_target):
    args = tiny_target.args  # 4 layers, 2 KV heads, head_dim 16
    cache = tiny_target.model.new_cache(3, 40)
    assert cache.bytes_per_token == 2 * 4 * 2 * 16 * 4 == args.kv_bytes_per_token(4)
    assert cache.nbytes == cache.bytes_per_token * 3 * 40
    half = KVCache(4, 3, 2, 40, 16, dtype=torch.bfloat16)
    assert half.bytes_per_token * 2 == cache.bytes_per_token
    eng = DecodeEngine(tiny_target.model, None, max_batch_size=2, max_seq_len=64)
    report = eng.memory_report()
    assert report["target_cache_bytes_per_token"] == cache.bytes_per_token
    assert report["target_cache"] == eng.cache.nbytes >= cache.bytes_per_token * 2 * 64
    assert report["draft_cache"] == 0


def test_write_at_explicit_positions_of_chosen_rows():
    cache = KVCache(1, 3, 2, 10, 4)
    k = torch.arange(2 * 2 * 3 * 4, dtype=torch.float32).view(2, 2, 3, 4)  # (B=2, H, T=3, D)
    pos = torch.tensor([[0, 1, 2], [5, 6, 7]])
    rows = torch.tensor([2, 0])
    cache.write(0, rows, pos, k, -k)
    assert torch.equal(cache.k[0][2, :, 0:3], k[0]) and torch.equal(cache.k[0][0, :, 5:8], k[1])
    assert torch.equal(cache.v[0][0, :, 5:8], -k[1])
    assert cache.k[0][1].abs().sum() == 0  # untouched row
    keys, values = cache.read(0, rows, 8)
    assert keys.shape == (2, 2, 8, 4) and torch.equal(keys[1, :, 5:8], k[1])


def test_reading_chosen_rows_gives_the_same_views_short_or_long():
    """Row sets read through index_select (most of the row wanted) or a gather (a short prefix): same values."""
    cache = KVCache(2, 5, 2, 10, 4)
    for layer in range(2):
        cache.k[layer].copy_(torch.randn(5, 2, 10, 4))
        cache.v[layer].copy_(torch.randn(5, 2, 10, 4))
    rows = torch.tensor([3, 0, 4])
    for kv_len in (2, 4, 5, 9, 10):  # below and at or above half the row
        keys, values = cache.read(1, rows, kv_len)
        assert torch.equal(keys, cache.k[1][[3, 0, 4], :, :kv_len])
        assert torch.equal(values, cache.v[1][[3, 0, 4], :, :kv_len])


def test_visibility_is_by_position():
    mask = visibility_mask(torch.tensor([[3, 4], [0, 1]]), 6)  # (B, 1, T, S)
    assert mask.shape == (2, 1, 2, 6)
    assert mask[0, 0, 0].tolist() == [True] * 4 + [False] * 2
    assert mask[0, 0, 1].tolist() == [True] * 5 + [False]
    assert mask[1, 0, 0].tolist() == [True] + [False] * 5


def _visible_positions(cache: WindowedKVCache, mask_row: torch.Tensor, row: int) -> list[int]:
    """Positions whose keys a query sees: read back from the keys themselves (key value = its position)."""
    keys, _ = cache.read(0, torch.tensor([row]), 0)
    return sorted(int(keys[0, 0, s, 0]) for s in range(cache.max_seq_len) if mask_row[s])


def _write_positions(cache: WindowedKVCache, row: int, positions: list[int]) -> torch.Tensor:
    pos = torch.tensor([positions])
    mask = cache.visibility(pos, torch.tensor([row]), 0)
    k = pos.float()[:, None, :, None].expand(1, 1, len(positions), 2)  # key value = position
    cache.write(0, torch.tensor([row]), pos, k, k)
    return mask


def test_windowed_cache_shows_only_the_last_window_positions():
    window, slack = 4, 3
    cache = WindowedKVCache(1, 2, 1, window, 2, slack)
    assert cache.max_seq_len == window + slack
    for q in range(20):  # decode one position at a time, on row 1
        mask = _write_positions(cache, 1, [q])
        assert _visible_positions(cache, mask[0, 0, 0], 1) == list(range(max(0, q - window + 1), q + 1)), q
    # A speculative pass writing 3 positions at once: each query sees its own window.
    mask = _write_positions(cache, 1, [20, 21, 22])
    for t, q in enumerate((20, 21, 22)):
        assert _visible_positions(cache, mask[0, 0, t], 1) == list(range(q - window + 1, q + 1))
    # Row 0 was never written: nothing visible there but its own new position.
    mask = _write_positions(cache, 0, [0])
    assert _visible_positions(cache, mask[0, 0, 0], 0) == [0]


def test_windowed_cache_rollback_rewrites_positions():
    cache = WindowedKVCache(1, 1, 1, 4, 2, 3)
    for q in range(10):
        _write_positions(cache, 0, [q])
    # Positions 8, 9 were speculative and rejected: 8 is written again with new keys (value 8 again, then 108).
    pos = torch.tensor([[8]])
    mask = cache.visibility(pos, torch.tensor([0]), 0)
    cache.write(0, torch.tensor([0]), pos, torch.full((1, 1, 1, 2), 108.0), torch.zeros(1, 1, 1, 2))
    assert _visible_positions(cache, mask[0, 0, 0], 0) == [5, 6, 7, 108]  # 9 (stale, in the future) is hidden


def test_windowed_cache_long_prefill_keeps_the_last_positions():
    """One pass over more positions than the ring holds (a prompt longer than window + slack)."""
    cache = WindowedKVCache(1, 1, 1, 4, 2, 2)
    mask = _write_positions(cache, 0, list(range(15)))
    assert _visible_positions(cache, mask[0, 0, 14], 0) == [11, 12, 13, 14]
    mask = _write_positions(cache, 0, [15])
    assert _visible_positions(cache, mask[0, 0, 0], 0) == [12, 13, 14, 15]


def test_reset_forgets_the_row():
    cache = WindowedKVCache(1, 2, 1, 4, 2, 2)
    for q in range(6):
        _write_positions(cache, 0, [q])
        _write_positions(cache, 1, [q])
    cache.reset(torch.tensor([0]))
    assert (cache.slot_pos[0] == -1).all() and (cache.slot_pos[1] >= 0).any()
    assert cache.lengths[0] == 0


def test_to_device_gives_the_host_numbers_in_the_dtype_asked():
    from engine.cache import to_device

    got = to_device([[3, 1], [4, 1]], "cpu")
    assert got.dtype == torch.long and got.tolist() == [[3, 1], [4, 1]]
    half = to_device([0.5, 2.0], torch.device("cpu"), torch.float32)
    assert half.dtype == torch.float32 and half.tolist() == [0.5, 2.0]

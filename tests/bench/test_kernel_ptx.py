"""bench.kernel_ptx: the engine's Triton kernels compiled for a GPU on this machine (where triton is installed)."""

import pytest

pytest.importorskip("triton")

from bench import kernel_ptx  # noqa: E402


def test_attention_tiles_of_64_rows_take_wgmma_on_hopper_and_smaller_ones_mma_sync():
    rows = kernel_ptx.attention_tiles(90, (1, 16), group=3)
    assert [(r["tokens"], r["BLOCK_M"]) for r in rows] == [(1, 16), (16, 64)]
    assert rows[0]["wgmma"] == 0 and rows[0]["mma_sync"] > 0
    assert rows[1]["wgmma"] > 0 and rows[1]["mma_sync"] == 0
    packed = kernel_ptx.attention_tiles(80, (13,), group=3, packed=True)[0]  # no wgmma before Hopper
    assert packed["packed"] and packed["wgmma"] == 0 and packed["mma_sync"] > 0


def test_two_warps_keep_a_64_row_attention_tile_on_mma_sync():
    """With 2 warps (`wide_warps`) a tile of over 32 rows is too few warps for a warpgroup's wgmma."""
    rows = kernel_ptx.attention_tiles(90, (6, 16), group=3, wide_warps=2)
    assert [(r["BLOCK_M"], r["warps"]) for r in rows] == [(32, 4), (64, 2)]
    assert all(r["wgmma"] == 0 and r["mma_sync"] > 0 for r in rows)


def test_cache_kernels_compile_and_a_hash_names_their_instructions():
    rows = kernel_ptx.cache_kernels(90)
    assert [r["kernel"] for r in rows] == ["kv_write", "rope_kv_write", "step_context"]
    assert all(r["instructions"] > 50 and r["cubin_bytes"] > 0 and len(r["instructions_sha256"]) == 16 for r in rows)
    assert kernel_ptx.cache_kernels(90) == rows  # the same source compiles to the same instructions

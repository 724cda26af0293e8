"""bench.tile_bits needs a GPU; here: its refusal without one, and the warps setting it varies."""

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gets")
def test_without_cuda_it_names_the_gpu_machine():
    from bench import tile_bits

    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        tile_bits.main(["--tokens", "1"])


def test_the_warps_it_varies_reach_the_kernels_tiles():
    """The tool measures other warps of tiles over 32 rows by overriding `WIDE_WARPS`; tiles of 32 rows or fewer
    keep 4."""
    import engine.triton_attention as ta
    from bench.round_profile import overridden

    assert [ta.tile(rows) for rows in (3, 18, 48)] == [(16, 4), (32, 4), (64, 4)]
    with overridden(ta, WIDE_WARPS=2):
        assert [ta.tile(rows) for rows in (3, 18, 48)] == [(16, 4), (32, 4), (64, 2)]
    assert ta.tile(48) == (64, 4)

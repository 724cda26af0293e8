"""bench.tile_bits needs a GPU; here: its refusal without one, and the warps setting it varies."""

import importlib

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gets")
def test_without_cuda_it_names_the_gpu_machine():
    from bench import tile_bits

    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        tile_bits.main(["--tokens", "1"])


def test_the_wide_tiles_warps_come_from_the_environment_and_bad_values_are_refused(monkeypatch):
    import engine.triton_attention as ta

    try:
        monkeypatch.setenv("FLASHSPEC_ATTN_WIDE_WARPS", "2")
        assert importlib.reload(ta).WIDE_WARPS == 2
        monkeypatch.setenv("FLASHSPEC_ATTN_WIDE_WARPS", "3")
        with pytest.raises(ValueError, match="FLASHSPEC_ATTN_WIDE_WARPS='3'.*1, 2, 4 or 8"):
            importlib.reload(ta)
    finally:
        monkeypatch.delenv("FLASHSPEC_ATTN_WIDE_WARPS", raising=False)
        assert importlib.reload(ta).WIDE_WARPS == 4

"""bench.head_split: three bf16 parts carry an fp32 vector exactly enough for an fp32-accurate product."""

from __future__ import annotations

import pytest
import torch

from bench.head_split import main, split


def test_three_bf16_parts_rebuild_fp32_and_give_its_product():
    torch.manual_seed(0)
    x = torch.randn(6, 576) * 3
    w = (torch.randn(1000, 576) * 0.05).to(torch.bfloat16)
    parts = split(x, 3)
    assert all(p.dtype == torch.bfloat16 for p in parts)
    rebuilt = sum(p.double() for p in parts)
    assert (rebuilt - x.double()).abs().max() <= 2.0**-24 * x.abs().max()  # fp32's last bit, about
    assert (split(x, 1)[0].double() - x.double()).abs().max() > 1e-3  # one part alone is bf16's 8 bits
    ref = x.double() @ w.double().t()
    three = sum(p.float() @ w.float().t() for p in parts)  # the GEMM's fp32 accumulation, on the CPU
    assert (three.double() - ref).abs().max() < 1e-4 and torch.equal(three.argmax(-1), ref.argmax(-1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_without_cuda_it_says_what_it_needs(capsys):
    with pytest.raises(SystemExit, match="needs|CUDA"):
        main([])

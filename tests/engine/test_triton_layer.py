"""The layer kernels (engine/triton_layer.py) under Triton's CPU interpreter, where triton is installed;
the GPU runs (bf16, CUDA graphs, the engine's tokens) are in tests/gpu/test_triton_layer_gpu.py. The
interpreter rounds to bf16 by truncation, so bf16 is checked on the GPU only; fp16 and fp32 here."""

import pytest
import torch

from engine import triton_layer


def test_layer_kernels_decline_cpu_tensors_outside_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, w = torch.randn(2, 64), torch.randn(128, 64)
    assert triton_layer.norm_gate_up_silu(x, None, torch.ones(64), 1e-5, w, 64) is None


KERNELS = """
import torch, torch.nn.functional as F
from engine import triton_layer as TL
from engine.fused import add_rms_norm, rms_norm, silu_mul
from engine.rope import apply_rope_qk
torch.manual_seed(0)
TL.PROJ = True  # the output and down projections (on by default)
TL.MAX_ROWS = 64  # batches too (FLASHSPEC_LAYER_ROWS=64)
H, HQ, HKV, D, R, S, I = 96, 3, 1, 32, 10, 40, 80  # H: not a multiple of the kernels' 64-feature steps


def same(a, b):
    # A row's output alone and among other rows: the same bits in fp16. In fp32 the interpreter's dot is numpy's
    # sgemm, whose rounding can depend on a row's place in the tile (seen with triton 3.9's interpreter: a few ulp
    # at rows 8 and up); there the values agree to float rounding, and tests/gpu/test_triton_layer_gpu.py checks
    # the bits on the GPU.
    return torch.equal(a, b) if a.dtype != torch.float32 else torch.allclose(a, b, rtol=1e-6, atol=2e-6)


for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 4e-3)):
    for b, t, rows, with_delta in ((1, 1, None, True), (1, 5, slice(2, 3), False), (2, 3, torch.tensor([7, 1]), True),
                                   (8, 2, torch.randperm(R)[:8], True),  # 16 rows: one tile
                                   (5, 8, torch.randperm(R)[:5], True)):  # 40 rows: three tiles, the last ragged
        n = b * t
        x = torch.randn(n, H).to(dtype)
        delta = torch.randn(n, H).to(dtype) if with_delta else None
        nw = (1 + 0.1 * torch.randn(H)).to(dtype)
        w = (torch.randn((HQ + 2 * HKV) * D, H) / H ** 0.5).to(dtype)
        ang = torch.rand(n, D // 2) * 6
        ang = torch.cat([ang, ang], -1)
        cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
        kc, vc = torch.zeros(R, HKV, S, D, dtype=dtype), torch.zeros(R, HKV, S, D, dtype=dtype)
        pos = torch.randint(0, S - t, (b, 1)) + torch.arange(t)
        pos[0, -1] = S  # past the cache: not written
        res, q = TL.norm_qkv_rope_write(x, delta, nw, 1e-5, w, cos, sin, kc, vc, rows, pos, HQ, HKV)
        want_res, h = (x, rms_norm(x, nw, 1e-5)) if delta is None else add_rms_norm(x, delta, nw, 1e-5)
        qkv = F.linear(h, w)
        qk = apply_rope_qk(qkv.float(), cos.float(), sin.float(), HQ + HKV, D)  # RoPE in fp32, as the kernel
        assert torch.equal(res, want_res) if dtype == torch.float32 else torch.allclose(res, want_res, atol=1e-2)
        torch.testing.assert_close(q.float(), qk[:, :HQ], atol=tol, rtol=tol)
        r = torch.arange(b) if rows is None else (torch.arange(R)[rows] if isinstance(rows, slice) else rows)
        for i in range(n):
            p = int(pos[i // t, i % t])
            if p < S:
                torch.testing.assert_close(kc[r[i // t], :, p].float(), qk[i, HQ:], atol=tol, rtol=tol)
                torch.testing.assert_close(vc[r[i // t], :, p].float(), qkv[i, (HQ + HKV) * D:].view(HKV, D).float(),
                                           atol=tol, rtol=tol)
        assert int((kc != 0).any(-1).sum()) == HKV * (n - 1) and int((vc != 0).any(-1).sum()) == HKV * (n - 1)
        wg = (torch.randn(2 * I, H) / H ** 0.5).to(dtype)
        res2, act = TL.norm_gate_up_silu(x, delta, nw, 1e-5, wg, I)
        assert torch.equal(res2, res)
        torch.testing.assert_close(act, silu_mul(F.linear(h, wg), I), atol=tol, rtol=tol)
        for i in sorted({0, n // 2, n - 1}):  # a row's bits do not depend on the rows (or tiles) sharing its call
            one = slice(i, i + 1)
            d1 = None if delta is None else delta[one]
            kc1, vc1 = torch.zeros_like(kc), torch.zeros_like(vc)
            _, q1 = TL.norm_qkv_rope_write(x[one], d1, nw, 1e-5, w, cos[one], sin[one], kc1, vc1,
                                           r[i // t : i // t + 1].clone(), pos[i // t : i // t + 1, i % t : i % t + 1], HQ, HKV)
            assert same(q1, q[one]), (dtype, n, i)
            assert same(TL.norm_gate_up_silu(x[one], d1, nw, 1e-5, wg, I)[1], act[one]), (dtype, n, i)
        # The weight's first features read before the wait (FLASHSPEC_LAYER_PREFETCH=1): the same bits, whether the
        # whole row is one step (k=128) or three (k=32)
        for step in (128, 32):
            TL.CONFIG["k"] = step
            outs = []
            for TL.PREFETCH in (False, True):
                kc2, vc2 = torch.zeros_like(kc), torch.zeros_like(vc)
                outs.append((*TL.norm_qkv_rope_write(x, delta, nw, 1e-5, w, cos, sin, kc2, vc2, rows, pos, HQ, HKV), kc2,
                             vc2, *TL.norm_gate_up_silu(x, delta, nw, 1e-5, wg, I)))
            assert all(torch.equal(a, b) for a, b in zip(*outs)), (dtype, n, step)
        TL.CONFIG["k"], TL.PREFETCH = 128, False
        wd = (torch.randn(72, I) / I ** 0.5).to(dtype)  # 72 outputs: not a multiple of a program's 16 columns
        for cfg in (None, {"k": 32, "n": 32}):  # the whole row in one step; three steps of 32 (and a ragged one)
            y = TL.project(act, wd, cfg)
            assert y.dtype == dtype and y.shape == (n, 72)
            torch.testing.assert_close(y, F.linear(act, wd), atol=tol, rtol=tol)
            for i in (0, n - 1):  # a row's output does not depend on the rows sharing its call
                assert same(TL.project(act[i : i + 1], wd, cfg), y[i : i + 1]), (n, i, cfg)
# What it does not serve: a projection of other heads, more rows than MAX_ROWS, a gate|up of another width.
assert TL.norm_qkv_rope_write(x, delta, nw, 1e-5, w, cos, sin, kc, vc, rows, pos, HQ + 1, HKV) is None
big = torch.randn(TL.MAX_ROWS + 1, H, dtype=dtype)  # more rows than it serves
assert TL.norm_gate_up_silu(big, None, nw, 1e-5, wg, I) is None
assert TL.norm_gate_up_silu(x, delta, nw, 1e-5, wg, I + 1) is None
assert TL.project(big[:, :I].contiguous(), wd) is None  # more rows than MAX_ROWS
assert TL.project(act, wd[:, ::2]) is None and TL.project(act, wd[:, : I - 1]) is None  # strided, other width
assert TL.project(act, wd.double()) is None and TL.project(act.float(), wd.half()) is None  # mixed dtypes
assert TL.project(act.float().requires_grad_(), wd.float()) is None  # a gradient to carry: F.linear's
TL.PROJ = False
assert TL.project(act, wd) is None  # off: FLASHSPEC_PROJ_KERNEL=0
print("ok")
"""


def test_layer_kernels_match_the_separate_kernels_in_the_interpreter(triton_interpreter):
    triton_interpreter(KERNELS)


MODEL = """
import copy, torch
import engine.triton_layer as TL
from engine.config import ModelArgs
from engine.model import Transformer
torch.manual_seed(0)
args = ModelArgs(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=3,
                 num_heads=2, num_kv_heads=1, head_dim=32, max_position_embeddings=64)
ref = Transformer(args, max_seq_len=64).eval()
model = copy.deepcopy(ref)
ref.fuse_for_inference(compile=False), model.fuse_for_inference(compile=False)
calls = []
TL.PROJ = True
for name in ("norm_qkv_rope_write", "norm_gate_up_silu", "project"):
    real = getattr(TL, name)
    setattr(TL, name, lambda *a, real=real, name=name: (lambda out: calls.append((name, out is not None)) or out)(real(*a)))
caches = [m.new_cache(4, 64) for m in (ref, model)]
prompt = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]])  # 18 tokens: a prefill
steps = [(prompt[:, :18], torch.arange(18)[None], slice(2, 3)),  # prefill: the separate kernels
         (torch.tensor([[30]]), torch.tensor([[18]]), slice(2, 3)),  # a decode step
         (torch.tensor([[31, 32, 33, 34, 35, 36]]), torch.arange(19, 25)[None], torch.tensor([2])),  # a verify pass
         (torch.tensor([[40], [41]]), torch.tensor([[25], [3]]), torch.tensor([2, 0]))]  # batch 2: the separate kernels
# FLASHSPEC_LAYER_ROWS=32 serves batch 2 (2 rows x 16 tokens): its decode step and its verify pass alike
steps += [(torch.tensor([[42], [43]]), torch.tensor([[26], [4]]), torch.tensor([2, 0]), 32),
          (torch.tensor([[44, 45, 46], [47, 48, 49]]), torch.tensor([[27, 28, 29], [5, 6, 7]]), torch.tensor([2, 0]), 32)]
with torch.no_grad():
    for tokens, pos, rows, *max_rows in steps:
        TL.MAX_ROWS = max_rows[0] if max_rows else 16
        calls.clear()
        TL.ENABLED = True
        got = model(tokens, pos, cache=caches[1], rows=rows, kv_len=32).logits
        took = list(calls)
        TL.ENABLED = False
        want = ref(tokens, pos, cache=caches[0], rows=rows, kv_len=32).logits
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        if tokens.shape[1] > 16 or tokens.shape[0] * 16 > TL.MAX_ROWS:
            assert took == [], took  # a prefill, or a batch whose steps do not all fit, runs the separate kernels
        else:
            assert took == [("norm_qkv_rope_write", True), ("project", True), ("norm_gate_up_silu", True),
                            ("project", True)] * 3, took
        for layer in range(3):
            torch.testing.assert_close(caches[1].k[layer], caches[0].k[layer], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(caches[1].v[layer], caches[0].v[layer], atol=1e-5, rtol=1e-5)
print("ok")
"""


def test_fused_model_takes_the_layer_kernels_on_short_steps_in_the_interpreter(triton_interpreter):
    triton_interpreter(MODEL)


def test_launch_settings_parse_and_refuse_what_the_kernels_cannot_run():
    assert triton_layer._config("") == {"k": 128, "c": 32, "g": 32, "w": 8, "s": 3}
    assert triton_layer._config(" k=256, c=16 ") == {"k": 256, "c": 16, "g": 32, "w": 8, "s": 3}
    for bad, words in (("k=100", "power of two"), ("c=8", "power of two >= 16"), ("x=1", "one of k="),
                       ("s=0", "stages"), ("w=three", "one of k=")):
        with pytest.raises(ValueError, match=words):
            triton_layer._config(bad)


@pytest.mark.slow  # about 25 s on 2 cores (fresh interpreters): `make test-slow` (the default suite keeps under 15 minutes)
def test_projection_launch_settings_from_the_environment_are_checked():
    import os
    import subprocess
    import sys

    def load(value: str, switch: str | None = None) -> subprocess.CompletedProcess:
        code = "import engine.triton_layer as t; print(t.PROJ_CONFIG, t.PROJ)"
        env = {key: v for key, v in os.environ.items() if key != "FLASHSPEC_PROJ_KERNEL"}
        env.update({"FLASHSPEC_PROJ_CONFIG": value, **({"FLASHSPEC_PROJ_KERNEL": switch} if switch else {})})
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)

    assert load("n=32, w=8").stdout.strip() == "{'n': 32, 'k': 2048, 'w': 8, 's': 1} True"  # on by default
    code = "import engine.triton_layer as t; print(t.MAX_ROWS)"
    unset = {key: v for key, v in os.environ.items() if key != "FLASHSPEC_LAYER_ROWS"}
    assert subprocess.run([sys.executable, "-c", code], env=unset, capture_output=True, text=True).stdout.strip() == "128"
    rows = {**os.environ, "FLASHSPEC_LAYER_ROWS": "16"}  # batch 1 only
    assert subprocess.run([sys.executable, "-c", code], env=rows, capture_output=True, text=True).stdout.strip() == "16"
    done = subprocess.run([sys.executable, "-c", code], env={**rows, "FLASHSPEC_LAYER_ROWS": "eight"},
                          capture_output=True, text=True)
    assert done.returncode != 0 and "FLASHSPEC_LAYER_ROWS='eight'" in done.stderr and "e.g. 16 or 128" in done.stderr
    assert load("", "0").stdout.strip() == "{'n': 16, 'k': 2048, 'w': 4, 's': 1} False"  # FLASHSPEC_PROJ_KERNEL=0
    for bad, words in (("n=8", "power of two >= 16"), ("k=100", "power of two"), ("q=2", "one of n=")):
        done = load(bad)
        assert done.returncode != 0 and words in done.stderr, (bad, done.stderr[-300:])

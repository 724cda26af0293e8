"""The engine's small Triton kernels (engine/triton_kernels.py) under Triton's CPU interpreter, where
triton is installed; the GPU runs are in tests/gpu/test_triton_kernels_gpu.py."""

import os
import re

import pytest
import torch

from engine.cache import KVCache
from engine.triton_kernels import kv_write


def test_kv_write_declines_cpu_tensors_outside_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cache = KVCache(1, 2, 2, 8, 16)
    k = torch.randn(2, 2, 1, 16)
    assert not kv_write(cache.k[0], cache.v[0], None, torch.zeros(2, 1, dtype=torch.long), k, k)


KV_WRITE = """
import os

import torch
from engine.triton_kernels import kv_write
torch.manual_seed(0)
R, H, S, D = 5, 3, 40, 16
for rows, b in ((None, 2), (slice(1, 4), 3), (torch.tensor([4, 0]), 2)):
    for t in (1, 6):
        kc, vc = torch.randn(R, H, S, D), torch.randn(R, H, S, D)
        k, v = torch.randn(b, H, t, D), torch.randn(b, H, t, D)
        pos = torch.randint(0, S - t, (b, 1)) + torch.arange(t)
        ref_k, ref_v = kc.clone(), vc.clone()
        r = torch.arange(b) if rows is None else (torch.arange(rows.start, rows.stop) if isinstance(rows, slice) else rows)
        ref_k[r[:, None], :, pos] = k.transpose(1, 2)
        ref_v[r[:, None], :, pos] = v.transpose(1, 2)
        assert kv_write(kc, vc, rows, pos, k, v)
        assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v), (rows, t)
# strided inputs (views of a fused projection) and a strided cache view
kc, vc = torch.zeros(2, H, S, 2 * D)[..., :D], torch.zeros(2, H, S, D)
big = torch.randn(1, 2 * H, 3, D)
k, v = big[:, :H], big[:, H:]
pos = torch.tensor([[7, 8, 9]])
assert kv_write(kc, vc, slice(1, 2), pos, k, v)
assert torch.equal(kc[1, :, 7:10], k[0]) and torch.equal(vc[1, :, 7:10], v[0]) and not kc[0].any()
print("ok")
"""


def test_kv_write_matches_indexing_in_the_interpreter(triton_interpreter):
    triton_interpreter(KV_WRITE)


ARGMAX = """
import os

import torch
from engine.triton_kernels import argmax
torch.manual_seed(0)
for shape, dtype in (((3, 10000), torch.float32), ((2, 4, 5000), torch.bfloat16), ((1, 49152), torch.float32)):
    x = torch.randn(shape).to(dtype)
    assert torch.equal(argmax(x), x.argmax(-1)), shape
x = torch.zeros(2, 9000)
x[0, 7000] = x[0, 8000] = 5.0  # equal maxima in two chunks: the first
x[1, 100] = x[1, 101] = 5.0  # and within one chunk
x[1, 3] = float("nan")  # NaN counts as largest, as in torch
assert torch.equal(argmax(x), x.argmax(-1)), (argmax(x), x.argmax(-1))
assert torch.equal(argmax(torch.full((2, 9000), float("-inf"))), torch.zeros(2, dtype=torch.long))
small = torch.randn(2, 100)
assert torch.equal(argmax(small), small.argmax(-1))  # short rows: torch's own
print("ok")
"""


def test_argmax_matches_torch_in_the_interpreter(triton_interpreter):
    triton_interpreter(ARGMAX)


def test_argmax_is_torch_s_on_cpu(monkeypatch):
    from engine.triton_kernels import argmax

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(3, 9000)
    assert torch.equal(argmax(x), x.argmax(-1))


ROPE_KV_WRITE = """
import copy, torch
from engine.cache import KVCache
from engine.config import ModelArgs
from engine.model import Transformer
from engine.rope import apply_rope_qk
from engine.triton_kernels import kv_write, rope_kv_write
torch.manual_seed(0)
R, HQ, HKV, S, D = 5, 6, 2, 40, 16
for rows, b in ((None, 2), (slice(1, 4), 3), (torch.tensor([4, 0]), 2)):
    for t in (1, 6):
        n = b * t
        qkv = torch.randn(n, (HQ + 2 * HKV) * D)
        cos, sin = torch.randn(n, D), torch.randn(n, D)
        pos = torch.randint(0, S - t, (b, 1)) + torch.arange(t)
        pos[0, -1] = S  # past the cache: not written (as kv_write)
        kc, vc = torch.randn(R, HKV, S, D), torch.randn(R, HKV, S, D)
        ref_kc, ref_vc = kc.clone(), vc.clone()
        qk = apply_rope_qk(qkv, cos, sin, HQ + HKV, D)
        k = qk[:, HQ:].view(b, t, HKV, D).transpose(1, 2)
        v = qkv[:, (HQ + HKV) * D:].view(b, t, HKV, D).transpose(1, 2)
        assert kv_write(ref_kc, ref_vc, rows, pos, k, v)
        q = rope_kv_write(qkv, cos, sin, kc, vc, rows, pos, HQ, HKV)
        torch.testing.assert_close(q, qk[:, :HQ], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(kc, ref_kc, atol=1e-6, rtol=1e-6)
        assert torch.equal(vc, ref_vc), (rows, t)
assert rope_kv_write(qkv, cos, sin, kc, vc, None, pos, HQ + 1, HKV) is None  # heads do not match the projection
# The fused model takes it on every layer and gives the logits and cache of the two-kernel path.
args = ModelArgs(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64)
ref = Transformer(args, max_seq_len=64).eval()
model = copy.deepcopy(ref)
ref.fuse_for_inference(compile=False), model.fuse_for_inference(compile=False)
import engine.triton_kernels as tk, engine.triton_layer as tl_layer
tl_layer.ENABLED = False  # this checks rope_kv_write, which the layer kernels would replace
calls, real = [], tk.rope_kv_write
tk.rope_kv_write = lambda *a: (lambda q: calls.append(q is not None) or q)(real(*a))
caches = [m.new_cache(4, 64) for m in (ref, model)]
tokens, pos, rows = torch.tensor([[5, 6, 7], [8, 9, 10]]), torch.tensor([[20, 21, 22], [9, 10, 11]]), torch.tensor([3, 1])
with torch.no_grad():
    got = model(tokens, pos, cache=caches[1], rows=rows, kv_len=32).logits
    tk.ENABLED = False
    want = ref(tokens, pos, cache=caches[0], rows=rows, kv_len=32).logits
torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
assert calls == [True, True, False, False], calls  # both layers took it; the reference ran with the kernels off
for layer in range(2):
    torch.testing.assert_close(caches[1].k[layer], caches[0].k[layer], atol=1e-6, rtol=1e-6)
    assert torch.equal(caches[1].v[layer], caches[0].v[layer])
print("ok")
"""


def test_rope_kv_write_matches_rope_then_write_in_the_interpreter(triton_interpreter):
    triton_interpreter(ROPE_KV_WRITE)


UNIFORM = """
import os

import torch
import engine.triton_kernels as tk, engine.triton_layer as tl_layer
tl_layer.ENABLED = False  # this checks rope_kv_write, which the layer kernels would replace
from engine.sampling import uniform_at
torch.manual_seed(0)
state = torch.stack([torch.randint(0, 2**32, (5,)), torch.tensor([0, 7, 2**32 - 3, 2**31, 123456])], 1)
for offset, shape in ((0, (5,)), (3, (5, 11)), (9, (5, 4)), (0, (5, 1)), (2**32 - 2, (5, 6))):
    fast = uniform_at(state, offset, shape)
    tk.ENABLED = False
    ref = uniform_at(state, offset, shape)
    tk.ENABLED = True
    assert fast.shape == ref.shape and torch.equal(fast, ref), (offset, shape)
    assert tk.uniform(state, offset, shape[0], shape[-1] if len(shape) > 1 else 1) is not None
assert torch.equal(uniform_at(state[:, :], 1, (5, 3)), uniform_at(state.clone(), 1, (5, 3)))
print("ok")
"""


def test_uniform_draws_are_the_torch_hashs_bit_for_bit_in_the_interpreter(triton_interpreter):
    triton_interpreter(UNIFORM)


SAMPLING = """
import os

import torch
import engine.triton_kernels as tk
from engine.sampling import processed_probs, sample_with

def torch_path(fn, *args, **kwargs):
    tk.SAMPLING = False
    try:
        return fn(*args, **kwargs)
    finally:
        tk.SAMPLING = True

torch.manual_seed(0)
# tempered softmax: rows of (B, ..., V), each row's temperature (0: one-hot at the first largest logit)
for shape, temps, dtype in (((3, 5000), (0.7, 0.0, 1.3), torch.float32), ((2, 3, 3000), (1.0, 0.0), torch.bfloat16),
                            ((2, 9000), (0.5, 2.0), torch.float32), ((1, 1), (1.0,), torch.float32)):
    x = (torch.randn(shape) * 3).to(dtype)
    if shape[-1] > 200:
        x[..., 100] = x[..., 150] = x.amax(-1)  # equal maxima: the first for a greedy row, as torch.argmax
    t = torch.tensor(temps)
    none, ones = torch.zeros(len(temps), dtype=torch.long), torch.ones(len(temps))
    fast = tk.tempered_softmax(x, t)
    ref = torch_path(processed_probs, x, t, none, ones, filtered=False)
    assert fast is not None and fast.dtype == torch.float32 and fast.shape == ref.shape
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-7)
    assert torch.equal(processed_probs(x, t, none, ones, filtered=False), fast)  # the fast path is processed_probs'
    assert tk.tempered_softmax(x, t.double()) is None  # a call it does not serve: the caller's torch code runs
# inverse CDF: the same token as sample_with's float64 search for every draw, zero-probability tails never drawn
for v in (7, 1500, 8192, 9000):
    p = torch.rand(4, v) ** 4
    p[:2, v // 2:] = 0  # two rows end in zeros
    u = torch.rand(150, 4)
    u[0] = 1 - 2**-24  # the largest draw: the last token of positive probability
    for i in range(u.shape[0]):
        fast = tk.inverse_cdf(p, u[i])
        assert torch.equal(fast, torch_path(sample_with, p, u[i])), (v, i)
        assert (p.gather(1, fast[:, None]) > 0).all()
    one = p[:1] if v > tk.SAMPLING_MAX_BLOCK else None  # one row over the whole vocabulary: torch's search
    assert one is None or (tk.inverse_cdf(one, u[0, :1]) is None and torch.equal(sample_with(one, u[0, :1]),
                                                                                 torch_path(sample_with, one, u[0, :1])))
    draws = torch.rand(4, 3)  # a column of the round's draws: strided
    assert torch.equal(tk.inverse_cdf(p, draws[:, 1]), torch_path(sample_with, p, draws[:, 1].contiguous()))
print("ok")
"""


def test_sampling_kernels_match_the_torch_path_in_the_interpreter(triton_interpreter):
    triton_interpreter(SAMPLING)


VOCAB = """
import os

import torch
import torch.nn.functional as F
import engine.triton_kernels as tk
from engine.config import ModelArgs
from engine.model import Transformer

tk.VOCAB_CONFIG["split"] = 0  # fp32 products: the interpreter's bf16 dot is wrong (the split products: tests/gpu)
tk.VOCAB_NORM = False  # the projection alone first; the norm inside its launch below
torch.manual_seed(0)
w = (torch.randn(1000, 96) * 0.05).to(torch.bfloat16)  # not a multiple of the vocabulary block or the feature step
x = torch.randn(20, 96)
ref = F.linear(x, w.float())
out = tk.vocab_projection(x, w)
assert out is not None and out.dtype == torch.float32 and out.shape == (20, 1000)
torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
for n in (1, 6, 17):  # a row gets the same bits whichever rows share its call (and its 16-row tile)
    assert torch.equal(tk.vocab_projection(x[n - 1 : n], w), out[n - 1 : n]), n
for t in (0, 1):  # and whichever order its call's tiles are launched in
    assert torch.equal(tk.vocab_projection(x, w, {"t": t}), out), t
assert tk.vocab_projection(x.view(4, 5, 96), w).shape == (4, 5, 1000)
assert tk.vocab_projection(x[:, ::2].contiguous(), w[:, ::2]) is None  # a strided weight: declined
assert tk.vocab_projection(torch.randn(tk.VOCAB_MAX_ROWS + 1, 96), w) is None  # too many rows: F.linear's
assert tk.vocab_projection(x.double(), w) is None and tk.vocab_projection(x, w.float()) is None
assert tk.vocab_projection(x, w.half(), {"split": 3}) is None  # fp16 parts of an fp32 underflow: not served
assert tk.vocab_projection(x.clone().requires_grad_(), w) is None  # a gradient to carry: F.linear's
with torch.no_grad():
    assert tk.vocab_projection(x.clone().requires_grad_(), w.clone().requires_grad_()) is not None
# the model: a bf16 model's logits come from the kernel, close to F.linear over the fp32 copy, which is never made
args = ModelArgs(model_type="llama", vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16, max_position_embeddings=64, tie_word_embeddings=True)
model = Transformer(args).to(torch.bfloat16).eval()
tokens = torch.randint(0, 300, (2, 5))
with torch.no_grad():
    fast = model(tokens, torch.arange(5)[None].expand(2, 5)).logits
    assert getattr(model, "_lm_head_f32", None) is None
    tk.VOCAB = False
    slow = model(tokens, torch.arange(5)[None].expand(2, 5)).logits
assert fast.dtype == slow.dtype == torch.float32
torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
# the final norm inside the projection's launch (FLASHSPEC_VOCAB_NORM, on by default): the torch path's logits and
# final states
tk.VOCAB = True
hidden = (3 * torch.randn(2, 5, 64)).to(torch.bfloat16)
norm_w = (1 + 0.1 * torch.randn(64)).to(torch.bfloat16)
tk.VOCAB_NORM = False
assert tk.norm_vocab_projection(hidden, norm_w, 1e-5, model.lm_head.weight) is None  # FLASHSPEC_VOCAB_NORM=0
tk.VOCAB_NORM = True
with torch.no_grad():
    logits, normed = tk.norm_vocab_projection(hidden, norm_w, 1e-5, model.lm_head.weight)
    tiled = tk.norm_vocab_projection(hidden, norm_w, 1e-5, model.lm_head.weight, {"t": 1})
    assert torch.equal(tiled[0], logits) and torch.equal(tiled[1], normed)
    x = hidden.float()
    x = norm_w.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(logits, F.linear(x, model.lm_head.weight.float()), rtol=1e-5, atol=1e-5)
    assert normed.dtype == torch.bfloat16 and normed.shape == hidden.shape
    # within one bf16 unit (the interpreter's casts truncate where the GPU's round to nearest)
    torch.testing.assert_close(normed.float(), x.to(torch.bfloat16).float(), rtol=2**-7, atol=1e-6)
    both = model(tokens, torch.arange(5)[None].expand(2, 5))  # the model takes it: same logits as the torch path
    torch.testing.assert_close(both.logits, slow, rtol=1e-5, atol=1e-5)
print("ok")
"""


def test_vocab_projection_matches_fp32_linear_in_the_interpreter(triton_interpreter):
    triton_interpreter(VOCAB)


STEP_CONTEXT = """
import copy, torch
import engine.triton_kernels as tk
from engine.cache import WindowedKVCache, visibility_mask
from engine.config import ModelArgs
from engine.model import Transformer
torch.manual_seed(0)
tk.CONTEXT = True  # FLASHSPEC_CONTEXT_KERNEL=1
table_cos, table_sin = torch.randn(300, 16), torch.randn(300, 16)
for dtype in (torch.float32, torch.float16):
    for pos, kv_len in ((torch.tensor([[7]]), 40), (torch.tensor([[3, 4, 5], [250, 251, 252]]), 2100),
                        (torch.tensor([[0, 1]], dtype=torch.int32), 1)):
        cos, sin, mask = tk.step_context(table_cos, table_sin, pos, dtype, kv_len)
        assert torch.equal(cos, table_cos[pos].to(dtype)[:, None]) and torch.equal(sin, table_sin[pos].to(dtype)[:, None])
        assert mask.dtype == torch.bool and torch.equal(mask, visibility_mask(pos.long(), kv_len)), (pos, kv_len)
# In the model: the context's cos, sin and mask are the torch path's; a windowed cache (its own mask), a
# caller's mask and a pass without a cache keep the torch path.
args = ModelArgs(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128)
model = Transformer(args, max_seq_len=128).eval()
cache = model.new_cache(2, 128)
calls = []
real = tk.step_context
tk.step_context = lambda *a: calls.append(a[3]) or real(*a)
pos = torch.tensor([[20, 21, 22], [5, 6, 7]])
for on in (True, False):
    tk.CONTEXT = on
    ctx = model.context(pos, cache, torch.tensor([1, 0]), 64)
    if on:
        got = ctx
    else:
        for name in ("cos", "sin", "mask"):
            assert torch.equal(getattr(got, name), getattr(ctx, name)), name
assert calls == [torch.float32, torch.float32]  # asked twice, served once (CONTEXT off the second time)
tk.CONTEXT = True
calls.clear()
windowed = WindowedKVCache(2, 2, 2, 8, 8, 8)
model.context(pos, windowed, torch.tensor([1, 0]), 16)
model.context(pos, cache, None, 64, mask=torch.ones(2, 1, 3, 64, dtype=torch.bool))
model.context(pos, None)
assert calls == []
with torch.no_grad():  # a whole forward pass with it: the same logits
    tokens = torch.tensor([[5, 6, 7], [8, 9, 10]])
    want = model(tokens, pos, cache=model.new_cache(2, 128), kv_len=64).logits
    tk.CONTEXT = False
    assert torch.equal(model(tokens, pos, cache=model.new_cache(2, 128), kv_len=64).logits, want)
print("ok")
"""


def test_step_context_is_the_torch_path_s_bit_for_bit_in_the_interpreter(triton_interpreter):
    triton_interpreter(STEP_CONTEXT)


def test_vocab_launch_settings_from_the_environment_are_checked():
    import subprocess
    import sys

    from engine.triton_kernels import vocab_config

    defaults = {"v": 128, "h": 64, "w": 4, "split": 3, "t": 1}
    assert vocab_config("FLASHSPEC_VOCAB_CONFIG", "v=64, w=8", defaults) == {"v": 64, "h": 64, "w": 8, "split": 3, "t": 1}
    assert vocab_config("FLASHSPEC_VOCAB_CONFIG", "t=0", defaults) == {**defaults, "t": 0}
    for bad, words in (("v=100", "power of two >= 16"), ("split=1", "must be 3"), ("x=2", "one of v="),
                       ("t=2", "must be 1")):
        with pytest.raises(ValueError, match=re.escape(words)) as error:
            vocab_config("FLASHSPEC_VOCAB_CONFIG", bad, defaults)
        assert "FLASHSPEC_VOCAB_CONFIG" in str(error.value)

    def load(value: str) -> subprocess.CompletedProcess:  # the variable reaches the module's setting at import
        code = "import engine.triton_kernels as t; print(t.VOCAB_CONFIG)"
        return subprocess.run([sys.executable, "-c", code], env={**os.environ, "FLASHSPEC_VOCAB_CONFIG": value},
                              capture_output=True, text=True)

    assert load("v=64, w=8").stdout.strip() == "{'v': 64, 'h': 64, 'w': 8, 'split': 3, 't': 1}"
    done = load("v=100")
    assert done.returncode != 0 and "power of two >= 16" in done.stderr, done.stderr[-300:]


def test_programmatic_dependent_launch_only_where_asked_and_on_a_hopper_gpu(monkeypatch):
    import engine.triton_kernels as tk

    monkeypatch.setattr(tk, "PDL", False)  # FLASHSPEC_PDL=0
    assert tk.pdl(torch.zeros(1)) == {"PDL": False}
    monkeypatch.setattr(tk, "PDL", True)  # the default
    assert tk.pdl(torch.zeros(1)) == {"PDL": False}  # CPU tensors (Triton's interpreter): never


def test_engine_kernels_compile_with_programmatic_dependent_launch_for_hopper():
    """Every engine kernel's PDL variant compiles for sm90 (Triton's own compiler and ptxas, no GPU needed) and waits
    for the kernel before it (griddepcontrol); the GPU runs are tests/gpu/test_pdl_gpu.py."""
    from engine.triton_kernels import available

    if not available():
        pytest.skip("needs the triton package")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import engine.triton_attention as ta
    import engine.triton_kernels as tk
    import engine.triton_layer_kernels as lk

    def ptx(kernel, pointers: dict, constants: dict) -> str:
        signature = {p.name: "constexpr" if p.is_constexpr else pointers.get(p.name, "i32") for p in kernel.params}
        src = ASTSource(fn=kernel, signature=signature, constexprs={**constants, "PDL": True})
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "launch_pdl": True}).asm["ptx"]

    attend, merge = ta._kernels()
    kernels = tk._kernels()
    cases = [
        (kernels.vocab_projection, {"X": "*fp32", "NW": "*fp32", "W": "*bf16", "OUT": "*fp32", "NORMED": "*fp32",
                                    "eps": "fp32"}, dict(H=576, BLOCK_V=128, BLOCK_H=64, SPLIT=3, NORM=False)),
        (kernels.vocab_projection, {"X": "*bf16", "NW": "*bf16", "W": "*bf16", "OUT": "*fp32", "NORMED": "*bf16",
                                    "eps": "fp32"}, dict(H=576, BLOCK_V=128, BLOCK_H=64, SPLIT=3, NORM=True)),
        (attend, {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "M": "*u8", "O": "*fp32", "LSE": "*fp32", "ROWS": "*i64",
                  "POS": "*i64", "scale": "fp32"},
         dict(G=3, D=64, BLOCK_M=16, BLOCK_N=64, IEEE=False, SPLIT=True, HAS_ROWS=False, HAS_POS=True, BLOCK_T=2)),
        (merge, {"P": "*fp32", "LSE": "*fp32", "O": "*bf16"}, dict(D=64, SP=16)),
        (kernels.step_context, {"RC": "*fp32", "RS": "*fp32", "POS": "*i64", "COS": "*bf16", "SIN": "*bf16", "MASK": "*u8"},
         dict(D=64, DP=64, BLOCK_S=1024)),
        (lk.norm_gate_up_kernel, {n: "*bf16" for n in ("X", "DELTA", "RES", "NW", "W", "OUT")} | {"eps": "fp32"},
         dict(K=576, INTER=1536, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, HAS_DELTA=True)),
        (lk.norm_gate_up_kernel, {n: "*bf16" for n in ("X", "DELTA", "RES", "NW", "W", "OUT")} | {"eps": "fp32"},
         dict(K=576, INTER=1536, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, HAS_DELTA=True, PREFETCH=True)),
        (kernels.argmax_partial, {"X": "*fp32", "VAL": "*fp32", "IDX": "*i64"}, dict(BLOCK=2048)),
        (lk.norm_qkv_rope_kernel, {n: "*bf16" for n in ("X", "DELTA", "RES", "NW", "W", "COS", "SIN", "QO", "KC", "VC")}
         | {"ROWS": "*i64", "POS": "*i64", "eps": "fp32"},
         dict(K=576, HQ=9, HKV=3, D=64, BLOCK_M=16, BLOCK_K=128, COLS=32, HAS_DELTA=True, HAS_ROWS=False, PREFETCH=True)),
        (lk.project_kernel, {"X": "*bf16", "W": "*bf16", "OUT": "*bf16"},
         dict(K=1536, N=576, BLOCK_M=16, BLOCK_N=16, BLOCK_K=2048)),
    ]
    for kernel, pointers, constants in cases:
        assert ptx(kernel, pointers, constants).count("griddepcontrol.wait") == 1, kernel
    # The projection, and a layer kernel with PREFETCH, read weight (a constant) before they wait for the kernel
    # before them; without PREFETCH nothing is read before the wait.
    for case in (cases[-1], cases[-2], cases[-4]):
        code = ptx(*case)
        assert -1 < code.find("ld.global") < code.find("griddepcontrol.wait"), case[0]
    code = ptx(*cases[-5])
    assert code.find("griddepcontrol.wait") < code.find("ld.global")
    # The attention kernel merging its own splits (FLASHSPEC_ATTN_INLINE_MERGE=1): a fence in every thread, a
    # barrier, then one acquire-release count at GPU scope; the last program reads the partials at L2 (.cg).
    code = ptx(attend, {**cases[2][1], "OUT": "*bf16", "CNT": "*i32"}, {**cases[2][2], "INLINE_MERGE": True, "FENCE": True})
    assert code.count("griddepcontrol.wait") == 1 and "ld.global.cg" in code
    count = next(i for i, line in enumerate(code.splitlines()) if "atom" in line and ".acq_rel" in line and ".gpu" in line)
    before = code.splitlines()[:count]
    fence = max(i for i, line in enumerate(before) if "fence.acq_rel.gpu" in line)  # every thread's stores fenced,
    assert any("bar.sync" in line for line in before[fence:])  # then the barrier, then the count
    assert "ld.global.cg" not in ptx(*cases[2])


LOOKUP = """
import torch
from engine import lookup, triton_kernels
torch.manual_seed(0)


def torch_propose(*args):
    triton_kernels.ENABLED = False
    try:
        return lookup.propose(*args)
    finally:
        triton_kernels.ENABLED = True


for b, s, vocab in ((3, 40, 4), (5, 1500, 3), (2, 7, 2)):  # few distinct tokens: n-grams recur, some rows find none
    history = torch.randint(0, vocab, (b, s))
    for lengths in (torch.randint(0, s + 1, (b,)), torch.full((b,), s), torch.tensor([1, 2] + [3] * (b - 2))):
        for gamma, max_n, min_n, repeat in ((5, 3, 2, True), (1, 1, 1, True), (8, 4, 1, True), (3, 2, 2, True),
                                            (8, 3, 1, False), (5, 3, 2, False), (6, 6, 1, True)):
            for rows in (history, history[1:], history[:, : s - 1]):  # whole, a slice of rows, a strided view
                n = lengths[: rows.shape[0]].clamp(max=rows.shape[1])
                fast = triton_kernels.lookup_propose(rows, n, gamma, max_n, min_n, repeat)
                ref = torch_propose(rows, n, gamma, max_n, min_n, repeat, True)
                assert fast is not None and len(fast) == len(ref) == 3
                assert all(torch.equal(f, r) for f, r in zip(fast, ref)), (b, s, gamma, max_n)
                assert [f.dtype for f in fast] == [r.dtype for r in ref]
assert lookup.propose(torch.tensor([[1, 2, 9, 1, 2]]), torch.tensor([5]), 3)[1].tolist() == [3]  # found: "9 1 2"
assert triton_kernels.lookup_propose(history, lengths, 0, 3, 1) is None  # what it does not serve: torch's path
print("ok")
"""


def test_lookup_propose_matches_torch_in_the_interpreter(triton_interpreter):
    triton_interpreter(LOOKUP)

"""The Triton attention kernel under Triton's CPU interpreter (where triton is installed), and the
backend choice. The GPU runs are in tests/gpu/test_triton_attention.py."""

import pytest
import torch

from engine.attention import SdpaBackend, make_backend
from engine.triton_kernels import available


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match="sdpa, flex, triton"):
        make_backend("fast")


def test_the_kernel_declines_cpu_tensors_outside_the_interpreter(monkeypatch):
    from engine.triton_attention import triton_attention

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = torch.randn(1, 4, 2, 16), torch.randn(1, 2, 10, 16), torch.randn(1, 2, 10, 16)
    assert triton_attention(q, k, v, torch.ones(1, 1, 2, 10, dtype=torch.bool)) is None


def test_triton_backend_runs_sdpa_on_cpu_tensors():
    backend = make_backend("triton")
    q, k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    mask = torch.ones(1, 1, 2, 10, dtype=torch.bool)
    torch.testing.assert_close(backend(q, k, v, mask), SdpaBackend()(q, k, v, mask))
    assert backend.name == ("triton" if available() else "sdpa")


CHECK = """
import torch, torch.nn.functional as F
from engine.triton_attention import triton_attention
torch.manual_seed(0)
b, hq, hkv, t, s, d = 2, 6, 2, 5, 300, 16
q, k, v = torch.randn(b, hq, t, d), torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, d)
pos = torch.tensor([[100], [250]]) + torch.arange(t)
mask = torch.arange(s)[None, None, None, :] <= pos[:, None, :, None]
mask[1, :, 0, 200:] = False  # not only causal: any visibility mask
ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
for splits in (1, 3):
    out = triton_attention(q, k, v, mask, splits=splits)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert out.transpose(1, 2).is_contiguous()  # laid out (B, T, Hq, D): o_proj's input is a view
# In place in a whole cache layer: batch row i reads cache row rows[i], its first s slots of 400.
cache_k, cache_v = torch.randn(5, hkv, 400, d), torch.randn(5, hkv, 400, d)
rows = torch.tensor([3, 0])
cache_k[rows, :, :s], cache_v[rows, :, :s] = k, v
for splits in (1, 3):
    out = triton_attention(q, cache_k, cache_v, mask, splits=splits, rows=rows, kv_len=s)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
assert triton_attention(q, cache_k, cache_v, mask, rows=rows, kv_len=s + 1) is None  # the mask is for s slots
assert triton_attention(q, cache_k, cache_v, mask[:, :, :, :300], rows=torch.tensor([3]), kv_len=s) is None
# Bounded by position over the whole cache (slot == position): slots past a row's last query position are
# never read. NaN there would reach the output through a masked block (0 * NaN); the kernel must skip them.
full = 400
big = torch.arange(full)[None, None, None, :] <= pos[:, None, :, None]
ck, cv = torch.randn(5, hkv, full, d), torch.randn(5, hkv, full, d)
ck[rows, :, :s], cv[rows, :, :s] = k, v
for r, p in zip(rows.tolist(), pos[:, -1].tolist()):
    ck[r, :, p + 1:], cv[r, :, p + 1:] = float("nan"), float("nan")
causal = torch.arange(s)[None, None, None, :] <= pos[:, None, :, None]
ref = F.scaled_dot_product_attention(q, k, v, attn_mask=causal, enable_gqa=True)
for splits in (None, 1, 3, 16):
    out = triton_attention(q, ck, cv, big, splits=splits, rows=rows, kv_len=full, positions=pos)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # rows 0..B-1 as a view of the whole cache (no rows input)
    out = triton_attention(q, ck[rows], cv[rows], big, splits=splits, positions=pos)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
assert triton_attention(q, ck, cv, big, rows=rows, kv_len=full, positions=pos[:, :1]) is None  # one position per query
print("ok")
"""


def test_kernel_matches_sdpa_in_the_interpreter(triton_interpreter):
    triton_interpreter(CHECK)


IN_PLACE = """
import copy, torch
from engine.config import ModelArgs
from engine.model import Transformer
torch.manual_seed(0)
args = ModelArgs(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64)
ref = Transformer(args, max_seq_len=64).eval()
model = copy.deepcopy(ref).set_attention_backend("triton")
calls = []
kernel = model.backend._kernel
model.backend._kernel = lambda *a, **kw: calls.append(kw.get("rows") is not None) or kernel(*a, **kw)
caches = [m.new_cache(4, 64) for m in (ref, model)]
for layer in range(2):  # history in every row
    k, v = torch.randn(4, 2, 64, 16), torch.randn(4, 2, 64, 16)
    for c in caches:
        c.k[layer].copy_(k), c.v[layer].copy_(v)
tokens = torch.tensor([[5, 6, 7], [8, 9, 10]])
pos = torch.tensor([[20, 21, 22], [9, 10, 11]])
rows = torch.tensor([3, 1])  # scattered rows: the model reads them in place, the reference gathers them
with torch.no_grad():
    want = ref(tokens, pos, cache=caches[0], rows=rows, kv_len=32).logits
    got = model(tokens, pos, cache=caches[1], rows=rows, kv_len=32).logits
torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
assert calls == [True, True], calls  # both layers took the in-place kernel
for layer in range(2):
    torch.testing.assert_close(caches[1].k[layer], caches[0].k[layer])
print("ok")
"""


def test_scattered_cache_rows_are_read_in_place_in_the_interpreter(triton_interpreter):
    triton_interpreter(IN_PLACE)


def test_auto_is_sdpa_off_cuda_and_the_model_setter_uses_it():
    assert make_backend("auto", "cpu").name == "sdpa"
    from engine.config import ModelArgs
    from engine.model import Transformer

    args = ModelArgs(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                     num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=64)
    model = Transformer(args, max_seq_len=64)
    assert model.set_attention_backend("auto").backend.name == "sdpa"
    with pytest.raises(ValueError, match="unknown attention backend"):
        model.set_attention_backend("fastest")

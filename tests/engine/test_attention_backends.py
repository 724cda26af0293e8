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
import engine.triton_attention as TA
attend_kernel, merge_kernel = TA._kernels()
merges = []


class CountingMerge:  # the merge kernel's launches
    def __getitem__(self, grid):
        merges.append(grid)
        return merge_kernel[grid]


TA._kernels = lambda: (attend_kernel, CountingMerge())
# The split results merged by the merge kernel, and by each (row, KV head)'s last split program
# (FLASHSPEC_ATTN_INLINE_MERGE=1): the same checks for both.
for TA.INLINE_MERGE in (False, True):
    merges.clear()
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
    assert (merges == []) == TA.INLINE_MERGE, (TA.INLINE_MERGE, len(merges))
    assert all(int(c.abs().sum()) == 0 for c in TA._COUNTS.values())  # every count set back for the next call
assert list(TA._COUNTS) == [torch.device("cpu")]
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


def _flashinfer_stand_in(calls: list):
    """A module with flashinfer's `single_prefill_with_kv_cache` contract (q (T, Hq, D); k, v (Hkv, S, D) in the HND
    layout; custom_mask (T, S) bool, True = visible; -> (T, Hq, D)), computed with SDPA: flashinfer itself is a GPU
    package (tests/gpu/test_attention_flashinfer.py runs the real one)."""
    import types

    def single_prefill_with_kv_cache(q, k, v, custom_mask=None, kv_layout="NHD", backend="auto"):
        calls.append((tuple(q.shape), tuple(k.shape), tuple(custom_mask.shape), kv_layout, backend))
        assert kv_layout == "HND" and custom_mask.dtype == torch.bool and custom_mask.shape == (q.shape[0], k.shape[1])
        out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None].float(), k[None].float(),
                                                               v[None].float(), attn_mask=custom_mask[None, None],
                                                               enable_gqa=True)
        return out[0].transpose(0, 1).to(q.dtype)

    return types.SimpleNamespace(single_prefill_with_kv_cache=single_prefill_with_kv_cache)


def test_flashinfer_backend_passes_each_row_in_flashinfer_s_layout(monkeypatch):
    import sys

    from engine.attention import FlashInferBackend

    calls = []
    monkeypatch.setitem(sys.modules, "flashinfer", _flashinfer_stand_in(calls))
    backend = make_backend("flashinfer")
    assert isinstance(backend, FlashInferBackend)
    monkeypatch.setattr(backend, "devices", ("cuda", "cpu"))
    torch.manual_seed(0)
    for t in (1, 5):
        cache_k, cache_v = torch.randn(3, 2, 40, 16).bfloat16(), torch.randn(3, 2, 40, 16).bfloat16()
        k, v = cache_k[:, :, :30], cache_v[:, :, :30]  # the filled slots of a bigger cache: a strided view
        q = torch.randn(3, 6, t, 16).bfloat16()  # GQA: 3 query heads per KV head
        mask = torch.rand(3, 1, t, 30) < 0.6
        mask[..., 0] = True  # every query sees a key
        calls.clear()
        out = backend(q, k, v, mask)
        ref = SdpaBackend()(q.float(), k.float(), v.float(), mask).to(q.dtype)
        assert out.shape == q.shape and len(calls) == 3 and calls[0] == ((t, 6, 16), (2, 30, 16), (t, 30), "HND", "fa2")
        torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)
    calls.clear()
    q32 = torch.randn(1, 6, 2, 16)
    backend(q32, torch.randn(1, 2, 30, 16), torch.randn(1, 2, 30, 16), torch.ones(1, 1, 2, 30, dtype=torch.bool))
    long_q = torch.randn(1, 6, FlashInferBackend.max_tokens + 1, 16).bfloat16()  # a prefill: SDPA's
    kv = torch.randn(1, 2, 70, 16).bfloat16()
    backend(long_q, kv, kv, torch.ones(1, 1, long_q.shape[2], 70, dtype=torch.bool))
    assert calls == []  # fp32 and prefill calls went to SDPA


def test_flashinfer_backend_without_the_package_runs_sdpa_and_says_so(monkeypatch, caplog):
    import sys

    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import fails, as where it is not installed
    with caplog.at_level("WARNING"):
        assert make_backend("flashinfer").name == "sdpa"
    assert "flashinfer-python" in caplog.text


PACKED = """
import torch, torch.nn.functional as F
from engine.triton_attention import triton_attention
torch.manual_seed(0)
# Three cache rows' chains of 4, 1 and 3 new tokens packed into 8 query rows of one token (an allotted lookup
# round's pass): each row's chain as one tile (qidx), against SDPA over each token alone by position.
hq, hkv, d, full, width = 6, 2, 16, 300, 4
ck, cv = torch.randn(5, hkv, full, d), torch.randn(5, hkv, full, d)
rows, lengths, pos0 = torch.tensor([4, 1, 2]), [4, 1, 3], torch.tensor([100, 20, 250])
order = [r * width + j for r, n in enumerate(lengths) for j in range(n)]
qidx = torch.full((3 * width,), -1).scatter_(0, torch.tensor(order), torch.arange(len(order))).view(3, width)
chains = pos0[:, None] + torch.arange(width)
q = torch.randn(len(order), hq, 1, d)
for r in range(3):  # slots past a chain's last position hold NaN: never read by a live query
    ck[rows[r], :, pos0[r] + lengths[r]:] = float("nan")
    cv[rows[r], :, pos0[r] + lengths[r]:] = float("nan")
mask = torch.arange(full)[None, None, None, :] <= chains[:, None, :, None]
ref = []
for n, o in enumerate(order):
    r, j = divmod(o, width)
    p = int(pos0[r]) + j
    k, v = ck[rows[r], :, :p + 1][None], cv[rows[r], :, :p + 1][None]
    ref.append(F.scaled_dot_product_attention(q[n:n + 1], k, v, enable_gqa=True))
ref = torch.cat(ref)
for splits in (None, 1, 3):
    out = triton_attention(q, ck, cv, mask, splits=splits, rows=rows, kv_len=full, positions=chains, qidx=qidx)
    assert out is not None and out.shape == q.shape
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert out.transpose(1, 2).is_contiguous()
assert triton_attention(q, ck, cv, mask, rows=None, kv_len=full, positions=chains, qidx=qidx) is None  # rows needed
assert triton_attention(q, ck, cv, mask[:2], rows=rows, kv_len=full, positions=chains, qidx=qidx) is None

# Through the engine: allotted lookup rounds on the Triton backend (packed attention) give plain decoding's tokens.
from engine.config import ModelArgs
from engine.generate import generate
from engine.lookup import LookupDraft
from engine.model import Transformer
from engine.sampling import SamplingParams
from engine.scheduler import DecodeEngine
from engine.speculative import SpecConfig
args = ModelArgs(model_type="llama", vocab_size=8, hidden_size=32, intermediate_size=64, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=128)
model = Transformer(args, max_seq_len=128).eval().set_attention_backend("triton")
packed = []
kernel = model.backend._kernel
model.backend._kernel = lambda *a, **kw: packed.append(kw.get("qidx") is not None) or kernel(*a, **kw)
prompts = [[1, 2, 3, 4], [5, 0, 6], [7, 7, 1], [2, 2, 5, 1, 3], [4, 6]]
params = [SamplingParams(max_new_tokens=n, eos_token_ids=()) for n in (24, 30, 20, 28, 26)]
with torch.no_grad():
    want = [o.token_ids for o in generate(DecodeEngine(model, None, max_batch_size=4, max_seq_len=128), prompts, params)]
    eng = DecodeEngine(model, None, max_batch_size=4, max_seq_len=128, spec=SpecConfig(5, 5))
    eng.add_draft("lookup", LookupDraft(allot=True))
    got = [o.token_ids for o in generate(eng, prompts, params, "lookup")]
assert got == want, (got, want)
assert any(packed), "no packed attention call"
print("ok")
"""


def test_packed_queries_attend_as_each_token_alone_and_allotted_rounds_keep_plain_tokens_in_the_interpreter(
        triton_interpreter):
    triton_interpreter(PACKED)

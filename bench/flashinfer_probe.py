"""Whether flashinfer installs, compiles and runs on this GPU, and what its attention calls cost against the
engine's Triton kernel and PyTorch SDPA at the default model's shapes (bf16, 9 query / 3 KV heads, head dim 64;
one row: a decode step's 1 token and a verify pass's 6, over 704 and 2,048 filled cache slots).

    SET=flashinfer PART_SIZE=24m STAGE=.stage/fi bash bench/stage_wheels.sh   # here: 243 MB in 11 parts (a part
                                                          # and the working tree fit one 64 MiB transfer)
    bash bench/install_wheels.sh /root/fi /tmp/fisite     # there, once every part (and wheels.sha256) is copied
    PYTHONPATH=/tmp/fisite python -m bench.flashinfer_probe [--slots 704,2048] [--tokens 1,6] [--prefill-backend fa2|auto]

flashinfer-python is a pure-Python wheel (101 MB of sources) that compiles its CUDA kernels with nvcc on first
use; the probe times that first call per kernel. Each call is then timed in a CUDA graph of 20 calls (us a
call; eager calls between synchronizations if flashinfer's call cannot be captured, said in the row), with its largest
difference from SDPA in fp32. One JSON line per case; the import's failure, if any, is a line too (exit 1).
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch
import torch.nn.functional as F

from bench.gpu import cuda_ms, per_call_us


def timed_us(fn) -> tuple[float, str]:
    """us a call (`bench.gpu.per_call_us`: a CUDA graph of 20 calls), or of eager calls when the capture fails."""
    try:
        return per_call_us(fn), "graph"
    except Exception as exc:  # noqa: BLE001 - a call that cannot be captured is timed eagerly, and said so
        torch.cuda.synchronize()
        return cuda_ms(fn, 200) * 1e3, f"eager ({type(exc).__name__})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", default="704,2048", help="filled cache slots, comma list")
    parser.add_argument("--tokens", default="1,6", help="new tokens of the row (1: decode, more: a verify pass)")
    parser.add_argument("--prefill-backend", default="fa2",
                        help="single_prefill_with_kv_cache's backend: fa2, or auto / fa3 (sm90), which stopped the "
                             "process with SIGFPE on a 6-token call on the H200 (bench/RESULTS.md, run 28)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.flashinfer_probe needs a CUDA GPU; run it on the GPU machine")
    start = time.perf_counter()
    try:
        import flashinfer
    except Exception as exc:  # noqa: BLE001 - what fails to import is the finding
        traceback.print_exc()
        print(json.dumps({"import": "failed", "error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    print(json.dumps({"import": "ok", "version": getattr(flashinfer, "__version__", "?"),
                      "import_s": round(time.perf_counter() - start, 1)}), flush=True)
    from engine.triton_attention import triton_attention

    hq, hkv, d = 9, 3, 64
    g = torch.Generator(device="cuda").manual_seed(0)
    for slots in (int(s) for s in args.slots.split(",")):
        for t in (int(n) for n in args.tokens.split(",")):
            q = torch.randn(t, hq, d, device="cuda", generator=g).to(torch.bfloat16)  # (tokens, heads, D)
            k = torch.randn(hkv, slots, d, device="cuda", generator=g).to(torch.bfloat16)  # HND: one row's cache
            v = torch.randn(hkv, slots, d, device="cuda", generator=g).to(torch.bfloat16)
            positions = torch.arange(slots - t, slots, device="cuda")[None]  # the new tokens are the last slots
            mask = (torch.arange(slots, device="cuda")[None, :] <= positions[0][:, None])[None, None]  # (1, 1, T, S)
            q4, k4, v4 = q.transpose(0, 1)[None], k[None], v[None]  # (1, Hq, T, D), (1, Hkv, S, D)
            ref = F.scaled_dot_product_attention(q4.float(), k4.float(), v4.float(), attn_mask=mask, enable_gqa=True)
            row = {"slots": slots, "tokens": t} | ({"prefill_backend": args.prefill_backend} if t > 1 else {})
            if t == 1:
                def fi():
                    return flashinfer.single_decode_with_kv_cache(q[0], k, v, kv_layout="HND")[None]
            else:
                def fi():
                    return flashinfer.single_prefill_with_kv_cache(q, k, v, causal=True, kv_layout="HND",
                                                                   backend=args.prefill_backend)
            try:
                first = time.perf_counter()
                out = fi()
                torch.cuda.synchronize()
                row["flashinfer_first_call_s"] = round(time.perf_counter() - first, 1)
                row["flashinfer_max_err"] = float(f"{(out.float().transpose(0, 1)[None] - ref).abs().max().item():.2g}")
                row["flashinfer_us"], row["flashinfer_timed"] = timed_us(fi)
                row["flashinfer_us"] = round(row["flashinfer_us"], 2)
            except Exception as exc:  # noqa: BLE001 - a kernel that does not build or run is the finding
                traceback.print_exc()
                row["flashinfer_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"

            def tri():
                return triton_attention(q4, k4, v4, mask, positions=positions)

            row["triton_max_err"] = float(f"{(tri().float() - ref).abs().max().item():.2g}")
            row["triton_us"] = round(per_call_us(tri), 2)
            row["sdpa_us"] = round(per_call_us(lambda: F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask,
                                                                                      enable_gqa=True)), 2)
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`args.fused_inference`: the Generator fuses its target and every draft it activates; same tokens."""

import asyncio

from services.config import AppArgs
from services.generator import GeneratorCore


def _complete(core: GeneratorCore, domain: str | None, request_id: str) -> tuple[str, dict | None]:
    async def run():
        text, stats = "", None
        req = {"request_id": request_id, "prompt": "w5 w9 w17 w3", "max_tokens": 24, "temperature": 0.0,
               "domain": domain}
        async for item in core.generate(req):
            assert item["type"] != "error", item
            if item["type"] == "delta":
                text += item["text"]
                stats = item["stats"] or stats
        return text, stats

    return asyncio.run(run())


def test_fused_generator_gives_the_unfused_tokens(app_args):
    outputs = {}
    for fused in (False, True):
        args = AppArgs.model_validate({**app_args, "fused_inference": fused, "max_batch_size": 2})
        core = GeneratorCore(args, registry=None)
        try:
            assert core.activate("code", "v1") == "ok"
            assert core.target.fused == ("hand" if fused else None)  # CPU: fused GEMMs, eager elementwise kernels
            draft = core.loop.engine.drafts["code"]
            assert all((getattr(layer, layer._fused_attr, None) is not None) == fused for layer in
                       (m.self_attn for m in draft.adapters))
            outputs[fused] = (_complete(core, None, "plain"), _complete(core, "code", "spec"))
        finally:
            core.loop.stop()
    assert outputs[True] == outputs[False]
    assert outputs[True][1][1]["rounds"] > 0  # the code draft speculated


def test_attention_backend_reaches_the_target_and_bad_names_are_refused(app_args):
    import pytest
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="attention_backend"):
        AppArgs.model_validate({**app_args, "attention_backend": "fastest"})
    assert AppArgs.model_validate(app_args).attention_backend == "auto"  # triton on CUDA, SDPA on the CPU
    args = AppArgs.model_validate({**app_args, "attention_backend": "triton", "max_batch_size": 2})
    core = GeneratorCore(args, registry=None)
    try:
        # On the CPU the triton backend hands every call to SDPA (or is SDPA, without the triton package).
        assert core.target.backend.name in ("triton", "sdpa")
        assert _complete(core, None, "plain")[0]
    finally:
        core.loop.stop()

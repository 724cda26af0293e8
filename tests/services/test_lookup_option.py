"""Draft version "lookup": a domain served by the n-gram lookup drafter (engine.lookup), no checkpoint."""

from services.config import AppArgs
from services.generator import GeneratorCore
from tests.services.test_fused_option import _complete


def test_a_domain_on_the_lookup_drafter_gives_plain_decoding_s_text_in_rounds(app_args):
    args = AppArgs.model_validate({**app_args, "max_batch_size": 2})
    core = GeneratorCore(args, registry=None)
    try:
        assert core.activate("code", "lookup") == "ok"
        assert core.versions["code"] == "lookup"
        assert type(core.loop.engine.drafts["code"]).__name__ == "LookupDraft"
        assert not core.loop.engine.drafts["code"].allot  # lookup_allot: off by default
        plain, (text, stats) = _complete(core, None, "plain"), _complete(core, "code", "lookup")
        assert text == plain[0] and stats["rounds"] > 0  # the lookup rounds' text is plain decoding's
        assert stats["drafter"] == "lookup"
        assert "governor" not in core.info()  # no governor here (the tests' app_args): nothing of its decisions
        assert core.activate("code", "v1") == "ok"  # back to a trained draft, as any version swap
        assert type(core.loop.engine.drafts["code"]).__name__ == "DraftModel"
    finally:
        core.loop.stop()


def test_trained_drafts_get_the_lookup_drafter_as_their_alternative_under_the_governor(app_args):
    """lookup_alternative (on by default, with the governor): each trained draft may be replaced per request by the
    lookup drafter, as the governor measures them; a domain on 'lookup' itself has no alternative; text unchanged."""
    args = AppArgs.model_validate({**app_args, "max_batch_size": 2, "governor": True})
    assert args.lookup_alternative
    core = GeneratorCore(args, registry=None)
    try:
        eng = core.loop.engine
        assert type(eng.drafts["lookup"]).__name__ == "LookupDraft"
        assert core.activate("code", "v1") == "ok"
        assert eng.alternatives == {"code": ("lookup",)}
        plain = _complete(core, None, "plain")
        runs = [_complete(core, "code", f"r{i}") for i in range(3)]  # the draft until measured, then lookup
        assert {text for text, _ in runs} == {plain[0]}
        assert {stats["drafter"] for _, stats in runs} == {"draft", "lookup"}
        samples = eng.governor.snapshot()["spec_samples"]
        assert samples.get("code@1", 0) > 0 and samples.get("code/lookup@1", 0) > 0  # both were measured
        governor = core.info()["governor"]  # in /health: what this replica's governor decided
        assert governor["decisions"]["speculate"] >= 3 and "batch_probes" in governor["decisions"]
        assert governor["samples_left_out"] >= 0
        assert core.activate("code", "lookup") == "ok"
        assert eng.alternatives == {}
    finally:
        core.loop.stop()
    off = GeneratorCore(AppArgs.model_validate({**app_args, "governor": True, "lookup_alternative": False}), registry=None)
    try:
        assert off.activate("code", "v1") == "ok"
        assert "lookup" not in off.loop.engine.drafts and off.loop.engine.alternatives == {}
        assert "governor" in off.info()
    finally:
        off.loop.stop()


def test_lookup_allot_reaches_the_lookup_drafter_and_keeps_plain_text(app_args):
    """lookup_allot: the domain's lookup drafter and every draft's lookup alternative allot a batch's verify tokens
    by row (LookupDraft(allot=True)); two requests at once, the same text as plain decoding."""
    import concurrent.futures

    args = AppArgs.model_validate({**app_args, "max_batch_size": 2, "governor": True, "lookup_allot": True})
    core = GeneratorCore(args, registry=None)
    try:
        assert core.loop.engine.drafts["lookup"].allot
        assert core.activate("code", "lookup") == "ok" and core.loop.engine.drafts["code"].allot
        plain = _complete(core, None, "plain")
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            runs = list(pool.map(lambda i: _complete(core, "code", f"a{i}"), range(2)))
        assert {text for text, _ in runs} == {plain[0]}
    finally:
        core.loop.stop()


def test_rows_prefilled_ahead_default_to_the_batch_less_one_on_cuda_and_reach_the_engine(app_args):
    """prefill_ahead: null means max_batch_size - 1, at most 7 (groups of up to eight, as measured), on CUDA (where it
    paid, bench/RESULTS.md run 45) and 0 on the CPU; a set value is taken as is, and the replica's engine holds that
    many rows beyond the batch."""
    import pytest
    from pydantic import ValidationError

    assert AppArgs(device="cuda", max_batch_size=8).engine_prefill_ahead() == 7
    assert AppArgs(device="cuda", max_batch_size=4).engine_prefill_ahead() == 3
    assert AppArgs(device="cuda", max_batch_size=32).engine_prefill_ahead() == 7
    assert AppArgs(device="cuda:1", max_batch_size=1).engine_prefill_ahead() == 0
    assert AppArgs(device="cuda", prefill_ahead=2).engine_prefill_ahead() == 2
    assert AppArgs(device="cpu").engine_prefill_ahead() == 0
    with pytest.raises(ValidationError, match="prefill_ahead"):
        AppArgs(prefill_ahead=-1)
    core = GeneratorCore(AppArgs.model_validate({**app_args, "max_batch_size": 2, "prefill_ahead": 3}), registry=None)
    try:
        eng = core.loop.engine
        assert eng.prefill_ahead == 3 and len(eng.slots) == 5
        assert _complete(core, None, "plain")[0]
    finally:
        core.loop.stop()

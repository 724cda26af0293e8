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
        plain, (text, stats) = _complete(core, None, "plain"), _complete(core, "code", "lookup")
        assert text == plain[0] and stats["rounds"] > 0  # the lookup rounds' text is plain decoding's
        assert core.activate("code", "v1") == "ok"  # back to a trained draft, as any version swap
        assert type(core.loop.engine.drafts["code"]).__name__ == "DraftModel"
    finally:
        core.loop.stop()

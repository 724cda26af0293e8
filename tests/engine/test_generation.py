"""Autoregressive generation: ragged batches, rollback, seeded sampling, stop conditions."""

from __future__ import annotations

import pytest
import torch

from engine.generate import generate, stream
from engine.requests import Request
from engine.sampling import SamplingParams
from engine.scheduler import DecodeEngine
from tests.conftest import drive


def _prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lengths]


def _engine(loaded, batch: int = 4, max_seq_len: int = 128) -> DecodeEngine:
    return DecodeEngine(loaded.model, loaded.tokenizer, max_batch_size=batch, max_seq_len=max_seq_len)


def test_ragged_batch_rows_equal_each_prompt_alone(tiny_target):
    prompts = _prompts(tiny_target.args.vocab_size, (3, 11, 1, 25))
    greedy = SamplingParams(max_new_tokens=20)
    sampled = [SamplingParams(max_new_tokens=20, temperature=0.9, top_p=0.95, seed=s) for s in range(4)]
    for params in (greedy, sampled):
        batched = generate(_engine(tiny_target), prompts, params)
        for i, prompt in enumerate(prompts):
            p = params[i] if isinstance(params, list) else params
            alone = generate(_engine(tiny_target, batch=1), [prompt], p)[0]
            assert batched[i].token_ids == alone.token_ids, f"row {i} (prompt length {len(prompt)})"
            assert len(alone.token_ids) == 20


def test_rows_joining_a_running_batch_are_unaffected(tiny_target):
    """A request admitted while others are mid-generation (continuous batching) gives what it gives alone."""
    prompts = _prompts(tiny_target.args.vocab_size, (9, 4, 14))
    params = SamplingParams(max_new_tokens=12)
    alone = [generate(_engine(tiny_target, batch=1), [p], params)[0].token_ids for p in prompts]
    eng = _engine(tiny_target, batch=2)
    eng.add_request(Request("a", prompts[0], params))
    got = {"a": [], "b": [], "c": []}
    for step in range(40):
        if step == 3:
            eng.add_request(Request("b", prompts[1], params))
            eng.add_request(Request("c", prompts[2], params))  # waits for a free row
        for out in eng.step():
            got[out.request_id].extend(out.token_ids)
        if not eng.has_work():
            break
    assert [got[k] for k in "abc"] == alone


def test_generation_after_rollback_equals_generation_from_scratch(tiny_target):
    """Re-admitting a request on a row with stale KV (prompt + part of its own output) continues exactly."""
    prompt = _prompts(tiny_target.args.vocab_size, (10,))[0]
    eng = _engine(tiny_target, batch=1)
    full = generate(eng, [prompt], SamplingParams(max_new_tokens=24))[0].token_ids
    # Same row, the cache still holds all 34 positions: generation must ignore slots past the new prompt.
    resumed = generate(eng, [prompt + full[:8]], SamplingParams(max_new_tokens=16))[0].token_ids
    assert resumed == full[8:]
    # A different continuation overwrites positions 10.. that held the first one.
    other = prompt + [(t + 1) % tiny_target.args.vocab_size for t in full[:5]]
    fresh = generate(_engine(tiny_target, batch=1), [other], SamplingParams(max_new_tokens=10))[0].token_ids
    assert generate(eng, [other], SamplingParams(max_new_tokens=10))[0].token_ids == fresh


def test_cache_rollback_then_new_tokens_matches_uncached_forward(tiny_target):
    model = tiny_target.model
    vocab = model.args.vocab_size
    first, second = _prompts(vocab, (20, 8), seed=5)
    cache = model.new_cache(1, 64)
    with torch.no_grad():
        model(torch.tensor([first]), torch.arange(20)[None], cache=cache, kv_len=20)
        cache.rollback(torch.tensor([0]), torch.tensor([12]))
        assert cache.lengths.tolist() == [12]
        # Positions 12..19 are overwritten by `second`; 20.. never written in this pass.
        got = model(torch.tensor([second]), torch.arange(12, 20)[None], cache=cache, kv_len=20).logits
        expected = model(torch.tensor([first[:12] + second]), torch.arange(20)[None]).logits[:, 12:]
    assert torch.allclose(got, expected, atol=1e-5)


def test_seeded_sampling_is_reproducible_and_seeds_differ(tiny_target):
    prompt = _prompts(tiny_target.args.vocab_size, (6,))[0]

    def run(seed, batch_size=1):
        params = SamplingParams(max_new_tokens=30, temperature=1.0, seed=seed)
        return generate(_engine(tiny_target, batch=batch_size), [prompt], params)[0].token_ids

    a = run(1234)
    assert run(1234) == a
    assert run(1234, batch_size=3) == a
    assert run(1235) != a
    assert run(7) != a


def test_max_new_tokens_is_exact_and_eos_stops(tiny_target):
    prompt = _prompts(tiny_target.args.vocab_size, (7,))[0]
    eng = _engine(tiny_target, batch=1)
    full = generate(eng, [prompt], SamplingParams(max_new_tokens=20, eos_token_ids=()))[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 20
    for n in (1, 2, 7):
        result = generate(eng, [prompt], SamplingParams(max_new_tokens=n, eos_token_ids=()))[0]
        assert result.token_ids == full.token_ids[:n] and result.finish_reason == "length"
    # The first token whose first occurrence is at index >= 3 becomes the EOS: output stops before it.
    cut = next(i for i, t in enumerate(full.token_ids) if i >= 3 and t not in full.token_ids[:i])
    eos = full.token_ids[cut]
    result = generate(eng, [prompt], SamplingParams(max_new_tokens=20, eos_token_ids=(eos,)))[0]
    assert result.token_ids == full.token_ids[:cut]
    assert result.finish_reason == "stop"


def test_stop_string_cuts_text(tiny_target):
    tok = tiny_target.tokenizer
    prompt = _prompts(tiny_target.args.vocab_size, (7,))[0]
    eng = _engine(tiny_target, batch=1)
    full = generate(eng, [prompt], SamplingParams(max_new_tokens=20, eos_token_ids=()))[0]
    assert full.text == tok.decode(full.token_ids, skip_special_tokens=True)
    words = full.text.split(" ")
    stop = " ".join(words[5:7])  # two words from the middle
    cut = full.text.find(stop)
    result = generate(eng, [prompt], SamplingParams(max_new_tokens=20, eos_token_ids=(), stop=(stop,)))[0]
    assert result.finish_reason == "stop"
    assert result.text == full.text[:cut]


def test_stream_yields_deltas_that_add_up(tiny_target):
    prompt = _prompts(tiny_target.args.vocab_size, (5,))[0]
    eng = _engine(tiny_target, batch=2)
    params = SamplingParams(max_new_tokens=15, eos_token_ids=())
    whole = generate(eng, [prompt], params)[0]
    outs = list(stream(eng, prompt, params))
    assert outs[-1].finished and all(not o.finished for o in outs[:-1])
    assert sum((o.token_ids for o in outs), []) == whole.token_ids
    assert "".join(o.text for o in outs) == whole.text
    assert outs[-1].completion_tokens == 15
    assert not eng.has_work()


def test_min_admit_groups_admissions_into_fewer_prefills(tiny_target, monkeypatch):
    """Offline batches (min_admit > 1): requests wait until enough rows are free, then prefill together.
    Same tokens, greedy and seeded sampling; far fewer prefill passes; the last stragglers still run."""
    vocab = tiny_target.args.vocab_size
    prompts = _prompts(vocab, [3 + (7 * i) % 19 for i in range(24)])
    params = [SamplingParams(max_new_tokens=4 + (5 * i) % 17, eos_token_ids=(),
                             temperature=0.9 if i % 2 else 0.0, seed=i) for i in range(24)]

    def run(min_admit):
        eng = DecodeEngine(tiny_target.model, tiny_target.tokenizer, max_batch_size=8, max_seq_len=128,
                           min_admit=min_admit)
        sizes = []
        real = eng._prefill
        monkeypatch.setattr(eng, "_prefill", lambda batch: (sizes.append(len(batch)), real(batch))[1])
        return [r.token_ids for r in generate(eng, prompts, params)], sizes

    one, one_sizes = run(1)
    grouped, grouped_sizes = run(4)
    assert grouped == one and all(len(t) == p.max_new_tokens for t, p in zip(grouped, params))
    assert sum(grouped_sizes) == sum(one_sizes) == 24
    assert all(n >= 4 for n in grouped_sizes[:-1]), grouped_sizes  # only the last group may be the smaller rest
    assert len(grouped_sizes) < len(one_sizes) / 2, (grouped_sizes, one_sizes)
    with pytest.raises(ValueError, match="min_admit"):
        DecodeEngine(tiny_target.model, None, min_admit=0)


# ----- overlapped plain decoding (DecodeEngine(overlap=True); graphs emulated on the CPU) ------------------


def _overlapped(loaded, batch: int = 3, overlap: bool = True, **kw) -> DecodeEngine:
    eng = DecodeEngine(loaded.model, loaded.tokenizer, max_batch_size=batch, max_seq_len=128, cuda_graphs="emulate",
                       ar_steps_per_sync=4, overlap=overlap, **kw)
    eng.resolved = 0
    real = eng._resolve_ahead

    def counted():
        eng.resolved += 1
        return real()

    eng._resolve_ahead = counted
    return eng


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_overlapped_calls_give_the_same_tokens_text_and_stops(tiny_target, sampled):
    """Each call's successor launched before its tokens are read: the same tokens and text as one call at a
    time, rows of different lengths, an EOS and a stop string met mid-call (their rows' work in the call
    launched meanwhile is dropped), and nothing left running."""
    prompts = _prompts(tiny_target.args.vocab_size, (3, 11, 6))
    base = [SamplingParams(max_new_tokens=n, eos_token_ids=(), temperature=0.9 if sampled else 0.0, seed=i)
            for i, n in enumerate((30, 23, 41))]
    full = generate(_overlapped(tiny_target, overlap=False), prompts, base)
    eos = full[0].token_ids[13]  # row 0 stops there (or earlier, where that token came first)
    words = full[2].text.split(" ")
    stop = " ".join(words[4:6]) if len(words) > 6 else full[2].text[10:14]
    params = [SamplingParams(max_new_tokens=30, eos_token_ids=(eos,), temperature=base[0].temperature, seed=0), base[1],
              SamplingParams(max_new_tokens=41, eos_token_ids=(), temperature=base[2].temperature, seed=2, stop=(stop,))]
    one_at_a_time = generate(_overlapped(tiny_target, overlap=False), prompts, params)
    eng = _overlapped(tiny_target)
    overlapped = generate(eng, prompts, params)
    assert [r.token_ids for r in overlapped] == [r.token_ids for r in one_at_a_time]
    assert [r.text for r in overlapped] == [r.text for r in one_at_a_time]
    assert [r.finish_reason for r in overlapped] == [r.finish_reason for r in one_at_a_time] == ["stop", "length", "stop"]
    assert eng.resolved >= 2 and not eng.has_work()


def test_an_overlapped_plain_call_is_priced_from_the_last_read_the_host_s_work_between_reads_included(tiny_target):
    """Chained calls run back to back on the device, so what a plain token costs is the time between the reads of
    successive calls, the host's work between them included (as a chained round is timed): 20 ms of host work a
    step, on calls of 4 tokens, is at least 5 ms a token; timed from each step's start it fell outside."""
    import time

    from engine.governor import SpeculationGovernor

    gov = SpeculationGovernor()
    eng = _overlapped(tiny_target, batch=1, governor=gov)
    eng.add_request(Request("a", _prompts(tiny_target.args.vocab_size, (5,))[0],
                            SamplingParams(max_new_tokens=41, eos_token_ids=())))
    while eng.has_work():
        eng.step()
        time.sleep(0.02)  # the host's own work between steps (a server's, say)
    assert eng.resolved >= 5
    assert gov.snapshot()["ar_samples"][1] >= 5
    assert gov.snapshot()["ar_seconds_per_token"][1] >= 0.02 / 4


def test_an_overlapped_batch_makes_way_for_a_waiting_request_and_a_cancelled_row(tiny_target):
    """A request arriving while a call is in flight is admitted at the next step (the chain stops for it) and
    is unaffected; a row cancelled with a call in flight loses that call's tokens, the others keep theirs."""
    prompts = _prompts(tiny_target.args.vocab_size, (9, 4, 14))
    params = SamplingParams(max_new_tokens=30, eos_token_ids=())
    alone = [generate(_engine(tiny_target, batch=1), [p], params)[0].token_ids for p in prompts]
    eng = _overlapped(tiny_target)
    eng.add_request(Request("a", prompts[0], params))
    eng.add_request(Request("b", prompts[1], params))

    def arrive(e):
        assert e._ahead is not None  # a call in flight
        e.add_request(Request("c", prompts[2], params))

    got, first = drive(eng, {3: arrive, 5: lambda e: e.cancel("b")})
    assert first["c"] <= 4  # at most one step behind the call in flight
    assert got["a"] == alone[0] and got["c"] == alone[2]
    assert got["b"] == alone[1][: len(got["b"])] and len(got["b"]) < 30
    assert eng.resolved > 0 and not eng.has_work()

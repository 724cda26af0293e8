"""The Generator's stream: engine steps that pile up while the consumer is busy go out as one delta."""

from __future__ import annotations

import asyncio
import threading

from engine.requests import RequestOutput
from services.batcher import StreamError
from services.generator import GeneratorCore


class FakeLoop:
    """Stands in for the engine loop: submit() hands back a queue already holding `items`."""

    def __init__(self, items) -> None:
        self.items = items
        self.cancelled: list[str] = []

    def submit(self, request):
        queue: asyncio.Queue = asyncio.Queue()
        for item in self.items:
            queue.put_nowait(item)
        return queue

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)


def core_with(items) -> GeneratorCore:
    core = GeneratorCore.__new__(GeneratorCore)  # no model: only the streaming path is under test
    core.loaded = threading.Event()
    core.loaded.set()
    core.replica = "r0"
    core.loop = FakeLoop(items)
    core._prepare = lambda req: (type("Req", (), {"request_id": "x"})(), {"draft_version": None, "prompt_tokens": 3})
    return core


def out(text: str, n: int, finished: bool = False) -> RequestOutput:
    return RequestOutput("x", list(range(n)), text, finished, "length" if finished else None, 3, 0)


def collect(core: GeneratorCore) -> list[dict]:
    async def run():
        return [item async for item in core.generate({})]

    return asyncio.run(run())


def test_queued_steps_merge_into_one_delta_and_the_text_is_whole():
    items = collect(core_with([out("Hel", 2), out("lo", 1), out(" world", 2, finished=True)]))
    assert [i["type"] for i in items] == ["start", "delta"]
    delta = items[1]
    assert delta["text"] == "Hello world" and delta["tokens"] == 5 and delta["finished"]
    assert delta["finish_reason"] == "length"


def test_an_error_after_queued_steps_still_delivers_their_text_then_the_error():
    core = core_with([out("a", 1), out("b", 1), StreamError(500, "replica lost its GPU")])
    items = collect(core)
    assert [i["type"] for i in items] == ["start", "delta", "error"]
    assert items[1]["text"] == "ab" and items[1]["tokens"] == 2 and not items[1]["finished"]
    assert items[2]["status"] == 500 and "GPU" in items[2]["message"]
    assert core.loop.cancelled == []  # the engine already dropped the request


def test_a_consumer_that_keeps_up_gets_one_delta_per_step():
    """Items arriving one at a time (an empty queue between them) are not held back."""
    core = core_with([])
    steps = [out("a", 1), out("b", 1), out("c", 1, finished=True)]

    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        core.loop.submit = lambda request: queue
        gen = core.generate({})
        got = [await gen.__anext__()]  # start
        for step in steps:
            queue.put_nowait(step)
            got.append(await gen.__anext__())
        return got

    got = asyncio.run(run())
    assert [g.get("text") for g in got[1:]] == ["a", "b", "c"]


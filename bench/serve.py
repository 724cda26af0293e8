"""Serving benchmark: concurrent streaming clients against the real app, speculation on vs off side by side.

    python -m bench.serve [--duration 15] [--clients 1,4,16] [--max-tokens 64] [--out bench/results_serve.md]

Starts Ray and the app (serve config args, default model) in this process, then for each client
count runs the same closed loop twice, `speculation: true` and `false` (a request field), and
prints requests/s, tokens/s, time to first token and time per output token (p50/p99), errors.
Drafts: the store's active versions (or the shipped demo drafts); when a domain has none, an
untrained early-exit draft (the target's own layers, tied head) is published to a temporary store.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.ar import git_commit

PROMPTS = [
    ("code", "Write a Python function that checks whether a string is a palindrome."),
    ("code", "Explain what this does: for i in range(10): print(i * i)"),
    ("general", "Summarize the causes of the French Revolution in a few sentences."),
    ("general", "What is photosynthesis and why does it matter?"),
    ("dialog", "Hi! How was your weekend? Mine was pretty relaxing."),
    ("dialog", "I'm feeling a bit tired today, any tips to cheer up?"),
]


NOTE = {"untrained": "The drafts are untrained early exits that accept few tokens: this table measures the serving "
                     "path and what speculation costs when it does not pay, not FlashSpec's speedup with trained drafts.\n\n"}


@dataclass
class Cell:
    clients: int
    speculation: bool
    seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    tokens: int = 0
    requests: int = 0
    errors: int = 0
    drafted: int = 0
    accepted: int = 0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, speculation: bool, cell: Cell):
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "speculation": speculation}
    start = time.perf_counter()
    first = None
    final = None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                cell.errors += 1
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    cell.errors += 1
                    return
                if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    first = time.perf_counter()
                if "usage" in chunk:
                    final = chunk
    except httpx.HTTPError:
        cell.errors += 1
        return
    end = time.perf_counter()
    if final is None:
        cell.errors += 1
        return
    n = final["usage"]["completion_tokens"]
    cell.requests += 1
    cell.tokens += n
    first = first or end
    cell.ttft.append(first - start)
    if n > 1:
        cell.tpot.append((end - first) / (n - 1))
    stats = final["flashspec"]["stats"]
    if stats:
        cell.drafted += stats["drafted"]
        cell.accepted += stats["accepted"]


async def run_cell(url: str, cell: Cell, duration: float, max_tokens: int) -> None:
    deadline = time.perf_counter() + duration

    async def client_loop(index: int) -> None:
        async with httpx.AsyncClient(timeout=600) as client:
            i = index
            while time.perf_counter() < deadline:
                await one_request(client, url, PROMPTS[i % len(PROMPTS)][1], max_tokens, cell.speculation, cell)
                i += 1

    start = time.perf_counter()
    await asyncio.gather(*(client_loop(i) for i in range(cell.clients)))
    cell.seconds = time.perf_counter() - start


def ensure_drafts(model: str, store_root: str | None) -> tuple[str | None, str]:
    """(draft_store to serve from, description of the drafts)."""
    from drafts.config import DraftConfig
    from drafts.model import DraftModel
    from drafts.store import DraftStore, resolve_draft

    found = {d: resolve_draft(d, store_root=store_root) for d in ("code", "general", "dialog")}
    if all(found.values()):
        return store_root, "store/demo drafts: " + ", ".join(f"{d}={p.name}" for d, p in found.items())
    from engine.loading import load_model

    target = load_model(model).model
    root = tempfile.mkdtemp(prefix="flashspec-bench-store-")
    store = DraftStore(root)
    for domain in ("code", "general", "dialog"):
        draft = DraftModel(target, DraftConfig(head="mlp_tied"), name=domain, version="early-exit")
        draft.init_from_target()
        store.publish(draft, domain, "early-exit", dtype=target.embed_tokens.weight.dtype)
        store.activate(domain, "early-exit", gate=False)
    n = draft.shared_layers + draft.adapter_layers
    return root, f"untrained early-exit drafts (target layers 0..{n - 1} + tied head; no trained drafts found)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="services/serve_config.yaml")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds per (clients, speculation) cell")
    parser.add_argument("--clients", default="1,4,16")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--port", type=int, default=8020)
    parser.add_argument("--out", default="bench/results_serve.md")
    args = parser.parse_args(argv)

    from ray import serve

    from services.app import build_app
    from services.config import ServeConfig
    from services.run import start_ray

    config = ServeConfig.from_yaml(args.config).applications[0]
    store, drafts_note = ensure_drafts(config.args.model, config.args.draft_store)
    app_args = config.args.model_copy(update={"draft_store": store, "max_batch_size": max(config.args.max_batch_size, 16),
                                              "max_queue": max(config.args.max_queue, 16)})
    options = config.deployment_options()
    start_ray()
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    serve.run(build_app(app_args, options), name="bench", route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{args.port}"
    health = httpx.get(f"{base}/health", timeout=120).json()
    url = f"{base}/v1/chat/completions"
    asyncio.run(run_cell(url, Cell(1, True), 3.0, 8))  # warm-up

    cells = []
    for clients in [int(c) for c in args.clients.split(",")]:
        for speculation in (True, False):
            cell = Cell(clients, speculation)
            asyncio.run(run_cell(url, cell, args.duration, args.max_tokens))
            cells.append(cell)
            print(f"clients={clients} speculation={'on' if speculation else 'off'}: {cell.requests} requests, "
                  f"{cell.tokens / cell.seconds:.1f} tok/s, {cell.errors} errors", flush=True)
    serve.shutdown()

    rows = ["| clients | speculation | req/s | tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | acceptance | errors |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ratios = []
    for cell in cells:
        acc = f"{cell.accepted / cell.drafted:.2f}" if cell.drafted else "-"
        rows.append(f"| {cell.clients} | {'on' if cell.speculation else 'off'} | {cell.requests / cell.seconds:.2f} | "
                    f"{cell.tokens / cell.seconds:.1f} | {pct(cell.ttft, .5) * 1e3:.0f} | {pct(cell.ttft, .99) * 1e3:.0f} | "
                    f"{pct(cell.tpot, .5) * 1e3:.1f} | {pct(cell.tpot, .99) * 1e3:.1f} | {acc} | {cell.errors} |")
    for on, off in zip(cells[::2], cells[1::2]):
        ratio = (on.tokens / on.seconds) / (off.tokens / off.seconds) if off.tokens else float("nan")
        ratios.append(f"{on.clients} clients: {ratio:.2f}x")
    setup = (f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, commit {git_commit()}\n"
             f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs (shared), "
             f"device {config.args.device}, model {health.get('model')}, dtype {config.args.dtype}\n"
             f"- app: 1 Generator replica, max_batch_size {app_args.max_batch_size}, gamma {app_args.num_speculative_tokens}, "
             f"block {app_args.block_size}, governor {'on' if app_args.governor else 'off'}\n"
             f"- drafts: {drafts_note}\n"
             f"- load: closed loop, each client streams chat requests (6 prompts, code/general/dialog), greedy, "
             f"max_tokens {args.max_tokens}, {args.duration:.0f} s per cell; clients and server on the same machine\n")
    text = ("# Serving benchmark (CPU): speculation on vs off\n\n" + setup + "\n" + "\n".join(rows) +
            "\n\nTokens/s ratio, speculation on / off: " + ", ".join(ratios) +
            f"\nErrors (must be 0): {sum(c.errors for c in cells)}\n\n" + NOTE.get(drafts_note.split(" ")[0], "") +
            f"Reproduce: `python -m bench.serve --duration {args.duration:.0f} --clients {args.clients} "
            f"--max-tokens {args.max_tokens}`\n")
    print(text)
    Path(args.out).write_text(text)
    return 0 if all(c.errors == 0 for c in cells) else 1


if __name__ == "__main__":
    raise SystemExit(main())

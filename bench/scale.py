"""Scale-out saturation benchmark: the real app with R Generator replicas under C streaming clients.

    python -m bench.scale --replicas 1,2 --clients 64 --duration 60 --max-tokens 128 --device cuda
    python -m bench.scale --device cpu --replicas 1,2 --clients 4 --duration 8 --max-tokens 16   # smoke test

Starts Ray once (every CPU and GPU of this machine) and the Serve HTTP proxy, then for each replica
count R deploys the app of the serve config (`build_app`, its `args` with `device`, `max_batch_size`,
`max_queue` overridden; Generator `num_replicas=R`, one GPU each on CUDA; Ingress and Router
`--ingress-replicas` each), waits for /health and every Generator replica, warms every replica with
the measured load itself (CUDA graphs are captured on first use of each shape), then runs a closed loop
of C streaming clients for D seconds (bench/serve.py's request loop) and deletes the app. Prints and
writes a markdown table (requests/s, output tokens/s, TTFT and TPOT p50/p99, errors, requests per
replica from the `X-FlashSpec-Replica` response header) and the throughput ratio of the replica counts,
all measured in this one run. Exits 1 on any request error or failed deployment.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing
import os
import platform
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from bench.ar import git_commit
from bench.serve import PROMPTS, Cell, ensure_drafts, one_request, pct

REPLICA_HEADER = "x-flashspec-replica"
APP_PREFIX = "scale-r"


# ----- results and report (pure: no Ray, no network) ------------------------------------------------
@dataclass
class Row:
    """One measured cell: R Generator replicas, one speculation setting, C clients."""

    replicas: int
    speculation: bool
    clients: int
    seconds: float
    requests: int
    tokens: int
    errors: int
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    drafted: int = 0
    accepted: int = 0
    per_replica: dict[str, int] = field(default_factory=dict)
    error_statuses: dict[str, int] = field(default_factory=dict)

    @property
    def req_per_s(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @classmethod
    def from_cell(cls, cell: Cell, replicas: int, per_replica: dict[str, int] | None = None,
                  error_statuses: dict[str, int] | None = None) -> "Row":
        return cls(replicas=replicas, speculation=cell.speculation, clients=cell.clients, seconds=cell.seconds,
                   requests=cell.requests, tokens=cell.tokens, errors=cell.errors,
                   ttft_p50=pct(cell.ttft, 0.5), ttft_p99=pct(cell.ttft, 0.99),
                   tpot_p50=pct(cell.tpot, 0.5), tpot_p99=pct(cell.tpot, 0.99),
                   drafted=cell.drafted, accepted=cell.accepted,
                   per_replica=dict(per_replica or {}), error_statuses=dict(error_statuses or {}))


def _on_off(speculation: bool) -> str:
    return "on" if speculation else "off"


def _ms(seconds: float, digits: int) -> str:
    return "-" if seconds != seconds else f"{seconds * 1e3:.{digits}f}"  # NaN: no sample


def replica_split(per_replica: dict[str, int]) -> str:
    """'id: n / id: n', most requests first; '-' when the responses named no replica."""
    if not per_replica:
        return "-"
    return " / ".join(f"{rid}: {n}" for rid, n in sorted(per_replica.items(), key=lambda kv: (-kv[1], kv[0])))


def markdown_table(rows: list[Row]) -> str:
    lines = ["| Generator replicas | speculation | clients | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | "
             "TPOT p50 ms | TPOT p99 ms | acceptance | errors | requests per replica |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        acceptance = f"{r.accepted / r.drafted:.2f}" if r.drafted else "-"
        lines.append(f"| {r.replicas} | {_on_off(r.speculation)} | {r.clients} | {r.req_per_s:.2f} | {r.tok_per_s:.1f} | "
                     f"{_ms(r.ttft_p50, 0)} | {_ms(r.ttft_p99, 0)} | {_ms(r.tpot_p50, 1)} | {_ms(r.tpot_p99, 1)} | "
                     f"{acceptance} | {r.errors} | {replica_split(r.per_replica)} |")
    return "\n".join(lines)


def scale_ratios(rows: list[Row]) -> list[str]:
    """Per speculation setting: output tokens/s of each replica count over the smallest one measured.

    -> ['throughput R=2 / R=1: 1.93x (output tokens/s, speculation on; requests/s 1.95x)', ...]
    """
    out = []
    for speculation in sorted({r.speculation for r in rows}, reverse=True):
        same = sorted((r for r in rows if r.speculation == speculation), key=lambda r: r.replicas)
        if len(same) < 2:
            continue
        base = same[0]
        for r in same[1:]:
            tok = f"{r.tok_per_s / base.tok_per_s:.2f}x" if base.tok_per_s > 0 else "n/a"
            req = f"{r.req_per_s / base.req_per_s:.2f}x" if base.req_per_s > 0 else "n/a"
            out.append(f"throughput R={r.replicas} / R={base.replicas}: {tok} "
                       f"(output tokens/s, speculation {_on_off(speculation)}; requests/s {req})")
    return out


def speculation_ratios(rows: list[Row]) -> list[str]:
    """Per replica count measured both ways: output tokens/s with speculation on over off."""
    out = []
    for replicas in sorted({r.replicas for r in rows}):
        on = [r for r in rows if r.replicas == replicas and r.speculation]
        off = [r for r in rows if r.replicas == replicas and not r.speculation]
        if on and off:
            ratio = f"{on[0].tok_per_s / off[0].tok_per_s:.2f}x" if off[0].tok_per_s > 0 else "n/a"
            out.append(f"speculation on / off at R={replicas}: {ratio}")
    return out


def uneven_replicas(rows: list[Row]) -> list[str]:
    """Warnings for cells where fewer replicas answered than were deployed (only when the header was seen)."""
    return [f"R={r.replicas}, speculation {_on_off(r.speculation)}: only {len(r.per_replica)} of {r.replicas} "
            f"replicas served requests" for r in rows if r.per_replica and len(r.per_replica) < r.replicas]


def render_report(title: str, setup: list[str], rows: list[Row], failures: list[str], reproduce: str) -> str:
    errors = sum(r.errors for r in rows)
    parts = [f"# {title}", "", *[f"- {line}" for line in setup], "", markdown_table(rows), ""]
    parts += scale_ratios(rows) or ["throughput ratio: n/a (fewer than two replica counts measured)"]
    parts += speculation_ratios(rows)
    parts.append(f"Errors (must be 0): {errors}")
    statuses = Counter()
    for r in rows:
        statuses.update(r.error_statuses)
    if statuses:
        parts.append("Error kinds: " + ", ".join(f"{k} x{n}" for k, n in sorted(statuses.items())))
    for warning in uneven_replicas(rows):
        parts.append(f"WARNING: {warning}")
    for failure in failures:
        parts.append(f"FAILED: {failure}")
    parts += ["", f"Reproduce: `{reproduce}`", ""]
    return "\n".join(parts)


# ----- load (closed loop of streaming clients, possibly over several processes) -----------------------
async def one_request_whole(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, speculation: bool,
                            cell: Cell, per_replica: Counter) -> None:
    """One non-streaming request: latency goes in cell.ttft (the whole answer is the first byte), no TPOT."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": False, "speculation": speculation}
    start = time.perf_counter()
    try:
        response = await client.post(url, json=body)
        if response.status_code != 200:
            cell.errors += 1
            return
        data = response.json()
    except (httpx.HTTPError, ValueError):
        cell.errors += 1
        return
    cell.ttft.append(time.perf_counter() - start)
    cell.requests += 1
    cell.tokens += data["usage"]["completion_tokens"]
    flashspec = data.get("flashspec") or {}
    if flashspec.get("replica"):
        per_replica[flashspec["replica"]] += 1
    stats = flashspec.get("stats")
    if stats:
        cell.drafted += stats["drafted"]
        cell.accepted += stats["accepted"]


async def _load(url: str, clients: int, first_client: int, duration: float, max_tokens: int, speculation: bool,
                start_at: float, stream: bool = True) -> dict:
    """C clients from `start_at` (wall clock) for `duration` s; bench.serve.one_request does each request."""
    cell = Cell(clients, speculation)
    per_replica: Counter = Counter()
    statuses: Counter = Counter()

    async def on_response(response: httpx.Response) -> None:
        if response.status_code == 200:
            if not stream:  # counted from the body by one_request_whole
                return
            replica = response.headers.get(REPLICA_HEADER)
            if replica:
                per_replica[replica] += 1
            return
        try:
            body = (await response.aread()).decode("utf-8", "replace")
            code = json.loads(body)["error"].get("code")
        except Exception:
            code = None
        statuses[f"HTTP {response.status_code}" + (f" {code}" if code else "")] += 1

    await asyncio.sleep(max(0.0, start_at - time.time()))
    deadline = start_at + duration

    async def client_loop(index: int) -> None:
        limits = httpx.Limits(max_connections=4, max_keepalive_connections=4)
        async with httpx.AsyncClient(timeout=600, limits=limits, event_hooks={"response": [on_response]}) as client:
            i = index
            while time.time() < deadline:
                if stream:
                    await one_request(client, url, PROMPTS[i % len(PROMPTS)][1], max_tokens, speculation, cell)
                else:
                    await one_request_whole(client, url, PROMPTS[i % len(PROMPTS)][1], max_tokens, speculation, cell,
                                            per_replica)
                i += 1

    await asyncio.gather(*(client_loop(first_client + k) for k in range(clients)))
    cell.seconds = time.time() - start_at
    errors_by_status = sum(statuses.values())
    if cell.errors > errors_by_status:  # failures with no HTTP error status
        statuses["connection error or error event in the stream"] += cell.errors - errors_by_status
    return {"cell": asdict(cell), "per_replica": dict(per_replica), "statuses": dict(statuses)}


def _load_worker(*args) -> dict:
    return asyncio.run(_load(*args))


def _merge(parts: list[dict], clients: int, speculation: bool) -> tuple[Cell, Counter, Counter]:
    cell = Cell(clients, speculation)
    per_replica: Counter = Counter()
    statuses: Counter = Counter()
    for part in parts:
        c = part["cell"]
        cell.seconds = max(cell.seconds, c["seconds"])
        cell.ttft += c["ttft"]
        cell.tpot += c["tpot"]
        for name in ("tokens", "requests", "errors", "drafted", "accepted"):
            setattr(cell, name, getattr(cell, name) + c[name])
        per_replica.update(part["per_replica"])
        statuses.update(part["statuses"])
    return cell, per_replica, statuses


def run_load(url: str, clients: int, duration: float, max_tokens: int, speculation: bool,
             pool: ProcessPoolExecutor | None, procs: int, stream: bool = True) -> tuple[Cell, Counter, Counter]:
    """One closed-loop cell, the clients spread over `procs` processes (one event loop each)."""
    procs = max(1, min(procs, clients))
    shares = [clients // procs + (1 if k < clients % procs else 0) for k in range(procs)]
    firsts = [sum(shares[:k]) for k in range(procs)]
    if pool is None or procs == 1:
        parts = [asyncio.run(_load(url, clients, 0, duration, max_tokens, speculation, time.time(), stream))]
    else:
        start_at = time.time() + 2.0  # every process starts its clients at the same moment
        futures = [pool.submit(_load_worker, url, n, first, duration, max_tokens, speculation, start_at, stream)
                   for n, first in zip(shares, firsts)]
        parts = [f.result() for f in futures]
    return _merge(parts, clients, speculation)


# ----- the app ---------------------------------------------------------------------------------------
def _wait_ready(app_name: str, base: str, replicas: int, timeout: float) -> dict:
    """Block until the app runs with `replicas` RUNNING Generator replicas and /health answers 200."""
    from ray import serve

    deadline = time.monotonic() + timeout
    last = "no status yet"
    while time.monotonic() < deadline:
        app = serve.status().applications.get(app_name)
        running = 0
        if app is not None:
            if str(getattr(app.status, "value", app.status)) == "DEPLOY_FAILED":
                raise RuntimeError(f"app {app_name} failed to deploy: {app.message}")
            generator = app.deployments.get("Generator")
            if generator is not None:
                running = sum(n for state, n in generator.replica_states.items()
                              if str(getattr(state, "value", state)) == "RUNNING")
        try:
            health = httpx.get(f"{base}/health", timeout=15)
            last = f"{running}/{replicas} Generator replicas running, /health {health.status_code}"
            if running >= replicas and health.status_code == 200:
                return health.json()
        except httpx.HTTPError as exc:
            last = f"{running}/{replicas} Generator replicas running, /health {type(exc).__name__}"
        time.sleep(1.0)
    raise RuntimeError(f"app {app_name} not ready within {timeout:.0f} s ({last})")


def _warm(url: str, replicas: int, clients: int, max_tokens: int, speculation: bool, seconds: float,
          timeout: float, pool, procs: int, stream: bool = True) -> tuple[int, int, Counter]:
    """Run the measured load for `seconds`, then more short rounds until every replica has answered.

    -> (replicas seen, warm-up errors, error kinds).
    """
    deadline = time.monotonic() + timeout
    seen: Counter = Counter()
    errors, statuses = 0, Counter()
    rounds = 0
    while True:
        cell, per_replica, kinds = run_load(url, clients, seconds if rounds == 0 else 2.0, max_tokens, speculation,
                                            pool, procs, stream)
        rounds += 1
        seen.update(per_replica)
        errors += cell.errors
        statuses.update(kinds)
        if len(seen) >= replicas or time.monotonic() > deadline:
            return len(seen), errors, statuses


def _machine(device: str) -> tuple[str, int]:
    """(accelerator or CPU name, GPU count)."""
    if device.startswith("cuda"):
        try:
            import torch

            if torch.cuda.is_available():
                return torch.cuda.get_device_name(0), torch.cuda.device_count()
        except Exception as exc:  # the report says so rather than failing the run
            return f"unknown GPU ({type(exc).__name__})", 0
        return "no CUDA device visible", 0
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return name, 0


def parse_replicas(text: str) -> list[int]:
    values = sorted({int(v) for v in text.split(",") if v.strip()})
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"--replicas wants positive counts like 1,2; got {text!r}")
    return values


def speculation_modes(text: str) -> list[bool]:
    return {"on": [True], "off": [False], "both": [True, False]}[text]


def cpu_budget(max_replicas: int, generator_cpus: float, front_replicas: int, front_cpus: float) -> float:
    """CPUs the largest deployment reserves: R Generators + Ingress and Router replicas."""
    return max_replicas * generator_cpus + 2 * front_replicas * front_cpus


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="services/serve_config.yaml", help="serve config (args and Generator user_config)")
    parser.add_argument("--replicas", type=parse_replicas, default=parse_replicas("1,2"), help="Generator replica counts, e.g. 1,2")
    parser.add_argument("--clients", type=int, default=64, help="concurrent streaming clients (closed loop)")
    parser.add_argument("--duration", type=float, default=60.0, help="measured seconds per cell")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--device", default="cuda", help="cpu or cuda (each Generator replica takes one GPU)")
    parser.add_argument("--speculation", choices=("on", "off", "both"), default="on")
    parser.add_argument("--max-batch-size", type=int, default=32, help="running requests per Generator replica")
    parser.add_argument("--max-queue", type=int, default=None,
                        help="waiting requests per replica beyond the batch (default: max(config, clients), so no 503)")
    parser.add_argument("--ingress-replicas", type=int, default=2, help="Ingress replicas, and Router replicas")
    parser.add_argument("--generator-cpus", type=float, default=None, help="num_cpus per Generator (default 2 cuda, 0.5 cpu)")
    parser.add_argument("--ingress-cpus", type=float, default=None, help="num_cpus per Ingress / Router (default 1 cuda, 0.25 cpu)")
    parser.add_argument("--client-procs", type=int, default=None,
                        help="processes the clients are spread over (default 4 on cuda, 1 on cpu)")
    parser.add_argument("--warmup", type=float, default=None, help="warm-up seconds per cell under the measured load "
                                                                    "(default 20 cuda, 3 cpu); more until every replica answered")
    parser.add_argument("--ready-timeout", type=float, default=900.0, help="seconds to wait for the app and all replicas")
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs Ray may use (default: all)")
    parser.add_argument("--no-stream", dest="stream", action="store_false",
                        help="non-streaming requests (one JSON answer each; TTFT column = whole-request latency)")
    parser.add_argument("--access-log", action="store_true",
                        help="keep Ray Serve's per-request access log (off by default: at saturation it costs CPU in every replica)")
    parser.add_argument("--graph-warmup-tokens", type=int, default=None,
                        help="Generator graph_warmup_tokens (default: the serve config's; 0: capture on first use)")
    parser.add_argument("--port", type=int, default=8030)
    parser.add_argument("--commit", default=None, help="commit to report (default: git rev-parse, else 'unknown')")
    parser.add_argument("--out", default="bench/results_scale.md")
    args = parser.parse_args(argv)

    cuda = args.device.startswith("cuda")
    generator_cpus = args.generator_cpus if args.generator_cpus is not None else (2.0 if cuda else 0.5)
    front_cpus = args.ingress_cpus if args.ingress_cpus is not None else (1.0 if cuda else 0.25)
    procs = args.client_procs if args.client_procs is not None else (4 if cuda else 1)
    warmup = args.warmup if args.warmup is not None else (20.0 if cuda else 3.0)
    modes = speculation_modes(args.speculation)

    from services.config import ServeConfig

    config = ServeConfig.from_yaml(args.config).applications[0]
    store, drafts_note = ensure_drafts(config.args.model, config.args.draft_store)
    app_args = config.args.model_copy(update={
        "device": args.device, "draft_store": store, "max_batch_size": args.max_batch_size,
        "max_queue": args.max_queue if args.max_queue is not None else max(config.args.max_queue, args.clients),
        **({"graph_warmup_tokens": args.graph_warmup_tokens} if args.graph_warmup_tokens is not None else {})})
    options = config.deployment_options()
    machine, gpu_count = _machine(args.device)
    need = cpu_budget(max(args.replicas), generator_cpus, args.ingress_replicas, front_cpus)

    import ray
    from ray import serve

    from services.app import build_app
    from services.run import start_ray

    start_ray(num_cpus=args.num_cpus)
    resources = ray.cluster_resources()
    ray_cpus, ray_gpus = resources.get("CPU", 0.0), resources.get("GPU", 0.0)
    if need > ray_cpus + 1e-6:
        print(f"error: R={max(args.replicas)} needs {need:g} CPUs ({generator_cpus:g} per Generator, {front_cpus:g} per "
              f"Ingress/Router x {args.ingress_replicas} each); Ray has {ray_cpus:g}: lower --generator-cpus / "
              f"--ingress-cpus / --ingress-replicas", file=sys.stderr)
        ray.shutdown()
        return 2
    if cuda and max(args.replicas) > ray_gpus:
        print(f"error: R={max(args.replicas)} Generator replicas need {max(args.replicas)} GPUs; Ray sees {ray_gpus:g}",
              file=sys.stderr)
        ray.shutdown()
        return 2

    logging_config = {"enable_access_log": args.access_log}
    serve.start(http_options={"host": "127.0.0.1", "port": args.port}, logging_config=logging_config)
    base = f"http://127.0.0.1:{args.port}"
    url = f"{base}/v1/chat/completions"
    pool = ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn")) if procs > 1 else None
    rows: list[Row] = []
    failures: list[str] = []
    health: dict = {}
    warm_notes: list[str] = []
    try:
        for replicas in args.replicas:
            name = f"{APP_PREFIX}{replicas}"
            deployments = {k: dict(v) for k, v in options.items()}
            deployments["Generator"] = {**deployments.get("Generator", {}), "num_replicas": replicas,
                                        "ray_actor_options": {"num_cpus": generator_cpus, "num_gpus": 1 if cuda else 0}}
            for front in ("Ingress", "Router"):
                deployments[front] = {**deployments.get(front, {}), "num_replicas": args.ingress_replicas,
                                      "ray_actor_options": {"num_cpus": front_cpus}}
            try:
                started = time.monotonic()
                print(f"R={replicas}: deploying ({replicas} Generator, {args.ingress_replicas} Ingress, "
                      f"{args.ingress_replicas} Router replicas)", flush=True)
                serve.run(build_app(app_args, deployments), name=name, route_prefix="/", blocking=False,
                          logging_config=logging_config)
                health = _wait_ready(name, base, replicas, args.ready_timeout)
                print(f"R={replicas}: ready after {time.monotonic() - started:.0f} s", flush=True)
                for speculation in modes:
                    seen, warm_errors, warm_kinds = _warm(url, replicas, args.clients, args.max_tokens, speculation,
                                                          warmup, args.ready_timeout, pool, procs, args.stream)
                    note = (f"R={replicas} speculation {_on_off(speculation)}: warm-up reached {seen}/{replicas} "
                            f"replicas, {warm_errors} errors" + (f" ({dict(warm_kinds)})" if warm_kinds else ""))
                    print(note, flush=True)
                    if warm_errors or seen < replicas:
                        warm_notes.append(note)
                    if seen < replicas:
                        raise RuntimeError(f"only {seen} of {replicas} Generator replicas answered during warm-up")
                    cell, per_replica, kinds = run_load(url, args.clients, args.duration, args.max_tokens, speculation,
                                                        pool, procs, args.stream)
                    row = Row.from_cell(cell, replicas, per_replica, kinds)
                    rows.append(row)
                    print(f"R={replicas} speculation={_on_off(speculation)}: {row.requests} requests, "
                          f"{row.req_per_s:.2f} req/s, {row.tok_per_s:.1f} output tok/s, {row.errors} errors, "
                          f"per replica {replica_split(row.per_replica)}", flush=True)
            except Exception as exc:
                failures.append(f"R={replicas}: {type(exc).__name__}: {exc}")
                print(f"R={replicas} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            finally:
                try:
                    serve.delete(name)
                except Exception as exc:
                    failures.append(f"R={replicas}: serve.delete failed: {exc}")
    finally:
        if pool is not None:
            pool.shutdown()
        try:
            serve.shutdown()
        finally:
            ray.shutdown()

    served = ", ".join(f"{d}={v}" for d, v in sorted((health.get("drafts") or {}).items())) or "none reported"
    refused = health.get("refused") or {}
    modes_text = {"on": "on (request field speculation: true; the governor may still decode plainly where it does not pay)",
                  "off": "off (request field speculation: false)", "both": "on and off, each measured"}[args.speculation]
    setup = [
        f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}, commit {args.commit or git_commit()}",
        (f"machine: {gpu_count} x {machine}, " if cuda else f"machine: {machine}, ") +
        f"{os.cpu_count()} CPUs; Ray: {ray_cpus:g} CPUs, {ray_gpus:g} GPUs; Python {platform.python_version()}",
        f"model: {health.get('model', config.args.model)}, device {args.device}, dtype {app_args.dtype}, "
        f"max_seq_len {app_args.max_seq_len}",
        f"app: Generator x R ({'1 GPU, ' if cuda else ''}{generator_cpus:g} CPU each), Ingress x {args.ingress_replicas} "
        f"and Router x {args.ingress_replicas} ({front_cpus:g} CPU each), one Serve HTTP proxy, Serve access log "
        f"{'on' if args.access_log else 'off'}; max_batch_size "
        f"{app_args.max_batch_size}, max_queue {app_args.max_queue} per replica, gamma {app_args.num_speculative_tokens}, "
        f"block {app_args.block_size}, governor {'on' if app_args.governor else 'off'}, CUDA graph warm-up "
        f"{app_args.graph_warmup_tokens if cuda else 0} tokens at replica start",
        f"drafts: {drafts_note}; served: {served}" + (f"; refused: {refused}" if refused else ""),
        f"speculation: {modes_text}",
        f"load: closed loop, {args.clients} clients in {max(1, min(procs, args.clients))} client process(es) on the same "
        f"machine, {'streaming' if args.stream else 'non-streaming (TTFT = whole-request latency)'} chat requests ({len(PROMPTS)} prompts, code/general/dialog), greedy, max_tokens "
        f"{args.max_tokens}, {args.duration:g} s per cell after {warmup:g} s warm-up at the same load",
        "requests per replica: " + ("the X-FlashSpec-Replica header of each admitted request" if args.stream
                                    else "the flashspec.replica field of each answer"),
    ] + [f"warm-up: {n}" for n in warm_notes]
    reproduce = (f"python -m bench.scale --replicas {','.join(map(str, args.replicas))} --clients {args.clients} "
                 f"--duration {args.duration:g} --max-tokens {args.max_tokens} --device {args.device} "
                 f"--speculation {args.speculation} --max-batch-size {args.max_batch_size} "
                 f"--ingress-replicas {args.ingress_replicas}" + ("" if args.stream else " --no-stream"))
    text = render_report(f"Scale-out benchmark ({args.device}): Generator replicas {', '.join(map(str, args.replicas))}",
                         setup, rows, failures, reproduce)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    expected = len(args.replicas) * len(modes)
    return 0 if not failures and len(rows) == expected and all(r.errors == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""The Ingress deployment: OpenAI-compatible HTTP API, tenants, routing, streaming, admin.

Request path: authenticate (401) -> parse and validate (400/422) -> route to a domain (Router
deployment, unless the tenant pins one) -> tenant checks (403, 429) -> Generator stream. The
first Generator item arrives before any response byte is sent, so admission errors (prompt over
the context, queue full) are real HTTP statuses even for streams.
"""


import asyncio
import hashlib
import json
import logging
import os
import time
import uuid

import yaml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from router.errors import RateLimited, RouterError
from router.tenants import TenantPolicy, hash_key
from services.config import AppArgs
from services.metrics import Metrics
from services.registry import registry_handle
from services.schemas import AdminDraftRequest, APIError, ChatCompletionRequest, CompletionRequest, parse_body

log = logging.getLogger(__name__)
ADMIN_KEY_ENV = "FLASHSPEC_ADMIN_KEY"
TENANTS_ENV = "FLASHSPEC_TENANTS_FILE"
ADMIN_TIMEOUT_S = 120.0

app = FastAPI(title="FlashSpec Router", docs_url=None, redoc_url=None)


@app.exception_handler(APIError)
async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


@app.exception_handler(StarletteHTTPException)
async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)


def load_policy(tenants_file: str | None) -> tuple[TenantPolicy, set[str]]:
    """The tenant policy (open mode without a file) and the admin key digests it names."""
    path = tenants_file or os.environ.get(TENANTS_ENV)
    admin: set[str] = set()
    if os.environ.get(ADMIN_KEY_ENV):
        admin.add(hash_key(os.environ[ADMIN_KEY_ENV]))
    if not path:
        return TenantPolicy(), admin
    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    digests = data.pop("admin_api_key_sha256", []) if isinstance(data, dict) else []
    admin.update([digests] if isinstance(digests, str) else digests)
    return TenantPolicy.from_dict(data, source=str(path)), admin


def _from_router(exc: RouterError) -> APIError:
    headers = exc.headers() if isinstance(exc, RateLimited) else None
    return APIError(exc.http_status, exc.message, exc.code, exc.param, exc.error_type, headers)


def _replica_failed(exc: BaseException) -> APIError:
    return APIError(503, f"the generator replica serving this request failed ({type(exc).__name__}); "
                         "the request was not completed: retry it", "replica_failed")


def _ended_early() -> APIError:
    """A Generator stream that ended without its last item (its replica went away between items)."""
    return APIError(503, "the generation ended before it finished; retry it", "replica_failed")


def _item_error(item: dict) -> APIError:
    """A Generator stream's error item as the API error it answers."""
    return APIError(item["status"], item["message"], item.get("code"), item.get("param"))


async def _first_item(stream) -> dict:
    """A Generator stream's first item: admission's answer (APIError where it refused the request)."""
    try:
        first = await stream.__anext__()
    except StopAsyncIteration:
        raise APIError(500, "the generator returned nothing", "generation_failed") from None
    except Exception as exc:
        raise _replica_failed(exc) from None
    if first["type"] == "error":
        raise _item_error(first)
    return first


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


@serve.deployment(name="Ingress", max_ongoing_requests=512)
@serve.ingress(app)
class Ingress:
    def __init__(self, args: dict, router, generator) -> None:
        self.args = AppArgs.model_validate(args)
        self.policy, self.admin_digests = load_policy(self.args.tenants_file)
        self.router = router
        self.generator = generator
        self.metrics = Metrics()
        self.model_name = self.args.model
        try:
            app_name = serve.get_replica_context().app_name
        except Exception:
            app_name = "local"
        self.registry = registry_handle(app_name)

    # ----- plain endpoints -----------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> JSONResponse:
        try:
            info = await asyncio.wait_for(self.generator.info.remote(), timeout=10)
        except Exception as exc:
            return JSONResponse({"status": "unavailable", "detail": f"{type(exc).__name__}: {exc}"}, status_code=503)
        if not info["ready"]:
            return JSONResponse({"status": "loading" if not info["error"] else "failed", **info}, status_code=503)
        self.model_name = info.get("model", self.model_name)
        return JSONResponse({"status": "ok", **info})

    @app.get("/metrics")
    async def metrics(self) -> Response:
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    @app.get("/v1/models")
    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "flashspec"}]}

    # ----- generation ----------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._serve("chat", request)

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._serve("completion", request)

    async def _serve(self, kind: str, request: Request):
        endpoint = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        try:
            response = await self._start(kind, request)
        except APIError as exc:
            self.metrics.request(endpoint, exc.status)
            raise
        self.metrics.request(endpoint, 200)
        return response

    async def _start(self, kind: str, request: Request):
        started = time.perf_counter()
        try:
            tenant = self.policy.authenticate(request.headers.get("authorization"))
        except RouterError as exc:
            raise _from_router(exc) from None
        body = parse_body(await request.body(), ChatCompletionRequest if kind == "chat" else CompletionRequest)
        requested = (getattr(body, "max_completion_tokens", None) or body.max_tokens) if kind == "chat" else body.max_tokens
        if requested is not None and requested > self.args.max_tokens_cap:
            raise APIError(400, f"max_tokens is {requested}; this server allows at most {self.args.max_tokens_cap}",
                           "max_tokens_exceeded", "max_tokens")
        max_tokens = tenant.cap_max_tokens(requested or self.args.default_max_tokens)
        if kind == "chat":
            payload = [m.model_dump(include={"role", "content"}) for m in body.messages]
            text_len = sum(len(json.dumps(m["content"])) for m in payload)
        else:
            payload = body.prompt
            text_len = len(payload)
        try:
            decision = None
            if tenant.pinned_domain is None and body.domain is None:
                decision = await self.router.route.remote(payload)
                if "error" in decision:
                    raise APIError(400, decision["error"], "invalid_request", decision.get("param"))
                self.metrics.route(decision["domain"], decision["fallback_used"])
            domain = self.policy.check_domain(tenant, decision["domain"] if decision else tenant.pinned_domain,
                                              override=body.domain)
            self.policy.acquire(tenant, tokens=text_len // 4 + max_tokens * body.n)
        except RouterError as exc:
            raise _from_router(exc) from None
        speculation = tenant.speculation and body.speculation
        request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        job = {"request_id": request_id, "max_tokens": max_tokens, "temperature": body.temperature,
               "top_p": body.top_p, "top_k": body.top_k, "seed": body.seed, "stop": body.stop,
               "domain": domain, "speculation": speculation,
               "messages" if kind == "chat" else "prompt": payload}
        # n choices: n requests of the Generator, batched like any others; choice i samples with seed + i.
        jobs = [job] if body.n == 1 else [
            {**job, "request_id": f"{request_id}-{i}", "seed": None if body.seed is None else body.seed + i}
            for i in range(body.n)]
        streams = [self.generator.options(stream=True).generate.remote(j) for j in jobs]
        try:
            firsts = await asyncio.gather(*(_first_item(s) for s in streams), return_exceptions=True)
        except BaseException:  # the client left while the choices were admitted
            for s in streams:
                s.cancel()
            raise
        failed = next((f for f in firsts if isinstance(f, BaseException)), None)
        if failed is not None:
            for s in streams:
                s.cancel()  # the choices that did start free their Generator slots
            raise failed if isinstance(failed, APIError) else _replica_failed(failed)
        first = firsts[0]
        info = {"domain": domain, "draft_version": first["draft_version"], "speculation": first["draft_version"] is not None,
                "router_confidence": decision["confidence"] if decision else None, "replica": first["replica"]}
        ctx = {"kind": kind, "id": request_id, "created": int(time.time()), "started": started, "info": info,
               "prompt_tokens": first["prompt_tokens"]}
        if body.stream:
            return StreamingResponse(self._events(streams, ctx), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": request_id,
                                              "X-FlashSpec-Replica": first["replica"]})
        return await self._collect(streams, ctx)

    def _record(self, ctx: dict, final: dict, ttft: float | None) -> None:
        """Metrics of one finished choice."""
        info = ctx["info"]
        self.metrics.finished(info["domain"], info["speculation"], final["prompt_tokens"], final["completion_tokens"],
                              ttft, time.perf_counter() - ctx["started"], final["stats"])

    def _totals(self, ctx: dict, finals: list[dict]) -> dict:
        """The usage and flashspec fields of a response (or of its last chunk): the prompt counted once, the
        choices' completions summed; `stats` is the first choice's, and with n > 1 `stats_by_choice` has them all."""
        prompt, completion = finals[0]["prompt_tokens"], sum(f["completion_tokens"] for f in finals)
        flashspec = {**ctx["info"], "stats": finals[0]["stats"]}
        if len(finals) > 1:
            flashspec["stats_by_choice"] = [f["stats"] for f in finals]
        return {"usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
                "flashspec": flashspec}

    async def _collect_one(self, stream, ctx: dict) -> tuple[str, dict]:
        """One choice's whole text and its final item."""
        parts, final, ttft = [], None, None
        try:
            async for item in stream:
                if item["type"] == "error":
                    raise _item_error(item)
                if ttft is None and item["tokens"]:
                    ttft = time.perf_counter() - ctx["started"]
                parts.append(item["text"])
                if item["finished"]:
                    final = item
        except APIError:
            raise
        except Exception as exc:
            raise _replica_failed(exc) from None
        if final is None:
            raise _ended_early()
        self._record(ctx, final, ttft)
        return "".join(parts), final

    async def _collect(self, streams: list, ctx: dict) -> dict:
        try:
            done = await asyncio.gather(*(self._collect_one(s, ctx) for s in streams))
        except BaseException:
            for s in streams:
                s.cancel()  # one choice failed (or the client left): the others stop too
            raise
        choices = []
        for index, (text, final) in enumerate(done):
            reason = final["finish_reason"]
            if ctx["kind"] == "chat":
                choices.append({"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
                                "finish_reason": reason})
            else:
                choices.append({"index": index, "text": text, "logprobs": None, "finish_reason": reason})
        obj = "chat.completion" if ctx["kind"] == "chat" else "text_completion"
        return {"id": ctx["id"], "object": obj, "created": ctx["created"], "model": self.model_name,
                "choices": choices, **self._totals(ctx, [final for _, final in done])}

    def _chunk(self, ctx: dict, text: str | None, reason: str | None, first: bool = False, index: int = 0) -> dict:
        if ctx["kind"] == "chat":
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": reason}
            obj = "text_completion"
        return {"id": ctx["id"], "object": obj, "created": ctx["created"], "model": self.model_name, "choices": [choice]}

    async def _events(self, streams: list, ctx: dict):
        """Server-sent events of every choice as they come. One choice: its last chunk carries usage and flashspec.
        n > 1: each choice's last chunk carries its finish_reason, then one chunk with no choices carries them."""
        n = len(streams)
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream) -> None:
            try:
                async for item in stream:
                    await queue.put((index, item))
            except Exception as exc:  # noqa: BLE001 - the replica died: the consumer answers in the OpenAI shape
                await queue.put((index, exc))
            await queue.put((index, None))  # this choice's stream ended

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        ttft, finals, open_streams = [None] * n, [None] * n, n
        try:
            if ctx["kind"] == "chat":
                for i in range(n):
                    yield _sse(self._chunk(ctx, None, None, first=True, index=i))
            while open_streams:
                i, item = await queue.get()
                if item is None:
                    open_streams -= 1
                    continue
                if isinstance(item, Exception):
                    yield _sse(_replica_failed(item).body())
                    return
                if item["type"] == "error":
                    yield _sse(_item_error(item).body())
                    return
                if ttft[i] is None and item["tokens"]:
                    ttft[i] = time.perf_counter() - ctx["started"]
                if item["finished"]:
                    finals[i] = item
                    self._record(ctx, item, ttft[i])
                    chunk = self._chunk(ctx, item["text"], item["finish_reason"], index=i)
                    if n == 1:
                        chunk.update(self._totals(ctx, finals))
                    yield _sse(chunk)
                elif item["text"]:
                    yield _sse(self._chunk(ctx, item["text"], None, index=i))
            if any(f is None for f in finals):  # a stream ended without its last item
                yield _sse(_ended_early().body())
                return
            if n > 1:
                yield _sse({**self._chunk(ctx, None, None), "choices": [], **self._totals(ctx, finals)})
            yield _sse("[DONE]")
        finally:
            for task in tasks:
                task.cancel()
            for stream, final in zip(streams, finals):
                if final is None:
                    stream.cancel()  # client gone or failure: free the Generator slot

    # ----- admin -----------------------------------------------------------------------------
    def _check_admin(self, authorization: str | None) -> None:
        if not self.admin_digests:
            raise APIError(403, f"the admin endpoint is disabled: set {ADMIN_KEY_ENV} or admin_api_key_sha256 "
                                "in the tenant policy", "admin_disabled")
        key = (authorization or "").strip()
        if key[:7].lower() == "bearer ":
            key = key[7:].strip()
        if not key or hashlib.sha256(key.encode()).hexdigest() not in self.admin_digests:
            raise APIError(401, "missing or wrong admin key; send it as 'Authorization: Bearer <admin key>'",
                           "invalid_api_key")

    @app.post("/admin/drafts")
    async def activate_draft(self, request: Request):
        """Activate a draft version for one domain on every Generator replica."""
        self._check_admin(request.headers.get("authorization"))
        body = parse_body(await request.body(), AdminDraftRequest)
        seq = await self.registry.push.remote(body.domain, body.version)
        deadline = time.monotonic() + ADMIN_TIMEOUT_S
        while True:
            outcome = await self.registry.outcome.remote(seq)
            if outcome["live"] and not outcome["pending"]:
                break
            if time.monotonic() > deadline:
                raise APIError(503, f"no answer from Generator replicas {outcome['pending'] or '(none live)'} within "
                                    f"{ADMIN_TIMEOUT_S:.0f} s; they apply the version when they come back", "timeout")
            await asyncio.sleep(0.1)
        refused = {r: a["message"] for r, a in outcome["acks"].items() if not a["ok"]}
        if refused:
            if len(refused) == len(outcome["acks"]):
                await self.registry.withdraw.remote(seq)
            reasons = "; ".join(f"replica {r}: {m}" for r, m in sorted(refused.items()))
            raise APIError(400, f"draft {body.domain}/{body.version} refused, the previous version keeps serving: "
                                f"{reasons}", "draft_refused", "version")
        return {"domain": body.domain, "version": body.version, "replicas": outcome["acks"]}

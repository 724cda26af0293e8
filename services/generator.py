"""The Generator deployment: the target, every active domain draft and the continuous-batching loop.

Drafts live here with the target because they share its first layers and its KV cache. Draft
versions come from `user_config` (`reconfigure`) and from the admin endpoint (through the draft
registry); a new version is loaded and checked before it replaces the old one, and running
requests keep the draft object they started with.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid

from ray import serve

from engine.lookup import LookupDraft
from engine.requests import Request
from engine.sampling import SamplingParams
from services.batcher import EngineLoop, QueueFull, StreamError
from services.config import AppArgs, GeneratorUserConfig
from services.drafts import DraftRefused, import_factory, load_checked, store_factory
from services.prompts import chat_prompt_ids, completion_prompt_ids

log = logging.getLogger(__name__)
POLL_S = 0.25


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Serve replica (unit use)
        return uuid.uuid4().hex[:8]


def _app_name() -> str:
    try:
        return serve.get_replica_context().app_name
    except Exception:
        return "local"


def error_item(status: int, message: str, code: str | None = None, param: str | None = None) -> dict:
    return {"type": "error", "status": status, "message": message, "code": code, "param": param}


LOOKUP = "lookup"  # the draft version that names the n-gram lookup drafter (GeneratorUserConfig.drafts)


class GeneratorCore:
    """Model, drafts and engine loop of one replica (the deployment class wraps it)."""

    def __init__(self, args: AppArgs, registry=None) -> None:
        self.args = args
        self.replica = _replica_id()
        self.loaded = threading.Event()
        self.load_error: str | None = None
        self.versions: dict[str, str] = {}  # domain -> active version (as the draft names itself)
        self._requested: dict[str, str] = {}  # domain -> version asked for ('latest' resolves to a version)
        self.refusals: dict[str, str] = {}  # domain -> why the last activation was refused
        self._desired: GeneratorUserConfig | None = None
        self._swap = threading.Lock()
        self._poll_lock = threading.Lock()
        self.factory = import_factory(args.draft_source) if args.draft_source else store_factory(args.draft_store)
        self.registry = registry
        self._registry_seq = 0
        self.loop: EngineLoop | None = None
        self._caught_up = threading.Event()  # set once the registry's activations are applied
        self._warmed = False
        self._load()

    # ----- start-up ------------------------------------------------------------------------
    def _load(self) -> None:
        from engine.gamma import GammaController
        from engine.governor import SpeculationGovernor
        from engine.loading import load_model
        from engine.scheduler import DecodeEngine
        from engine.speculative import SpecConfig

        if self.args.torch_threads:
            import torch

            torch.set_num_threads(self.args.torch_threads)
        try:
            loaded = load_model(self.args.model, device=self.args.device, dtype=self.args.dtype,
                                max_seq_len=self.args.max_seq_len)
            if self.args.fused_inference:  # before the engine: its CUDA graphs point at the fused weights
                loaded.model.fuse_for_inference()
            loaded.model.set_attention_backend(self.args.attention_backend)
            spec = SpecConfig(num_speculative_tokens=self.args.num_speculative_tokens,
                              block_size=min(self.args.block_size, self.args.num_speculative_tokens),
                              draft_confidence=self.args.draft_confidence, tree_width=self.args.tree_width,
                              tree_max_batch=self.args.tree_max_batch)
            engine = DecodeEngine(loaded.model, loaded.tokenizer, max_batch_size=self.args.max_batch_size,
                                  max_seq_len=self.args.max_seq_len, spec=spec,
                                  governor=SpeculationGovernor(enabled=self.args.governor),
                                  gamma=GammaController(spec.num_speculative_tokens, enabled=self.args.adaptive_gamma),
                                  overlap=self.args.overlap, prefill_ahead=self.args.engine_prefill_ahead())
            if self.args.governor:
                if self.args.lookup_alternative:  # each trained draft's alternative (`activate`)
                    engine.add_draft(LOOKUP, LookupDraft(allot=self.args.lookup_allot))
                engine.calibrate()  # the governor's plain-decoding (and, with graphs, lookup round) costs up front
        except Exception as exc:  # the replica fails to start and Serve reports why
            self.load_error = f"{type(exc).__name__}: {exc}"
            raise
        self.model_name = loaded.name
        self.target, self.tokenizer = loaded.model, loaded.tokenizer
        self.loop = EngineLoop(engine, self.args.max_queue)
        self.loaded.set()
        if self.registry is not None:
            threading.Thread(target=self._poll_registry, name="draft-registry", daemon=True).start()

    def warmup(self) -> int:
        """Capture the engine's CUDA graphs with the drafts now loaded (once per replica; a no-op on CPU)."""
        if self._warmed or not self.args.graph_warmup_tokens:
            return 0
        self._warmed = True
        t0 = time.perf_counter()
        try:
            n = self.loop.call(lambda eng: eng.warmup(self.args.graph_warmup_tokens)).result()
        except Exception:  # the replica still serves; its graphs are captured on first use instead
            log.exception("CUDA graph warm-up failed on replica %s", self.replica)
            return 0
        if n:
            log.info("replica %s captured %d CUDA graphs in %.1f s", self.replica, n, time.perf_counter() - t0)
        return n

    # ----- drafts --------------------------------------------------------------------------
    def _drafter(self, ran: str | None) -> str:
        """What a request's rounds ran, from the engine's name for it (`RequestOutput.draft`): "lookup" (the
        lookup drafter, as the domain's alternative or its version) or "draft" (the domain's trained draft)."""
        domain, _, alternative = (ran or "").partition("/")
        return "lookup" if alternative == LOOKUP or self.versions.get(domain) == LOOKUP else "draft"

    @property
    def _lookup_alternative(self) -> bool:
        """Whether trained drafts get the lookup drafter as their alternative (`AppArgs.lookup_alternative`)."""
        return self.args.governor and self.args.lookup_alternative

    def apply_user_config(self, config: GeneratorUserConfig) -> dict[str, str]:
        """Activate every domain's version (refused ones keep the old); drop domains left out."""
        self._desired = config
        if not self.loaded.is_set():
            return {}
        results = {}
        for domain, version in config.drafts.items():
            if self._requested.get(domain) != version:
                try:
                    results[domain] = self.activate(domain, version)
                except DraftRefused as exc:
                    results[domain] = f"refused: {exc}"
        for domain in set(self.versions) - set(config.drafts):
            self.loop.call(lambda eng, d=domain: eng.remove_draft(d)).result()
            self.versions.pop(domain, None)
            self._requested.pop(domain, None)
            results[domain] = "removed"
        return results

    def activate(self, domain: str, version: str) -> str:
        """Load, check and swap in one domain's draft; 'ok' or raises DraftRefused (old version stays). Version
        `LOOKUP` ("lookup") gives the domain the n-gram lookup drafter instead of a trained draft (`engine.lookup`:
        no weights: the domain's requests propose their next tokens from their own earlier ones)."""
        if not self.loaded.is_set():
            raise DraftRefused("the model is still loading; retry when /health is ready")
        with self._swap:
            try:
                if version == LOOKUP:  # the n-gram lookup drafter: no checkpoint to load or check
                    draft = LookupDraft(allot=self.args.lookup_allot)
                else:
                    draft = load_checked(self.factory, self.target, domain, version)
                    if self.args.fused_inference:
                        from engine.fused import fuse_for_inference

                        fuse_for_inference(draft)  # its own adapter layers; its trunk is the (fused) target's
                alternatives = [LOOKUP] if self._lookup_alternative and version != LOOKUP else []

                def install(eng) -> None:
                    eng.add_draft(domain, draft)
                    eng.set_alternatives(domain, alternatives)

                self.loop.call(install).result(timeout=120)
            except DraftRefused as exc:
                self.refusals[domain] = str(exc)
                log.warning("refused draft %s/%s: %s", domain, version, exc)
                raise
            except ValueError as exc:  # the engine refuses an incompatible draft
                self.refusals[domain] = f"draft {domain}/{version} refused: {exc}"
                raise DraftRefused(self.refusals[domain]) from exc
            self.versions[domain] = str(getattr(draft, "version", None) or version)
            self._requested[domain] = version
            self.refusals.pop(domain, None)
            log.info("draft %s/%s active on replica %s", domain, self.versions[domain], self.replica)
            self._warm_draft(domain)
            return "ok"

    def _warm_draft(self, domain: str) -> None:
        """After the replica's warm-up, a new draft's graphs (its own, and mixed batches') are captured on the
        engine thread while no request is in flight; a request arriving meanwhile ends it, and what is left is
        captured on first use. Does not wait: an activation returns at once."""
        if not (self._warmed and self.args.graph_warmup_tokens):
            return
        tokens, loop = self.args.graph_warmup_tokens, self.loop

        def busy() -> bool:
            return loop.in_flight > 0

        def done(future) -> None:
            if future.exception() is not None:
                log.error("CUDA graph warm-up of draft %s failed on replica %s: %s", domain, self.replica,
                          future.exception())
            elif future.result():
                log.info("replica %s captured %d CUDA graphs for draft %s", self.replica, future.result(), domain)

        loop.call(lambda eng: 0 if eng.has_work() or busy() else eng.warm_draft(domain, tokens, stop=busy)
                  ).add_done_callback(done)

    def catch_up(self) -> None:
        """Apply the registry's activations newer than the last applied one (admin pushes)."""
        import ray

        with self._poll_lock:
            entries = ray.get(self.registry.poll.remote(self.replica, self._registry_seq), timeout=30)
            for seq, domain, version in entries:
                try:
                    self.activate(domain, version)
                    ok, message = True, "ok"
                except DraftRefused as exc:
                    ok, message = False, str(exc)
                self._registry_seq = max(self._registry_seq, seq)
                ray.get(self.registry.ack.remote(self.replica, seq, ok, message, self.versions.get(domain, "")))
        self._caught_up.set()

    def _poll_registry(self) -> None:
        # user_config first (reconfigure runs right after __init__), then the admin pushes on top of it.
        self._caught_up.wait(timeout=10)
        while True:
            try:
                self.catch_up()
            except Exception:  # the registry restarts or is slow: try again next round
                log.exception("draft registry poll failed")
            time.sleep(POLL_S)

    # ----- requests ------------------------------------------------------------------------
    def info(self) -> dict:
        out = {"ready": self.loaded.is_set(), "error": self.load_error, "replica": self.replica,
               "drafts": dict(self.versions), "refused": dict(self.refusals)}
        if self.loop is not None:
            eng = self.loop.engine
            out.update(model=self.model_name, running=eng.num_running, admitting=eng.num_admitting,
                       waiting=len(eng.waiting), in_flight=self.loop.in_flight, max_batch_size=eng.max_batch_size,
                       steps=self.loop.steps, cache_bytes=eng.memory_report()["target_cache"])
            if eng.governor.enabled:  # what this replica's governor decided: is it holding speculation off?
                snap = eng.governor.snapshot()
                out["governor"] = {"decisions": snap["decisions"], "samples_left_out": snap["samples_left_out"]}
        return out

    def _prepare(self, req: dict) -> tuple[Request, dict] | dict:
        """The engine request for an API request, or an error item."""
        try:
            if req.get("messages") is not None:
                prompt_ids = chat_prompt_ids(self.tokenizer, req["messages"])
                param = "messages"
            else:
                prompt_ids = completion_prompt_ids(self.tokenizer, req["prompt"])
                param = "prompt"
        except Exception as exc:
            return error_item(400, f"cannot render the prompt: {exc}", "invalid_prompt")
        if len(prompt_ids) >= self.args.max_seq_len:
            return error_item(400, f"prompt has {len(prompt_ids)} tokens; this model's context is "
                              f"{self.args.max_seq_len} (prompt plus at least one new token): shorten it",
                              "context_length_exceeded", param)
        stop = req.get("stop") or ()
        try:
            params = SamplingParams(
                max_new_tokens=req["max_tokens"], temperature=req.get("temperature", 1.0), top_p=req.get("top_p", 1.0),
                top_k=req.get("top_k", 0), seed=req.get("seed"), stop=tuple([stop] if isinstance(stop, str) else stop))
        except ValueError as exc:
            return error_item(400, str(exc), "invalid_sampling_params")
        domain = req.get("domain")
        use_draft = bool(req.get("speculation", True)) and domain in self.versions
        draft = domain if use_draft else None
        meta = {"prompt_tokens": len(prompt_ids), "draft_version": self.versions.get(domain) if use_draft else None}
        return Request(req["request_id"], prompt_ids, params, draft), meta

    async def generate(self, req: dict):
        """Async stream of dicts: {"type": "start"}, {"type": "delta"}..., or one {"type": "error"}."""
        if not self.loaded.is_set():
            message = f"model failed to load: {self.load_error}" if self.load_error else "the model is loading; retry shortly"
            yield error_item(503, message, "model_not_ready")
            return
        prepared = self._prepare(req)
        if isinstance(prepared, dict):
            yield prepared
            return
        request, meta = prepared
        try:
            outputs = self.loop.submit(request)
        except QueueFull as exc:
            yield error_item(503, str(exc), "server_overloaded")
            return
        yield {"type": "start", "replica": self.replica, **meta}
        done = False
        try:
            while not done:
                # Steps that arrived while the consumer was busy go out as one delta: under load the
                # stream sends fewer, larger chunks instead of falling behind the engine.
                items = [await outputs.get()]
                while not isinstance(items[-1], StreamError) and not items[-1].finished and not outputs.empty():
                    items.append(outputs.get_nowait())
                error = items.pop() if isinstance(items[-1], StreamError) else None
                if items:
                    last = items[-1]
                    done = last.finished
                    yield {"type": "delta", "text": "".join(i.text for i in items),
                           "tokens": sum(len(i.token_ids) for i in items), "finished": last.finished,
                           "finish_reason": last.finish_reason, "prompt_tokens": last.prompt_tokens,
                           "completion_tokens": last.completion_tokens,
                           "stats": ({**last.stats.to_dict(), "drafter": self._drafter(last.draft)}
                                     if last.stats is not None and last.finished else None)}
                if error is not None:
                    done = True
                    yield error_item(error.status, error.message, "generation_failed" if error.status >= 500 else None)
                    return
        finally:
            if not done:  # the caller went away: free the slot
                self.loop.cancel(request.request_id)


@serve.deployment(name="Generator", max_ongoing_requests=256, health_check_period_s=2, health_check_timeout_s=30)
class Generator:
    """Serve wrapper: one GeneratorCore per replica."""

    def __init__(self, args: dict) -> None:
        from services.registry import registry_handle

        self.core = GeneratorCore(AppArgs.model_validate(args), registry=registry_handle(_app_name()))

    async def reconfigure(self, user_config: dict) -> None:
        """Apply `user_config.drafts`; a refused version is logged and the old one keeps serving."""
        config = GeneratorUserConfig.model_validate(user_config or {})
        results = await asyncio.to_thread(self.core.apply_user_config, config)
        for domain, result in results.items():
            if result.startswith("refused"):
                log.error("user_config draft for %s %s (the old version keeps serving)", domain, result)
        if not self.core._caught_up.is_set():  # a new replica: take the admin pushes before serving
            try:
                await asyncio.to_thread(self.core.catch_up)
            except Exception:
                log.exception("draft registry catch-up failed; the poller retries")
            await asyncio.to_thread(self.core.warmup)

    async def activate(self, domain: str, version: str) -> dict:
        try:
            await asyncio.to_thread(self.core.activate, domain, version)
            return {"ok": True, "replica": self.core.replica, "version": version}
        except DraftRefused as exc:
            return {"ok": False, "replica": self.core.replica, "message": str(exc),
                    "version": self.core.versions.get(domain)}

    async def info(self) -> dict:
        return self.core.info()

    async def generate(self, req: dict):
        async for item in self.core.generate(req):
            yield item

"""The Router deployment: the domain classifier, one call per request."""

from __future__ import annotations

from ray import serve

from router.classifier import DEFAULT_MODEL, DomainClassifier
from router.errors import InvalidRequest
from services.config import AppArgs


@serve.deployment(name="Router", max_ongoing_requests=256)
class Router:
    def __init__(self, args: dict) -> None:
        config = AppArgs.model_validate(args)
        self.classifier = DomainClassifier.load(config.router_model or DEFAULT_MODEL,
                                                threshold=config.router_threshold, fallback=config.router_fallback)

    async def route(self, request: object) -> dict:
        """A prompt string or chat messages -> {"domain", "confidence", ...} or {"error": message}."""
        try:
            decision = self.classifier.predict(request)
        except InvalidRequest as exc:
            return {"error": exc.message, "param": exc.param}
        return {"domain": decision.domain, "confidence": decision.confidence, "fallback_used": decision.fallback_used,
                "predicted": decision.predicted, "latency_ms": decision.latency_ms}

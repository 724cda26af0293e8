"""CLI functions (registered by flashspec.cli): route, train-router, tenants hash-key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from router.classifier import DEFAULT_MODEL, DomainClassifier
from router.data import DOMAINS, DataConfig
from router.errors import InvalidRequest, RouterLoadError
from router.tenants import hash_key


def route(
    text: Annotated[Optional[str], typer.Option("--text", help="A completion prompt to classify.")] = None,
    messages_json: Annotated[Optional[str], typer.Option(
        "--messages-json", help='Chat messages as JSON: \'[{"role": "user", "content": "..."}]\'.')] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    model: Annotated[Path, typer.Option("--model", help="Router model (.skops with its manifest).")] = DEFAULT_MODEL,
    threshold: Annotated[float, typer.Option(help="Below this confidence the fallback domain is used.")] = 0.5,
    fallback: Annotated[str, typer.Option(help=f"Fallback domain: {', '.join(DOMAINS)}.")] = "general",
) -> None:
    """Classify one request and print its domain, confidence and latency."""
    if (text is None) == (messages_json is None):
        raise typer.BadParameter("give exactly one of --text or --messages-json")
    request: object = text
    if messages_json is not None:
        try:
            request = json.loads(messages_json)
        except json.JSONDecodeError as exc:
            raise typer.BadParameter(f"--messages-json is not valid JSON: {exc}") from None
    try:
        classifier = DomainClassifier.load(model, threshold=threshold, fallback=fallback)
    except (RouterLoadError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=1) from None
    try:
        classifier.predict(request)  # first call pays one-off costs; report a warm request
        decision = classifier.predict(request)
    except InvalidRequest as exc:
        raise typer.BadParameter(str(exc)) from None
    if json_output:
        typer.echo(json.dumps({
            "domain": decision.domain, "confidence": round(decision.confidence, 4),
            "latency_ms": round(decision.latency_ms, 3), "fallback_used": decision.fallback_used,
            "predicted": decision.predicted,
        }))
    else:
        note = f" (fallback; predicted {decision.predicted})" if decision.fallback_used else ""
        typer.echo(f"domain: {decision.domain}{note}\nconfidence: {decision.confidence:.3f}\n"
                   f"latency: {decision.latency_ms:.3f} ms")


def train_router(
    out: Annotated[Path, typer.Option(help="Where to write the model (+ .manifest.json).")] = DEFAULT_MODEL,
    seed: Annotated[int, typer.Option(help="Seed for data generation and the model.")] = 0,
    per_class: Annotated[int, typer.Option(help="Training examples per domain (before the split).")] = 12000,
    conversations: Annotated[int, typer.Option(help="chitchat conversations to draw dialog from.")] = 3000,
    max_features: Annotated[int, typer.Option(help="Vocabulary size per vectorizer (word, char).")] = 30000,
) -> None:
    """Build the training data, train the router, print held-out metrics, write model + manifest."""
    from router.train import TrainConfig, format_confusion, train_and_save

    config = TrainConfig(
        data=DataConfig(per_class=per_class, conversations=conversations, seed=seed),
        max_features=max_features,
    )
    try:
        manifest = train_and_save(config, out)
    except FileNotFoundError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=1) from None
    metrics = manifest["metrics"]
    for name in ("validation", "test"):
        typer.echo(f"{name}: macro-F1 {metrics[name]['macro_f1']:.4f} on {metrics[name]['n']} examples")
    typer.echo("test confusion matrix:\n" + format_confusion(metrics["test"]))
    typer.echo(f"wrote {out} ({Path(out).stat().st_size / 1e6:.2f} MB) and its manifest "
               f"in {metrics['train_seconds']} s")


def tenants_hash_key(
    key: Annotated[str, typer.Argument(help="The API key to hash (it is not stored anywhere).")],
) -> None:
    """Print the sha256 digest of an API key, to paste into the policy's api_key_sha256."""
    if not key.strip():
        raise typer.BadParameter("the key is empty")
    typer.echo(hash_key(key))

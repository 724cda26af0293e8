"""Build the data, fit the classifier on the train split, evaluate on validation and test."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from sklearn.metrics import confusion_matrix, f1_score

from router.classifier import DEFAULT_MODEL, DomainClassifier, build_pipeline
from router.data import DOMAINS, DataConfig, Example, build_examples, split
from router.features import render
from router.persist import save_pipeline


@dataclass(frozen=True)
class TrainConfig:
    data: DataConfig = DataConfig()
    max_features: int = 30000  # per vectorizer (word, char)
    C: float = 0.5  # LinearSVC regularization


def evaluate(classifier: DomainClassifier, examples: list[Example]) -> dict:
    """Macro-F1, per-domain F1 and the confusion matrix (rows: true, columns: predicted)."""
    truth = [e.domain for e in examples]
    predicted = classifier.predict_many([e.request for e in examples])
    return {
        "n": len(examples),
        "macro_f1": float(f1_score(truth, predicted, labels=list(DOMAINS), average="macro")),
        "f1": dict(zip(DOMAINS, map(float, f1_score(truth, predicted, labels=list(DOMAINS), average=None)))),
        "labels": list(DOMAINS),
        "confusion": confusion_matrix(truth, predicted, labels=list(DOMAINS)).tolist(),
    }


def train(config: TrainConfig = TrainConfig()) -> tuple[DomainClassifier, dict, dict[str, list[Example]]]:
    """Returns the classifier, its metrics and the splits it was trained / evaluated on."""
    start = time.perf_counter()
    splits = split(build_examples(config.data))
    pipeline = build_pipeline(seed=config.data.seed, max_features=config.max_features, C=config.C)
    pipeline.fit([render(e.request) for e in splits["train"]], [e.domain for e in splits["train"]])
    classifier = DomainClassifier(pipeline)
    metrics = {
        "train_n": len(splits["train"]),
        "validation": evaluate(classifier, splits["validation"]),
        "test": evaluate(classifier, splits["test"]),
        "train_seconds": round(time.perf_counter() - start, 1),
    }
    return classifier, metrics, splits


def train_and_save(config: TrainConfig = TrainConfig(), out: str | Path = DEFAULT_MODEL) -> dict:
    """Train, evaluate and write the model + manifest; returns the manifest."""
    classifier, metrics, _ = train(config)
    return save_pipeline(classifier.pipeline, out, metrics=metrics,
                         extra={"train_config": asdict(config)})


def format_confusion(metrics: dict) -> str:
    labels = metrics["labels"]
    width = max(map(len, labels)) + 2
    lines = ["true \\ predicted".ljust(18) + "".join(l.rjust(width) for l in labels)]
    for label, row in zip(labels, metrics["confusion"]):
        lines.append(label.ljust(18) + "".join(str(v).rjust(width) for v in row))
    return "\n".join(lines)

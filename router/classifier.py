"""Domain classifier: rendered request -> TF-IDF word + char n-grams + shape -> calibrated linear model."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from sklearn.calibration import CalibratedClassifierCV
from sklearn.pipeline import FeatureUnion, Pipeline
from sklearn.svm import LinearSVC

from router.data import DOMAINS
from router.features import CompactTfidfVectorizer, ShapeFeatures, render, shape_vector, text_body

DEFAULT_MODEL = Path(__file__).parent / "assets" / "router.skops"


@dataclass(frozen=True)
class RouteDecision:
    domain: str  # the domain to use (the fallback when confidence < threshold)
    confidence: float  # calibrated probability of the predicted domain
    fallback_used: bool
    latency_ms: float
    predicted: str = ""  # the classifier's top domain, before the threshold
    probabilities: dict[str, float] = field(default_factory=dict)


def build_pipeline(seed: int = 0, max_features: int = 30000, C: float = 0.5) -> Pipeline:
    """The untrained pipeline. Input: strings from router.features.render."""
    words = CompactTfidfVectorizer(
        preprocessor=text_body, token_pattern=r"\w+|[^\w\s]", ngram_range=(1, 2),
        max_features=max_features, min_df=2, sublinear_tf=True, dtype=np.float32,
    )
    chars = CompactTfidfVectorizer(
        preprocessor=text_body, analyzer="char_wb", ngram_range=(2, 4),
        max_features=max_features, min_df=3, sublinear_tf=True, dtype=np.float32,
    )
    features = FeatureUnion([("words", words), ("chars", chars), ("shape", ShapeFeatures())])
    model = CalibratedClassifierCV(
        LinearSVC(C=C, random_state=seed), method="sigmoid", cv=3, ensemble=False
    )
    return Pipeline([("features", features), ("model", model)])


class DomainClassifier:
    """Predicts the traffic domain of one request; below `threshold` it returns `fallback`."""

    def __init__(self, pipeline: Pipeline, threshold: float = 0.5, fallback: str = "general",
                 manifest: dict | None = None):
        classes = [str(c) for c in pipeline.classes_]
        if sorted(classes) != sorted(DOMAINS):
            raise ValueError(f"pipeline classes {classes} do not match the domains {list(DOMAINS)}")
        if fallback not in DOMAINS:
            raise ValueError(f"fallback {fallback!r} is not a domain; use one of {', '.join(DOMAINS)}")
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold {threshold} must be within [0, 1]")
        self.pipeline = pipeline
        self.classes = classes
        self._scorer = _LinearScorer(pipeline)
        self.threshold = threshold
        self.fallback = fallback
        self.manifest = manifest or {}

    @classmethod
    def load(cls, path: str | Path = DEFAULT_MODEL, threshold: float = 0.5,
             fallback: str = "general") -> "DomainClassifier":
        from router.persist import load_pipeline

        pipeline, manifest = load_pipeline(path)
        return cls(pipeline, threshold=threshold, fallback=fallback, manifest=manifest)

    def predict(self, request: object) -> RouteDecision:
        """Classify a prompt string or a list of chat messages.

        Raises InvalidRequest (a ValueError, HTTP 400) on empty, non-text or non-UTF-8 input.
        """
        start = time.perf_counter()
        rendered = render(request)
        probs = self._scorer.predict_proba(rendered)  # (n_classes,)
        best = int(np.argmax(probs))
        predicted, confidence = self.classes[best], float(probs[best])
        fallback_used = confidence < self.threshold
        return RouteDecision(
            domain=self.fallback if fallback_used else predicted,
            confidence=confidence,
            fallback_used=fallback_used,
            latency_ms=(time.perf_counter() - start) * 1000.0,
            predicted=predicted,
            probabilities={c: float(p) for c, p in zip(self.classes, probs)},
        )

    def predict_many(self, requests: list) -> list[str]:
        """Top domains for many requests at once (evaluation; no threshold)."""
        probs = self.pipeline.predict_proba([render(r) for r in requests])
        return [self.classes[i] for i in np.argmax(probs, axis=1)]


class _LinearScorer:
    """The fitted pipeline's math for one request, without scikit-learn's per-call overhead.

    Same result as `pipeline.predict_proba([rendered])[0]` (a test checks it): sublinear TF-IDF
    with l2 norm per vectorizer, the linear decision function, then one sigmoid calibrator per
    class, normalized to sum to one. Single requests take ~0.5 ms instead of ~2.5 ms.
    """

    def __init__(self, pipeline: Pipeline):
        union, model = pipeline.named_steps["features"], pipeline.named_steps["model"]
        calibrated = model.calibrated_classifiers_[0]
        estimator = calibrated.estimator
        coef = np.asarray(estimator.coef_, dtype=np.float64)  # (C, F) or (1, F) for two classes
        if coef.shape[0] != len(model.classes_):
            raise ValueError("the fast scorer needs a one-vs-rest model with one row per class")
        self.blocks = []  # (analyzer, vocabulary, idf, coef^T slice (F_i, C)) per vectorizer
        offset = 0
        for name, transformer in union.transformer_list:
            if isinstance(transformer, ShapeFeatures):
                width = len(transformer.get_feature_names_out())
                self.shape = (transformer, coef[:, offset : offset + width].T.copy())
            else:
                if not (transformer.sublinear_tf and transformer.norm == "l2" and transformer.use_idf):
                    raise ValueError(f"vectorizer {name!r} must use sublinear_tf, idf and l2 norm")
                width = len(transformer.vocabulary_)
                self.blocks.append((
                    transformer.build_analyzer(), transformer.vocabulary_,
                    np.asarray(transformer.idf_, dtype=np.float64),
                    coef[:, offset : offset + width].T.copy(),
                ))
            offset += width
        if offset != coef.shape[1]:
            raise ValueError(f"feature width {offset} does not match the model's {coef.shape[1]}")
        self.intercept = np.asarray(estimator.intercept_, dtype=np.float64)  # (C,)
        self.a = np.array([c.a_ for c in calibrated.calibrators], dtype=np.float64)  # (C,)
        self.b = np.array([c.b_ for c in calibrated.calibrators], dtype=np.float64)  # (C,)

    def predict_proba(self, rendered: str) -> np.ndarray:
        decision = self.intercept.copy()  # (C,)
        for analyzer, vocabulary, idf, coef_t in self.blocks:
            found = [(vocabulary.get(term), n) for term, n in Counter(analyzer(rendered)).items()]
            found = [(i, n) for i, n in found if i is not None]
            if not found:
                continue
            index = np.fromiter((i for i, _ in found), dtype=np.int64, count=len(found))
            weight = 1.0 + np.log(np.fromiter((n for _, n in found), dtype=np.float64, count=len(found)))
            weight *= idf[index]
            weight /= np.sqrt(weight @ weight)
            decision += weight @ coef_t[index]
        transformer, coef_t = self.shape
        decision += np.asarray(shape_vector(rendered)) * transformer.weight @ coef_t
        proba = 1.0 / (1.0 + np.exp(self.a * decision + self.b))  # (C,) sigmoid calibration
        total = proba.sum()
        return proba / total if total > 0 else np.full_like(proba, 1.0 / len(proba))

"""Router bench: macro-F1 + confusion matrix on the held-out test split, and single-request latency.

    python bench/router.py [--model router/assets/router.skops] [--requests 3000]

The test split is rebuilt from the corpora with the seed and sizes in the model's manifest, so the
documents it holds were never seen in training. Latency: one request at a time, warm, CPU.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from router.classifier import DEFAULT_MODEL, DomainClassifier  # noqa: E402
from router.data import DataConfig, build_examples, split  # noqa: E402
from router.train import evaluate, format_confusion  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--requests", type=int, default=3000, help="single requests timed (>= 2000)")
    args = parser.parse_args()

    classifier = DomainClassifier.load(args.model)
    data = classifier.manifest.get("train_config", {}).get("data", {})
    config = DataConfig(**data) if data else DataConfig()
    splits = split(build_examples(config))
    test = splits["test"]

    # Step 1: accuracy on the held-out split (whole documents unseen in training).
    metrics = evaluate(classifier, test)
    print(f"setup: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}, model {args.model.name} "
          f"({args.model.stat().st_size / 1e6:.2f} MB), data {config}")
    print(f"held-out test split: {metrics['n']} requests, macro-F1 {metrics['macro_f1']:.4f} "
          f"(goal >= 0.95: {'met' if metrics['macro_f1'] >= 0.95 else 'NOT met'})")
    print("per-domain F1: " + ", ".join(f"{d} {f:.4f}" for d, f in metrics["f1"].items()))
    print(format_confusion(metrics))

    # Step 2: hand-written requests in the style of real traffic (tests/router/realistic.py).
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "router"))
    from realistic import FRESH, REALISTIC

    for name, items in (("all hand-written", REALISTIC), ("fresh (never used to tune the data)", FRESH)):
        truth = [d for _, d in items]
        predicted = classifier.predict_many([r for r, _ in items])
        accuracy = np.mean([p == t for p, t in zip(predicted, truth)])
        print(f"{name}: {len(items)} requests, accuracy {accuracy:.3f}")

    # Step 3: latency of single requests (render + features + model), after a warm-up.
    requests = [test[i % len(test)].request for i in range(max(args.requests, 2000))]
    for request in requests[:200]:
        classifier.predict(request)
    gc.collect()
    latencies = np.empty(len(requests))  # wall clock
    cpu = np.empty(len(requests))  # this thread's CPU time: the same work, minus waiting for a core
    for i, request in enumerate(requests):
        start, start_cpu = time.perf_counter(), time.thread_time()
        classifier.predict(request)
        latencies[i] = (time.perf_counter() - start) * 1000.0
        cpu[i] = (time.thread_time() - start_cpu) * 1000.0
    p50, p99 = np.percentile(latencies, [50, 99])
    print(f"load average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    print(f"latency over {len(requests)} single requests (wall): p50 {p50:.3f} ms, p99 {p99:.3f} ms, "
          f"max {latencies.max():.3f} ms (goal p99 <= 2 ms: {'met' if p99 <= 2.0 else 'NOT met'})")
    c50, c99 = np.percentile(cpu, [50, 99])
    print(f"CPU time per request: p50 {c50:.3f} ms, p99 {c99:.3f} ms")


if __name__ == "__main__":
    main()

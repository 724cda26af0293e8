"""The scale-out benchmark's report helpers (bench/scale.py): table, ratios, warnings. No Ray, no server."""

from __future__ import annotations

import argparse
import math

import pytest

from bench.scale import (Row, cpu_budget, markdown_table, parse_replicas, render_report, replica_split, scale_ratios,
                         speculation_ratios, uneven_replicas)
from bench.serve import Cell


def _row(replicas: int, tokens: int, speculation: bool = True, requests: int = 10, errors: int = 0,
         per_replica: dict | None = None) -> Row:
    cell = Cell(8, speculation, seconds=10.0, ttft=[0.1, 0.2, 0.3], tpot=[0.01, 0.02], tokens=tokens,
                requests=requests, errors=errors, drafted=100, accepted=40)
    return Row.from_cell(cell, replicas, per_replica if per_replica is not None else {f"r{i}": 1 for i in range(replicas)})


def test_row_from_cell_rates_and_percentiles():
    row = _row(2, tokens=1000, requests=20)
    assert row.tok_per_s == pytest.approx(100.0) and row.req_per_s == pytest.approx(2.0)
    assert row.ttft_p50 == pytest.approx(0.2) and row.ttft_p99 == pytest.approx(0.3)
    empty = Row.from_cell(Cell(4, False), 1)
    assert empty.tok_per_s == 0.0 and math.isnan(empty.ttft_p50)


def test_markdown_table_has_one_line_per_cell():
    rows = [_row(1, 500, per_replica={"abc": 7}), _row(2, 1000, speculation=False, per_replica={"x": 3, "y": 5})]
    lines = markdown_table(rows).splitlines()
    assert len(lines) == 4 and lines[0].startswith("| Generator replicas |")
    assert lines[2].startswith("| 1 | on | 8 | 1.00 | 50.0 | 200 | 300 | 10.0 | 20.0 | 0.40 | 0 | abc: 7 |")
    assert lines[3].endswith("| y: 5 / x: 3 |")
    no_samples = markdown_table([Row.from_cell(Cell(4, True, seconds=1.0), 1)]).splitlines()[2]
    assert "| - | - | - | - | - | 0 | - |" in no_samples


def test_scale_ratio_per_speculation_setting():
    rows = [_row(1, 500), _row(2, 950), _row(1, 400, speculation=False), _row(2, 800, speculation=False)]
    assert scale_ratios(rows) == [
        "throughput R=2 / R=1: 1.90x (output tokens/s, speculation on; requests/s 1.00x)",
        "throughput R=2 / R=1: 2.00x (output tokens/s, speculation off; requests/s 1.00x)",
    ]
    assert speculation_ratios(rows) == ["speculation on / off at R=1: 1.25x", "speculation on / off at R=2: 1.19x"]
    assert scale_ratios([_row(1, 0), _row(2, 10)])[0].startswith("throughput R=2 / R=1: n/a")
    assert scale_ratios([_row(1, 10)]) == []


def test_report_counts_errors_and_flags_failures_and_idle_replicas():
    rows = [_row(1, 500), _row(2, 900, errors=2, per_replica={"only-one": 9})]
    rows[1].error_statuses = {"HTTP 503 server_overloaded": 2}
    text = render_report("T", ["date: now"], rows, ["R=4: RuntimeError: boom"], "python -m bench.scale")
    assert "throughput R=2 / R=1: 1.80x" in text
    assert "Errors (must be 0): 2" in text and "HTTP 503 server_overloaded x2" in text
    assert "WARNING: R=2, speculation on: only 1 of 2 replicas served requests" in text
    assert "FAILED: R=4: RuntimeError: boom" in text and text.startswith("# T\n\n- date: now\n")
    assert uneven_replicas([_row(2, 10, per_replica={})]) == []  # no header seen: no claim either way
    assert "n/a (fewer than two replica counts measured)" in render_report("T", [], [_row(1, 5)], [], "x")


def test_small_helpers():
    assert replica_split({}) == "-"
    assert replica_split({"b": 2, "a": 2, "c": 5}) == "c: 5 / a: 2 / b: 2"
    assert parse_replicas("2,1,2") == [1, 2]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_replicas("0,1")
    assert cpu_budget(2, 2.0, 2, 1.0) == 8.0  # 2 Generators x 2 + (Ingress + Router) x 2 x 1
    assert cpu_budget(2, 0.5, 2, 0.25) == 2.0  # the CPU smoke test fits 2 cores

"""Command-line functions of the training package (registered on the `flashspec` CLI)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from training import corpora
from training.sources import CorpusError


def data_build(
    out: Annotated[
        Optional[Path], typer.Option(help="Folder for the built data; default: $FLASHSPEC_HOME/data.")
    ] = None,
    domains: Annotated[
        str, typer.Option(help="Comma-separated built-in domains to build (code, general, dialog).")
    ] = ",".join(corpora.DOMAINS),
    max_docs: Annotated[
        Optional[int], typer.Option(help="At most this many documents per domain, a seeded random subset (default: 10000 for built-in domains, all rows of --dataset).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the document sample, the split and the request shapes.")] = 0,
    dataset: Annotated[
        Optional[str],
        typer.Option(help="Your own data instead: a json/jsonl/csv/parquet/txt file or a save_to_disk folder."),
    ] = None,
    domain: Annotated[Optional[str], typer.Option(help="With --dataset: the domain this data is for.")] = None,
    text_field: Annotated[
        Optional[str], typer.Option(help="With --dataset: column of raw documents (code, doc text, transcripts).")
    ] = None,
    messages_field: Annotated[
        Optional[str], typer.Option(help='With --dataset: column of chats, lists of {"role", "content"}.')
    ] = None,
) -> None:
    """Build the per-domain training corpora (train/validation/test, split by document)."""
    out_dir = out or corpora.default_data_dir()
    try:
        if dataset is None:
            if domain or text_field or messages_field:
                raise CorpusError("--domain, --text-field and --messages-field go with --dataset")
            names = [corpora.check_domain(d.strip()) for d in domains.split(",") if d.strip()]
            if not names:
                raise CorpusError(f"--domains is empty; valid domains: {', '.join(corpora.DOMAINS)}")
            render = corpora.default_render()
            for name in names:
                start = time.perf_counter()
                report = corpora.build_domain(
                    name, out_dir, max_docs=corpora.DEFAULT_MAX_DOCS if max_docs is None else max_docs, seed=seed, render=render
                )
                _echo(report, time.perf_counter() - start)
        else:
            if domain is None:
                raise CorpusError(f"--dataset needs --domain (one of {', '.join(corpora.DOMAINS)})")
            start = time.perf_counter()
            report = corpora.build_user_domain(
                dataset, corpora.check_domain(domain), out_dir, text_field=text_field,
                messages_field=messages_field, max_docs=max_docs, seed=seed,
            )
            _echo(report, time.perf_counter() - start)
    except CorpusError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(code=1) from exc


def _echo(report: corpora.BuildReport, seconds: float) -> None:
    rows = ", ".join(f"{split} {n}" for split, n in report.rows.items())
    typer.echo(f"{report.domain}: {rows} rows ({report.duplicates} duplicates dropped) -> {report.path} [{seconds:.1f}s]")

"""Command-line functions of the training package (registered on the `flashspec` CLI)."""

from __future__ import annotations

import json
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


# ----- drafts: train, evaluate, publish, activate, roll back ----------------------------------------
StoreOpt = Annotated[Optional[Path], typer.Option(help="Draft store folder; default: $FLASHSPEC_HOME/store.")]
PushOpt = Annotated[
    Optional[str], typer.Option(help="Base URL of a running app: POST {domain, version} to <url>/admin/drafts after the change.")
]


def _fail(exc: Exception) -> None:
    typer.echo(f"error: {exc}", err=True)
    raise typer.Exit(code=1) from exc


def _errors() -> tuple[type[Exception], ...]:
    from drafts.checkpoint import DraftLoadError
    from drafts.store import StoreError
    from engine.loading import ModelLoadError
    from training.distill import TrainError

    return (TrainError, CorpusError, StoreError, DraftLoadError, ModelLoadError, ValueError, OSError)


def _store(store: Optional[Path]):
    from drafts.store import DraftStore, default_store_root

    return DraftStore(store or default_store_root())


def push_activation(url: str, domain: str, version: str, timeout: float = 10.0) -> dict:
    """Tell a running app to load `version` for `domain` (POST <url>/admin/drafts {domain, version})."""
    import httpx

    endpoint = url.rstrip("/")
    if not endpoint.endswith("/admin/drafts"):
        endpoint += "/admin/drafts"
    try:
        response = httpx.post(endpoint, json={"domain": domain, "version": version}, timeout=timeout)
    except httpx.HTTPError as exc:
        raise OSError(f"cannot reach {endpoint}: {exc}; is the app running? the store change is kept, push again "
                      f"with: flashspec drafts activate --domain {domain} --version {version} --push-url URL") from exc
    if response.status_code >= 400:
        raise OSError(f"{endpoint} answered {response.status_code}: {response.text[:300]}")
    try:
        return response.json()
    except ValueError:
        return {"status_code": response.status_code}


def _push(push_url: Optional[str], domain: str, version: str) -> None:
    if push_url:
        push_activation(push_url, domain, version)
        typer.echo(f"pushed {domain} {version} to {push_url}")


def drafts_list(store: StoreOpt = None) -> None:
    """List published drafts per domain (* = active), with their mean accepted length; then the shipped ones."""
    from drafts.store import DOMAINS, DraftStore, shipped_drafts_dir

    try:
        for title, st in (("store", _store(store)), ("shipped", DraftStore(shipped_drafts_dir(), read_only=True))):
            typer.echo(f"{title}: {st.root}")
            for domain in DOMAINS:
                active = st.active(domain)
                versions = st.versions(domain)
                if not versions:
                    typer.echo(f"  {domain:8s} (none)")
                for version in versions:
                    metrics = st.manifest(domain, version).get("metrics", {})
                    mal = metrics.get("mean_accepted_length")
                    shown = f"mean_accepted_length {mal:.3f}" if isinstance(mal, (int, float)) else "not evaluated"
                    typer.echo(f"  {domain:8s} {'*' if version == active else ' '} {version:24s} {shown}")
    except _errors() as exc:
        _fail(exc)


def drafts_activate(
    domain: Annotated[str, typer.Option(help="code, general or dialog.")],
    version: Annotated[str, typer.Option(help="A published version (see drafts list).")],
    store: StoreOpt = None,
    force: Annotated[bool, typer.Option(help="Skip the gate (new mean accepted length >= active - tolerance).")] = False,
    tolerance: Annotated[float, typer.Option(help="Gate tolerance on the mean accepted length.")] = 0.05,
    push_url: PushOpt = None,
) -> None:
    """Make a published version the domain's active draft, if the gate passes (or --force)."""
    try:
        from drafts.store import DraftStore, shipped_drafts_dir

        shipped = DraftStore(shipped_drafts_dir(), read_only=True)
        result = _store(store).activate(domain, version, gate=True, tolerance=tolerance, force=force, fallback=shipped)
        typer.echo(result.message)
        if not result.activated:
            raise typer.Exit(code=1)
        _push(push_url, domain, version)
    except _errors() as exc:
        _fail(exc)


def drafts_rollback(
    domain: Annotated[str, typer.Option(help="code, general or dialog.")],
    store: StoreOpt = None,
    push_url: PushOpt = None,
) -> None:
    """Re-activate the domain's previously active draft."""
    try:
        version = _store(store).rollback(domain)
        typer.echo(f"{domain}: rolled back to {version}")
        _push(push_url, domain, version)
    except _errors() as exc:
        _fail(exc)


def _threads(threads: Optional[int]) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


def eval_draft(
    domain: Annotated[str, typer.Option(help="Domain whose held-out prompts to decode: code, general or dialog.")],
    target: Annotated[str, typer.Option(help="'default', a Hugging Face folder or a .gguf file.")] = "default",
    draft: Annotated[Optional[Path], typer.Option(help="A draft folder; default: the domain's active draft.")] = None,
    store: StoreOpt = None,
    data_dir: Annotated[Optional[Path], typer.Option(help="Built data folder; default: $FLASHSPEC_HOME/data.")] = None,
    split: Annotated[str, typer.Option(help="validation or test.")] = "validation",
    num_prompts: Annotated[int, typer.Option(help="Held-out prompts to decode.")] = 16,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens generated per prompt.")] = 64,
    gamma: Annotated[int, typer.Option(help="Drafted tokens per round.")] = 5,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    report: Annotated[Optional[Path], typer.Option(help="Write the JSON report here too.")] = None,
    threads: Annotated[Optional[int], typer.Option(help="torch CPU threads.")] = None,
) -> None:
    """Decode held-out prompts with the real FlashSpec loop (block 2 and block gamma) and AR; print a JSON report."""
    from drafts.checkpoint import load_draft
    from drafts.store import resolve_draft
    from engine.loading import load_model
    from training.evaluate import evaluate_draft, held_out_prompts

    _threads(threads)
    try:
        folder = draft or resolve_draft(domain, store)
        if folder is None:
            raise ValueError(f"no active {domain} draft in the store nor shipped; pass --draft FOLDER")
        loaded = load_model(target, device=device)
        model = load_draft(folder, loaded.model)
        prompts = held_out_prompts(domain, loaded.tokenizer, num_prompts, split, data_dir=data_dir)
        out = evaluate_draft(loaded.model, loaded.tokenizer, model, prompts, max_new_tokens, gamma, blocks=(2, gamma))
        out.update({"domain": domain, "split": split, "target": loaded.name, "draft_path": str(folder), "device": device})
        text = json.dumps(out, indent=2)
        typer.echo(text)
        if report:
            report.write_text(text + "\n")
    except _errors() as exc:
        _fail(exc)


def train_draft(
    domain: Annotated[str, typer.Option(help="code, general, dialog, or mixed (all three; saved, not published).")],
    target: Annotated[str, typer.Option(help="'default', a Hugging Face folder or a .gguf file.")] = "default",
    store: StoreOpt = None,
    data_dir: Annotated[Optional[Path], typer.Option(help="Built data folder; default: $FLASHSPEC_HOME/data.")] = None,
    dataset: Annotated[Optional[str], typer.Option(help="Train on your own data (file or save_to_disk folder) instead.")] = None,
    text_field: Annotated[Optional[str], typer.Option(help="With --dataset: column of raw documents.")] = None,
    messages_field: Annotated[Optional[str], typer.Option(help="With --dataset: column of chats.")] = None,
    steps: Annotated[int, typer.Option(help="Optimizer steps.")] = 300,
    max_seconds: Annotated[Optional[float], typer.Option(
        help="Time budget of the training loop; the schedule follows whichever of steps or time runs out first.")] = None,
    batch_size: Annotated[int, typer.Option(help="Sequences per micro-batch.")] = 8,
    grad_accum: Annotated[int, typer.Option(help="Micro-batches per step.")] = 1,
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence.")] = 256,
    lr_adapters: Annotated[float, typer.Option(help="Adapters' learning rate.")] = 5e-5,
    lr_head: Annotated[float, typer.Option(help="Head's learning rate.")] = 1e-4,
    warmup_steps: Annotated[int, typer.Option(help="Linear warmup steps.")] = 20,
    ce_weight: Annotated[float, typer.Option(help="Cross-entropy weight (0: pure KL to the target).")] = 0.0,
    tv_weight: Annotated[float, typer.Option(
        help="Total variation weight: 1 - sum min(p, q), a sampled draft token's rejection probability (0: off).")] = 0.0,
    rollout_steps: Annotated[int, typer.Option(help="Draft passes per batch for deep drafts (1-3).")] = 2,
    group_by_length: Annotated[bool, typer.Option(
        help="Batch sequences of about one length (less padding); --no-group-by-length: uniformly random batches.")] = True,
    teacher_cache_gb: Annotated[float, typer.Option(
        help="Keep the target's hidden states of the training set in device memory up to this size (0: off).")] = 8.0,
    shared_layers: Annotated[int, typer.Option(help="N: target layers shared as the trunk.")] = 3,
    adapter_layers: Annotated[int, typer.Option(help="A: adapter layers.")] = 1,
    head: Annotated[str, typer.Option(help="mlp or mlp_tied.")] = "mlp_tied",
    feature_input: Annotated[str, typer.Option(help="deep or none.")] = "deep",
    head_vocab: Annotated[int, typer.Option(help="Sub-vocabulary size K (0: full vocabulary).")] = 8192,
    feature_layers: Annotated[str, typer.Option(
        help="Deep drafts: comma list of target layer counts (between N and L) whose states are fused in "
             "beside the final one, e.g. 10,20 ('': final state only).")] = "",
    self_distill: Annotated[int, typer.Option(help="Generate the target's replies to this many training prompts first (0: off).")] = 0,
    self_distill_tokens: Annotated[int, typer.Option(help="Max tokens per self-distilled reply.")] = 128,
    self_distill_sampled: Annotated[int, typer.Option(
        help="With --self-distill: this many extra sampled replies per prompt (seeded).")] = 0,
    sample_temperature: Annotated[float, typer.Option(help="Temperature of the sampled replies.")] = 0.8,
    max_rows: Annotated[Optional[int], typer.Option(help="Use at most this many training rows.")] = None,
    eval_prompts: Annotated[int, typer.Option(help="Held-out prompts for the acceptance evaluation.")] = 16,
    eval_tokens: Annotated[int, typer.Option(help="Tokens generated per evaluation prompt.")] = 64,
    version: Annotated[Optional[str], typer.Option(help="Version name in the store (default: UTC timestamp).")] = None,
    tolerance: Annotated[float, typer.Option(help="Activation gate tolerance.")] = 0.05,
    activate: Annotated[bool, typer.Option(help="Activate the new version when the gate passes.")] = True,
    out: Annotated[Optional[Path], typer.Option(help="Run folder (checkpoints, log, eval); default: $FLASHSPEC_HOME/runs/<domain>.")] = None,
    resume: Annotated[bool, typer.Option(help="Resume from the run folder's checkpoint when present.")] = True,
    init_from: Annotated[Optional[Path], typer.Option(
        help="Fine-tune a trained draft (a version folder, or a domain folder's ACTIVE one) instead of starting "
             "fresh adapters; its shape is kept and the shape options are not used.")] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    seed: Annotated[int, typer.Option(help="Seed.")] = 0,
    threads: Annotated[Optional[int], typer.Option(help="torch CPU threads.")] = None,
) -> None:
    """Train a domain draft, evaluate it with the real decoder, publish it to the store, activate it if the gate passes."""
    from drafts.checkpoint import version_folder
    from training.distill import TrainConfig, check_train_domain, draft_shape, layer_list
    from training.pipeline import run_pipeline

    _threads(threads)
    try:
        check_train_domain(domain)
        from engine.loading import flashspec_home

        run_dir = out or flashspec_home() / "runs" / domain
        shape = dict(shared_layers=shared_layers, adapter_layers=adapter_layers, head=head, feature_input=feature_input,
                     head_vocab=head_vocab or None, feature_layers=layer_list(feature_layers))
        if init_from is not None:
            init_from = version_folder(init_from)
            shape = draft_shape(init_from)
            typer.echo(f"init-from {init_from}: fine-tuning a {shape} draft")
        cfg = TrainConfig(
            domain=domain, **shape, init_from=str(init_from) if init_from else None,
            steps=steps, max_seconds=max_seconds,
            batch_size=batch_size,
            grad_accum=grad_accum, seq_len=seq_len, lr_adapters=lr_adapters, lr_head=lr_head, warmup_steps=warmup_steps,
            ce_weight=ce_weight, tv_weight=tv_weight, rollout_steps=rollout_steps, group_by_length=group_by_length, teacher_cache_gb=teacher_cache_gb, seed=seed, device=device, out_dir=str(run_dir),
            resume=resume, eval_every=max(1, min(100, steps)), save_every=max(1, min(100, steps)),
        )
        run_pipeline(cfg, target=target, store=store, data_dir=data_dir, dataset=dataset, text_field=text_field,
                     messages_field=messages_field, self_distill=self_distill, self_distill_tokens=self_distill_tokens,
                     self_distill_sampled=self_distill_sampled, sample_temperature=sample_temperature,
                     max_rows=max_rows, eval_prompts=eval_prompts, eval_tokens=eval_tokens, version=version,
                     tolerance=tolerance, activate=activate, echo=typer.echo)
    except _errors() as exc:
        _fail(exc)
    except Exception as exc:  # pydantic validation of the options
        from pydantic import ValidationError

        if isinstance(exc, ValidationError):
            _fail(ValueError(str(exc)))
        raise


def main() -> None:
    """`python -m training.cli ...` without the flashspec package."""
    app = typer.Typer(add_completion=False, no_args_is_help=True)
    for fn in (data_build, train_draft, eval_draft, drafts_list, drafts_activate, drafts_rollback):
        app.command(fn.__name__.replace("_", "-"))(fn)
    app()


if __name__ == "__main__":
    main()

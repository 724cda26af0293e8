"""The `flashspec` command line: one typer app, each package contributes its commands."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="FlashSpec Router: speculative decoding served per domain.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that print ratios measured side by side in one run.")
drafts_app = typer.Typer(no_args_is_help=True, help="The draft store: list, activate, roll back domain drafts.")
data_app = typer.Typer(no_args_is_help=True, help="Training corpora per domain.")
tenants_app = typer.Typer(no_args_is_help=True, help="Tenant policy helpers.")
app.add_typer(bench_app, name="bench")
app.add_typer(drafts_app, name="drafts")
app.add_typer(data_app, name="data")
app.add_typer(tenants_app, name="tenants")


def fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


def resolve_draft_arg(draft: str, loaded, prompt_text: str | list):
    """--draft none|auto|DOMAIN|PATH -> (DraftModel | None, description)."""
    if draft == "none":
        return None, "none"
    from drafts.checkpoint import DraftLoadError, load_draft
    from drafts.store import DOMAINS, resolve_draft

    domain = None
    if draft == "auto":
        from router.classifier import DomainClassifier

        decision = DomainClassifier.load().predict(prompt_text)
        domain = decision.domain
    elif draft in DOMAINS:
        domain = draft
    if domain is not None:
        path = resolve_draft(domain)
        if path is None:
            fail(f"no active draft for domain {domain!r}: train one with `flashspec train-draft --domain {domain}` "
                 "or pass --draft PATH")
    else:
        path = Path(draft)
        if not path.exists():
            fail(f"--draft {draft!r} is not none, auto, a domain ({', '.join(DOMAINS)}) nor an existing folder")
    try:
        model = load_draft(path, loaded.model, name=domain or path.name)
    except DraftLoadError as exc:
        fail(str(exc))
    return model, f"{domain or 'path'}:{path}"


@app.command()
def generate(
    prompt: Annotated[str, typer.Option("--prompt", help="Prompt text.")],
    model: Annotated[str, typer.Option(help="'default' (SmolLM2-135M-Instruct), a Hugging Face folder or a .gguf file.")] = "default",
    chat: Annotated[bool, typer.Option("--chat", help="Wrap the prompt as a user message with the model's chat template.")] = False,
    max_new_tokens: Annotated[int, typer.Option(help="Most tokens to generate.")] = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass, in (0, 1].")] = 1.0,
    top_k: Annotated[int, typer.Option(help="Keep the k most likely tokens (0 = off).")] = 0,
    seed: Annotated[Optional[int], typer.Option(help="Seed for reproducible sampling.")] = None,
    stop: Annotated[Optional[list[str]], typer.Option(help="Stop string (repeatable).")] = None,
    draft: Annotated[str, typer.Option(help="none, auto (the router picks the domain), code|general|dialog (that domain's active draft) or a draft folder.")] = "none",
    num_speculative_tokens: Annotated[int, typer.Option(help="gamma: tokens drafted per round.")] = 5,
    block_size: Annotated[int, typer.Option(help="Verify every this many drafted tokens (= gamma: one verify per round).")] = 2,
    tree_width: Annotated[int, typer.Option(help="Greedy rounds draft this many branches and keep the longest accepted (1 = a chain).")] = 1,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    dtype: Annotated[str, typer.Option(help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16.")] = "auto",
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Generate text with the engine, plainly or with a FlashSpec draft."""
    from engine.generate import generate as run_generate
    from engine.loading import ModelLoadError, load_model
    from engine.requests import RequestError
    from engine.sampling import SamplingParams
    from engine.scheduler import DecodeEngine
    from engine.speculative import SpecConfig

    try:
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed, stop=tuple(stop or ()))
        spec = SpecConfig(num_speculative_tokens, block_size, tree_width=tree_width)
    except ValueError as exc:
        fail(str(exc))
    if not prompt:
        fail("--prompt is empty: give the text to continue")
    try:
        loaded = load_model(model, device=device, dtype=dtype)
    except (ModelLoadError, ValueError) as exc:
        fail(str(exc))
    tok = loaded.tokenizer
    messages = [{"role": "user", "content": prompt}]
    if chat:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    else:
        ids = tok(prompt).input_ids
    draft_model, draft_desc = resolve_draft_arg(draft, loaded, messages if chat else prompt)
    max_seq_len = min(loaded.args.max_position_embeddings, max(len(ids) + max_new_tokens + 1, 256))
    engine = DecodeEngine(loaded.model, tok, max_batch_size=1, max_seq_len=max_seq_len, spec=spec)
    name = None
    if draft_model is not None:
        name = draft_model.name
        engine.add_draft(name, draft_model)
    try:
        result = run_generate(engine, [ids], params, draft=name)[0]
    except RequestError as exc:
        fail(str(exc))
    if json_output:
        out = result.to_dict()
        out["draft"] = draft_desc
        typer.echo(json.dumps(out))
    else:
        typer.echo(result.text)
        if result.stats is not None:
            s = result.stats.to_dict()
            typer.echo(f"[draft {draft_desc}: acceptance {s['acceptance_rate']:.2f}, mean accepted length "
                       f"{s['mean_accepted_length']:.2f}, {result.decode_tokens_per_s:.1f} tokens/s]", err=True)


@bench_app.command("ar")
def bench_ar(
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    prompts: Annotated[int, typer.Option(help="Prompts to run.")] = 4,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens per prompt.")] = 64,
    threads: Annotated[int, typer.Option(help="torch threads (0 = torch's default).")] = 0,
) -> None:
    """Engine AR tokens/s next to transformers generate tokens/s, same prompts, same run."""
    from bench.ar import run

    run(device=device, n_prompts=prompts, max_new_tokens=max_new_tokens, threads=threads)


@bench_app.command("spec")
def bench_spec(
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    draft: Annotated[list[str], typer.Option(help="Draft(s) to measure: a domain, a folder, 'untrained:N,A,HEAD,FEATURE', 'lookup' (n-gram lookup), or D+lookup (draft D with the lookup drafter as its alternative, the governor picking).")] = ["code"],
    domain: Annotated[str, typer.Option(help="Held-out prompts of this domain.")] = "code",
    prompts: Annotated[int, typer.Option(help="Prompts to run.")] = 4,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens per prompt.")] = 256,
    gamma: Annotated[list[int], typer.Option(help="num_speculative_tokens (several: each is a row).")] = [5],
    threads: Annotated[int, typer.Option(help="torch threads (0 = torch's default).")] = 0,
    split: Annotated[str, typer.Option(help="Corpus split the prompts come from (tune on validation, report test).")] = "test",
    block: Annotated[Optional[list[int]], typer.Option(help="Block size(s) to run (default: 2 and gamma).")] = None,
    draft_confidence: Annotated[list[float], typer.Option(help="draft_confidence value(s) to run (0 = off).")] = [0.0],
    repeats: Annotated[int, typer.Option(help="Interleaved passes (AR, every row, AR, ...); speedup = median over them.")] = 1,
    temperature: Annotated[float, typer.Option(help="Sampling temperature of every path (0 = greedy).")] = 0.0,
    draft_temperature: Annotated[Optional[list[float]], typer.Option(
        help="With --temperature: the draft's sampling temperature(s), each a row (default: the same as --temperature).")] = None,
    full_vocab_draws: Annotated[bool, typer.Option(
        help="With --temperature: each row again, the draft's tokens drawn over the whole vocabulary, not its sub-vocabulary.")] = False,
    tree_width: Annotated[list[int], typer.Option(help="Draft-tree width(s), each a row (1 = a chain; greedy rounds only).")] = [1],
    shape: Annotated[str, typer.Option(help="request: the split's plain requests; long: the GPU benchmark's long shape (the request with the next rows' documents appended to 512 tokens).")] = "request",
) -> None:
    """AR vs FlashSpec tokens/s, mean accepted length and acceptance rate (block 2 and block gamma), one run."""
    from bench.spec import run

    run(device=device, drafts=draft, domain=domain, n_prompts=prompts, max_new_tokens=max_new_tokens, gamma=tuple(gamma),
        threads=threads, split=split, blocks=tuple(block) if block else None, confidences=tuple(draft_confidence),
        repeats=repeats, temperature=temperature,
        draft_temperatures=tuple(draft_temperature) if draft_temperature else (None,), full_vocab_draws=full_vocab_draws,
        trees=tuple(tree_width), shape=shape)


@app.command()
def serve(
    config: Annotated[Path, typer.Option(help="Serve config YAML (the one docker-compose and the RayService use).")] = Path("services/serve_config.yaml"),
    host: Annotated[str, typer.Option(help="HTTP host; 127.0.0.1 keeps it on this machine.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="HTTP port.")] = 8000,
    num_cpus: Annotated[Optional[int], typer.Option(help="CPUs Ray may use (default: all).")] = None,
) -> None:
    """Start Ray light and serve the app (OpenAI API under /v1) until Ctrl-C."""
    from services.run import main as run_main

    args = ["--config", str(config), "--host", host, "--port", str(port)]
    if num_cpus:
        args += ["--num-cpus", str(num_cpus)]
    raise typer.Exit(code=run_main(args))


@bench_app.command("serve", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench_serve(ctx: typer.Context) -> None:
    """Concurrent streaming clients against a local app, speculation on vs off (see bench/serve.py --help)."""
    from bench.serve import main as serve_main

    raise typer.Exit(code=serve_main(list(ctx.args)) or 0)


def _register_optional() -> None:
    """Commands of the other packages; each imports its heavy dependencies only when it runs."""
    try:
        from router.cli import route, tenants_hash_key, train_router

        app.command("route")(route)
        app.command("train-router")(train_router)
        tenants_app.command("hash-key")(tenants_hash_key)
    except ImportError as exc:  # scikit-learn / skops missing
        logging.getLogger(__name__).debug("router commands unavailable: %s", exc)
    try:
        from training import cli as tcli

        data_app.command("build")(tcli.data_build)
        for name, attr, target in (("train-draft", "train_draft", app), ("eval-draft", "eval_draft", app),
                                   ("list", "drafts_list", drafts_app), ("activate", "drafts_activate", drafts_app),
                                   ("rollback", "drafts_rollback", drafts_app)):
            if hasattr(tcli, attr):
                target.command(name)(getattr(tcli, attr))
    except ImportError as exc:  # datasets missing
        logging.getLogger(__name__).debug("training commands unavailable: %s", exc)


_register_optional()


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    app()


if __name__ == "__main__":
    sys.exit(main())

"""Per-domain corpora for draft training: documents -> request-shaped chats -> `datasets` on disk.

Each domain is saved with `DatasetDict.save_to_disk` to `<data_dir>/<domain>/` with splits
train / validation / test, split by document (a document's rows all land in one split),
deduplicated by exact hash of the normalized text. Row columns (`FEATURES`):
  doc_id, source, license   where the row comes from
  text      a chunk of the raw document (code chunk, doc section, "A: ... / B: ..." transcript)
  messages  a request a real user of the domain would send, ending with a user turn
  prompt    `messages` rendered with the target's chat template, generation prompt appended
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import textwrap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import datasets

from training import sources
from training.sources import Chunk, CorpusError, Document, PyFunction, SourceInfo

DOMAINS = ("code", "general", "dialog")
SPLITS = ("train", "validation", "test")
DEFAULT_MAX_DOCS = 10_000  # per domain; every built-in source is smaller, so the default build takes all
DEFAULT_FRACTIONS = (0.90, 0.05, 0.05)  # train, validation, test: share of documents
DIALOG_MAX_PROMPT_TURNS = 9

FEATURES = datasets.Features(
    {
        "doc_id": datasets.Value("string"),
        "source": datasets.Value("string"),
        "license": datasets.Value("string"),
        "text": datasets.Value("string"),
        "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
        "prompt": datasets.Value("string"),
    }
)

Render = Callable[[list[dict]], str]

BUILTIN_SOURCES: dict[str, tuple[SourceInfo, ...]] = {
    "code": (sources.STDLIB,),
    "general": (sources.PYTHON_DOCS,),
    "dialog": (sources.CHITCHAT, sources.CHATTERBOT),
}


def default_data_dir() -> Path:
    """`$FLASHSPEC_HOME/data` (FLASHSPEC_HOME defaults to ~/.cache/flashspec)."""
    from engine.loading import flashspec_home  # lazy: engine.loading imports torch

    return flashspec_home() / "data"


def check_domain(domain: str) -> str:
    if domain not in DOMAINS:
        raise CorpusError(f"unknown domain {domain!r}; valid domains: {', '.join(DOMAINS)}")
    return domain


@dataclass(frozen=True)
class Example:
    """One row before rendering."""

    doc_id: str
    source: str
    license: str
    text: str
    messages: tuple[tuple[str, str], ...]  # (role, content), last role is "user"


def _user(content: str) -> tuple[tuple[str, str], ...]:
    return (("user", content),)


def _hash01(*parts: object) -> float:
    """Uniform in [0, 1), stable across runs and machines (unlike hash())."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


# ---- code: requests built from real stdlib functions ----


_BUGS = (
    (" == ", " != "),
    (" != ", " == "),
    (" < ", " <= "),
    (" > ", " >= "),
    (" + 1", " - 1"),
    (" - 1", " + 1"),
    (" and ", " or "),
    (" is None", " is not None"),
    ("return True", "return False"),
)


def _inject_bug(body: str, rng: random.Random) -> str | None:
    """Flip one comparison/operator in `body`; None if nothing applies."""
    options = [(old, new) for old, new in _BUGS if old in body]
    if not options:
        return None
    old, new = rng.choice(options)
    spots = [i for i in range(len(body)) if body.startswith(old, i)]
    at = rng.choice(spots)
    return body[:at] + new + body[at + len(old) :]


def _fence(code: str) -> str:
    return f"```python\n{code.rstrip()}\n```"


def _module_name(doc_id: str) -> str:
    name = doc_id.split("/", 1)[-1].removesuffix(".py").replace("/", ".")
    return name.removesuffix(".__init__")


def _first_paragraph(doc: str) -> str:
    return " ".join(doc.strip().split("\n\n")[0].split())


def code_request(doc: Document, chunk: Chunk, functions: Sequence[PyFunction], rng: random.Random) -> str:
    """A request built from the chunk: write (docstring -> function), complete, explain or fix."""
    lines = doc.text.splitlines()
    inside = [f for f in functions if f.start >= chunk.start_line and f.end <= chunk.end_line and f.body_start]
    module = _module_name(doc.doc_id)
    if not inside:
        chunk_lines = chunk.text.splitlines()
        if rng.random() < 0.5 and len(chunk_lines) >= 4:
            head = "\n".join(chunk_lines[: len(chunk_lines) // 2])
            return rng.choice(["Complete this code:", f"Continue this Python code from the `{module}` module:"]) + (
                "\n" + _fence(head)
            )
        return rng.choice(
            ["Explain what this Python code does:", f"What does this part of the `{module}` module do?"]
        ) + ("\n" + _fence(chunk.text))
    kind = rng.choices(["write", "complete", "explain", "fix"], weights=[35, 30, 20, 15])[0]
    pools = {
        "write": [f for f in inside if len(_first_paragraph(f.docstring)) >= 20],
        "fix": [f for f in inside if any(old in "\n".join(lines[f.body_start - 1 : f.end]) for old, _ in _BUGS)],
    }
    if not pools.get(kind, inside):
        kind = "complete" if kind == "write" else "explain"
    fn = rng.choice(pools.get(kind, inside))
    # dedent the whole function once, then cut it into header (signature + docstring) and body
    source_lines = textwrap.dedent("\n".join(lines[fn.start - 1 : fn.end])).splitlines()
    head_lines, body_lines = source_lines[: fn.body_start - fn.start], source_lines[fn.body_start - fn.start :]
    head = "\n".join(head_lines) + "\n"
    source = head + "\n".join(body_lines)
    what = f"method `{fn.signature}` of a class `{fn.owner}`" if fn.owner else f"function `{fn.signature}`"
    summary = _first_paragraph(fn.docstring)
    if kind == "fix":
        broken = _inject_bug("\n".join(body_lines), rng)
        return rng.choice(
            [
                "This Python function has a bug. Find it and fix it:",
                f"My `{fn.name}` function doesn't work as expected. Can you fix it?",
            ]
        ) + ("\n" + _fence(head + broken))
    if kind == "write":
        return rng.choice(
            [
                f"Write a Python {what} that does the following:\n\n{summary}",
                f"Implement this in Python.\n\nSignature: `{fn.signature}`\nDescription: {summary}",
                f"Can you write the {what}? {summary}",
            ]
        )
    if kind == "complete":
        partial = head + "\n".join(body_lines[: max(1, len(body_lines) // 2)])
        return rng.choice(
            ["Complete this code:", "Finish the implementation of this Python function:"]
        ) + ("\n" + _fence(partial))
    return rng.choice(
        [
            "Explain what this Python function does:",
            f"What does `{fn.name}` do? Walk me through it.",
            f"Explain how this function from the `{module}` module works:",
        ]
    ) + ("\n" + _fence(source))


def code_examples(doc: Document, seed: int) -> list[Example]:
    functions = sources.python_functions(doc.text)
    out = []
    for i, chunk in enumerate(sources.chunk_code(doc.text)):
        rng = random.Random(f"{seed}:{doc.doc_id}:{i}")
        request = code_request(doc, chunk, functions, rng)
        out.append(Example(doc.doc_id, doc.source, doc.license, chunk.text, _user(request)))
    return out


# ---- general: requests about documentation sections ----

_EXCERPT_CHARS = 2500


def _excerpt(text: str, limit: int = _EXCERPT_CHARS) -> str:
    if len(text) <= limit:
        return text
    cut = text.rfind("\n\n", 0, limit)
    return text[: cut if cut > limit // 3 else limit].rstrip()


def general_request(title: str, doc_title: str, chunk_text: str, rng: random.Random) -> str:
    topic = title or doc_title or "this topic"
    if doc_title and title and title != doc_title:
        topic = f"{title} ({doc_title})"
    passage = _excerpt(sources.rst_passage(chunk_text))
    kind = rng.choices(["summarize", "explain", "what", "passage", "how"], weights=[30, 25, 15, 20, 10])[0]
    if kind == "summarize":
        return f"Summarize the following section of the Python documentation:\n\n{passage}"
    if kind == "passage":
        return (
            f"Here is an excerpt from the Python documentation about {topic}:\n\n{passage}\n\n"
            "Explain it in simple words, with an example."
        )
    if kind == "explain":
        return rng.choice([f"Explain {topic} in Python.", f"Can you explain {topic}? Keep it short."])
    if kind == "what":
        return f"What is {topic} in Python docs terms?"
    return f"How do I use {topic} in Python? Show an example."


def general_examples(doc: Document, seed: int) -> list[Example]:
    chunks = sources.chunk_rst(doc.text)
    doc_title = next((c.title for c in chunks if c.title), "")
    out = []
    for i, chunk in enumerate(chunks):
        rng = random.Random(f"{seed}:{doc.doc_id}:{i}")
        request = general_request(chunk.title, doc_title, chunk.text, rng)
        out.append(Example(doc.doc_id, doc.source, doc.license, chunk.text, _user(request)))
    return out


# ---- dialog: the opening turns of a real conversation ----


def dialog_messages(turns: Sequence[str], rng: random.Random) -> tuple[tuple[str, str], ...]:
    """The first k turns (k odd) as alternating user/assistant roles, so the last is a user turn."""
    most = min(len(turns), DIALOG_MAX_PROMPT_TURNS)
    k = rng.choice(range(1, most + 1, 2))
    return tuple(("user" if i % 2 == 0 else "assistant", turns[i]) for i in range(k))


def _turn_windows(turns: Sequence[str], max_chars: int = sources.CHUNK_MAX_CHARS) -> list[tuple[str, ...]]:
    """Long conversations become consecutive windows of whole turns, each <= max_chars of transcript."""
    windows: list[list[str]] = [[]]
    size = 0
    for turn in turns:
        if windows[-1] and size + len(turn) + 4 > max_chars:
            windows.append([])
            size = 0
        windows[-1].append(turn)
        size += len(turn) + 4
    return [tuple(w) for w in windows if w]


def dialog_examples(doc: Document, seed: int) -> list[Example]:
    out = []
    for i, window in enumerate(_turn_windows(doc.turns)):
        rng = random.Random(f"{seed}:{doc.doc_id}:{i}")
        out.append(
            Example(doc.doc_id, doc.source, doc.license, sources.render_turns(window), dialog_messages(window, rng))
        )
    return out


EXAMPLE_BUILDERS: dict[str, Callable[[Document, int], list[Example]]] = {
    "code": code_examples,
    "general": general_examples,
    "dialog": dialog_examples,
}


def read_builtin(domain: str) -> list[Document]:
    """All documents of a domain's built-in sources."""
    check_domain(domain)
    if domain == "code":
        return sources.read_stdlib()
    if domain == "general":
        return sources.read_python_docs()
    return sources.read_chitchat() + sources.read_chatterbot()


# ---- sample, deduplicate, split, render, save ----


def sample_documents(items: Sequence, max_docs: int | None, seed: int, key=lambda d: d.doc_id) -> list:
    """The items of a seeded random subset of at most max_docs distinct keys, in their original order."""
    if max_docs is not None and max_docs < 1:
        raise CorpusError(f"--max-docs must be at least 1, got {max_docs}")
    keys = {key(item) for item in items}
    if max_docs is None or len(keys) <= max_docs:
        return list(items)
    keep = set(sorted(keys, key=lambda k: _hash01("sample", seed, k))[:max_docs])
    return [item for item in items if key(item) in keep]


def normalize(text: str) -> str:
    return " ".join(text.lower().split())


def deduplicate(examples: Iterable[Example]) -> tuple[list[Example], int]:
    """Drop rows whose normalized text was seen before (first one wins); returns (kept, dropped)."""
    seen: set[bytes] = set()
    kept = []
    dropped = 0
    for ex in examples:
        digest = hashlib.sha256(normalize(ex.text).encode()).digest()
        if digest in seen:
            dropped += 1
            continue
        seen.add(digest)
        kept.append(ex)
    return kept, dropped


def assign_splits(
    doc_ids: Iterable[str], seed: int, fractions: tuple[float, float, float] = DEFAULT_FRACTIONS
) -> dict[str, str]:
    """doc_id -> split, from a seeded hash of the id alone (a document's split never depends on others).

    With 3 or more documents no split is left empty: the highest-hash training documents move over.
    """
    if len(fractions) != 3 or any(f < 0 for f in fractions) or abs(sum(fractions) - 1) > 1e-6:
        raise CorpusError(f"split fractions must be 3 non-negative numbers summing to 1, got {fractions}")
    ids = sorted(set(doc_ids))
    score = {d: _hash01("split", seed, d) for d in ids}
    test_cut, val_cut = fractions[2], fractions[2] + fractions[1]
    split = {d: "test" if score[d] < test_cut else "validation" if score[d] < val_cut else "train" for d in ids}
    if len(ids) >= 3:
        for name, frac in (("validation", fractions[1]), ("test", fractions[2])):
            if frac > 0 and name not in split.values():
                train = sorted((d for d in ids if split[d] == "train"), key=lambda d: -score[d])
                if len(train) > 1:
                    split[train[0]] = name
    return split


@dataclass
class BuildReport:
    """What one domain build wrote."""

    domain: str
    path: Path
    rows: dict[str, int]
    documents: dict[str, int]
    duplicates: int
    per_source: dict[str, dict[str, int]] = field(default_factory=dict)  # source -> {"documents", "rows", "chars"}


def _to_rows(examples: Sequence[Example], render: Render) -> dict[str, list]:
    rows: dict[str, list] = {name: [] for name in FEATURES}
    for ex in examples:
        messages = [{"role": role, "content": content} for role, content in ex.messages]
        rows["doc_id"].append(ex.doc_id)
        rows["source"].append(ex.source)
        rows["license"].append(ex.license)
        rows["text"].append(ex.text)
        rows["messages"].append(messages)
        rows["prompt"].append(render(messages))
    return rows


def write_domain(
    domain: str,
    examples: Sequence[Example],
    out_dir: Path,
    *,
    render: Render,
    seed: int,
    infos: Sequence[SourceInfo],
    fractions: tuple[float, float, float] = DEFAULT_FRACTIONS,
    settings: str = "",
) -> BuildReport:
    """Deduplicate, split by document, render prompts and save `<out_dir>/<domain>/` (replacing it)."""
    check_domain(domain)
    kept, dropped = deduplicate(examples)
    if not kept:
        raise CorpusError(f"no rows left for domain {domain!r} (all inputs empty or too short)")
    split_of = assign_splits((ex.doc_id for ex in kept), seed, fractions)
    parts = {name: [ex for ex in kept if split_of[ex.doc_id] == name] for name in SPLITS}
    dataset = datasets.DatasetDict(
        {name: datasets.Dataset.from_dict(_to_rows(parts[name], render), features=FEATURES) for name in SPLITS}
    )
    per_source: dict[str, dict[str, int]] = {}
    for ex in kept:
        stats = per_source.setdefault(ex.source, {"documents": 0, "rows": 0, "chars": 0, "_seen": set()})
        stats["rows"] += 1
        stats["chars"] += len(ex.text)
        stats["_seen"].add(ex.doc_id)
    for stats in per_source.values():
        stats["documents"] = len(stats.pop("_seen"))
    report = BuildReport(
        domain,
        Path(out_dir) / domain,
        {name: len(parts[name]) for name in SPLITS},
        {name: len({ex.doc_id for ex in parts[name]}) for name in SPLITS},
        dropped,
        per_source,
    )
    # Write beside the target and swap, so a failed build never leaves a half-written domain.
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = out_dir / f".{domain}.building-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        # one shard per split: datasets cannot load back a split saved as zero shards
        dataset.save_to_disk(str(staging), num_shards={name: 1 for name in SPLITS})
    finally:
        if bars:
            datasets.enable_progress_bars()
    (staging / "SOURCES.md").write_text(sources.sources_note(report, infos, seed, fractions, settings), encoding="utf-8")
    if report.path.exists():
        shutil.rmtree(report.path)
    staging.rename(report.path)
    return report


def build_domain(
    domain: str,
    out_dir: Path | None = None,
    *,
    documents: Sequence[Document] | None = None,
    max_docs: int | None = DEFAULT_MAX_DOCS,
    seed: int = 0,
    render: Render | None = None,
    fractions: tuple[float, float, float] = DEFAULT_FRACTIONS,
) -> BuildReport:
    """Build one domain from its built-in sources (or from `documents`, e.g. a test fixture)."""
    check_domain(domain)
    docs = list(documents) if documents is not None else read_builtin(domain)
    if not docs:
        raise CorpusError(f"no documents for domain {domain!r}")
    docs = sample_documents(sorted(docs, key=lambda d: d.doc_id), max_docs, seed)
    examples = [ex for doc in docs for ex in EXAMPLE_BUILDERS[domain](doc, seed)]
    known = {info.name: info for infos in BUILTIN_SOURCES.values() for info in infos}
    used = sorted({(d.source, d.license) for d in docs})
    infos = [known.get(name) or SourceInfo(name, lic, "documents given to build_domain") for name, lic in used]
    return write_domain(
        domain, examples, Path(out_dir or default_data_dir()), render=render or default_render(), seed=seed,
        infos=infos, fractions=fractions, settings=f", at most {max_docs} documents" if max_docs else "",
    )


def build_user_domain(
    name_or_path: str,
    domain: str,
    out_dir: Path | None = None,
    *,
    text_field: str | None = None,
    messages_field: str | None = None,
    max_docs: int | None = None,
    seed: int = 0,
    render: Render | None = None,
    fractions: tuple[float, float, float] = DEFAULT_FRACTIONS,
) -> BuildReport:
    """Build `domain` from a user's dataset: raw text (`text_field`) or chats (`messages_field`)."""
    check_domain(domain)
    if (text_field is None) == (messages_field is None):
        raise CorpusError("give exactly one of --text-field (raw documents) or --messages-field (chats)")
    table = sources.load_user_dataset(name_or_path)
    info = sources.user_source_info(name_or_path)
    if text_field is not None:
        docs = sources.read_user_texts(table, text_field, info, as_dialog=domain == "dialog")
        docs = sample_documents(docs, max_docs, seed)
        examples = [ex for doc in docs for ex in EXAMPLE_BUILDERS[domain](doc, seed)]
    else:
        chats = sample_documents(sources.read_user_chats(table, messages_field, info), max_docs, seed)
        examples = [Example(c.doc_id, c.source, c.license, c.text, c.prompt_messages) for c in chats]
    return write_domain(
        domain, examples, Path(out_dir or default_data_dir()), render=render or default_render(), seed=seed,
        infos=[info], fractions=fractions, settings=f", at most {max_docs} documents" if max_docs else "",
    )


def default_render() -> Render:
    """The default target's chat template, generation prompt appended."""
    from engine.loading import ModelLoadError, load_tokenizer

    try:
        tokenizer = load_tokenizer("default")
    except ModelLoadError as exc:
        raise CorpusError(f"cannot load the default target's tokenizer for its chat template: {exc}") from exc

    def render(messages: list[dict]) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    return render


# ---- reading a built domain ----


def load_domain(domain: str, split: str, data_dir: Path | str | None = None) -> datasets.Dataset:
    """One split of a built domain, e.g. `load_domain("code", "train")`."""
    check_domain(domain)
    if split not in SPLITS:
        raise CorpusError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
    path = data_dir / domain
    if not (path / "dataset_dict.json").is_file():
        out = "" if data_dir == default_data_dir() else f" --out {data_dir}"
        raise CorpusError(
            f"no built data for domain {domain!r} at {path}; build it with: flashspec data build{out} --domains {domain}"
        )
    return datasets.load_from_disk(str(path))[split]

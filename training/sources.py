"""Offline corpus readers: each returns whole documents with their source and license.

Nothing here touches the network. Built-in sources (see docs/data.md):
  code     CPython standard library source of the running interpreter (PSF-2.0)
  general  Debian python3.11-doc reStructuredText sources (PSF-2.0)
  dialog   PyPI chitchat-dataset (MIT) and chatterbot-corpus English YAML (BSD-3-Clause)
"""

from __future__ import annotations

import importlib.util
import ast
import json
import re
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING

import datasets
import yaml

if TYPE_CHECKING:
    from training.corpora import BuildReport

PYTHON_DOCS_DIR = Path("/usr/share/doc/python3.11/html/_sources")

# Generated or test-only trees: codec tables are machine-written, tests are not what users ask for.
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "encodings", "idle_test", "test", "tests"}


class CorpusError(RuntimeError):
    """A corpus source or dataset is missing, empty or malformed; the message says how to fix it."""


@dataclass(frozen=True)
class Document:
    """One source document; the unit of the train/validation/test split.

    `turns` is set for conversations (one string per speaker turn, speakers alternate).
    """

    doc_id: str
    source: str
    license: str
    text: str
    turns: tuple[str, ...] = ()


@dataclass(frozen=True)
class SourceInfo:
    """What SOURCES.md says about one source."""

    name: str
    license: str
    obtained: str


STDLIB = SourceInfo(
    "cpython-stdlib",
    "PSF-2.0",
    "the running interpreter's `sysconfig.get_paths()['stdlib']`, `*.py`, without test/, encodings/ and site-packages/",
)
PYTHON_DOCS = SourceInfo(
    "python3.11-doc",
    "PSF-2.0",
    f"Debian package python3.11-doc (`apt-get install -y python3.11-doc`), `{PYTHON_DOCS_DIR}/**/*.rst.txt`",
)
CHITCHAT = SourceInfo(
    "chitchat-dataset",
    "MIT",
    "PyPI chitchat-dataset==0.9.0 (`pip install chitchat-dataset==0.9.0`), `chitchat_dataset/dataset.json`",
)
CHATTERBOT = SourceInfo(
    "chatterbot-corpus",
    "BSD-3-Clause",
    "PyPI chatterbot-corpus==1.3.3 (`pip install chatterbot-corpus==1.3.3`), `chatterbot_corpus/data/english/*.yml`",
)


def _package_dir(module: str, install: str) -> Path:
    # find_spec without importing: these packages' __init__ may be slow or pull in extras.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError(f"package {module!r} is not installed; install it with `{install}`")
    return Path(list(spec.submodule_search_locations)[0])


def read_stdlib(root: Path | None = None) -> list[Document]:
    """Every non-test `*.py` file of the standard library, sorted by path."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise CorpusError(f"standard library folder {root} does not exist")
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in _STDLIB_SKIP_DIRS or part.startswith("test_") for part in rel.parts[:-1]):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            docs.append(Document(f"stdlib/{rel.as_posix()}", STDLIB.name, STDLIB.license, text))
    if not docs:
        raise CorpusError(f"no *.py files found under {root}")
    return docs


def read_python_docs(root: Path | None = None) -> list[Document]:
    """Every `*.rst.txt` source of the Python documentation, sorted by path."""
    root = Path(root or PYTHON_DOCS_DIR)
    files = sorted(root.rglob("*.rst.txt")) if root.is_dir() else []
    if not files:
        raise CorpusError(
            f"no Python documentation sources under {root}; install them with `apt-get install -y python3.11-doc`"
        )
    docs = []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            rel = path.relative_to(root).as_posix()
            docs.append(Document(f"pydoc/{rel}", PYTHON_DOCS.name, PYTHON_DOCS.license, text))
    return docs


def render_turns(turns: tuple[str, ...] | list[str], speakers: tuple[str, str] = ("A", "B")) -> str:
    """Plain transcript: `A: ...` / `B: ...`, one turn per line."""
    return "\n".join(f"{speakers[i % 2]}: {turn}" for i, turn in enumerate(turns))


def _conversation(doc_id: str, info: SourceInfo, turns: list[str]) -> Document | None:
    turns = [" ".join(t.split()) for t in turns]
    turns = [t for t in turns if t]
    if len(turns) < 2:
        return None
    return Document(doc_id, info.name, info.license, render_turns(turns), tuple(turns))


def read_chitchat(path: Path | None = None) -> list[Document]:
    """chitchat-dataset conversations; consecutive messages of one sender form one turn."""
    if path is None:
        path = _package_dir("chitchat_dataset", "pip install chitchat-dataset==0.9.0") / "dataset.json"
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"{path} not found; reinstall with `pip install --force-reinstall chitchat-dataset==0.9.0`")
    data = json.loads(path.read_text(encoding="utf-8"))
    docs = []
    for conv_id in sorted(data):
        # messages: list of turns, each a list of {"sender", "text", "timestamp"} from one sender
        turns = [" ".join(m["text"] for m in group) for group in data[conv_id]["messages"]]
        doc = _conversation(f"chitchat/{conv_id}", CHITCHAT, turns)
        if doc is not None:
            docs.append(doc)
    return docs


def read_chatterbot(folder: Path | None = None) -> list[Document]:
    """chatterbot-corpus English conversations (each YAML list entry is one conversation)."""
    if folder is None:
        folder = _package_dir("chatterbot_corpus", "pip install chatterbot-corpus==1.3.3") / "data" / "english"
    files = sorted(Path(folder).glob("*.yml"))
    if not files:
        raise CorpusError(f"no *.yml files in {folder}; reinstall with `pip install chatterbot-corpus==1.3.3`")
    docs = []
    for path in files:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        for i, conv in enumerate(loaded.get("conversations") or []):
            if isinstance(conv, list):
                doc = _conversation(f"chatterbot/{path.stem}#{i}", CHATTERBOT, [str(t) for t in conv])
                if doc is not None:
                    docs.append(doc)
    return docs


# ---- Python source structure ----


@dataclass(frozen=True)
class PyFunction:
    """A function or method found in Python source."""

    name: str
    owner: str  # enclosing class name, "" for a module-level function
    start: int  # first line (decorators included), 1-based
    end: int
    body_start: int  # first line of the body after the docstring; 0 when the body is only a docstring
    signature: str
    docstring: str


def python_functions(source: str) -> list[PyFunction]:
    """Every function and method of `source` (nested ones too); [] if it does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    found = []

    def visit(node: ast.AST, owner: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(child) or ""
                body = child.body[1:] if doc else child.body
                returns = f" -> {ast.unparse(child.returns)}" if child.returns else ""
                start = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                found.append(
                    PyFunction(
                        child.name,
                        owner,
                        start,
                        child.end_lineno or child.lineno,
                        body[0].lineno if body else 0,
                        f"{child.name}({ast.unparse(child.args)}){returns}",
                        doc,
                    )
                )
                visit(child, "")
            elif isinstance(child, ast.ClassDef):
                visit(child, child.name)
            else:
                visit(child, owner)

    visit(tree, "")
    return found


# ---- chunking: documents -> pieces of roughly 1-4k characters at natural boundaries ----

CHUNK_TARGET_CHARS = 2000
CHUNK_MAX_CHARS = 4000
_MIN_CHUNK_CHARS = 80  # drop shreds (a lone import, a blank tail)
_CODE_STARTS = ("def ", "async def ", "class ", "@")
_RST_UNDERLINE = re.compile(r"([=\-~^\"*#+`'.:_])\1{2,}")


@dataclass(frozen=True)
class Chunk:
    """A piece of a document; lines are 1-based and inclusive (end_line = last line)."""

    text: str
    start_line: int
    end_line: int
    title: str = ""


def _split_range(lines: list[str], a: int, b: int, max_chars: int) -> list[tuple[int, int]]:
    """Split lines[a:b] at blank lines so that each part is <= max_chars where possible."""
    if b - a <= 1 or sum(len(x) for x in lines[a:b]) <= max_chars:
        return [(a, b)]
    cuts = [i for i in range(a + 1, b) if not lines[i - 1].strip() and lines[i].strip()]
    if not cuts:  # no blank line at all: cut by lines
        cuts = list(range(a + 1, b))
    parts = []
    for x, y in zip([a, *cuts], [*cuts, b]):
        parts.extend(_split_range(lines, x, y, max_chars))
    return _pack(lines, parts, max_chars, max_chars)


def _pack(
    lines: list[str],
    ranges: list[tuple[int, int]],
    target: int,
    max_chars: int,
    hard_starts: frozenset[int] = frozenset(),
    min_chars: int = 0,
) -> list[tuple[int, int]]:
    """Greedily merge consecutive line ranges into chunks of >= target chars (never over max_chars).

    A range starting at a line in `hard_starts` opens a new chunk unless the current one is
    shorter than `min_chars`.
    """
    out: list[tuple[int, int]] = []
    cur: tuple[int, int] | None = None
    cur_len = 0
    for a, b in ranges:
        size = sum(len(x) for x in lines[a:b])
        if cur is not None and (cur_len + size > max_chars or (a in hard_starts and cur_len >= min_chars)):
            out.append(cur)
            cur, cur_len = None, 0
        cur = (a, b) if cur is None else (cur[0], b)
        cur_len += size
        if cur_len >= target:
            out.append(cur)
            cur, cur_len = None, 0
    if cur is not None:
        # a short tail joins the previous chunk when it fits
        if out and cur_len < target // 2 and out[-1][1] == cur[0] and cur[0] not in hard_starts:
            prev_len = sum(len(x) for x in lines[out[-1][0] : out[-1][1]])
            if prev_len + cur_len <= max_chars:
                out[-1] = (out[-1][0], cur[1])
                return out
        out.append(cur)
    return out


def _chunks(lines: list[str], ranges: list[tuple[int, int]], titles: list[str] | None = None) -> list[Chunk]:
    chunks = []
    for a, b in ranges:
        text = "".join(lines[a:b]).strip("\n")
        if len(text.strip()) >= _MIN_CHUNK_CHARS:
            chunks.append(Chunk(text, a + 1, b, titles[a] if titles else ""))
    return chunks


def chunk_code(text: str, target: int = CHUNK_TARGET_CHARS, max_chars: int = CHUNK_MAX_CHARS) -> list[Chunk]:
    """Python source split after blank lines, at top-level statements and def/class/decorator lines."""
    lines = text.splitlines(keepends=True)
    starts = [0]
    for i in range(1, len(lines)):
        line = lines[i]
        if not lines[i - 1].strip() and line.strip():
            if not line[0].isspace() or line.lstrip().startswith(_CODE_STARTS):
                starts.append(i)
    pieces: list[tuple[int, int]] = []
    for a, b in zip(starts, [*starts[1:], len(lines)]):
        pieces.extend(_split_range(lines, a, b, max_chars))
    return _chunks(lines, _pack(lines, pieces, target, max_chars))


def rst_plain(text: str) -> str:
    """Plain text of reST inline markup: roles, literals, emphasis and link targets."""
    text = re.sub(r":[\w:.-]+:`(?:[^`<]*<)?~?!?([^`>]+)>?`", r"\1", text)
    text = re.sub(r"`([^`<]+?)\s*<[^`>]+>`_+", r"\1", text)
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    return re.sub(r"\*\*([^*]+)\*\*", r"\1", text)


def rst_passage(text: str) -> str:
    """A section as readable text: inline markup, heading underlines and link labels removed."""
    kept = [
        line
        for line in text.splitlines()
        if not _RST_UNDERLINE.fullmatch(line.strip()) and not re.fullmatch(r"\.\. _[^:]+:", line.strip())
    ]
    return re.sub(r"\n{3,}", "\n\n", rst_plain("\n".join(kept))).strip()


def rst_title(text: str) -> str:
    """A heading as one line of plain text."""
    return " ".join(rst_plain(text).replace("`", "").split())


def chunk_rst(
    text: str, target: int = CHUNK_TARGET_CHARS, max_chars: int = CHUNK_MAX_CHARS, min_section_chars: int = 500
) -> list[Chunk]:
    """reST split by section; long sections at paragraphs, short ones merged with the next.

    Each chunk's title is the (plain-text) title of the section it starts in.
    """
    lines = text.splitlines(keepends=True)
    heads = []  # line index where each section's heading (overline included) starts
    for i in range(len(lines) - 1):
        title, under = lines[i].strip(), lines[i + 1].strip()
        if not title or not _RST_UNDERLINE.fullmatch(under) or _RST_UNDERLINE.fullmatch(title):
            continue  # not a heading, or an overline (the title is on the next line)
        has_over = i > 0 and lines[i - 1].strip() == under
        if len(under) >= min(len(title), 4) and (has_over or not lines[i][0].isspace()):
            heads.append((i - 1 if has_over else i, rst_title(title)))
    titles = [""] * len(lines)
    bounds = [0] + [h for h, _ in heads if h > 0]
    current = heads[0][1] if heads else ""  # labels and directives before the first heading
    head_title = dict(heads)
    for i in range(len(lines)):
        current = head_title.get(i, current)
        titles[i] = current
    pieces: list[tuple[int, int]] = []
    for a, b in zip(bounds, [*bounds[1:], len(lines)]):
        pieces.extend(_split_range(lines, a, b, max_chars))
    ranges = _pack(lines, pieces, target, max_chars, frozenset(bounds), min_section_chars)
    return _chunks(lines, ranges, titles)


# ---- users' own data ----

_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


def load_user_dataset(name_or_path: str) -> datasets.Dataset:
    """Anything `datasets` loads offline: a json/jsonl/csv/parquet/txt file, a `save_to_disk` folder,
    a folder of data files, or a dataset name in the local cache. All splits are concatenated."""
    path = Path(name_or_path).expanduser()
    try:
        if path.is_dir():
            try:
                loaded = datasets.load_from_disk(str(path))
            except FileNotFoundError:  # a plain folder of data files
                loaded = datasets.load_dataset(str(path))
        elif path.is_file():
            if path.stat().st_size < 1 << 20 and not path.read_bytes().strip():
                raise CorpusError(f"dataset {name_or_path!r} has no rows (the file is empty)")
            builder = _FILE_BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise CorpusError(
                    f"cannot read {path}: unknown file type {path.suffix!r}; use one of {sorted(_FILE_BUILDERS)}"
                )
            loaded = datasets.load_dataset(builder, data_files=str(path))
        else:
            loaded = datasets.load_dataset(name_or_path)
    except CorpusError:
        raise
    except Exception as exc:  # datasets raises many types; say what we tried
        raise CorpusError(
            f"could not load dataset {name_or_path!r} ({type(exc).__name__}: {exc}); pass a local "
            "json/jsonl/csv/parquet/txt file, a folder written by save_to_disk, or a dataset already in the local cache"
        ) from exc
    if isinstance(loaded, datasets.DatasetDict):
        splits = [loaded[name] for name in loaded]
        loaded = datasets.concatenate_datasets(splits) if splits else datasets.Dataset.from_dict({})
    if len(loaded) == 0:
        raise CorpusError(f"dataset {name_or_path!r} has no rows")
    return loaded


def user_source_info(name_or_path: str) -> SourceInfo:
    name = Path(name_or_path).name or str(name_or_path)
    return SourceInfo(name, "user-provided", f"`flashspec data build --dataset {name_or_path}`")


def _require_column(table: datasets.Dataset, column: str, option: str) -> None:
    if column not in table.column_names:
        raise CorpusError(
            f"{option} {column!r} is not a column of this dataset; available columns: {', '.join(table.column_names)}"
        )


def _row_ids(table: datasets.Dataset, prefix: str) -> list[str]:
    # A user id column keeps rows of one document together in one split.
    for column in ("doc_id", "id"):
        if column in table.column_names:
            return [f"{prefix}/{value}" for value in table[column]]
    return [f"{prefix}/{i}" for i in range(len(table))]


_SPEAKER = re.compile(r"^\s*(?:[AB]|user|assistant|human|bot)\s*:\s*", re.IGNORECASE)


def read_user_texts(
    table: datasets.Dataset, field: str, info: SourceInfo, *, as_dialog: bool = False
) -> list[Document]:
    """One document per row of the text column. For dialog, each non-empty line is a turn
    (a leading `A:`/`B:`/`user:`/`assistant:` speaker tag is dropped)."""
    _require_column(table, field, "--text-field")
    docs = []
    for doc_id, value in zip(_row_ids(table, info.name), table[field]):
        if not isinstance(value, str) or not value.strip():
            continue
        turns: tuple[str, ...] = ()
        if as_dialog:
            turns = tuple(t for t in (_SPEAKER.sub("", line).strip() for line in value.splitlines()) if t)
            if not turns:
                continue
        docs.append(Document(doc_id, info.name, info.license, value, turns))
    if not docs:
        raise CorpusError(f"column {field!r} has no non-empty text")
    return docs


@dataclass(frozen=True)
class UserChat:
    """A chat row: the transcript as text and the messages up to its last user turn as the request."""

    doc_id: str
    source: str
    license: str
    text: str
    prompt_messages: tuple[tuple[str, str], ...]


_ROLES = ("system", "user", "assistant")


def read_user_chats(table: datasets.Dataset, field: str, info: SourceInfo) -> list[UserChat]:
    """Rows of the messages column: lists of {"role", "content"} (a JSON string of one also works)."""
    _require_column(table, field, "--messages-field")
    chats = []
    for i, (doc_id, value) in enumerate(zip(_row_ids(table, info.name), table[field])):
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise CorpusError(f"row {i}: {field!r} is a string but not JSON ({exc})") from exc
        if not isinstance(value, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
        ):
            raise CorpusError(f'row {i}: {field!r} must be a list of {{"role": str, "content": str}}, got {value!r:.200}')
        messages = [(m["role"], m["content"]) for m in value]
        bad = sorted({role for role, _ in messages if role not in _ROLES})
        if bad:
            raise CorpusError(f"row {i}: unknown roles {bad}; use {', '.join(_ROLES)}")
        users = [j for j, (role, _) in enumerate(messages) if role == "user"]
        if not users:
            continue  # nothing a user asked: no request to build
        text = "\n".join(f"{role}: {content}" for role, content in messages)
        chats.append(UserChat(doc_id, info.name, info.license, text, tuple(messages[: users[-1] + 1])))
    if not chats:
        raise CorpusError(f"no row of {field!r} has a user message")
    return chats


def sources_note(
    report: BuildReport, infos: Sequence[SourceInfo], seed: int, fractions: Sequence[float], settings: str
) -> str:
    """SOURCES.md of a built domain: each source's license, size and origin, and the split."""
    lines = [
        f"# Sources of the `{report.domain}` corpus",
        "",
        f"Built by `flashspec data build` on {date.today().isoformat()}: seed {seed}{settings}; split by document "
        f"(train/validation/test = {'/'.join(f'{f:.0%}' for f in fractions)} of documents); "
        f"exact deduplication of normalized text removed {report.duplicates} rows.",
        "",
        "| source | license | documents | rows | characters | how obtained |",
        "|---|---|---|---|---|---|",
    ]
    for info in infos:
        stats = report.per_source.get(info.name, {"documents": 0, "rows": 0, "chars": 0})
        lines.append(
            f"| {info.name} | {info.license} | {stats['documents']} | {stats['rows']} | {stats['chars']:,} "
            f"| {info.obtained} |"
        )
    lines += ["", "| split | documents | rows |", "|---|---|---|"]
    lines += [f"| {name} | {report.documents[name]} | {report.rows[name]} |" for name in report.rows]
    return "\n".join(lines) + "\n"

"""Request-shaped training data for the domain classifier, built offline from installed corpora.

Sources (see DATA.md): code = the CPython standard library (skipping test/); general = the Python
documentation rst sources; dialog = chitchat-dataset conversations and chatterbot-corpus YAMLs.
Corpus text is wrapped in request phrasings (router.templates) as completion prompts or chat
messages. Every example carries the source document it came from; the split assigns whole
documents to train / validation / test, so no document leaks across splits.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from router import templates as T
from router.errors import InvalidRequest
from router.features import render

DOMAINS = ("code", "general", "dialog")
DOCS_DIR = Path("/usr/share/doc/python3.11/html/_sources")
SPLITS = ("train", "validation", "test")

Request = str | list[dict]


@dataclass(frozen=True)
class Example:
    request: Request  # completion prompt or chat messages
    domain: str
    group: str  # source document (or template subject) the example came from
    source: str  # generator family, for error analysis


def split_of(group: str, validation: float = 0.1, test: float = 0.1) -> str:
    """Deterministic split of a source document by hash (whole documents, no leakage)."""
    bucket = int(hashlib.sha256(group.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    if bucket < test:
        return "test"
    if bucket < test + validation:
        return "validation"
    return "train"


# ---------------------------------------------------------------- corpus readers


def stdlib_files(limit: int | None = None) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idle_test", "site-packages", "lib2to3", "__pycache__"}
    files = sorted(
        p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)
    )
    if not files:
        raise FileNotFoundError(f"no Python sources under {root}; the stdlib source is needed")
    return files[:limit] if limit else files


_DEF_RE = re.compile(r'^\s*def (\w+)\(([^)]*)\)[^:]*:\n\s+(?:r?"""|\'\'\')\s*([^\n"]{12,100})', re.M)


def code_documents(limit: int | None = None) -> Iterator[tuple[str, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in stdlib_files(limit):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) > 400:
            yield f"stdlib:{path.relative_to(root)}", text


_ROLE_RE = re.compile(r":[\w:.-]+:`~?([^`<]+?)(?:\s*<[^>]+>)?`")
_LINK_RE = re.compile(r"`([^`<]+?)\s*<[^>]+>`_+")
_LITERAL_RE = re.compile(r"``([^`]+)``")


def clean_rst(block: str, rng: random.Random) -> str:
    """rst markup -> plain prose; inline code stays as `x` half of the time (a hard case)."""
    tick = "`" if rng.random() < 0.5 else ""
    text = _ROLE_RE.sub(lambda m: f"{tick}{m.group(1)}{tick}", block)
    text = _LINK_RE.sub(r"\1", text)
    text = _LITERAL_RE.sub(lambda m: f"{tick}{m.group(1)}{tick}", text)
    text = text.replace("**", "").replace("*", "").replace("::", ":")
    return " ".join(text.split())


def docs_documents(limit: int | None = None) -> Iterator[tuple[str, list[str]]]:
    """(document id, prose paragraphs) per rst file; indented blocks (code) are dropped."""
    if not DOCS_DIR.is_dir():
        raise FileNotFoundError(
            f"{DOCS_DIR} not found; install the Debian package python3.11-doc"
        )
    files = sorted(p for p in DOCS_DIR.rglob("*.rst.txt") if "c-api" not in p.parts)
    for path in files[:limit] if limit else files:
        paragraphs = []
        for block in path.read_text(encoding="utf-8", errors="replace").split("\n\n"):
            lines = block.strip("\n").split("\n")
            if not lines or lines[0][:1] in (" ", "\t", ".", ":", "=", "-", "*", "+", "|", ">"):
                continue
            if any(set(line.strip()) <= set("=-~^*#+") for line in lines):
                continue  # section title
            if len(block) >= 120 and len(block.split()) >= 18:
                paragraphs.append(block)
        if paragraphs:
            yield f"docs:{path.relative_to(DOCS_DIR)}", paragraphs


def chitchat_conversations(limit: int | None = None) -> Iterator[tuple[str, list[str]]]:
    """(conversation id, turns) from chitchat-dataset; found without importing the package."""
    spec = importlib.util.find_spec("chitchat_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("chitchat-dataset is not installed: pip install chitchat-dataset==0.9.0")
    path = Path(list(spec.submodule_search_locations)[0]) / "dataset.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    for i, (conv_id, conv) in enumerate(sorted(data.items())):
        if limit and i >= limit:
            break
        turns = [" ".join(m["text"] for m in turn).strip() for turn in conv["messages"]]
        turns = [t for t in turns if t]
        if len(turns) >= 2:
            yield f"chitchat:{conv_id}", turns


CHATTERBOT_DOMAIN = {
    "coding": "code", "history": "general", "literature": "general", "science": "general",
    "trivia": "general", "politics": "general", "money": "general", "health": "general",
    "computers": "general", "tech_support": "general",
}  # every other English file is casual talk about the bot, feelings, greetings: dialog


def chatterbot_conversations() -> Iterator[tuple[str, str, list[str]]]:
    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None or not spec.submodule_search_locations:
        return
    root = Path(list(spec.submodule_search_locations)[0]) / "data" / "english"
    for path in sorted(root.glob("*.yml")):
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        domain = CHATTERBOT_DOMAIN.get(path.stem, "dialog")
        for i, conv in enumerate(data.get("conversations") or []):
            turns = [str(t).strip() for t in conv if str(t).strip()]
            if turns:
                yield f"chatterbot:{path.stem}:{i // 4}", domain, turns


# ---------------------------------------------------------------- request shaping


def vary(text: str, rng: random.Random) -> str:
    """Casing / punctuation noise the way people type."""
    r = rng.random()
    if r < 0.25:
        text = text.lower()
    elif r < 0.3:
        text = text.upper() if len(text) < 60 else text
    if rng.random() < 0.3:
        text = text.rstrip(".?!")
    if rng.random() < 0.1:
        text = rng.choice(("please ", "pls ", "hey, ", "Quick question: ", "")) + text
    if rng.random() < 0.1:
        text += rng.choice((" thanks!", " thx", " :)", " ??", " asap"))
    return text


def as_request(user: str, rng: random.Random, history: list[dict] | None = None) -> Request:
    """A completion prompt (about 40%) or chat messages with optional system prompt and history."""
    if rng.random() < 0.4 and not history:
        return user
    messages = []
    system = rng.choice(T.SYSTEM_PROMPTS)
    if system and rng.random() < 0.5:
        messages.append({"role": "system", "content": system})
    if history:
        messages.extend(history)
    elif rng.random() < 0.15:
        messages += [
            {"role": "user", "content": rng.choice(T.DIALOG_OPENERS[:14])},
            {"role": "assistant", "content": "Hi! How can I help you today?"},
        ]
    messages.append({"role": "user", "content": user})
    return messages


def _snippet(text: str, rng: random.Random, max_lines: int = 30) -> str:
    lines = text.split("\n")
    start = rng.randrange(max(1, len(lines) - 4))
    chunk = lines[start : start + rng.randint(3, max_lines)]
    while chunk and not chunk[0].strip():
        chunk = chunk[1:]
    return "\n".join(chunk).rstrip() or text[:400]


def _fenced(code: str, rng: random.Random, lang: str = "python") -> str:
    r = rng.random()
    if r < 0.5:
        return f"```{lang.lower() if rng.random() < 0.7 else ''}\n{code}\n```"
    return code


def _names(text: str) -> list[str]:
    return re.findall(r"\bdef (\w{3,})", text) or ["process"]


def code_examples(doc_id: str, text: str, rng: random.Random, n: int) -> Iterator[Example]:
    defs = _DEF_RE.findall(text)
    names = _names(text)
    for _ in range(n):
        r = rng.random()
        name, name2 = rng.choice(names), rng.choice(names)
        fmt = dict(
            lang=rng.choice(T.LANGS), lang2=rng.choice(T.LANGS), task=rng.choice(T.TASKS),
            err=rng.choice(T.ERRORS), name=name, name2=name2, sql=rng.choice(T.SQL_TASKS),
            regex=rng.choice(T.REGEX_TASKS), git=rng.choice(T.GIT_TASKS),
            file=f"/home/user/app/{doc_id.split('/')[-1].removeprefix('stdlib:')}", line=rng.randint(3, 400),
            doc=(defs and rng.choice(defs)[2].rstrip(".").lower()) or rng.choice(T.TASKS),
        )
        if r < 0.25:  # raw code completion
            yield Example(_snippet(text, rng, 40), "code", doc_id, "code:completion")
        elif r < 0.55:
            code = _snippet(text, rng, 25)
            if rng.random() < 0.2:
                lang, tmpl = rng.choice(T.OTHER_LANG_SNIPPETS)
                code = tmpl.format(name=name, name2=name2, Name=name.title().replace("_", ""),
                                   Name2=name2.title().replace("_", ""))
                fmt["lang"] = lang
            prompt = rng.choice(T.CODE_WITH_SNIPPET).format(code=_fenced(code, rng), **fmt)
            yield Example(as_request(prompt, rng), "code", doc_id, "code:snippet")
        elif r < 0.7:
            prompt = vary(rng.choice(T.CODE_NO_SNIPPET).format(**fmt), rng)
            yield Example(as_request(prompt, rng), "code", doc_id, "code:question")
        elif r < 0.9:
            prompt = vary(rng.choice(T.CODE_CONCEPT_Q).format(
                concept=rng.choice(T.CONCEPTS), concept2=rng.choice(T.CONCEPTS), tech=rng.choice(T.TECHS),
                symptom=rng.choice(T.SYMPTOMS), op=rng.choice(T.OPERATIONS), name=name, lang=fmt["lang"],
                property=rng.choice(T.PROPERTIES), feature=rng.choice(T.FEATURES),
                module=doc_id.removeprefix("stdlib:").removesuffix(".py").replace("/", ".").removesuffix(".__init__"),
            ), rng)
            yield Example(as_request(prompt, rng), "code", doc_id, "code:question")
        else:  # multi-turn: question, code answer, follow-up
            code = _snippet(text, rng, 15)
            history = [
                {"role": "user", "content": vary(rng.choice(T.CODE_NO_SNIPPET[:12]).format(**fmt), rng)},
                {"role": "assistant", "content": rng.choice(T.ASSISTANT_CODE_REPLIES).format(code=code)},
            ]
            follow = rng.choice((
                f"that gives me {fmt['err']}", "can you add comments?", "now make it async",
                "what if the input is empty?", "thanks! how do I test it?", "it doesn't work",
                "can you do it without recursion", "ok and in " + fmt["lang2"] + "?",
            ))
            yield Example(as_request(follow, rng, history), "code", doc_id, "code:multiturn")


def general_examples(doc_id: str, paragraphs: list[str], rng: random.Random, n: int) -> Iterator[Example]:
    for _ in range(n):
        text = clean_rst(rng.choice(paragraphs), rng)
        r = rng.random()
        if r < 0.15:  # raw prose completion
            yield Example(text, "general", doc_id, "general:completion")
        elif r < 0.5:
            prompt = rng.choice(T.GENERAL_WITH_TEXT).format(text=text, lang_h=rng.choice(T.HUMAN_LANGS))
            yield Example(as_request(prompt, rng), "general", doc_id, "general:text")
        else:  # an instruction about a general topic; the doc paragraph is an earlier answer
            prompt = vary(general_instruction(rng), rng)
            history = None
            if rng.random() < 0.2:
                history = [
                    {"role": "user", "content": vary(general_instruction(rng), rng)},
                    {"role": "assistant", "content": text},
                ]
                prompt = rng.choice((prompt, "can you make that shorter?", "Give me an example.",
                                     "Now summarize it in one sentence.", "translate that to French",
                                     "explain it more simply please", "What are the main takeaways?"))
            yield Example(as_request(prompt, rng, history), "general", doc_id, "general:instruction")


def general_instruction(rng: random.Random) -> str:
    a, b = rng.choice(T.PAIRS)
    part, whole = rng.choice(T.PARTS)
    template = rng.choice(T.FACT_Q if rng.random() < 0.35 else T.GENERAL_NO_TEXT)
    return template.format(
        invention=rng.choice(T.INVENTIONS), book=rng.choice(T.BOOKS), landmark=rng.choice(T.LANDMARKS),
        part=part, whole=whole, category=rng.choice(T.CATEGORIES), movie=rng.choice(T.MOVIES),
        occasion=rng.choice(T.OCCASIONS), relation=rng.choice(T.RELATIONS), place2=rng.choice(T.PLACES),
        topic=rng.choice(T.TOPICS), a=a, b=b, thing=rng.choice(T.THINGS), person=rng.choice(T.PEOPLE),
        matter=rng.choice(T.MATTERS), job=rng.choice(T.JOBS), product=rng.choice(T.PRODUCTS),
        activity=rng.choice(T.ACTIVITIES), subject=rng.choice(T.SUBJECTS), event=rng.choice(T.EVENTS),
        figure=rng.choice(T.FIGURES), dish=rng.choice(T.DISHES), place=rng.choice(T.PLACES),
        country=rng.choice(T.COUNTRIES), word=rng.choice(T.WORDS), phrase=rng.choice(T.PHRASES),
        lang_h=rng.choice(T.HUMAN_LANGS),
    )


def dialog_examples(doc_id: str, turns: list[str], rng: random.Random, n: int) -> Iterator[Example]:
    for _ in range(n):
        end = rng.randrange(1, len(turns) + 1)
        window = turns[max(0, end - rng.randint(1, 8)) : end]
        r = rng.random()
        if r < 0.35:  # one casual message
            yield Example(vary(window[-1], rng) if rng.random() < 0.3 else window[-1], "dialog", doc_id, "dialog:single")
        elif r < 0.45:  # transcript as a completion prompt
            a, b = rng.choice((("A", "B"), ("User", "Bot"), ("Me", "Friend"), ("Human", "AI")))
            lines = [f"{a if (len(window) - i) % 2 else b}: {t}" for i, t in enumerate(window)]
            yield Example("\n".join(lines) + f"\n{b}:" * (rng.random() < 0.5), "dialog", doc_id, "dialog:transcript")
        else:  # chat messages ending with the user
            roles = ["user" if (len(window) - i) % 2 else "assistant" for i in range(len(window))]
            messages = [{"role": r_, "content": t} for r_, t in zip(roles, window)]
            system = rng.choice(T.SYSTEM_PROMPTS)
            if system and rng.random() < 0.4:
                messages.insert(0, {"role": "system", "content": system})
            yield Example(messages, "dialog", doc_id, "dialog:chat")


def opener_examples(rng: random.Random, n: int) -> Iterator[Example]:
    for _ in range(n):
        i = rng.randrange(len(T.DIALOG_OPENERS))
        text = vary(T.DIALOG_OPENERS[i], rng)
        yield Example(as_request(text, rng), "dialog", f"opener:{i}", "dialog:opener")


def chatterbot_examples(rng: random.Random) -> Iterator[Example]:
    for doc_id, domain, turns in chatterbot_conversations():
        if domain == "dialog":
            yield from dialog_examples(doc_id, turns, rng, 1)
        else:  # single question: knowledge (general) or programming (code)
            yield Example(as_request(vary(turns[0], rng), rng), domain, doc_id, f"{domain}:chatterbot")


# ---------------------------------------------------------------- dataset


@dataclass(frozen=True)
class DataConfig:
    code_files: int | None = None  # limit on stdlib files (None: all)
    docs_files: int | None = None
    conversations: int | None = 3000
    per_class: int = 12000  # target examples per domain
    seed: int = 0


def build_examples(config: DataConfig = DataConfig()) -> list[Example]:
    """All examples, about `per_class` per domain, deterministic for a given seed."""
    rng = random.Random(config.seed)
    examples: list[Example] = []

    code_docs = list(code_documents(config.code_files))
    per_doc = max(1, config.per_class // len(code_docs) + 1)
    for doc_id, text in code_docs:
        examples.extend(code_examples(doc_id, text, rng, per_doc))

    docs = list(docs_documents(config.docs_files))
    per_doc = max(1, config.per_class // len(docs) + 1)
    for doc_id, paragraphs in docs:
        examples.extend(general_examples(doc_id, paragraphs, rng, min(per_doc, 4 * len(paragraphs))))

    convs = list(chitchat_conversations(config.conversations))
    per_doc = max(1, (config.per_class * 9 // 10) // len(convs) + 1)
    for doc_id, turns in convs:
        examples.extend(dialog_examples(doc_id, turns, rng, per_doc))
    examples.extend(opener_examples(rng, config.per_class // 20))
    examples.extend(chatterbot_examples(rng))

    examples = [e for e in examples if _renders(e.request)]
    # Balance the domains to `per_class` each (sampling whole lists keeps groups intact).
    balanced = []
    for domain in DOMAINS:
        of_domain = [e for e in examples if e.domain == domain]
        rng.shuffle(of_domain)
        balanced.extend(of_domain[: config.per_class])
    rng.shuffle(balanced)
    return balanced


def _renders(request: Request) -> bool:
    try:
        render(request)
    except InvalidRequest:
        return False
    return True


def split(examples: list[Example]) -> dict[str, list[Example]]:
    out: dict[str, list[Example]] = {name: [] for name in SPLITS}
    for example in examples:
        out[split_of(example.group)].append(example)
    return out

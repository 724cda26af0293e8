"""Corpora: readers, chunking, request shapes, dedup, split by document, user data, CLI."""

from __future__ import annotations

import json
import random
import textwrap
from pathlib import Path

import datasets
import pytest
import typer
from typer.testing import CliRunner

from training import corpora, sources
from training.cli import data_build
from training.sources import CorpusError, Document


def render(messages: list[dict]) -> str:
    """Stand-in chat template: deterministic and easy to check."""
    return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages) + "<assistant>"


def _module(i: int) -> str:
    # Several functions with docstrings and comparisons, long enough for a few chunks per file.
    funcs = []
    for j in range(12):
        funcs.append(
            textwrap.dedent(
                f'''
                def func_{i}_{j}(items, limit=10):
                    """Return the items of batch {i}/{j} that are smaller than limit, sorted."""
                    kept = []
                    for item in items:
                        if item < limit and item != {j}:
                            kept.append(item + {i})
                    # a comment so the function is a realistic size {"x" * (40 * j)}
                    return sorted(kept)
                '''
            )
        )
    return f'"""Module {i}."""\nimport os\n' + "\n".join(funcs)


def code_docs(n: int) -> list[Document]:
    return [Document(f"stdlib/pkg/mod{i}.py", "cpython-stdlib", "PSF-2.0", _module(i)) for i in range(n)]


def chat_doc(doc_id: str, turns: list[str]) -> Document:
    return Document(doc_id, "chitchat-dataset", "MIT", sources.render_turns(turns), tuple(turns))


def dialog_docs(n: int) -> list[Document]:
    return [chat_doc(f"chitchat/c{i}", [f"hello number {i}", "hi there", f"how was day {i}?", "good", "nice"])
            for i in range(n)]


# ---- readers ----


def test_read_stdlib_skips_tests_site_packages_and_codec_tables(tmp_path: Path) -> None:
    for rel in ["json/decoder.py", "test/test_json.py", "site-packages/x/y.py", "encodings/cp1252.py", "abc.py"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("def f():\n    return 1\n")
    ids = [d.doc_id for d in sources.read_stdlib(tmp_path)]
    assert ids == ["stdlib/abc.py", "stdlib/json/decoder.py"]


def test_missing_python_docs_says_how_to_install(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="apt-get install -y python3.11-doc"):
        sources.read_python_docs(tmp_path / "nowhere")


def test_read_chitchat_merges_sender_groups_and_drops_one_sided(tmp_path: Path) -> None:
    data = {
        "b": {"messages": [[{"sender": "x", "text": "hi"}, {"sender": "x", "text": "anyone?"}],
                           [{"sender": "y", "text": "hey"}]]},
        "a": {"messages": [[{"sender": "x", "text": "alone"}]]},
    }
    (tmp_path / "dataset.json").write_text(json.dumps(data))
    docs = sources.read_chitchat(tmp_path / "dataset.json")
    assert [(d.doc_id, d.turns) for d in docs] == [("chitchat/b", ("hi anyone?", "hey"))]
    assert docs[0].text == "A: hi anyone?\nB: hey"


def test_read_chatterbot(tmp_path: Path) -> None:
    (tmp_path / "greet.yml").write_text("conversations:\n- - Hello\n  - Hi\n  - How are you?\n- - lonely\n")
    docs = sources.read_chatterbot(tmp_path)
    assert [(d.doc_id, d.turns, d.license) for d in docs] == [
        ("chatterbot/greet#0", ("Hello", "Hi", "How are you?"), "BSD-3-Clause")
    ]


# ---- chunking ----


def test_chunk_code_sizes_and_boundaries() -> None:
    text = _module(1) * 8
    chunks = sources.chunk_code(text, target=1000, max_chars=2000)
    assert len(chunks) > 3
    assert all(len(c.text) <= 2000 for c in chunks)
    lines = text.splitlines()
    for c in chunks[1:]:
        first = lines[c.start_line - 1]
        assert not lines[c.start_line - 2].strip()  # cut after a blank line
        assert not first[0].isspace() or first.lstrip().startswith(("def ", "class ", "@"))
    # chunks cover the file in order without overlap
    assert all(a.end_line < b.start_line for a, b in zip(chunks, chunks[1:]))


def test_chunk_rst_titles_and_limits() -> None:
    body = "\n\n".join(f"Paragraph {i} " + "word " * 60 for i in range(30))
    text = "Guide\n=====\n\nIntro text " + "x " * 300 + f"\n\nDetails\n-------\n\n{body}\n"
    chunks = sources.chunk_rst(text, target=1000, max_chars=2000)
    assert chunks[0].title == "Guide"
    assert {c.title for c in chunks[1:]} == {"Details"}
    assert all(len(c.text) <= 2000 for c in chunks)


# ---- request shapes ----


def test_code_requests_come_from_real_functions() -> None:
    examples = [ex for seed in range(6) for doc in code_docs(4) for ex in corpora.code_examples(doc, seed)]
    requests = [ex.messages[-1][1] for ex in examples]
    assert all(len(ex.messages) == 1 and ex.messages[0][0] == "user" for ex in examples)
    writes = [r for r in requests if "that are smaller than limit" in r and "```" not in r]
    completes = [r for r in requests if r.startswith(("Complete this code", "Finish the implementation"))]
    fixes = [r for r in requests if "bug" in r or "fix" in r]
    assert writes and completes and fixes
    for r in fixes:  # the shown code differs from every real function by an injected bug
        code = r.split("```python\n")[1].split("```")[0]
        assert not any(code.strip() in textwrap.dedent(d.text) for d in code_docs(4))


def test_dialog_messages_are_a_prefix_ending_with_user() -> None:
    turns = [f"turn {i}" for i in range(12)]
    for seed in range(20):
        messages = corpora.dialog_messages(turns, random.Random(seed))
        assert len(messages) % 2 == 1 and len(messages) <= corpora.DIALOG_MAX_PROMPT_TURNS
        assert [c for _, c in messages] == turns[: len(messages)]
        assert [r for r, _ in messages] == ["user", "assistant"] * (len(messages) // 2) + ["user"]


# ---- build: split, dedup, contract ----


def _all_rows(out: Path, domain: str) -> dict[str, datasets.Dataset]:
    return {split: corpora.load_domain(domain, split, out) for split in corpora.SPLITS}


def test_split_by_document_has_no_leakage_and_is_seeded(tmp_path: Path) -> None:
    report = corpora.build_domain("code", tmp_path / "a", documents=code_docs(60), seed=1, render=render)
    rows = _all_rows(tmp_path / "a", "code")
    ids = {split: set(ds["doc_id"]) for split, ds in rows.items()}
    assert all(ids.values())
    assert not (ids["train"] & ids["validation"]) and not (ids["train"] & ids["test"])
    assert not (ids["validation"] & ids["test"])
    assert report.rows == {split: len(ds) for split, ds in rows.items()}
    assert sum(report.rows.values()) > 60  # several chunks per document
    corpora.build_domain("code", tmp_path / "b", documents=code_docs(60), seed=1, render=render)
    assert {s: set(d["doc_id"]) for s, d in _all_rows(tmp_path / "b", "code").items()} == ids
    corpora.build_domain("code", tmp_path / "c", documents=code_docs(60), seed=2, render=render)
    assert {s: set(d["doc_id"]) for s, d in _all_rows(tmp_path / "c", "code").items()} != ids


def test_assign_splits_keeps_every_split_non_empty_for_few_documents() -> None:
    split = corpora.assign_splits(["a", "b", "c"], seed=0)
    assert sorted(split.values()) == ["test", "train", "validation"]


def test_dedup_drops_normalized_duplicates(tmp_path: Path) -> None:
    docs = dialog_docs(30) + [
        chat_doc("chatterbot/x#0", ["Hello   number 3", "HI there", "how was day 3?", "good", "nice"]),
    ]
    report = corpora.build_domain("dialog", tmp_path, documents=docs, render=render)
    texts = [t for ds in _all_rows(tmp_path, "dialog").values() for t in ds["text"]]
    assert report.duplicates == 1
    assert len(texts) == 30 == len({corpora.normalize(t) for t in texts})


def test_rows_follow_the_contract(tmp_path: Path) -> None:
    corpora.build_domain("dialog", tmp_path, documents=dialog_docs(40), render=render)
    rows = _all_rows(tmp_path, "dialog")
    for ds in rows.values():
        assert ds.features == corpora.FEATURES
        assert list(ds.column_names) == ["doc_id", "source", "license", "text", "messages", "prompt"]
    row = rows["train"][0]
    assert (row["source"], row["license"]) == ("chitchat-dataset", "MIT")
    assert row["messages"][-1]["role"] == "user"
    assert row["prompt"] == render(row["messages"])
    assert row["text"].startswith("A: hello number")
    notes = (tmp_path / "dialog" / "SOURCES.md").read_text()
    assert "chitchat-dataset" in notes and "MIT" in notes


def test_two_documents_leave_an_empty_split_that_still_loads(tmp_path: Path) -> None:
    report = corpora.build_domain("dialog", tmp_path, documents=dialog_docs(2), render=render)
    assert sum(report.rows.values()) == 2
    assert sum(len(ds) for ds in _all_rows(tmp_path, "dialog").values()) == 2


def test_max_docs_takes_a_seeded_subset(tmp_path: Path) -> None:
    report = corpora.build_domain("dialog", tmp_path, documents=dialog_docs(50), max_docs=10, render=render)
    assert sum(report.documents.values()) == 10


def test_max_docs_counts_documents_not_rows(tmp_path: Path) -> None:
    rows = [{"doc_id": i // 3, "body": f"Part {i} of document {i // 3}. " + "word " * 40} for i in range(30)]
    data = _jsonl(tmp_path / "parts.jsonl", rows)
    report = corpora.build_user_domain(str(data), "general", tmp_path / "out", text_field="body", max_docs=4,
                                       render=render)
    assert sum(report.documents.values()) == 4 and sum(report.rows.values()) == 12
    with pytest.raises(CorpusError, match="at least 1"):
        corpora.build_user_domain(str(data), "general", tmp_path / "out", text_field="body", max_docs=0,
                                  render=render)


def test_rebuild_replaces_a_domain(tmp_path: Path) -> None:
    corpora.build_domain("dialog", tmp_path, documents=dialog_docs(40), render=render)
    corpora.build_domain("dialog", tmp_path, documents=dialog_docs(20), render=render)
    assert sum(len(ds) for ds in _all_rows(tmp_path, "dialog").values()) == 20
    assert [p.name for p in tmp_path.iterdir()] == ["dialog"]


# ---- errors ----


def test_unknown_domain_lists_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="unknown domain 'legal'; valid domains: code, general, dialog"):
        corpora.load_domain("legal", "train", tmp_path)
    with pytest.raises(CorpusError, match="valid domains"):
        corpora.build_domain("legal", tmp_path, documents=dialog_docs(3), render=render)


def test_load_domain_not_built_says_the_command(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match=f"flashspec data build --out {tmp_path} --domains code"):
        corpora.load_domain("code", "train", tmp_path)
    corpora.build_domain("dialog", tmp_path, documents=dialog_docs(5), render=render)
    with pytest.raises(CorpusError, match="unknown split"):
        corpora.load_domain("dialog", "dev", tmp_path)


# ---- users' own data ----


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_user_dataset_with_text_field(tmp_path: Path) -> None:
    data = _jsonl(tmp_path / "mine.jsonl", [{"id": i, "body": _module(i)} for i in range(12)])
    report = corpora.build_user_domain(str(data), "code", tmp_path / "out", text_field="body", render=render)
    rows = _all_rows(tmp_path / "out", "code")
    assert sum(report.rows.values()) == sum(len(ds) for ds in rows.values()) > 12
    row = rows["train"][0]
    assert row["source"] == "mine.jsonl" and row["license"] == "user-provided"
    assert row["doc_id"].startswith("mine.jsonl/")
    assert row["prompt"] == render(row["messages"])


def test_user_dataset_with_messages_field_from_a_saved_folder(tmp_path: Path) -> None:
    chats = [
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"question {i}"},
         {"role": "assistant", "content": f"answer {i}"}]
        for i in range(10)
    ] + [[{"role": "assistant", "content": "no user turn"}]]
    datasets.Dataset.from_dict({"chat": chats}).save_to_disk(str(tmp_path / "saved"))
    corpora.build_user_domain(str(tmp_path / "saved"), "dialog", tmp_path / "out", messages_field="chat",
                              render=render)
    rows = [r for ds in _all_rows(tmp_path / "out", "dialog").values() for r in ds]
    assert len(rows) == 10  # the chat without a user turn is skipped
    for r in rows:
        assert [m["role"] for m in r["messages"]] == ["system", "user"]  # cut after the last user turn
        assert r["text"].startswith("system: be brief\nuser: question")


def test_missing_field_lists_columns(tmp_path: Path) -> None:
    data = _jsonl(tmp_path / "d.jsonl", [{"body": "x" * 200, "meta": 1}])
    with pytest.raises(CorpusError, match="available columns: body, meta"):
        corpora.build_user_domain(str(data), "general", tmp_path, text_field="content", render=render)
    with pytest.raises(CorpusError, match="available columns: body, meta"):
        corpora.build_user_domain(str(data), "general", tmp_path, messages_field="chat", render=render)


def test_empty_dataset_is_a_clear_error(tmp_path: Path) -> None:
    datasets.Dataset.from_dict({"body": []}).save_to_disk(str(tmp_path / "empty"), num_shards=1)
    with pytest.raises(CorpusError, match="has no rows"):
        corpora.build_user_domain(str(tmp_path / "empty"), "general", tmp_path, text_field="body", render=render)
    (tmp_path / "nothing.jsonl").write_text("\n")
    with pytest.raises(CorpusError, match="has no rows"):
        corpora.build_user_domain(str(tmp_path / "nothing.jsonl"), "code", tmp_path, text_field="body", render=render)
    (tmp_path / "blank.jsonl").write_text(json.dumps({"body": "   "}) + "\n")
    with pytest.raises(CorpusError, match="no non-empty text"):
        corpora.build_user_domain(str(tmp_path / "blank.jsonl"), "general", tmp_path, text_field="body",
                                  render=render)


def test_unloadable_dataset_says_what_works(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="json/jsonl/csv/parquet/txt"):
        sources.load_user_dataset(str(tmp_path / "no-such-file.jsonl"))


# ---- CLI ----


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command()(data_build)
    app.callback()(lambda: None)  # keep `data-build` as a named subcommand
    return app


@pytest.fixture
def fake_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(corpora, "default_render", lambda: render)
    monkeypatch.setattr(corpora, "read_builtin", lambda domain: {"code": code_docs(20), "dialog": dialog_docs(20)}[domain])


def test_cli_builds_domains(tmp_path: Path, fake_sources: None) -> None:
    result = CliRunner().invoke(_app(), ["data-build", "--out", str(tmp_path), "--domains", "code,dialog"])
    assert result.exit_code == 0, result.output
    assert "code: train" in result.output and "dialog: train" in result.output
    assert len(corpora.load_domain("dialog", "train", tmp_path)) > 0


def test_cli_user_dataset_and_errors(tmp_path: Path, fake_sources: None) -> None:
    data = _jsonl(tmp_path / "d.jsonl", [{"text": f"A: hi {i}\nB: hello\nA: how are you {i}?"} for i in range(8)])
    ok = CliRunner().invoke(_app(), ["data-build", "--out", str(tmp_path / "o"), "--dataset", str(data),
                                     "--domain", "dialog", "--text-field", "text"])
    assert ok.exit_code == 0, ok.output
    row = corpora.load_domain("dialog", "train", tmp_path / "o")[0]
    assert row["messages"][0]["content"].startswith("hi ")  # speaker tags dropped
    bad = CliRunner().invoke(_app(), ["data-build", "--out", str(tmp_path), "--domains", "code,legal"])
    assert bad.exit_code == 1 and "valid domains: code, general, dialog" in bad.output
    missing = CliRunner().invoke(_app(), ["data-build", "--dataset", str(data), "--domain", "dialog",
                                          "--text-field", "body", "--out", str(tmp_path)])
    assert missing.exit_code == 1 and "available columns: text" in missing.output
    both = CliRunner().invoke(_app(), ["data-build", "--dataset", str(data), "--domain", "dialog",
                                       "--out", str(tmp_path)])
    assert both.exit_code == 1 and "exactly one of --text-field" in both.output

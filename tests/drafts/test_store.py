"""Draft store: publish, gated activation, rollback, domain isolation, permissions; the drafts CLI."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from drafts import store as store_mod
from drafts.config import DraftConfig
from drafts.model import DraftModel
from drafts.store import DraftStore, StoreError, resolve_draft
from engine.config import ModelArgs
from engine.model import Transformer

ARGS = ModelArgs(model_type="llama", vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                 num_kv_heads=1, head_dim=16, eos_token_ids=(1,), max_position_embeddings=64)


@pytest.fixture(scope="module")
def draft() -> DraftModel:
    torch.manual_seed(0)
    target = Transformer(ARGS, max_seq_len=64).eval().requires_grad_(False)
    d = DraftModel(target, DraftConfig(shared_layers=1, adapter_layers=1, head="mlp_tied"), name="d")
    d.init_from_target()
    return d


def tree_hash(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        digest.update(str(path.relative_to(folder)).encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


def publish(st: DraftStore, draft, domain: str, version: str, mal: float | None):
    return st.publish(draft, domain, version, metrics={} if mal is None else {"mean_accepted_length": mal})


def test_publish_activate_resolve(tmp_path, draft):
    st = DraftStore(tmp_path)
    assert st.versions("code") == [] and st.active("code") is None and st.resolve("code") is None
    folder = publish(st, draft, "code", "v1", 2.0)
    assert folder == tmp_path / "code" / "v1" and (folder / "manifest.json").is_file()
    assert (folder / "draft.safetensors").is_file()
    assert st.versions("code") == ["v1"] and st.active("code") is None  # publishing does not activate
    result = st.activate("code", "v1")
    assert result.activated and result.previous is None
    assert (tmp_path / "code" / "ACTIVE").read_text().strip() == "v1" and st.resolve("code") == folder
    assert not [p for p in (tmp_path / "code").iterdir() if p.name.startswith(".")]  # no temp files left


def test_auto_version_is_a_utc_timestamp_and_unique(tmp_path, draft):
    st = DraftStore(tmp_path)
    a = st.publish(draft, "dialog")
    b = st.publish(draft, "dialog")
    assert a.name != b.name and a.name[:8].isdigit() and a.name[8] == "-"
    with pytest.raises(StoreError, match="already exists"):
        st.publish(draft, "dialog", a.name)
    with pytest.raises(StoreError, match="invalid version"):
        st.publish(draft, "dialog", "../escape")


def test_gate_refuses_a_worse_draft_and_force_overrides(tmp_path, draft):
    st = DraftStore(tmp_path)
    publish(st, draft, "code", "good", 3.0)
    publish(st, draft, "code", "close", 2.97)
    publish(st, draft, "code", "bad", 2.5)
    publish(st, draft, "code", "unmeasured", None)
    assert st.activate("code", "good").activated
    refused = st.activate("code", "bad", tolerance=0.05)
    assert not refused.activated and "2.500" in refused.message and "3.000" in refused.message
    assert st.active("code") == "good"
    assert not st.activate("code", "unmeasured").activated
    assert st.activate("code", "close", tolerance=0.05).activated  # within the tolerance
    assert st.activate("code", "bad", force=True).activated and st.active("code") == "bad"
    assert st.activate("code", "good", gate=False).activated


def test_rollback_walks_back_through_previous_actives(tmp_path, draft):
    st = DraftStore(tmp_path)
    for i, mal in enumerate((2.0, 2.1, 2.2)):
        publish(st, draft, "general", f"v{i}", mal)
        st.activate("general", f"v{i}")
    assert st.rollback("general") == "v1" and st.active("general") == "v1"
    assert st.rollback("general") == "v0" and st.active("general") == "v0"
    with pytest.raises(StoreError, match="nothing to roll back"):
        st.rollback("general")
    actions = [entry["action"] for entry in st.history("general")["log"]]
    assert actions.count("rollback") == 2 and actions.count("publish") == 3


def test_writing_one_domain_never_touches_the_others(tmp_path, draft):
    st = DraftStore(tmp_path)
    for domain in ("code", "general", "dialog"):
        publish(st, draft, domain, "v1", 2.0)
        st.activate(domain, "v1")
    before = {d: tree_hash(tmp_path / d) for d in ("general", "dialog")}
    publish(st, draft, "code", "v2", 2.5)
    st.activate("code", "v2")
    st.rollback("code")
    st.activate("code", "v2", force=True)
    assert {d: tree_hash(tmp_path / d) for d in ("general", "dialog")} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["code", "dialog", "general"]


def test_unknown_domain_lists_the_valid_ones(tmp_path, draft):
    st = DraftStore(tmp_path)
    with pytest.raises(StoreError, match="code, general, dialog"):
        st.publish(draft, "poetry")
    with pytest.raises(StoreError, match="unknown domain"):
        resolve_draft("poetry", tmp_path)
    with pytest.raises(StoreError, match="no version 'nope'"):
        st.activate("code", "nope")


def test_read_only_and_unwritable_stores_are_refused_with_the_folder(tmp_path, draft):
    with pytest.raises(StoreError, match="read-only"):
        DraftStore(tmp_path, read_only=True).publish(draft, "code", "v1")
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(StoreError, match="cannot create .*a-file/code"):
        DraftStore(blocker).publish(draft, "code", "v1")


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root bypasses file permissions")
def test_no_write_permission_names_the_folder(tmp_path, draft):
    (tmp_path / "code").mkdir()
    os.chmod(tmp_path / "code", 0o555)
    try:
        with pytest.raises(StoreError, match="no write permission on .*code"):
            DraftStore(tmp_path).publish(draft, "code", "v1")
    finally:
        os.chmod(tmp_path / "code", 0o755)


def test_resolve_draft_prefers_the_user_store_then_the_shipped_drafts(tmp_path, draft, monkeypatch):
    shipped, user = tmp_path / "shipped", tmp_path / "user"
    monkeypatch.setattr(store_mod, "shipped_drafts_dir", lambda: shipped)
    assert resolve_draft("code", user) is None
    ship = DraftStore(shipped)
    publish(ship, draft, "code", "demo", 2.0)
    ship.activate("code", "demo")
    assert resolve_draft("code", user) == shipped / "code" / "demo"
    st = DraftStore(user)
    publish(st, draft, "code", "mine", 2.5)
    assert resolve_draft("code", user) == shipped / "code" / "demo"  # published, not active yet
    st.activate("code", "mine")
    assert resolve_draft("code", user) == user / "code" / "mine"
    monkeypatch.setenv("FLASHSPEC_HOME", str(tmp_path / "home"))
    assert resolve_draft("code") == shipped / "code" / "demo"


# ----- the drafts CLI ------------------------------------------------------------------------
def cli_app() -> typer.Typer:
    from training.cli import drafts_activate, drafts_list, drafts_rollback

    app = typer.Typer()
    app.command("list")(drafts_list)
    app.command("activate")(drafts_activate)
    app.command("rollback")(drafts_rollback)
    return app


def test_drafts_cli_list_activate_gate_rollback(tmp_path, draft):
    st = DraftStore(tmp_path)
    publish(st, draft, "code", "v1", 3.0)
    publish(st, draft, "code", "v2", 2.0)
    runner, app = CliRunner(), cli_app()
    res = runner.invoke(app, ["activate", "--domain", "code", "--version", "v1", "--store", str(tmp_path)])
    assert res.exit_code == 0 and "activated v1" in res.output
    res = runner.invoke(app, ["activate", "--domain", "code", "--version", "v2", "--store", str(tmp_path)])
    assert res.exit_code == 1 and "refused v2" in res.output and st.active("code") == "v1"
    res = runner.invoke(app, ["activate", "--domain", "code", "--version", "v2", "--store", str(tmp_path), "--force"])
    assert res.exit_code == 0 and st.active("code") == "v2"
    res = runner.invoke(app, ["list", "--store", str(tmp_path)])
    assert res.exit_code == 0 and "* v2" in res.output and "3.000" in res.output
    res = runner.invoke(app, ["rollback", "--domain", "code", "--store", str(tmp_path)])
    assert res.exit_code == 0 and "rolled back to v1" in res.output
    res = runner.invoke(app, ["rollback", "--domain", "poetry", "--store", str(tmp_path)])
    assert res.exit_code == 1 and "unknown domain" in res.output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_activate_pushes_the_change_to_a_running_app(tmp_path, draft):
    import uvicorn
    from fastapi import FastAPI

    received = []
    api = FastAPI()

    @api.post("/admin/drafts")
    def load(body: dict) -> dict:
        received.append(body)
        return {"loaded": body["version"]}

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(api, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(100):
            if server.started:
                break
            time.sleep(0.05)
        st = DraftStore(tmp_path)
        publish(st, draft, "dialog", "v1", 2.0)
        res = CliRunner().invoke(cli_app(), ["activate", "--domain", "dialog", "--version", "v1", "--store", str(tmp_path),
                                             "--push-url", f"http://127.0.0.1:{port}"])
        assert res.exit_code == 0, res.output
        assert received == [{"domain": "dialog", "version": "v1"}]
    finally:
        server.should_exit = True
        thread.join(timeout=5)
    res = CliRunner().invoke(cli_app(), ["rollback", "--domain", "dialog", "--store", str(tmp_path),
                                         "--push-url", f"http://127.0.0.1:{port}"])
    assert res.exit_code == 1  # nothing to roll back to: refused before any push
    publish(st, draft, "dialog", "v2", 2.0)
    res = CliRunner().invoke(cli_app(), ["activate", "--domain", "dialog", "--version", "v2", "--store", str(tmp_path),
                                         "--push-url", f"http://127.0.0.1:{port}"])
    assert res.exit_code == 1 and "cannot reach" in res.output and st.active("dialog") == "v2"


def test_first_activation_must_beat_the_shipped_draft_of_the_same_target(tmp_path, draft):
    shipped = DraftStore(tmp_path / "shipped")
    publish(shipped, draft, "code", "demo", 3.0)
    shipped.activate("code", "demo")
    st = DraftStore(tmp_path / "user")
    publish(st, draft, "code", "weak", 2.0)
    refused = st.activate("code", "weak", fallback=DraftStore(tmp_path / "shipped", read_only=True))
    assert not refused.activated and "shipped demo 3.000" in refused.message and st.active("code") is None
    assert st.activate("code", "weak").activated  # no fallback given: nothing to beat
    other = st.publish(draft, "dialog", "v1", metrics={"mean_accepted_length": 1.0})
    publish(shipped, draft, "dialog", "demo", 3.0)
    shipped.activate("dialog", "demo")
    manifest = other / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"target_fingerprint": "', '"target_fingerprint": "0'))
    assert st.activate("dialog", "v1", fallback=shipped).activated  # the shipped draft is for another target

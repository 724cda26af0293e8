import hashlib
import json

import typer
from typer.testing import CliRunner

from router.cli import route, tenants_hash_key, train_router

app = typer.Typer()
app.command("route")(route)
app.command("train-router")(train_router)
tenants = typer.Typer()
tenants.command("hash-key")(tenants_hash_key)
app.add_typer(tenants, name="tenants")
runner = CliRunner()


def test_route_text_and_json():
    result = runner.invoke(app, ["route", "--text", "def main():\n    print('hi')\n"])
    assert result.exit_code == 0, result.output
    assert "domain: code" in result.output and "latency:" in result.output and "confidence:" in result.output
    result = runner.invoke(app, ["route", "--json", "--messages-json",
                                 json.dumps([{"role": "user", "content": "hey! how are you doing today?"}])])
    assert result.exit_code == 0, result.output
    body = json.loads(result.output)
    assert body["domain"] == "dialog" and 0 < body["confidence"] <= 1 and body["latency_ms"] > 0


def test_route_fallback_and_errors(tmp_path):
    result = runner.invoke(app, ["route", "--json", "--threshold", "1.0", "--fallback", "general", "--text", "lol ok"])
    assert json.loads(result.output)["domain"] == "general"
    assert runner.invoke(app, ["route"]).exit_code != 0
    result = runner.invoke(app, ["route", "--messages-json", "[{"])
    assert result.exit_code != 0 and "not valid JSON" in result.output
    result = runner.invoke(app, ["route", "--text", "   "])
    assert result.exit_code != 0 and "empty" in result.output
    result = runner.invoke(app, ["route", "--text", "hi", "--model", str(tmp_path / "none.skops")])
    assert result.exit_code == 1 and "train-router" in result.output


def test_hash_key():
    result = runner.invoke(app, ["tenants", "hash-key", "sk-demo-code"])
    assert result.output.strip() == hashlib.sha256(b"sk-demo-code").hexdigest()


def test_train_router_small(tmp_path):
    out = tmp_path / "r.skops"
    result = runner.invoke(app, ["train-router", "--out", str(out), "--per-class", "400",
                                 "--conversations", "150", "--max-features", "3000"])
    assert result.exit_code == 0, result.output
    assert "test: macro-F1" in result.output and "confusion" in result.output
    result = runner.invoke(app, ["route", "--json", "--model", str(out), "--text", "import sys\nsys.exit(main())"])
    assert json.loads(result.output)["domain"] == "code"

"""Two Generator replicas behind one app, drafts from a real draft store: spread, hot-swap, replica loss."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest
import ray

from conftest import KEYS, deploy

APP = "pair"
AUTH = {"Authorization": f"Bearer {KEYS['acme']}"}


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_target):
    """A draft store with code v1, v2 (active v1), a corrupt code v3, and general v1."""
    from tiny import build_draft

    from drafts.store import DraftStore
    from engine.loading import load_model

    root = tmp_path_factory.mktemp("store")
    target = load_model(str(tiny_target)).model
    drafts = DraftStore(root)
    for domain, version in [("code", "v1"), ("code", "v2"), ("code", "v3"), ("general", "v1")]:
        drafts.publish(build_draft(target, domain, version), domain, version, dtype=target.embed_tokens.weight.dtype)
    drafts.activate("code", "v1", gate=False)
    weights = root / "code" / "v3" / "draft.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64])  # truncated: its sha256 no longer matches the manifest
    return root


@pytest.fixture(scope="module")
def base(serve_port, app_args, store):
    from ray import serve

    args = {**app_args, "draft_source": None, "draft_store": str(store), "max_seq_len": 512, "max_tokens_cap": 480}
    url = deploy(APP, serve_port, args, {"num_replicas": 2, "user_config": {"drafts": {"code": "latest", "general": "v1"}}})
    yield url
    serve.delete(APP)


def _complete(base: str, **body) -> httpx.Response:
    body = {"prompt": "def add(a, b):", "max_tokens": 24, "temperature": 0, "domain": "code", **body}
    return httpx.post(f"{base}/v1/completions", json=body, headers=AUTH, timeout=120)


def _complete_when_admitted(base: str, **body) -> httpx.Response:
    """A client that does what a full replica's 503 `server_overloaded` asks: retry shortly. (n concurrent
    requests may land more than a replica's capacity on one of the two replicas.)"""
    for _ in range(50):
        response = _complete(base, **body)
        if response.status_code != 503 or response.json()["error"]["code"] != "server_overloaded":
            return response
        time.sleep(0.1)
    return response


def _replicas_seen(base: str, n: int = 8, **body) -> dict[str, set]:
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        responses = list(pool.map(lambda _: _complete_when_admitted(base, **body), range(n)))
        assert all(r.status_code == 200 for r in responses), [r.text[:300] for r in responses if r.status_code != 200]
        outs = [r.json()["flashspec"] for r in responses]
    seen: dict[str, set] = {}
    for info in outs:
        seen.setdefault(info["replica"], set()).add(info["draft_version"])
    return seen


def test_requests_reach_both_replicas_with_store_drafts(base):
    seen = _replicas_seen(base)
    assert len(seen) == 2, seen
    assert all(versions == {"v1"} for versions in seen.values()), seen


def test_hot_swap_reaches_both_replicas(base):
    swap = httpx.post(f"{base}/admin/drafts", json={"domain": "code", "version": "v2"}, timeout=120,
                      headers={"Authorization": f"Bearer {KEYS['admin']}"})
    assert swap.status_code == 200, swap.text
    acks = swap.json()["replicas"]
    assert len(acks) == 2 and all(a["ok"] and a["version"] == "v2" for a in acks.values()), acks
    seen = _replicas_seen(base)
    assert len(seen) == 2 and all(v == {"v2"} for v in seen.values()), seen


def test_corrupt_version_is_refused_on_every_replica(base):
    swap = httpx.post(f"{base}/admin/drafts", json={"domain": "code", "version": "v3"}, timeout=120,
                      headers={"Authorization": f"Bearer {KEYS['admin']}"})
    assert swap.status_code == 400
    message = swap.json()["error"]["message"]
    assert message.count("sha256") == 2 and "previous version keeps serving" in message
    assert all(v == {"v2"} for v in _replicas_seen(base, 4).values())


def _open_stream(base: str) -> tuple[httpx.Client, httpx.Response]:
    client = httpx.Client(timeout=120)
    body = {"prompt": "a long story", "max_tokens": 480, "stream": True, "speculation": False}
    response = client.send(client.build_request("POST", f"{base}/v1/completions", json=body, headers=AUTH), stream=True)
    assert response.status_code == 200
    return client, response


def _finish_stream(response: httpx.Response) -> list[str]:
    return [line for line in response.iter_lines() if line.startswith("data: ")]


@pytest.mark.slow
def test_killing_a_replica_fails_only_its_in_flight_requests(base):
    # The code draft version every replica serves now (v2 after the hot-swap test, v1 when run alone).
    current = set().union(*_replicas_seen(base, 8, max_tokens=4).values())
    streams = [_open_stream(base) for _ in range(6)]
    by_replica: dict[str, list] = {}
    for client, response in streams:
        by_replica.setdefault(response.headers["x-flashspec-replica"], []).append(response)
    assert len(by_replica) == 2, list(by_replica)
    victim, survivor = sorted(by_replica)
    name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if "Generator" in a["name"] and a["name"].endswith(victim))
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    for response in by_replica[victim]:
        events = _finish_stream(response)
        error = json.loads(events[-1][6:])["error"]
        assert error["code"] == "replica_failed" and "retry" in error["message"], events[-1]
    for response in by_replica[survivor]:
        events = _finish_stream(response)
        assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["usage"]["completion_tokens"] == 480
    for client, _ in streams:
        client.close()
    # Later requests succeed: the survivor serves at once, and the replacement replica catches up
    # with the draft activations it missed (code v2) from the registry.
    deadline, streak, codes = time.monotonic() + 90, 0, []
    while streak < 6:
        assert time.monotonic() < deadline, codes
        response = _complete(base, max_tokens=4)
        codes.append(response.status_code)
        streak = streak + 1 if response.status_code == 200 else 0
        if response.status_code != 200:
            assert response.status_code == 503 and response.json()["error"]["code"] == "replica_failed"
            time.sleep(0.2)
    deadline = time.monotonic() + 90
    while len(seen := _replicas_seen(base, 8, max_tokens=4)) < 2:
        assert time.monotonic() < deadline, seen
        time.sleep(1)
    assert victim not in seen and all(v == current for v in seen.values()), (seen, current)

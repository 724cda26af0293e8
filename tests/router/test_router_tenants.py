import threading

import pytest

from router.errors import AuthError, InvalidRequest, PermissionDenied, PolicyError, RateLimited
from router.tenants import OPEN_TENANT, TenantPolicy, hash_key
from pathlib import Path

EXAMPLE = Path(__file__).parents[2] / "router" / "assets" / "tenants.example.yaml"


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def policy(clock=None, **tenant):
    base = {"name": "acme", "api_key_sha256": [hash_key("sk-acme")]}
    return TenantPolicy.from_dict({"tenants": [base | tenant]}, clock=clock or FakeClock())


def test_example_policy_and_demo_keys():
    p = TenantPolicy.from_yaml(EXAMPLE)
    assert p.authenticate("Bearer sk-demo-code").name == "code-team"
    assert p.authenticate("sk-demo-general").name == "support-bot"
    assert p.authenticate("sk-demo-open").speculation is False
    data_lines = [line.split("#", 1)[0] for line in EXAMPLE.read_text().splitlines()]
    assert not any("sk-" in line for line in data_lines)  # keys appear only in comments


def test_authenticate():
    p = policy()
    assert p.authenticate("sk-acme").name == "acme"
    for key in (None, "", "  ", "sk-other", "Bearer sk-acm"):
        with pytest.raises(AuthError) as info:
            p.authenticate(key)
        assert info.value.http_status == 401
        assert info.value.error_body()["error"]["code"] == "invalid_api_key"
        assert "sk-acme" not in str(info.value)
    assert "sk-acme" not in repr(p.authenticate("sk-acme")) and hash_key("sk-acme") not in repr(p.authenticate("sk-acme"))


def test_open_mode():
    p = TenantPolicy.from_dict({})
    tenant = p.authenticate(None)
    assert p.open_mode and tenant.name == OPEN_TENANT and tenant.speculation
    assert p.check_domain(tenant, "dialog") == "dialog"
    for _ in range(1000):
        p.acquire(tenant, tokens=10_000)


def test_domains_pinned_allowed_override():
    p = policy(allowed_domains=["code", "general"])
    tenant = p.authenticate("sk-acme")
    assert p.check_domain(tenant, "general") == "general"
    assert p.check_domain(tenant, "dialog") == "code"  # routed outside the list: first allowed
    with pytest.raises(PermissionDenied, match="may not choose") as info:
        p.check_domain(tenant, "code", override="general")
    assert info.value.http_status == 403 and info.value.error_body()["error"]["param"] == "domain"

    p = policy(allowed_domains=["code", "general"], pinned_domain="code", allow_domain_override=True)
    tenant = p.authenticate("sk-acme")
    assert p.check_domain(tenant, "general") == "code"
    assert p.check_domain(tenant, "code", override="general") == "general"
    with pytest.raises(PermissionDenied, match="may not use domain 'dialog'"):
        p.check_domain(tenant, "code", override="dialog")
    with pytest.raises(PermissionDenied, match="unknown domain"):
        p.check_domain(tenant, "code", override="math")


def test_max_tokens_cap():
    tenant = policy(max_tokens=256).authenticate("sk-acme")
    assert tenant.cap_max_tokens(None) == 256 and tenant.cap_max_tokens(1000) == 256 and tenant.cap_max_tokens(10) == 10


def test_request_rate_limit_refills():
    clock = FakeClock()
    p = policy(clock, rate_limit={"requests_per_minute": 6})
    tenant = p.authenticate("sk-acme")
    for _ in range(6):
        p.acquire(tenant)
    with pytest.raises(RateLimited) as info:
        p.acquire(tenant)
    assert info.value.http_status == 429 and info.value.retry_after == pytest.approx(10.0)
    assert info.value.headers() == {"Retry-After": "10"}
    clock.now += 9.9
    with pytest.raises(RateLimited):
        p.acquire(tenant)
    clock.now += 0.2
    p.acquire(tenant)


def test_token_limit_and_refusal_costs_nothing():
    clock = FakeClock()
    p = policy(clock, rate_limit={"requests_per_minute": 100, "tokens_per_minute": 600})
    tenant = p.authenticate("sk-acme")
    p.acquire(tenant, tokens=500)
    with pytest.raises(RateLimited, match="tokens") as info:
        p.acquire(tenant, tokens=200)
    assert info.value.retry_after == pytest.approx(10.0)  # 100 missing tokens at 10 tokens/s
    clock.now += 10
    p.acquire(tenant, tokens=200)
    with pytest.raises(InvalidRequest, match="max_tokens"):
        p.acquire(tenant, tokens=601)


def test_buckets_are_per_tenant_and_thread_safe():
    clock = FakeClock()
    hashes = {"a": hash_key("ka"), "b": hash_key("kb")}
    p = TenantPolicy.from_dict({"tenants": [
        {"name": n, "api_key_sha256": h, "rate_limit": {"requests_per_minute": 50}} for n, h in hashes.items()
    ]}, clock=clock)
    a, b = p.authenticate("ka"), p.authenticate("kb")
    granted = []

    def worker():
        for _ in range(20):
            try:
                p.acquire(a)
                granted.append(1)
            except RateLimited:
                pass

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(granted) == 50
    p.acquire(b)


@pytest.mark.parametrize("text, match", [
    ("tenants: [", r"not valid YAML at line"),
    ("- just\n- a list\n", "must be a mapping"),
    ("tenants:\n  - name: x\n    api_key: sk-plain\n", r"tenants\[0\] \(x\)\.api_key: plaintext keys"),
    ("tenants:\n  - name: x\n    api_key_sha256: abc\n", r"api_key_sha256: .*64-character"),
    (f"tenants:\n  - name: x\n    api_key_sha256: {'a' * 64}\n    rate_limit: {{requests_per_minute: -1}}\n",
     r"tenants\[0\] \(x\)\.rate_limit\.requests_per_minute"),
    (f"tenants:\n  - name: x\n    api_key_sha256: {'a' * 64}\n    allowed_domains: [code]\n    pinned_domain: dialog\n",
     "pinned_domain 'dialog' is not in allowed_domains"),
    (f"tenants:\n  - name: x\n    api_key_sha256: {'a' * 64}\n    allowed_domains: [cooking]\n", r"allowed_domains\[0\]"),
    (f"tenants:\n  - name: x\n    api_key_sha256: {'a' * 64}\n  - name: y\n    api_key_sha256: {'a' * 64}\n", "used by tenants"),
    ("tenants:\n  - name: x\n", "has no api_key_sha256"),
])
def test_malformed_policy_names_file_and_field(tmp_path, text, match):
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    with pytest.raises(PolicyError, match=match) as info:
        TenantPolicy.from_yaml(path)
    assert str(path) in str(info.value)
    assert "sk-plain" not in str(info.value)


def test_missing_policy_file(tmp_path):
    with pytest.raises(PolicyError, match="not found"):
        TenantPolicy.from_yaml(tmp_path / "nope.yaml")

"""Tenant policy: API-key hashes, allowed / pinned domains, speculation, max_tokens, rate limits.

The policy is YAML (or a dict, e.g. a Ray Serve user_config), validated by pydantic. Keys are
stored only as sha256 hex digests: `flashspec tenants hash-key KEY` prints one. With no tenants
configured the policy is in open mode: every request (with or without a key) is the default
tenant `anonymous`, all domains, speculation on, no limits.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from router.data import DOMAINS
from router.errors import AuthError, InvalidRequest, PermissionDenied, PolicyError, RateLimited

Domain = Literal["code", "general", "dialog"]
OPEN_TENANT = "anonymous"


def hash_key(key: str) -> str:
    """sha256 hex digest of an API key, as stored in the policy file."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class RateLimit(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    requests_per_minute: float | None = Field(
        None, gt=0, description="Token bucket of requests, refilled continuously; null: no limit."
    )
    tokens_per_minute: float | None = Field(
        None, gt=0, description="Token bucket of tokens (prompt + max_tokens); null: no limit."
    )


class Tenant(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, description="Tenant name, used in logs and metrics.")
    api_key_sha256: list[str] = Field(
        default_factory=list,
        description="sha256 hex digests of the tenant's API keys (several allow rotation).",
    )
    allowed_domains: list[Domain] = Field(
        default_factory=lambda: list(DOMAINS), min_length=1,
        description="Domains whose drafts this tenant may use.",
    )
    pinned_domain: Domain | None = Field(
        None, description="Always use this domain; the classifier is skipped."
    )
    speculation: bool = Field(True, description="Speculative decoding on/off for this tenant.")
    max_tokens: int | None = Field(None, gt=0, description="Cap on max_tokens per request.")
    rate_limit: RateLimit = Field(default_factory=RateLimit, description="Rate limits.")
    allow_domain_override: bool = Field(
        False, description="May a request choose its domain (within allowed_domains)?"
    )

    @field_validator("api_key_sha256", mode="before")
    @classmethod
    def _one_or_many(cls, value):
        return [value] if isinstance(value, str) else value

    @field_validator("api_key_sha256")
    @classmethod
    def _hex_digests(cls, value: list[str]) -> list[str]:
        for digest in value:
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest.lower()):
                raise ValueError(
                    "each api_key_sha256 must be a 64-character sha256 hex digest, not a key; "
                    "compute one with `flashspec tenants hash-key KEY`"
                )
        return [d.lower() for d in value]

    @model_validator(mode="after")
    def _pinned_is_allowed(self) -> "Tenant":
        if self.pinned_domain and self.pinned_domain not in self.allowed_domains:
            raise ValueError(
                f"pinned_domain {self.pinned_domain!r} is not in allowed_domains {self.allowed_domains}"
            )
        return self

    def __repr__(self) -> str:  # never print the key hashes
        return f"Tenant(name={self.name!r})"

    __str__ = __repr__

    def cap_max_tokens(self, requested: int | None) -> int | None:
        """The max_tokens to use: the request's, capped by the tenant's limit."""
        if self.max_tokens is None:
            return requested
        return self.max_tokens if requested is None else min(requested, self.max_tokens)


class PolicyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tenants: list[Tenant] = Field(
        default_factory=list, description="Tenants; empty: open mode (one anonymous tenant)."
    )
    open_tenant: Tenant = Field(
        default_factory=lambda: Tenant(name=OPEN_TENANT),
        description="The tenant every request gets in open mode.",
    )

    @model_validator(mode="after")
    def _unique(self) -> "PolicyConfig":
        names, digests = set(), {}
        for tenant in self.tenants:
            if tenant.name in names:
                raise ValueError(f"tenant name {tenant.name!r} appears twice")
            names.add(tenant.name)
            if not tenant.api_key_sha256:
                raise ValueError(f"tenant {tenant.name!r} has no api_key_sha256")
            for digest in tenant.api_key_sha256:
                if digest in digests:
                    raise ValueError(
                        f"the same api_key_sha256 is used by tenants {digests[digest]!r} and {tenant.name!r}"
                    )
                digests[digest] = tenant.name
        return self


class TokenBucket:
    """Capacity `per_minute`, refilled at per_minute / 60 per second. Not locked: the policy locks."""

    def __init__(self, per_minute: float, now: float):
        self.capacity = float(per_minute)
        self.rate = self.capacity / 60.0  # per second
        self.level = self.capacity
        self.updated = now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` is available (0 when it is)."""
        return 0.0 if self.level >= amount else (amount - self.level) / self.rate


class TenantPolicy:
    """Authenticates keys, resolves domains, enforces rate limits (thread-safe)."""

    def __init__(self, config: PolicyConfig | None = None, clock: Callable[[], float] = time.monotonic,
                 source: str = "<policy>"):
        self.config = config or PolicyConfig()
        self.source = source
        self._clock = clock
        self._by_digest = {d: t for t in self.config.tenants for d in t.api_key_sha256}
        self._buckets: dict[tuple[str, str], TokenBucket] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------ loading

    @classmethod
    def from_dict(cls, data: object, source: str = "<policy>", clock: Callable[[], float] = time.monotonic) -> "TenantPolicy":
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise PolicyError(f"{source}: the policy must be a mapping with a 'tenants' list, got {type(data).__name__}")
        try:
            config = PolicyConfig.model_validate(data)
        except ValidationError as exc:
            problems = []
            for error in exc.errors():
                field = _field_path(error["loc"], data)
                message = error["msg"].removeprefix("Value error, ")
                if error["type"] == "extra_forbidden" and str(error["loc"][-1]).startswith("api_key"):
                    message = ("plaintext keys are not accepted; store api_key_sha256 "
                               "(`flashspec tenants hash-key KEY`)")
                problems.append(f"{field}: {message}")
            raise PolicyError(f"{source}: invalid tenant policy:\n  " + "\n  ".join(problems)) from None
        return cls(config, clock=clock, source=source)

    @classmethod
    def from_yaml(cls, path: str | Path, clock: Callable[[], float] = time.monotonic) -> "TenantPolicy":
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise PolicyError(f"{path}: tenant policy file not found") from None
        except UnicodeDecodeError:
            raise PolicyError(f"{path}: tenant policy file is not UTF-8 text") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise PolicyError(f"{path}: not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
        return cls.from_dict(data, source=str(path), clock=clock)

    @property
    def open_mode(self) -> bool:
        return not self.config.tenants

    # ------------------------------------------------------------ decisions

    def authenticate(self, bearer_key: str | None) -> Tenant:
        """The tenant owning `bearer_key` ("Bearer " prefix accepted). Raises AuthError (401)."""
        if self.open_mode:
            return self.config.open_tenant
        if not bearer_key or not bearer_key.strip():
            raise AuthError("missing API key; send it as 'Authorization: Bearer <key>'")
        key = bearer_key.strip()
        if key[:7].lower() == "bearer ":
            key = key[7:].strip()
        tenant = self._by_digest.get(hash_key(key))
        if tenant is None:
            raise AuthError("invalid API key; check the key or ask the operator for one")
        return tenant

    def check_domain(self, tenant: Tenant, routed: str, override: str | None = None) -> str:
        """The domain to serve with. Raises PermissionDenied (403) for a forbidden override.

        Order: an explicit override (if the tenant allows it and the domain is allowed), else the
        pinned domain, else the routed domain if allowed, else the tenant's first allowed domain.
        """
        if override is not None:
            if override not in DOMAINS:
                raise PermissionDenied(f"unknown domain {override!r}; use one of {', '.join(DOMAINS)}",
                                       param="domain", code="unknown_domain")
            if not tenant.allow_domain_override:
                raise PermissionDenied(f"tenant {tenant.name!r} may not choose the domain", param="domain")
            if override not in tenant.allowed_domains:
                raise PermissionDenied(
                    f"tenant {tenant.name!r} may not use domain {override!r}; "
                    f"allowed: {', '.join(tenant.allowed_domains)}", param="domain")
            return override
        if tenant.pinned_domain:
            return tenant.pinned_domain
        return routed if routed in tenant.allowed_domains else tenant.allowed_domains[0]

    def acquire(self, tenant: Tenant, tokens: int = 0) -> None:
        """Take one request and `tokens` tokens from the tenant's buckets, or raise RateLimited (429).

        A request larger than a whole bucket can never pass: InvalidRequest (400).
        Both buckets are checked before either is charged, so a refused request costs nothing.
        """
        limits = tenant.rate_limit
        wanted = [("requests", limits.requests_per_minute, 1.0), ("tokens", limits.tokens_per_minute, float(tokens))]
        wanted = [(kind, per_minute, amount) for kind, per_minute, amount in wanted if per_minute]
        for kind, per_minute, amount in wanted:
            if amount > per_minute:
                raise InvalidRequest(
                    f"request needs {amount:g} {kind} but tenant {tenant.name!r} is limited to "
                    f"{per_minute:g} {kind} per minute; lower max_tokens", param="max_tokens")
        with self._lock:
            now = self._clock()
            buckets = []
            for kind, per_minute, amount in wanted:
                bucket = self._buckets.get((tenant.name, kind))
                if bucket is None or bucket.capacity != per_minute:
                    bucket = self._buckets[(tenant.name, kind)] = TokenBucket(per_minute, now)
                bucket.refill(now)
                buckets.append((kind, bucket, amount))
            waits = [(bucket.wait_for(amount), kind) for kind, bucket, amount in buckets]
            retry_after, kind = max(waits, default=(0.0, ""))
            if retry_after > 0:
                raise RateLimited(
                    f"tenant {tenant.name!r} is over its {kind} per minute limit; "
                    f"retry after {retry_after:.1f} s", retry_after=retry_after)
            for _, bucket, amount in buckets:
                bucket.level -= amount


def _field_path(loc: tuple, data: dict) -> str:
    """'tenants[1] (acme).rate_limit.requests_per_minute' from a pydantic error location."""
    parts = []
    node: object = data
    for item in loc:
        if isinstance(item, int):
            name = node[item].get("name") if isinstance(node, list) and item < len(node) and isinstance(node[item], dict) else None
            parts[-1:] = [f"{parts[-1] if parts else ''}[{item}]" + (f" ({name})" if name else "")]
        else:
            parts.append(str(item))
        try:
            node = node[item]  # type: ignore[index]
        except (KeyError, IndexError, TypeError):
            node = None
    return ".".join(parts) or "<root>"

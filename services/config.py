"""The service's configuration: the serve config YAML's `args` and the Generator's `user_config`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

Domain = Literal["code", "general", "dialog"]
DEPLOYMENTS = ("Ingress", "Router", "Generator")
# Rows prefilled ahead by default on CUDA (`AppArgs.engine_prefill_ahead`): groups of up to eight, the setting measured
# (bench/RESULTS.md run 45); a larger batch keeps its extra cache to that.
DEFAULT_PREFILL_AHEAD = 7


class AppArgs(BaseModel):
    """`applications[].args` of the serve config: what the app loads and how big it is."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field("default", description="Target model: 'default' (embedded SmolLM2-135M), an HF folder or a .gguf file.")
    device: str = Field("cpu", description="'cpu' or 'cuda' for the Generator's target and drafts.")
    dtype: str = Field("auto", description="Weights dtype: auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16.")
    draft_store: str | None = Field(None, description="Draft store root; null: $FLASHSPEC_HOME/store (then the shipped demo drafts).")
    draft_source: str | None = Field(
        None, description="Import path 'module:function' of a draft factory (target, domain, version) -> draft; "
                          "null: load versions from the draft store.")
    router_model: str | None = Field(None, description="Router classifier (.skops); null: the shipped router model.")
    router_threshold: float = Field(0.5, ge=0.0, le=1.0, description="Below this router confidence the fallback domain is used.")
    router_fallback: Domain = Field("general", description="Domain used when the router is not confident.")
    tenants_file: str | None = Field(None, description="Tenant policy YAML; null: env FLASHSPEC_TENANTS_FILE, else open mode.")
    max_batch_size: int = Field(8, ge=1, le=256, description="Requests decoded together by one Generator replica.")
    max_queue: int = Field(64, ge=0, description="Requests waiting beyond the batch per replica; more get 503.")
    max_seq_len: int = Field(2048, ge=16, description="Context per request (prompt + completion) in tokens.")
    max_tokens_cap: int = Field(1024, ge=1, description="Largest max_tokens a request may ask for; above it: 400.")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request gives none.")
    num_speculative_tokens: int = Field(5, ge=1, le=16, description="Draft tokens per FlashSpec round (gamma).")
    block_size: int = Field(5, ge=1, le=16, description="Drafted tokens verified together (= gamma: one verify pass per round, measured fastest on CPU and GPU; 2 is the write-up's block-wise schedule).")
    adaptive_gamma: bool = Field(
        True, description="Pick each round's gamma (1 to num_speculative_tokens) for the most tokens a second, from "
                          "the drafts' measured acceptance by position and the measured round costs (engine.gamma); "
                          "false: every round drafts num_speculative_tokens. Lossless either way; rounds with a seeded sampled "
                          "request keep num_speculative_tokens, so the same seed repeats its tokens.")
    tree_width: int = Field(
        1, ge=1, le=16, description="Draft trees: greedy rounds of at most tree_max_batch requests draft this many "
                                    "branches (the draft's best first tokens, each continued to gamma) and keep the "
                                    "longest the target accepts, in one verify pass (engine.tree). 1: a single chain. "
                                    "Greedy output is unchanged; sampled rounds keep the chain.")
    tree_max_batch: int = Field(1, ge=1, le=256, description="Largest batch whose greedy rounds draft trees (tree_width > 1).")
    draft_confidence: float = Field(
        0.0, ge=0.0, lt=1.0, description="Stop drafting a round early once no running request's draft gives its next "
                                         "token this probability (0: always draft num_speculative_tokens). Lossless "
                                         "either way; saves draft steps that would mostly be rejected. CUDA's one-graph "
                                         "greedy rounds always draft them all, and so do rounds holding a seeded "
                                         "sampled request (its tokens must not depend on its batch).")
    fused_inference: bool = Field(
        False, description="Fuse the target's and the drafts' layers for inference (one GEMM for q/k/v and for gate/up; "
                           "on CUDA also compiled RMSNorm/RoPE/SiLU): 1.4-2x faster plain decoding on the H200. "
                           "Compiles at replica start. On the CPU it replaces the packed projections: leave it off there.")
    attention_backend: Literal["auto", "sdpa", "flex", "triton"] = Field(
        "auto", description="Attention kernels: 'auto' (default) is triton on a CUDA device with the triton package, "
                            "SDPA otherwise; 'triton' one Triton kernel per decode/draft/verify step on CUDA (SDPA for "
                            "prefill and on the CPU); 'sdpa' PyTorch SDPA everywhere; 'flex' FlexAttention. On the H200 "
                            "triton's decode step is 0.95 ms against SDPA's 1.15 (bench/RESULTS.md).")
    governor: bool = Field(True, description="Switch speculation off per domain while it does not pay (never for a "
                                             "seeded sampled request: the same seed gives the same tokens).")
    lookup_alternative: bool = Field(
        True, description="With the governor: each domain's trained draft has the n-gram lookup drafter (no weights: a "
                          "request's own earlier tokens propose its next ones) as an alternative; per domain and batch "
                          "size the governor measures both and a new request runs the cheaper a token, each tried now "
                          "and then (engine DecodeEngine.set_alternatives). Lookup wins where replies repeat their "
                          "prompt or themselves (long documents, code edits), the drafts elsewhere. Same tokens either "
                          "way. No effect without the governor, or on a domain whose version is 'lookup'.")
    lookup_allot: bool = Field(
        False, description="Lookup rounds of a greedy batch give each row its own number of proposed tokens (up to 12) "
                           "by how long its match is, within the verify tokens the batch's gamma gives it (engine "
                           "LookupDraft(allot=True)): rows repeating long stretches propose more, the others less. "
                           "Same tokens. Off until measured on a GPU: over our validation replies it projects +9.8 % "
                           "at bs 8 (bench/RESULTS.md).")
    prefill_ahead: int | None = Field(
        None, ge=0, le=256, description="Cache rows beyond max_batch_size for requests prefilled ahead of a free running "
                                        "row: the first row that frees with none prefilled prefills a group of up to "
                                        "prefill_ahead + 1 waiting requests in one pass (at most max_batch_size); the "
                                        "rest take the next rows that free without a pass of their own "
                                        "(engine DecodeEngine(prefill_ahead=...)). Same tokens; costs their cache "
                                        "memory (about 48 MB a row for the default model at 2,048 tokens). null: "
                                        "max_batch_size - 1 but at most 7 on CUDA (groups of up to eight; bs 8 on an "
                                        "H100: +3.5-5.7 % for the service, bench/RESULTS.md runs 45-46), 0 on the CPU; "
                                        "0: admit into free running rows only.")

    def engine_prefill_ahead(self) -> int:
        """The engine's prefill_ahead: as set, else max_batch_size - 1 up to DEFAULT_PREFILL_AHEAD on CUDA and 0 on the
        CPU."""
        if self.prefill_ahead is not None:
            return self.prefill_ahead
        return min(self.max_batch_size - 1, DEFAULT_PREFILL_AHEAD) if self.device.startswith("cuda") else 0

    overlap: bool = Field(
        True, description="With CUDA graphs: a batch launches its next graph call (plain decoding steps, or a one-graph "
                          "speculative round) from the last one's outcome on the device before the host reads it, so "
                          "the host's work per call (the transfer, stop conditions, detokenizing, scheduling) runs while "
                          "the GPU decodes. Same tokens. On the H200, batch 1: plain decoding 1.07x, adaptive gamma "
                          "1.18x (bench/RESULTS.md, run 20). No effect without graphs (CPU).")
    graph_warmup_tokens: int = Field(
        256, ge=0, description="With CUDA graphs: at replica start, capture the decode/draft/verify graphs of every "
                               "batch bucket, draft, mix of drafts, gamma and sampling kind (0: capture on first use "
                               "only). With the Triton attention kernel (CUDA's default) graphs do not depend on the "
                               "sequence length and warm-up captures all of them (any value > 0); with another "
                               "backend, sequences up to this many tokens.")
    torch_threads: int | None = Field(
        None, ge=1, description="CPU threads of the Generator's torch ops; null: as many as the replica's num_cpus "
                                "(Ray's OMP_NUM_THREADS). Small decode GEMMs scale with threads on the CPU.")

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if value != "cpu" and not value.startswith("cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {value!r}")
        return value


class GeneratorUserConfig(BaseModel):
    """The Generator's `user_config`, applied by `reconfigure` without a replica restart."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    drafts: dict[Domain, str] = Field(
        default_factory=dict,
        description="Active draft version per domain ('latest' = newest in the store; 'lookup' = the n-gram lookup drafter, "
                    "no checkpoint); a domain left out runs without a draft.")


class Deployment(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(description="Ingress, Router or Generator.")
    num_replicas: int | Literal["auto"] | None = Field(None, description="Fixed replica count (or 'auto').")
    autoscaling_config: dict | None = Field(None, description="Ray Serve autoscaling bounds (min/max_replicas, ...).")
    ray_actor_options: dict = Field(default_factory=dict, description="num_cpus / num_gpus per replica.")
    user_config: dict | None = Field(None, description="Generator only: GeneratorUserConfig.")

    def options(self) -> dict:
        """Keyword arguments for `Deployment.options`."""
        out = {k: v for k, v in self.model_dump(exclude={"name"}).items() if v is not None and v != {}}
        if self.num_replicas is None:
            out.pop("num_replicas", None)
        return out


class Application(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(description="Application name.")
    route_prefix: str = Field("/", description="HTTP route prefix.")
    import_path: str = Field(description="services.app:app_builder")
    args: AppArgs = Field(default_factory=AppArgs, description="App arguments.")
    deployments: list[Deployment] = Field(default_factory=list, description="Per-deployment options.")

    @field_validator("deployments")
    @classmethod
    def _known(cls, value: list[Deployment]) -> list[Deployment]:
        for d in value:
            if d.name not in DEPLOYMENTS:
                raise ValueError(f"unknown deployment {d.name!r}; the app has {', '.join(DEPLOYMENTS)}")
            if d.name == "Generator" and d.user_config is not None:
                GeneratorUserConfig.model_validate(d.user_config)
        return value

    def deployment_options(self) -> dict[str, dict]:
        return {d.name: d.options() for d in self.deployments}


class ServeConfig(BaseModel):
    """The whole serve config file (the subset this app reads; Ray Serve validates the rest)."""

    model_config = ConfigDict(extra="allow")

    http_options: dict = Field(default_factory=dict, description="host / port of the HTTP proxy.")
    applications: list[Application] = Field(min_length=1, description="Applications; this project ships one.")

    @classmethod
    def from_yaml(cls, path: str | Path) -> "ServeConfig":
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ValueError(f"serve config {path} not found; pass --config services/serve_config.yaml") from None
        except yaml.YAMLError as exc:
            raise ValueError(f"serve config {path} is not valid YAML: {exc}") from None
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ValueError(f"serve config {path} is invalid:\n{exc}") from None

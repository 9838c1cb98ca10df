"""The fleet status document: what `r9k fleet` serves at ``/fleet/status`` and the exporter reads
(``r9k exporter --fleet URL``, or a replica file). One typed model for both sides: the
controller builds a :class:`FleetStatus`, the entry point serves its JSON, monitoring validates
the same model, so a field renamed on one side fails a test instead of a scrape. Readers ignore
fields they do not know (an exporter older than the controller it reads keeps working).

A :class:`ReplicaDescription` is what monitoring needs of a replica (also given as
``--replica URL[,key=value...]``); :class:`ReplicaStatus` adds what the controller knows.
"""
from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

# The kinds of health verdict the fleet reports for a replica (deploy decides, monitoring reads)
EXITED, NO_HEARTBEAT, HUNG = VERDICTS = ("exited", "no_heartbeat", "hung")

def _http_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"expected an http(s)://host:port URL, got {value!r}")
    return value.rstrip("/")


class ReplicaDescription(BaseModel):
    """One vLLM replica as monitoring needs it."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=(), populate_by_name=True)

    name: str = Field(min_length=1)          # label `replica`; unique in the fleet
    url: str                                  # base URL of the replica's HTTP server
    metrics_path: str = "/metrics"
    model: str | None = None                  # label `model`; default: vLLM's `model_name` label
    model_config_path: str | None = Field(    # config.json (or its directory) readable here
        default=None, validation_alias=AliasChoices("model_config_path", "model_config"))
    tp: int = Field(default=1, ge=1)
    num_spec: int = Field(default=0, ge=0)    # speculative tokens per step (0: none)
    page_mode: Literal["stock", "onepage"] | None = Field(
        default=None, validation_alias=AliasChoices("page_mode", "mode"))  # None: stock unless the plugin says
    platform: Literal["gpu", "cpu"] = "gpu"   # attention block alignment (capacity module)
    max_model_len: int | None = Field(default=None, ge=1)  # None: ask the replica's /v1/models
    state: Literal["loading", "ready", "draining", "unhealthy"] | None = None  # from the fleet
    cards: list[str] = Field(default_factory=list)  # PCI addresses the replica runs on
    host: str | None = None                         # the host they are on (a card is host + address)

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        return _http_url(value)


class PageProof(BaseModel):
    """The page mode a replica runs, read from its /metrics and checked against the planner."""

    model_config = ConfigDict(extra="ignore")

    page_mode: str                  # what the engine runs: onepage | stock | unknown
    reason: str | None              # why stock (the plugin's words), or why the proof failed
    ok: bool                        # the engine runs what the fleet file asked for
    num_blocks: int | None          # vLLM's pool size (cache_config_info num_gpu_blocks)
    block_size: int | None          # its attention block size in tokens (cache_config_info)
    cache_mode: str | None          # vLLM's mamba_cache_mode (cache_config_info)
    planned_blocks: dict[str, int]  # the planner's per mode
    planned_tokens: dict[str, int]
    plugin: dict[str, str] | None   # the r9k_plugin_info labels as the replica served them


class EngineLoadStatus(BaseModel):
    """A replica's engine load from the controller's last probe (what pool-aware routing scores),
    and its age, so an entry point on another host routes as the controller's does."""

    model_config = ConfigDict(extra="ignore")

    running: float
    waiting: float
    kv_usage_ratio: float
    age_s: float = Field(ge=0)


class ReplicaStatus(ReplicaDescription):
    """A replica as the controller reports it: the description plus its lifecycle."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=(), populate_by_name=True)

    url: str | None = None                    # None: stopped, not routed
    reason: str | None = None                 # the lifecycle's last reason
    # the health verdict's kind while that reason stands (VERDICTS, r9k.deploy.health): typed,
    # so readers need not parse the reason's words
    verdict: str | None = None
    page_reason: str | None = None            # why stock pages, or why the page proof failed
    kv: PageProof | None = None
    starts: int = Field(default=0, ge=0)
    restarts: int = Field(default=0, ge=0)
    failures: int = Field(default=0, ge=0)
    outstanding: int = Field(default=0, ge=0)  # requests the router has in flight there
    served: int = Field(default=0, ge=0)
    pid: int | None = None
    engine_pids: list[int] = Field(default_factory=list)
    history: list[str] = Field(default_factory=list)
    rccl_env: dict[str, str] = Field(default_factory=dict)
    probe_age_s: float | None = None          # seconds since its last health probe finished
    engine_load: EngineLoadStatus | None = None

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str | None) -> str | None:
        return None if value is None else _http_url(value)


class CardStatus(BaseModel):
    model_config = ConfigDict(extra="ignore")

    bdf: str
    host: str
    replica: str | None = None     # the replica placed on it
    usable: bool = True
    reason: str | None = None      # why not usable (fenced, drift, ...)


class PlanStatus(BaseModel):
    """The capacity module's pool per replica of a model, both page modes."""

    model_config = ConfigDict(extra="ignore")

    stock_tokens: int
    onepage_tokens: int
    stock_blocks: int
    onepage_blocks: int


class ExporterStatus(BaseModel):
    model_config = ConfigDict(extra="ignore")

    url: str
    pid: int | None = None
    running: bool
    restarts: int = Field(default=0, ge=0)
    last_exit: int | None = None


class FleetStatus(BaseModel):
    """``{"replicas": [...], ...}``: routed replicas, stopped ones, cards, planned capacity."""

    model_config = ConfigDict(extra="ignore")

    replicas: list[ReplicaStatus]
    stopped: list[ReplicaStatus] = Field(default_factory=list)
    cards: list[CardStatus] = Field(default_factory=list)
    capacity: dict[str, PlanStatus] = Field(default_factory=dict)
    entry: str | None = None
    exporter: ExporterStatus | None = None

    @model_validator(mode="after")
    def _routed_replicas_have_urls(self) -> "FleetStatus":
        missing = [r.name for r in self.replicas if r.url is None]
        if missing:
            raise ValueError(f"replicas {', '.join(missing)}: a routed replica needs its url")
        return self

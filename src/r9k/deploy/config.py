"""The fleet file: what to serve, where, and how to watch it (YAML, validated before anything starts).

Every refusal is one line naming the file, the field, what was given and what was expected.
Checks that need the host inventory (cards that exist, TP that fits one host) are in
:mod:`r9k.deploy.placement`; :func:`check_fleet` runs both.
"""
from __future__ import annotations

import contextlib
import functools
import io
import os
import shlex
from pathlib import Path
from typing import Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr,
                      field_validator, model_validator)

from r9k.core import capacity
from r9k.core.config_errors import decode_config_text, parse_yaml_model, read_config_bytes
from r9k.core.http_client import is_loopback
from r9k.ops.state import BDF_RE, DEFAULT_STATE_DIR

DEFAULT_CARD_RESOURCE = "R9700"
HOST_LABEL = "r9k.host"          # Ray node label naming the host in the fleet file
# RCCL defaults of every replica on R9700s (a model's env overrides them; `fleet status` shows
# what each replica runs with): TP 2 deadlocks without the Simple protocol (vLLM issue 40980);
# 4-card TP can hang the host through PCIe peer-to-peer (the reported workaround disables it).
RCCL_DEFAULTS: dict[str, str] = {"NCCL_PROTO": "Simple"}
RCCL_TP4_DEFAULTS: dict[str, str] = {"NCCL_P2P_DISABLE": "1"}
# R9K_* is not among the prefixes vLLM's Ray executor copies to its workers.
RAY_EXTRA_COPY = "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"
# Environment the fleet sets itself (card placement, page mode, what Ray copies); in `env` they
# would override it.
_OWNED_ENV = ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES",
              "GPU_DEVICE_ORDINAL", "VLLM_CPU_OMP_THREADS_BIND", "R9K_GDN_STATE", RAY_EXTRA_COPY)


# What vLLM's own parser must leave as the fleet sets it: the fleet's typed fields, the socket
# it probes, and the cards it placed (a data- or pipeline-parallel replica takes cards no one
# placed). Compared by value after vLLM parses extra_args, so its abbreviations (`--hos`,
# allow_abbrev), underscores and `=` forms cannot slip past a list of spellings.
_OWNED_DESTS = {"model": "the model's path", "host": "replica_bind", "port": "replica_ports",
                "uds": "the replica's port", "served_model_name": "the model's name",
                "tensor_parallel_size": "tp", "data_parallel_size": "tp (one replica per placement)",
                "pipeline_parallel_size": "tp (one replica per placement)",
                "speculative_config": "speculative", "max_model_len": "max_model_len",
                "kv_cache_memory_bytes": "kv_cache_memory_bytes", "api_key": "the fleet's replica key",
                "enable_prefix_caching": "prefix_caching"}


class FleetConfigError(ValueError):
    """Fleet file refused; nothing was started."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, protected_namespaces=())


class Speculative(_Strict):
    method: Literal["mtp", "ngram", "eagle", "eagle3", "draft_model"] = "mtp"
    k: StrictInt = Field(default=3, ge=1, le=capacity.MAX_NUM_SPEC)  # num_speculative_tokens


class ModelSpec(_Strict):
    # served model name (the `model` of requests): printable, no blanks (a newline passed the
    # check, then broke every request line and log entry naming it)
    name: StrictStr = Field(min_length=1, max_length=200, pattern=r"^[!-~]+$")
    path: StrictStr = Field(min_length=1)            # local directory with config.json, on every host
    replicas: StrictInt = Field(default=1, ge=0)
    tp: StrictInt = 1
    speculative: Union[Speculative, None] = Speculative()
    max_model_len: StrictInt = Field(default=4096, ge=16)
    kv_cache_memory_bytes: StrictInt = Field(ge=1 << 20)  # per rank
    gdn_state: Literal["onepage", "stock"] = "onepage"
    # a mixed model for comparisons: replica i's pages (overrides gdn_state), one per replica
    gdn_state_per_replica: Union[list[Literal["onepage", "stock"]], None] = None
    state_dtype: Union[Literal["float32", "bfloat16"], None] = None  # --mamba-ssm-cache-dtype
    # vLLM's default for hybrids, on (one-page serves it); false: --no-enable-prefix-caching
    prefix_caching: StrictBool = True
    # vLLM's max_num_seqs. None: vLLM's default (it admits what fits now and preempts requests as
    # they grow); "planner": the whole requests of max_model_len the replica's pool holds in its
    # page mode (capacity.PoolPlan.whole_requests): no preemption by growth
    max_num_seqs: Union[StrictInt, Literal["planner"], None] = None
    extra_args: list[StrictStr] = []
    env: dict[StrictStr, StrictStr] = {}

    @field_validator("tp")
    @classmethod
    def _tp(cls, value: int) -> int:
        if value not in capacity.TP_SIZES:
            raise ValueError(f"expected a tensor-parallel size of "
                             f"{', '.join(map(str, capacity.TP_SIZES))}, got {value}")
        return value

    @field_validator("max_num_seqs")
    @classmethod
    def _max_num_seqs(cls, value: int | str | None) -> int | str | None:
        if isinstance(value, int) and value < 1:
            raise ValueError("expected a count >= 1 or \"planner\"")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, env: dict[str, str]) -> dict[str, str]:
        for key in env:
            if key in _OWNED_ENV:
                raise ValueError(f"{key} is set by the fleet (card placement, page mode, Ray's env "
                                 "copy); remove it from env")
        return env

    @model_validator(mode="after")
    def _onepage_needs_spec(self) -> "ModelSpec":
        per = self.gdn_state_per_replica
        if per is not None and len(per) != self.replicas:
            raise ValueError(f"gdn_state_per_replica lists {len(per)} page modes for "
                             f"{self.replicas} replicas; expected one per replica")
        if "onepage" in (per or [self.gdn_state]) and self.speculative is None:
            raise ValueError("gdn_state onepage needs speculative decoding (speculative: {method, k}); "
                             "without it one page is all stock keeps, use gdn_state: stock")
        return self

    @property
    def num_spec(self) -> int:
        return self.speculative.k if self.speculative else 0

    @property
    def page_modes(self) -> list[str]:
        """The page modes its replicas run, each once."""
        return list(dict.fromkeys(self.gdn_state_per_replica or [self.gdn_state]))

    def for_replica(self, replica: str) -> "ModelSpec":
        """The model as replica `<name>-<i>` serves it: its own page mode in a mixed model."""
        if self.gdn_state_per_replica is None:
            return self
        i = int(replica.rsplit("-", 1)[1])
        return self.model_copy(update={"gdn_state": self.gdn_state_per_replica[i],
                                       "gdn_state_per_replica": None})

    def resolved_path(self, base: Path) -> Path:
        p = Path(os.path.expanduser(self.path))
        return p if p.is_absolute() else (base / p).resolve()


class CardSpec(_Strict):
    bdf: StrictStr
    cpu_bind: Union[StrictStr, None] = None   # platform cpu: the cores that stand for this card

    @field_validator("bdf")
    @classmethod
    def _bdf(cls, value: str) -> str:
        if not BDF_RE.match(value):
            raise ValueError(f"expected a full lower-case PCI address like 0000:03:00.0, got {value!r}")
        return value


class HostSpec(_Strict):
    name: StrictStr = Field(min_length=1)     # the Ray node's `r9k.host` label
    cards: list[Union[StrictStr, CardSpec]]

    @field_validator("cards")
    @classmethod
    def _cards(cls, cards: list) -> list[CardSpec]:
        out = [CardSpec(bdf=c) if isinstance(c, str) else c for c in cards]
        bdfs = [c.bdf for c in out]
        if len(set(bdfs)) != len(bdfs):
            raise ValueError(f"a card is listed twice: {sorted(b for b in bdfs if bdfs.count(b) > 1)[0]}")
        return out


class RaySpec(_Strict):
    address: StrictStr = "local"      # local: start a one-host Ray here; auto / ray://...: join
    num_cpus: Union[StrictInt, None] = None   # local only (logical)
    namespace: StrictStr = "r9k-fleet"


class EntrySpec(_Strict):
    host: StrictStr = "127.0.0.1"
    port: StrictInt = Field(default=8000, ge=1, le=65535)
    api_key_env: Union[StrictStr, None] = None   # name of the env var holding the key (never the key)
    # Serving beyond loopback without a key lets anyone on the network drain or stop the fleet:
    # only with this explicit opt-in (and a warning at `fleet up`).
    allow_unauthenticated: StrictBool = False
    # r9k.deploy.routing: pool-aware | least-outstanding | prefix-affinity | round-robin
    routing: Literal["pool-aware", "least-outstanding", "prefix-affinity", "round-robin"] = "pool-aware"
    prefix_chars: StrictInt = Field(default=1024, ge=1)  # prefix affinity's key length
    # Upstream bounds: a replica that vanished (its host gone) or froze never holds a request
    # longer than these. First byte: a plain answer arrives whole, so it is the longest.
    connect_timeout_s: float = Field(default=5.0, gt=0)
    first_byte_timeout_s: float = Field(default=600.0, gt=0)
    chunk_timeout_s: float = Field(default=60.0, gt=0)     # between two chunks of a stream
    # An entry point on another host (`r9k fleet entry`) serves the controller's last routing
    # state this long while the controller does not answer, then answers 503.
    state_stale_s: float = Field(default=60.0, gt=0)
    # Client connections: one address cannot hold more than max_connections_per_peer; when all
    # max_connections are taken, a new one takes the slot of an idle (or head-arriving) one.
    max_connections: StrictInt = Field(default=1024, ge=1)
    max_connections_per_peer: StrictInt = Field(default=256, ge=1)
    header_timeout_s: float = Field(default=10.0, gt=0)   # a request head, from its first byte

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)


class ExporterSpec(_Strict):
    """The fleet's own exporter (replicas only, supervised by the controller); 9701 because every
    GPU host runs `r9k exporter` for its cards on 9700."""

    listen: StrictStr = "127.0.0.1"
    port: StrictInt = Field(default=9701, ge=1, le=65535)


class PlacementSpec(_Strict):
    card_resource: StrictStr = DEFAULT_CARD_RESOURCE
    avoid_cards: list[StrictStr] = []
    cpus_per_card: float = Field(default=1.0, ge=0)
    gpu_resource: Union[bool, None] = None   # ask bundles for Ray's GPU too; default: platform gpu

    # a placement group not ready this long (its host went away meanwhile, its resources are
    # held elsewhere) is removed, its cards freed, and the replica placed again after a backoff
    timeout_s: float = Field(default=120.0, gt=0)

    @field_validator("avoid_cards")
    @classmethod
    def _avoid(cls, cards: list[str]) -> list[str]:
        for c in cards:  # BDF (on every host) or host/BDF (on that host)
            CardSpec(bdf=c.rpartition("/")[2])
        return cards


class HealthSpec(_Strict):
    probe_interval_s: float = Field(default=2.0, gt=0)
    heartbeat_timeout_s: float = Field(default=30.0, gt=0)   # /health unanswered this long: unhealthy
    progress_timeout_s: float = Field(default=60.0, gt=0)    # work queued, no new token this long: hung
    startup_timeout_s: float = Field(default=900.0, gt=0)    # loading longer than this: failed start
    grace_after_ready_s: float = Field(default=30.0, ge=0)   # no progress verdict this soon after ready
    restart_backoff_s: float = Field(default=5.0, ge=0)
    restart_backoff_max_s: float = Field(default=300.0, ge=0)
    stable_after_s: float = Field(default=300.0, ge=0)      # ready this long: failure count resets
    drain_timeout_s: float = Field(default=120.0, ge=0)


class FleetConfig(_Strict):
    platform: Literal["gpu", "cpu"] = "gpu"
    # the vLLM release series the hosts run: the planner's block alignment follows it (0.34's
    # default block is 64 tokens) and each replica's proof checks it
    vllm: Literal["0.32", "0.33", "0.34"] = "0.32"
    ray: RaySpec = RaySpec()
    entry: EntrySpec = EntrySpec()
    exporter: Union[ExporterSpec, None] = ExporterSpec()
    replica_bind: Literal["127.0.0.1", "node-ip"] = "127.0.0.1"
    replica_ports: StrictStr = "8100-8199"
    # each host's ops state dir, read there by the host's agent; "{host}" is replaced by the
    # host's name (hosts that share a filesystem)
    ops_state_dir: StrictStr = DEFAULT_STATE_DIR
    run_dir: Union[StrictStr, None] = None    # logs and the controller file; default ~/.local/state/r9k/fleet
    hosts: list[HostSpec] = []                # inventory; empty: discovered on the Ray nodes
    placement: PlacementSpec = PlacementSpec()
    health: HealthSpec = HealthSpec()
    models: list[ModelSpec] = Field(min_length=1)
    # Where the file was read from (relative model paths resolve against it); not a YAML field.
    base_dir: Path = Field(default=Path("."), exclude=True)

    @field_validator("ops_state_dir", "run_dir")
    @classmethod
    def _home(cls, value: str | None) -> str | None:
        return os.path.expanduser(value) if value else value

    @field_validator("replica_ports")
    @classmethod
    def _range(cls, value: str) -> str:
        lo, sep, hi = value.partition("-")
        if not (sep and lo.isdigit() and hi.isdigit() and 1024 <= int(lo) <= int(hi) <= 65535):
            raise ValueError(f"expected a port range like 8100-8199 (1024..65535), got {value!r}")
        return value

    @property
    def port_range(self) -> tuple[int, int]:
        lo, _, hi = self.replica_ports.partition("-")
        return int(lo), int(hi)

    def host_state_dir(self, host: str) -> str:
        """The ops state dir of ``host`` as its agent reads it."""
        return self.ops_state_dir.replace("{host}", host)

    @property
    def use_gpu_resource(self) -> bool:
        gpu = self.placement.gpu_resource
        return self.platform == "gpu" if gpu is None else gpu

    def model(self, name: str) -> ModelSpec:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)

    def api_key(self) -> str | None:
        """The entry point's key; None when the file configures none. A configured variable that
        is unset or empty raises (fail closed: never serve unauthenticated by accident)."""
        env = self.entry.api_key_env
        if env is None:
            return None
        key = os.environ.get(env, "")
        if not key.strip():
            raise FleetConfigError(f"entry.api_key_env names {env}, but {env} is "
                                   f"{'empty' if env in os.environ else 'not set'}; expected the API key "
                                   f"in {env} (or remove api_key_env to serve without a key on loopback)")
        return key


def parse_fleet(text: str, source: str = "<fleet file>", base_dir: Path | None = None) -> FleetConfig:
    """Schema and self-consistency only (no filesystem or cluster)."""
    cfg = parse_yaml_model(text, FleetConfig, source, FleetConfigError,
                           top_level="a mapping with a `models` list", limit=3)
    cfg.base_dir = base_dir or Path(".").resolve()
    _check_consistency(cfg, source)
    return cfg


def _check_consistency(cfg: FleetConfig, source: str) -> None:
    for i, m in enumerate(cfg.models):
        problem = vllm_owned_problem(m)
        if problem:
            raise FleetConfigError(f"{source}: models.{i}.{problem}")
    names = [m.name for m in cfg.models]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise FleetConfigError(f"{source}: models: served name {dup[0]!r} appears twice; names must be unique")
    lo, hi = cfg.port_range
    ports = {"entry.port": cfg.entry.port}
    if cfg.exporter is not None:
        ports["exporter.port"] = cfg.exporter.port
    if len(set(ports.values())) != len(ports):
        raise FleetConfigError(f"{source}: entry.port and exporter.port are both {cfg.entry.port}; "
                               "expected two different ports")
    for field, port in ports.items():
        if lo <= port <= hi:
            raise FleetConfigError(f"{source}: {field} {port} lies in replica_ports {cfg.replica_ports}; "
                                   "expected a port outside the replicas' range")
    if sum(m.replicas for m in cfg.models) > hi - lo + 1:
        raise FleetConfigError(f"{source}: replica_ports {cfg.replica_ports} has {hi - lo + 1} ports "
                               f"for {sum(m.replicas for m in cfg.models)} replicas")
    if not cfg.entry.loopback and cfg.entry.api_key_env is None and not cfg.entry.allow_unauthenticated:
        raise FleetConfigError(f"{source}: entry.host {cfg.entry.host} serves beyond loopback without "
                               "api_key_env; expected api_key_env (recommended) or "
                               "entry.allow_unauthenticated: true")
    hosts = [h.name for h in cfg.hosts]
    if len(set(hosts)) != len(hosts):
        raise FleetConfigError(f"{source}: hosts: a host name appears twice")
    # identical servers have identical PCI addresses: a card is (host, address)
    if cfg.replica_bind == "127.0.0.1" and len(cfg.hosts) > 1:
        raise FleetConfigError(f"{source}: replica_bind 127.0.0.1 with {len(cfg.hosts)} hosts: the "
                               "controller could reach only its own host's replicas; expected "
                               "replica_bind: node-ip")
    host_names = set(hosts)
    for entry in cfg.placement.avoid_cards:
        host, sep, _ = entry.rpartition("/")
        if sep and cfg.hosts and host not in host_names:
            raise FleetConfigError(f"{source}: placement.avoid_cards: {entry!r} names host {host!r}, "
                                   f"which hosts does not list; expected one of {', '.join(hosts)}")
    if cfg.platform == "cpu":
        for h in cfg.hosts:
            for c in h.cards:
                if c.cpu_bind is None:
                    raise FleetConfigError(f"{source}: hosts.{h.name}: card {c.bdf} has no cpu_bind; "
                                           "platform cpu needs the cores that stand for each card")
    for m in cfg.models:
        if cfg.platform == "cpu" and m.tp != 1:
            raise FleetConfigError(f"{source}: models.{m.name}.tp {m.tp}: platform cpu serves TP 1 only")
        for key in m.env:
            if not key.replace("_", "").isalnum():
                raise FleetConfigError(f"{source}: models.{m.name}.env: {key!r} is not a variable name")


def planned_pool(model: ModelSpec, cfg: FleetConfig,
                 shape: capacity.HybridModelShape | None = None) -> capacity.CapacityPlan:
    """Both page modes' pools for a model's replicas, as its engines are launched."""
    if shape is None:
        shape = capacity.HybridModelShape.from_path(model.resolved_path(cfg.base_dir))
    return capacity.plan(shape, tp=model.tp, num_spec=model.num_spec,
                         kv_bytes_per_rank=model.kv_cache_memory_bytes,
                         max_model_len=model.max_model_len, platform=cfg.platform,
                         state_dtype=model.state_dtype, running=0,
                         prefix_caching=model.prefix_caching,  # as engine_argv runs it
                         vllm=cfg.vllm)


def max_num_seqs(model: ModelSpec, plan: capacity.CapacityPlan | None, mode: str) -> int | None:
    """A replica's `--max-num-seqs` in page mode `mode`: the model's count, or with "planner"
    the whole requests of max_model_len its pool holds (`plan`: `planned_pool`); None leaves
    vLLM's default. Where the plugin keeps stock pages for these GDN heads, a one-page replica
    runs the stock pool, and is admitted by it."""
    if model.max_num_seqs != "planner":
        return model.max_num_seqs
    if plan is None:
        raise ValueError("max_num_seqs planner: no capacity plan given (planned_pool)")
    pool = plan.onepage if mode == "onepage" and not plan.onepage_unservable else plan.stock
    if pool.whole_requests < 1:
        raise ValueError(f"max_num_seqs planner: the {mode} pool of {model.kv_cache_memory_bytes} "
                         f"B per rank holds no whole request of {model.max_model_len} tokens "
                         f"({pool.num_blocks} blocks, {pool.blocks_per_request} per request); "
                         "expected more kv_cache_memory_bytes or a shorter max_model_len")
    return pool.whole_requests


def replica_max_num_seqs(model: ModelSpec, cfg: FleetConfig, mode: str) -> int | None:
    """`max_num_seqs` for a replica of `model` in `mode`, planning the pool only for "planner"."""
    plan = planned_pool(model, cfg) if model.max_num_seqs == "planner" else None
    return max_num_seqs(model, plan, mode)


def check_model_paths(cfg: FleetConfig, source: str = "<fleet file>") -> None:
    """Every model path is a directory with a config.json the capacity module can read."""

    for m in cfg.models:
        path = m.resolved_path(cfg.base_dir)
        if not (path / "config.json").is_file():
            raise FleetConfigError(f"{source}: models.{m.name}.path {str(path)!r}: no config.json there; "
                                   "expected a local model directory present on every host "
                                   "(the tiny test model: r9k model make-tiny PATH)")
        try:
            plan = planned_pool(m, cfg, capacity.HybridModelShape.from_path(path))
        except capacity.CapacityInputError as exc:
            raise FleetConfigError(f"{source}: models.{m.name}: {exc}") from None
        for mode in m.page_modes:
            try:
                max_num_seqs(m, plan, mode)
            except ValueError as exc:
                raise FleetConfigError(f"{source}: models.{m.name}.{exc}") from None


def load_fleet(path: str | os.PathLike) -> FleetConfig:
    path = Path(path)
    try:
        text = decode_config_text(read_config_bytes(path), path)
    except FileNotFoundError:
        raise FleetConfigError(f"{path}: fleet file not found (expected YAML, see src/r9k/deploy/README.md)") from None
    except IsADirectoryError:
        raise FleetConfigError(f"{path}: is a directory; expected a fleet file (YAML)") from None
    except OSError as exc:
        raise FleetConfigError(f"{path}: cannot read the fleet file: {exc.strerror}") from None
    except ValueError as exc:
        raise FleetConfigError(str(exc)) from None
    cfg = parse_fleet(text, str(path), base_dir=path.resolve().parent)
    check_model_paths(cfg, str(path))
    return cfg


@functools.lru_cache(maxsize=1)
def _vllm_parser():
    """vLLM's api_server parser, built as its main() builds it."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog="vllm api_server"))


def _vllm_parse(args: list[str]):
    """The namespace vLLM's parser makes of ``args``; ValueError with its message if it refuses
    them (it would exit the replica at start)."""
    parser = _vllm_parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(args)
    except SystemExit:
        lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
        raise ValueError(lines[-1] if lines else "refused by vLLM's parser") from None
    except Exception as exc:  # noqa: BLE001 - its type checks raise what they like (JSON, asserts)
        raise ValueError(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None


def vllm_owned_problem(model: "ModelSpec") -> str | None:
    """Why ``model.extra_args``, read by vLLM's own parser, would change a setting the fleet owns
    (or cannot be read by it at all), or None. Fails closed: without vLLM, extra_args cannot be
    proven harmless."""
    extra = split_args(model.extra_args)
    if not extra:
        return None
    for word in extra:
        flag = flag_name(word)
        if flag.startswith("--") and len(flag) >= 6 and "--config".startswith(flag):
            # vLLM reads a YAML file of flags from it: its content on each replica's host
            # cannot be proven from here
            return (f"extra_args: {word} names a vLLM config file, which cannot be checked from "
                    "here (each host reads its own copy); put its flags in extra_args")
    try:
        parser = _vllm_parser()
    except Exception as exc:  # noqa: BLE001 - any import failure means: cannot check
        return (f"extra_args cannot be checked without vLLM's parser ({type(exc).__name__}: {exc}); "
                "expected vLLM installed where the fleet file is checked")
    # Two fleet command lines with different values for every flag the fleet sets: extra_args
    # that leave both unchanged cannot change the real one (`--port 8000`, vLLM's default,
    # would still win over the fleet's port as the last flag given).
    bases = [["--model", f"/r9k-{v}", "--host", f"r9k-{v}.invalid", "--port", str(n),
              "--served-model-name", f"r9k-{v}", "--tensor-parallel-size", str(n + 2),
              "--max-model-len", str(1000 + n), "--kv-cache-memory-bytes", str(1000 + n),
              "--api-key", f"r9k-{v}", "--max-num-seqs", str(1000 + n),
              "--mamba-ssm-cache-dtype", dtype]
             for v, n, dtype in (("a", 1, "float32"), ("b", 2, "bfloat16"))]
    try:
        pairs = [(_vllm_parse(base), _vllm_parse(base + extra)) for base in bases]
    except ValueError as exc:
        return f"extra_args {extra}: vLLM's parser refuses them: {exc}"
    owned = dict(_OWNED_DESTS)
    if model.max_num_seqs is not None:
        owned["max_num_seqs"] = "max_num_seqs"
    if model.state_dtype is not None:
        owned["mamba_ssm_cache_dtype"] = "state_dtype"
    for dest, field in owned.items():
        if any(getattr(before, dest, None) != getattr(after, dest, None) for before, after in pairs):
            words = [w for w in extra if w.startswith("-") and any(
                o.startswith(flag_name(w)) for o in parser._option_string_actions  # noqa: SLF001
                if parser._option_string_actions[o].dest == dest)]  # noqa: SLF001
            return (f"extra_args: {' '.join(words) or extra} set vLLM's {dest} (vLLM reads unique "
                    f"prefixes and underscores as the full flag), which the fleet sets from "
                    f"{field}; remove it from extra_args (keep one: the field)")
    return None


def flag_name(arg: str) -> str:
    """A command-line word's flag as vLLM's parser reads it: before any "=", and a long
    option's underscores as dashes (`--max_num_seqs=8` is `--max-num-seqs`)."""
    flag = arg.split("=", 1)[0]
    return "--" + flag[2:].replace("_", "-") if flag.startswith("--") else flag


def split_args(args: list[str]) -> list[str]:
    """extra_args entries may be whole strings like "--max-num-seqs 8"."""
    out: list[str] = []
    for a in args:
        out.extend(shlex.split(a) if " " in a and not a.startswith("{") else [a])
    return out

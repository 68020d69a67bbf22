"""Broker configuration: one YAML file, overridable by environment variables.

Keys follow the EMQX durable-storage settings (`durable_storage.messages.*`,
`durable_sessions.*`). Every key has a default, so an empty file (or no file) is a
valid configuration. Values from YAML and from the environment go through the same
pydantic models, so `"10ms"` in a file and `STRATAMQ__..._FLUSH_INTERVAL=10ms` mean
the same thing and fail the same way.

Every problem is raised as one `ConfigError` that lists all bad keys by their full
dotted path, one per line: an operator fixing a config should see everything at once.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails

from .ds.layouts import wildcard_optimized
from .ds.options import MAX_MQTT_PAYLOAD
from .errors import ConfigError, InvalidTopicFilterError
from .topic import validate_filter
from .yamlfile import load_yaml_file

ENV_PREFIX = "STRATAMQ__"
ENV_SEPARATOR = "__"


# --- value parsers ------------------------------------------------------------------

_DURATION_UNITS: dict[str, float] = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
# A plain number, or one or more number+unit parts ("100ms", "5s", "1h30m").
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?|\.\d+)\s*(ms|s|m|h|d)")
_DURATION_FULL = re.compile(r"(?:(?:\d+(?:\.\d+)?|\.\d+)\s*(?:ms|s|m|h|d)\s*)+")
_PLAIN_NUMBER = re.compile(r"\d+(?:\.\d+)?|\.\d+")

# Units are case-insensitive. KB/MB/GB are binary (1024-based), as in EMQX, so
# "16MB" and "16MiB" are the same size and nobody has to remember the difference.
_BYTE_UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "k": 1024, "kb": 1024, "kib": 1024,
    "m": 1024**2, "mb": 1024**2, "mib": 1024**2,
    "g": 1024**3, "gb": 1024**3, "gib": 1024**3,
}
_BYTE_SIZE = re.compile(r"(\d+)\s*([a-z]*)")


def parse_duration(text: str | float) -> float:
    """Parse `100ms`, `5s`, `10m`, `2h`, `1d` (or combinations like `1h30m`) or a plain
    number of seconds; return seconds as a float. Raises ValueError on anything else."""
    # bool is an int subclass: `flush_interval: true` is a mistake, not one second.
    if isinstance(text, bool):
        raise ValueError(f"invalid duration {text!r}: expected e.g. 100ms, 5s, 10m, 2h, 1d")
    if isinstance(text, int | float):
        seconds = float(text)
    elif isinstance(text, str):
        stripped = text.strip()
        if _PLAIN_NUMBER.fullmatch(stripped):
            seconds = float(stripped)
        elif _DURATION_FULL.fullmatch(stripped):
            seconds = sum(float(number) * _DURATION_UNITS[unit]
                          for number, unit in _DURATION_PART.findall(stripped))
        else:
            raise ValueError(
                f"invalid duration {text!r}: expected a number of seconds or a number with "
                f"a unit ms, s, m, h or d (e.g. 100ms, 5s, 10m, 2h, 1d)")
    else:
        raise ValueError(f"invalid duration {text!r}: expected a string or a number")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"invalid duration {text!r}: must be a finite, non-negative time")
    return seconds


def parse_byte_size(text: str | int) -> int:
    """Parse a byte count: an int, or a string like `512`, `512KiB`, `16MB`, `1G`
    (units are 1024-based and case-insensitive). Raises ValueError on anything else."""
    if isinstance(text, bool):
        raise ValueError(f"invalid byte size {text!r}: expected e.g. 1024, 512KiB, 16MB")
    if isinstance(text, int):
        size = text
    elif isinstance(text, str):
        match = _BYTE_SIZE.fullmatch(text.strip().lower())
        if match is None or match.group(2) not in _BYTE_UNITS:
            raise ValueError(
                f"invalid byte size {text!r}: expected a whole number of bytes, optionally "
                f"with a unit B, KB/KiB, MB/MiB or GB/GiB (e.g. 512KiB, 16MB)")
        size = int(match.group(1)) * _BYTE_UNITS[match.group(2)]
    else:
        raise ValueError(f"invalid byte size {text!r}: expected a string or an integer")
    if size < 0:
        raise ValueError(f"invalid byte size {text!r}: must not be negative")
    return size


def _reject_bool(value: Any) -> Any:
    # pydantic's lax mode turns `true` into 1; in a config that is always a typo.
    if isinstance(value, bool):
        raise ValueError(f"expected an integer, got a boolean ({value!r})")
    return value


def _parse_int_list(value: Any) -> Any:
    # Environment variables are strings: accept "[100,10]" and "100,10".
    if isinstance(value, str):
        inner = value.strip()
        if inner.startswith("[") and inner.endswith("]"):
            inner = inner[1:-1]
        return [item.strip() for item in inner.split(",")] if inner.strip() else []
    return value


PositiveInt = Annotated[int, BeforeValidator(_reject_bool), Field(ge=1)]
# Seconds as a float; every duration in this config must be > 0 (a zero interval
# would be a busy loop, a zero retention would drop every message).
Duration = Annotated[float, BeforeValidator(parse_duration), Field(gt=0)]
ByteSize = Annotated[int, BeforeValidator(parse_byte_size), Field(ge=1)]
# The durations where 0 means something: "do not wait".
Linger = Annotated[float, BeforeValidator(parse_duration), Field(ge=0)]


# --- models ---------------------------------------------------------------------------

class _Section(BaseModel):
    """Base of every config section: immutable, and unknown keys are errors."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _empty_section_means_defaults(cls, data: Any) -> Any:
        # `durable_sessions:` with all its children commented out parses as None in
        # YAML; the user meant "defaults", not "a section that is not a mapping".
        return {} if data is None else data


class WriteBufferConfig(_Section):
    """Per-shard buffer in front of the storage: flushed at whichever limit hits first."""

    max_items: PositiveInt = Field(
        default=1000, description="Flush a shard's buffer once it holds this many messages.")
    # 0 (the default): messages that arrive while the shard writes share the next
    # write (group commit), so batches still grow under load.
    flush_interval: Linger = Field(default=0.0, description=(
        "Longest a message waits for more to share its write, e.g. 0ms, 5ms; 0ms: flush "
        "as soon as the shard is not writing."))
    max_bytes: ByteSize = Field(default=parse_byte_size("16MiB"), description=(
        "Flush a shard's buffer once its payloads reach this size; also the most a shard "
        "queues before publishers wait."))


def _no_problem(problem: Callable[[int], str | None]) -> Callable[[int], int]:
    """A validator from a function that describes what is wrong with a value."""
    def check(value: int) -> int:
        found = problem(value)
        if found is not None:
            raise ValueError(found)
        return value
    return check


# The sizes of the `wildcard_optimized` key (ignored by `wildcard_optimized_v2`), each
# checked by the layout's own function.
_TopicIndexBytes = Annotated[int, BeforeValidator(_reject_bool), AfterValidator(
    _no_problem(wildcard_optimized.topic_index_bytes_problem))]
_BitsPerTopicLevel = Annotated[int, BeforeValidator(_reject_bool), AfterValidator(
    _no_problem(wildcard_optimized.bits_per_topic_level_problem))]
_EpochBits = Annotated[int, BeforeValidator(_reject_bool), AfterValidator(
    _no_problem(wildcard_optimized.epoch_bits_problem))]


def _key_size(default: int, maximum: int, description: str) -> Any:
    """The Field of a size of the `wildcard_optimized` key: its range, which the
    layout's function checks, is stated for a schema (the CRD's, operator/crd_schema.py)."""
    return Field(default=default, description=description,
                 json_schema_extra={"minimum": 1, "maximum": maximum})


class LayoutConfig(_Section):
    """Storage layout of new generations (old generations keep the layout they have)."""

    type: Literal["wildcard_optimized_v2", "wildcard_optimized"] = Field(
        default="wildcard_optimized_v2", description=(
            "Layout of new generations; a change takes effect at the next generation, old "
            "generations keep theirs."))
    # Learned topic structure: distinct values at one trie node before the level becomes
    # a `+` wildcard. A tuple, so a frozen config really cannot change.
    wildcard_thresholds: Annotated[
        tuple[PositiveInt, ...], BeforeValidator(_parse_int_list), Field(min_length=1)
    ] = Field(default=(100, 10), description=(
        "Distinct values at a topic level before it becomes `+`; the root first, the last "
        "entry for every deeper level."))
    topic_index_bytes: _TopicIndexBytes = _key_size(
        wildcard_optimized.DEFAULT_TOPIC_INDEX_BYTES, wildcard_optimized.MAX_TOPIC_INDEX_BYTES,
        "wildcard_optimized only. Bytes of the 8-byte stream index at the start of each key; "
        "fewer make shorter keys that streams may share (checked on read, counted as hash "
        "collisions).")
    bits_per_topic_level: _BitsPerTopicLevel = _key_size(
        wildcard_optimized.DEFAULT_BITS_PER_TOPIC_LEVEL,
        wildcard_optimized.MAX_BITS_PER_TOPIC_LEVEL,
        "wildcard_optimized only. Bits of each varying level's 64-bit hash in the key; fewer "
        "make shorter keys and more collisions (checked on read).")
    epoch_bits: _EpochBits = _key_size(wildcard_optimized.DEFAULT_EPOCH_BITS,
                                       wildcard_optimized.MAX_EPOCH_BITS, (
        "wildcard_optimized only. Bits of the time within an epoch; an epoch is 2^epochBits "
        "microseconds (20 is ~1.05 s), the most wildcard readers lag the writers."))

    def layout_options(self) -> dict[str, int]:
        """The options a new generation of `type` records."""
        if self.type != wildcard_optimized.NAME:
            return {}
        return {"topic_index_bytes": self.topic_index_bytes,
                "bits_per_topic_level": self.bits_per_topic_level,
                "epoch_bits": self.epoch_bits}


class MessagesDbConfig(_Section):
    """The `messages` database: MQTT messages, sharded by the publisher's client id."""

    data_dir: Annotated[str, Field(min_length=1)] = "data"
    n_shards: PositiveInt = Field(default=16, description=(
        "Hash partitions of the messages database (n_shards); fixed when the storage is "
        "created."))
    sync_writes: bool = Field(default=False, description=(
        "true: fsync every written batch (power-loss safe); false: the write-ahead log only "
        "(process-crash safe)."))
    local_write_buffer: WriteBufferConfig = Field(
        default_factory=WriteBufferConfig, description=(
            "Per-shard buffer in front of the storage (local_write_buffer), flushed at "
            "whichever limit comes first."))
    layout: LayoutConfig = Field(default_factory=LayoutConfig, description=(
        "Storage layout of new generations; old generations keep theirs."))
    # The largest payload MQTT can carry: Remaining Length tops out at 268,435,455.
    max_payload_bytes: Annotated[ByteSize, Field(le=MAX_MQTT_PAYLOAD)] = Field(
        default=MAX_MQTT_PAYLOAD, description=(
            "Largest accepted PUBLISH payload in bytes; 268435455 is the MQTT maximum."))
    # In bytes, not topics: topic names can be 64 KB each.
    topic_cache_bytes: ByteSize = Field(default=parse_byte_size("64MiB"), description=(
        "Memory the write path's topic caches may hold, over all shards."))
    # The learned topic structure of a generation: levels learned at most (65535 is
    # the most a topic can have), and its estimated memory over all shards (each
    # shard its share). What goes past them is folded, not learned (`lts.TrieBounds`).
    learned_topic_max_levels: Annotated[int, Field(ge=1, le=65535)] = Field(
        default=32, description=(
            "Topic levels the learned topic structure learns at most; the rest of a deeper "
            "topic is folded into one varying level."))
    learned_topic_bytes: ByteSize = Field(default=parse_byte_size("128MiB"), description=(
        "Estimated memory of one generation's learned topic structures, over all shards; "
        "past it, new topics are folded into the deepest state learned."))
    # A shorter one also lets a test roll generations over without shortening retention.
    generation_period: Duration | None = Field(default=None, description=(
        "How long a generation takes new messages before the next one starts; unset, "
        "durableSessions.messageRetentionPeriod. Shorter lets retention and the Spark GC "
        "work in finer steps; a message then lives between the retention and the "
        "retention plus this."))


class DurableStorageConfig(_Section):
    messages: MessagesDbConfig = Field(default_factory=MessagesDbConfig)


class DurableSessionsConfig(_Section):
    enable: bool = Field(default=True, description=(
        "Keep sessions with clean start false / session expiry > 0 in the durable storage."))
    batch_size: PositiveInt = Field(default=100, description=(
        "Most messages a session reads from one stream in one go."))
    idle_poll_interval: Duration = Field(default=parse_duration("10s"), description=(
        "Longest a session reading from storage waits before reading again, should a "
        "wake-up be missed; a session caught up, on the live feed, does not poll."))
    renew_streams_interval: Duration = Field(default=parse_duration("1s"), description=(
        "How often sessions look for new streams matching their subscriptions."))
    session_gc_interval: Duration = Field(default=parse_duration("10m"), description=(
        "How often expired sessions are looked for and deleted."))
    message_retention_period: Duration = Field(default=parse_duration("1d"), description=(
        "How long messages are kept (retention); a message lives between 1x and 2x this "
        "period."))
    # In a cluster: the site reports it to the controller; shorter costs more messages.
    heartbeat_interval: Duration = Field(default=parse_duration("1s"), description=(
        "How often an idle shard leader heartbeats its followers; the controller fails a "
        "shard over once its leader has heard from no majority of its replicas for three "
        "of these (or three of the controller's own probe intervals)."))
    # The Spark GC job applies them (`stratamq spark gc`); the site drops a generation
    # whole only once the longest retention has passed.
    retention_rules: dict[str, Duration] = Field(default_factory=dict, description=(
        "Per-topic retention, topic filter to duration (sensors/#: 7d); the most specific "
        "filter wins, other topics keep messageRetentionPeriod. Applied by the Spark GC "
        "job."))

    @field_validator("retention_rules")
    @classmethod
    def _rules_are_filters(cls, rules: dict[str, float]) -> dict[str, float]:
        for topic_filter in rules:
            try:
                validate_filter(topic_filter)
            except InvalidTopicFilterError as exc:
                raise ValueError(f"retention rule {topic_filter!r}: {exc.message}") from exc
        return rules


class AccessControlConfig(_Section):
    """Who may connect, and what they may publish and subscribe to (`broker/auth`).
    File paths are relative to the working directory, like `data_dir`."""

    # Clients without a user name may connect. Production should set false.
    allow_anonymous: bool = True
    # `username:hash` per line, written by `stratamq ctl passwd`; None: no user names
    # are checked (so `allow_anonymous` must be true).
    password_file: Annotated[str, Field(min_length=1)] | None = None
    # YAML list of topic rules, first match wins; None: no rules.
    acl_file: Annotated[str, Field(min_length=1)] | None = None
    # What happens when no ACL rule matches (or there is no ACL file).
    acl_no_match: Literal["allow", "deny"] = "allow"
    # Threads computing password hashes (0.1-0.3 s of CPU each at the default cost).
    hash_workers: PositiveInt = 2
    # Password checks admitted beyond those running; a CONNECT that finds no room is
    # refused at once with Server busy (3.1.1: Server unavailable) and retries.
    hash_queue: PositiveInt = 32
    # Password checks one source address may have admitted at once (the rest: Server
    # busy), so that one address cannot fill the queue; not 1 or 2, since many clients
    # may share one address (a NAT, a Service's source NAT).
    hash_per_source: PositiveInt = 4
    # After 10 failed logins from one source address, each further failure refuses its
    # password logins (0x9F Connection rate exceeded, no hash) for 1 s, 2 s, 4 s, ...
    # at most this long. 0: no back-off.
    failure_backoff_max: Linger = parse_duration("30s")

    @model_validator(mode="after")
    def _someone_can_connect(self) -> AccessControlConfig:
        if not self.allow_anonymous and self.password_file is None:
            raise ValueError("allow_anonymous is false but no password_file is set, so no "
                             "client could connect: set access_control.password_file")
        return self


class TcpListenerConfig(_Section):
    enable: bool = True
    bind: Annotated[str, Field(pattern=r"^.*:\d+$")] = "0.0.0.0:1883"


class WebSocketListenerConfig(_Section):
    enable: bool = True
    bind: Annotated[str, Field(pattern=r"^.*:\d+$")] = "0.0.0.0:8083"
    path: Annotated[str, Field(pattern=r"^/")] = "/mqtt"


class TlsListenerConfig(_Section):
    # Off until a certificate is configured.
    enable: bool = False
    bind: Annotated[str, Field(pattern=r"^.*:\d+$")] = "0.0.0.0:8883"
    certfile: str | None = None
    keyfile: str | None = None
    cafile: str | None = None
    # Require and verify a client certificate (against cafile).
    verify_peer: bool = False

    @model_validator(mode="after")
    def _certificate_when_enabled(self) -> TlsListenerConfig:
        if self.enable and not (self.certfile and self.keyfile):
            raise ValueError("certfile and keyfile are required when enable is true")
        return self


class ListenersConfig(_Section):
    # Accept queue of every listening socket: connections the kernel has completed but
    # the broker has not accepted yet. A reconnect storm needs thousands; a full queue
    # drops handshakes (capped by the kernel's net.core.somaxconn).
    backlog: PositiveInt = 4096
    tcp: TcpListenerConfig = Field(default_factory=TcpListenerConfig)
    ws: WebSocketListenerConfig = Field(default_factory=WebSocketListenerConfig)
    tls: TlsListenerConfig = Field(default_factory=TlsListenerConfig)


class MqttConfig(_Section):
    """Protocol limits, each with a production default."""

    max_connections: PositiveInt = Field(default=100_000, description=(
        "Client connections a site accepts at once."))
    max_packet_size: Annotated[ByteSize, Field(le=268_435_460)] = Field(
        default=parse_byte_size("1MiB"), description=(
            "Largest MQTT packet accepted or sent, header included (at most 256MiB)."))
    max_topic_levels: PositiveInt = 128
    # SUBSCRIBE beyond it gets Quota exceeded.
    max_subscriptions: PositiveInt = Field(default=1000, description=(
        "Subscriptions one session may hold."))
    # Also capped by the client's Receive Maximum.
    max_inflight: Annotated[int, Field(ge=1, le=65535)] = Field(default=128, description=(
        "Outbound QoS 1/2 messages awaiting acknowledgement per client."))
    # When it is full, QoS 0 messages are dropped (counted); QoS 1/2 ones wait in
    # storage and are read from there once there is room again (transient and durable
    # sessions alike).
    max_queued_messages: PositiveInt = Field(default=1000, description=(
        "Messages queued per client beyond the in-flight window."))
    # MQTT 5 Receive Maximum.
    receive_maximum: Annotated[int, Field(ge=1, le=65535)] = Field(default=128, description=(
        "Inbound QoS 1/2 messages a client may leave unacknowledged."))
    topic_alias_maximum: Annotated[int, Field(ge=0, le=65535)] = 64
    connect_timeout: Duration = Field(default=parse_duration("10s"), description=(
        "Time from accept to a whole CONNECT, however its bytes trickle in."))
    # What a client sends before it has authenticated is buffered, so this is small; a
    # larger one (a will message of that size) is refused with Packet too large.
    max_connect_packet_size: ByteSize = Field(default=parse_byte_size("64KiB"), description=(
        "Largest CONNECT accepted (at most maxPacketSize); a larger one is refused as soon "
        "as its fixed header is in."))
    # Longer requests get this (Server Keep Alive).
    max_keepalive: Annotated[int, Field(ge=1, le=65535)] = Field(default=65535, description=(
        "Longest keepalive a client may ask for, in seconds."))


class AdminConfig(_Section):
    """The admin HTTP API. Without token or password, a token is generated on first
    start, stored in `data_dir/admin-token` and printed once."""

    enable: bool = True
    bind: Annotated[str, Field(pattern=r"^.*:\d+$")] = "0.0.0.0:18083"
    token: Annotated[str, Field(min_length=16)] | None = None
    username: Annotated[str, Field(min_length=1)] | None = None
    password: Annotated[str, Field(min_length=8)] | None = None
    # /metrics needs the credentials above too (Prometheus then sends the token as a
    # bearer token); false: open, like /healthz and /readyz, and cached (below).
    metrics_auth: bool = False
    # /metrics is rendered at most once per interval, shared by every scrape meanwhile.
    metrics_interval: Duration = parse_duration("1s")
    # Connections the admin port holds at once (apart from MQTT's); more answer 503.
    max_connections: PositiveInt = 256
    # A connection must send its request headers within this time of its accept (or of
    # its previous response), else it is closed; and a request body within body_timeout.
    header_timeout: Duration = parse_duration("10s")
    body_timeout: Duration = parse_duration("30s")
    # Folders (absolute) checkpoints may be made in besides <data_dir>/checkpoints,
    # e.g. a volume shared with the Spark jobs; anywhere else is refused (403).
    checkpoint_dirs: list[Annotated[str, Field(pattern=r"^/")]] = []


class ClusterConfig(_Section):
    """Replication across sites (docs/replication.md). Off: a single site with
    no shard log, exactly as before."""

    enable: bool = False
    # The peer port: log shipping between shard replicas, writes forwarded to leaders.
    peer_bind: Annotated[str, Field(pattern=r"^.*:\d+$")] = "0.0.0.0:18084"
    # host:port other sites reach the peer port at; empty: peer_bind, with 0.0.0.0
    # read as 127.0.0.1.
    advertise: Annotated[str, Field(pattern=r"^(.*:\d+)?$")] = ""
    # The client is not acknowledged and may resend.
    write_timeout: Duration = Field(default=parse_duration("5s"), description=(
        "A write not committed by a majority of its shard's replicas by then fails (the "
        "client is not acknowledged)."))
    # So that a briefly lagging follower catches up from the log rather than a
    # checkpoint; older entries are trimmed.
    log_retain_entries: PositiveInt = Field(default=10_000, description=(
        "Shard log entries kept beyond what every replica holds; a new replica of a longer "
        "log bootstraps from a checkpoint of its leader."))
    # So that a joining site does not take the whole network or disk.
    checkpoint_rate: ByteSize | None = Field(default=None, description=(
        "Bytes per second a site sends a checkpoint at to a replica that bootstraps from "
        "it, such as 50MiB; absent, as fast as it goes."))
    # At SIGTERM; the controller names the other leaders.
    handover_timeout: Linger = Field(default=parse_duration("10s"), description=(
        "At a graceful stop, how long a site that leads shards waits for other replicas to "
        "be named their leaders, serving meanwhile (then what it still leads fails over); "
        "0s: it does not wait. Keep it below the pods' termination grace period (60s)."))
    # The failure zone this site runs in (e.g. a Kubernetes node's
    # topology.kubernetes.io/zone), reported to the controller, which keeps a shard's
    # replicas in distinct zones as far as the zones allow; None: not known (the site
    # counts as a zone of its own). Under the operator, each site's zone is its node's.
    zone: Annotated[str, Field(min_length=1, max_length=63)] | None = None

    def advertised_peer(self) -> str:
        if self.advertise:
            return self.advertise
        host, _, port = self.peer_bind.rpartition(":")
        return f"{'127.0.0.1' if host in ('', '0.0.0.0') else host}:{port}"


class Config(_Section):
    """The whole broker configuration. New top-level sections go here."""

    durable_storage: DurableStorageConfig = Field(default_factory=DurableStorageConfig)
    durable_sessions: DurableSessionsConfig = Field(default_factory=DurableSessionsConfig)
    access_control: AccessControlConfig = Field(default_factory=AccessControlConfig)
    listeners: ListenersConfig = Field(default_factory=ListenersConfig)
    mqtt: MqttConfig = Field(default_factory=MqttConfig)
    admin: AdminConfig = Field(default_factory=AdminConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)


# --- loading --------------------------------------------------------------------------

def merge_config(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`base` with `extra` laid over it, section by section (a configuration file's
    dictionaries; neither is changed)."""
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_config(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_config(path: str | os.PathLike[str] | None = None,
                env: Mapping[str, str] | None = None) -> Config:
    """Read the YAML file at `path` (defaults only when None), apply `STRATAMQ__*`
    overrides from `env` (os.environ when None) and validate. Raises ConfigError."""
    source = "defaults" if path is None else os.fspath(path)
    data: dict[str, Any] = {} if path is None else _read_yaml(Path(path))
    errors: list[str] = []
    env_sources = _apply_env(data, os.environ if env is None else env, errors)
    if env_sources:
        source += " + environment"
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        errors.extend(_format_error(err, env_sources) for err in exc.errors())
    else:
        if not errors:
            return config
    raise ConfigError(f"invalid configuration ({source}):\n" + "\n".join(
        f"  {line}" for line in errors))


def _read_yaml(path: Path) -> dict[str, Any]:
    data = load_yaml_file(path, "config file")
    if data is None:  # empty file, or only comments
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: the top level must be a mapping of keys, got {type(data).__name__}")
    return data


def _section_type(model: type[BaseModel], name: str) -> type[BaseModel] | None:
    """The model class of field `name` when it is a nested section, else None."""
    annotation = model.model_fields[name].annotation
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def _apply_env(data: dict[str, Any], env: Mapping[str, str], errors: list[str]) -> dict[str, str]:
    """Merge `STRATAMQ__A__B=value` into `data["a"]["b"]`; return dotted key -> variable
    name for the overrides applied (so errors can say where a bad value came from)."""
    applied: dict[str, str] = {}
    # Sorted, so that which of two clashing variables gets reported is deterministic.
    for name in sorted(env):
        if not name.upper().startswith(ENV_PREFIX):
            continue
        parts = name[len(ENV_PREFIX):].lower().split(ENV_SEPARATOR)
        dotted = ".".join(parts)
        model: type[BaseModel] | None = Config
        for depth, part in enumerate(parts):
            if model is None or part not in model.model_fields:
                errors.append(f"{name}: unknown key {'.'.join(parts[:depth + 1])!r}"
                              f"{_suggestion(model, part)}")
                break
            model = _section_type(model, part)
        else:
            if model is not None:
                errors.append(f"{name}: {dotted!r} is a section, set one of its keys instead")
            elif dotted in applied:
                errors.append(f"{name}: {dotted!r} is already set by {applied[dotted]}")
            else:
                _set_path(data, parts, env[name])
                applied[dotted] = name
    return applied


def _set_path(data: dict[str, Any], parts: list[str], value: str) -> None:
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            # The YAML has a scalar where a section belongs; validation reports that.
            return
        node = child
    node[parts[-1]] = value


def _suggestion(model: type[BaseModel] | None, key: object) -> str:
    if model is None or not isinstance(key, str):
        return ""
    close = difflib.get_close_matches(key, list(model.model_fields), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _format_error(err: ErrorDetails, env_sources: Mapping[str, str]) -> str:
    """One pydantic error as `dotted.key: why (got value)`."""
    loc = err["loc"]
    dotted = ""
    for item in loc:
        dotted += f"[{item}]" if isinstance(item, int) else (f".{item}" if dotted else item)
    keys = [item for item in loc if isinstance(item, str)]

    if err["type"] == "extra_forbidden":
        # Find the section the unknown key sits in, to suggest the closest known key.
        model: type[BaseModel] | None = Config
        for part in keys[:-1]:
            model = _section_type(model, part) if model and part in model.model_fields else None
        return f"{dotted}: unknown key{_suggestion(model, loc[-1])}"

    if err["type"] == "value_error":
        why = str(err.get("ctx", {}).get("error"))  # our own message, not pydantic's prefix
    else:
        why = f"{err['msg']} (got {_short_repr(err['input'])})"
    joined = ".".join(keys)
    for key, variable in env_sources.items():
        if joined == key or joined.startswith(key + "."):
            why += f" [from environment variable {variable}]"
    return f"{dotted or '(top level)'}: {why}"


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."

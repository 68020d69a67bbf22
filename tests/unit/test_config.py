"""Tests for broker/config.py: defaults, YAML, durations and sizes, env overrides, errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from stratamq.broker.config import (
    AccessControlConfig,
    Config,
    DurableSessionsConfig,
    DurableStorageConfig,
    LayoutConfig,
    MessagesDbConfig,
    WriteBufferConfig,
    load_config,
    parse_byte_size,
    parse_duration,
)
from stratamq.broker.errors import ConfigError

DEFAULT_CONFIG_FILE = Path(__file__).resolve().parents[2] / "config" / "stratamq.yaml"

FULL_YAML = """\
durable_storage:
  messages:
    data_dir: /var/lib/stratamq
    n_shards: 8
    sync_writes: true
    local_write_buffer:
      max_items: 500
      flush_interval: 250ms
      max_bytes: 512KiB
    layout:
      type: wildcard_optimized
      wildcard_thresholds: [50, 20, 5]
    max_payload_bytes: 1MB
durable_sessions:
  enable: false
  batch_size: 10
  idle_poll_interval: 2s
  renew_streams_interval: 500ms
  session_gc_interval: 2h
  message_retention_period: 7d
  heartbeat_interval: 250ms
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "stratamq.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def config_error(path: Path | None = None, env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, env={} if env is None else env)
    return info.value.message


def test_defaults_without_a_file() -> None:
    config = load_config(env={})
    messages = config.durable_storage.messages
    assert messages.data_dir == "data"
    assert messages.n_shards == 16
    assert messages.sync_writes is False
    assert messages.local_write_buffer.max_items == 1000
    assert messages.local_write_buffer.flush_interval == 0.0
    assert messages.local_write_buffer.max_bytes == 16 * 1024 * 1024
    assert messages.layout.type == "wildcard_optimized_v2"
    assert messages.layout.wildcard_thresholds == (100, 10)
    assert messages.max_payload_bytes == 268_435_455
    sessions = config.durable_sessions
    assert sessions.enable is True
    assert sessions.batch_size == 100
    assert sessions.idle_poll_interval == 10.0
    assert sessions.renew_streams_interval == 1.0
    assert sessions.session_gc_interval == 600.0
    assert sessions.message_retention_period == 86400.0
    assert sessions.heartbeat_interval == 1.0
    assert config == Config()


def test_empty_file_and_empty_sections_are_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, ""), env={}) == Config()
    assert load_config(write(tmp_path, "# only a comment\n"), env={}) == Config()
    text = "durable_storage:\n  messages:\ndurable_sessions:\n  # enable: true\n"
    assert load_config(write(tmp_path, text), env={}) == Config()


def test_shipped_default_file_loads_to_defaults() -> None:
    assert load_config(DEFAULT_CONFIG_FILE, env={}) == Config()


def test_shipped_default_file_shows_every_key() -> None:
    def keys(model: type[BaseModel], prefix: str = "") -> set[str]:
        found: set[str] = set()
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                found |= keys(annotation, f"{prefix}{name}.")
            else:
                found.add(prefix + name)
        return found

    def yaml_keys(node: Any, prefix: str = "") -> set[str]:
        found: set[str] = set()
        for name, value in node.items():
            if isinstance(value, dict) and value:  # `{}`: a key whose value is a mapping
                found |= yaml_keys(value, f"{prefix}{name}.")
            else:
                found.add(prefix + name)
        return found

    shipped = yaml.safe_load(DEFAULT_CONFIG_FILE.read_text(encoding="utf-8"))
    assert yaml_keys(shipped) == keys(Config)


def test_full_yaml_round_trip(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, FULL_YAML), env={})
    expected = Config(
        durable_storage=DurableStorageConfig(messages=MessagesDbConfig(
            data_dir="/var/lib/stratamq",
            n_shards=8,
            sync_writes=True,
            local_write_buffer=WriteBufferConfig(
                max_items=500, flush_interval=0.25, max_bytes=512 * 1024),
            layout=LayoutConfig(type="wildcard_optimized", wildcard_thresholds=(50, 20, 5)),
            max_payload_bytes=1024 * 1024,
        )),
        durable_sessions=DurableSessionsConfig(
            enable=False,
            batch_size=10,
            idle_poll_interval=2.0,
            renew_streams_interval=0.5,
            session_gc_interval=7200.0,
            message_retention_period=7 * 86400.0,
            heartbeat_interval=0.25,
        ),
    )
    assert config == expected
    # Dumping the validated model and loading the dump gives the same config back.
    dumped = write(tmp_path, yaml.safe_dump(config.model_dump(mode="json")))
    assert load_config(dumped, env={}) == config


def test_config_is_frozen() -> None:
    config = load_config(env={})
    with pytest.raises(ValueError, match="frozen"):
        config.durable_sessions.batch_size = 5


@pytest.mark.parametrize(("text", "seconds"), [
    ("100ms", 0.1),
    ("5s", 5.0),
    ("10m", 600.0),
    ("2h", 7200.0),
    ("1d", 86400.0),
    ("1.5s", 1.5),
    (" 250 ms ", 0.25),
    ("1h30m", 5400.0),
    ("3", 3.0),
    ("0.5", 0.5),
    (3, 3.0),
    (0.25, 0.25),
])
def test_parse_duration(text: str | float, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["5 parsecs", "", "s", "-5s", "5x", "1e3", "10 m s"])
def test_parse_duration_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError, match="invalid duration"):
        parse_duration(text)


@pytest.mark.parametrize("value", [-1, -0.5, float("inf"), float("nan"), True])
def test_parse_duration_rejects_bad_numbers(value: float) -> None:
    with pytest.raises(ValueError, match="invalid duration"):
        parse_duration(value)


@pytest.mark.parametrize(("text", "size"), [
    (4096, 4096),
    ("4096", 4096),
    ("100B", 100),
    ("512KiB", 512 * 1024),
    ("512kb", 512 * 1024),
    ("2K", 2048),
    ("16MB", 16 * 1024**2),
    ("16 MiB", 16 * 1024**2),
    ("1GB", 1024**3),
    ("1gib", 1024**3),
])
def test_parse_byte_size(text: str | int, size: int) -> None:
    assert parse_byte_size(text) == size


@pytest.mark.parametrize("value", ["16 parsecs", "1.5MB", "-1", "", "MB", -1, True])
def test_parse_byte_size_rejects_garbage(value: str | int) -> None:
    with pytest.raises(ValueError, match="invalid byte size"):
        parse_byte_size(value)


@pytest.mark.parametrize("text", ["0", "0s", "-1s", "5 parsecs"])
def test_durations_must_be_positive_and_valid(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, f"durable_sessions:\n  idle_poll_interval: {text}\n")
    assert "durable_sessions.idle_poll_interval: " in config_error(path)


@pytest.mark.parametrize("text", ["0ms", "-1s", "often", "[1]"])
def test_heartbeat_interval_must_be_a_positive_duration(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, f"durable_sessions:\n  heartbeat_interval: {text}\n")
    assert "durable_sessions.heartbeat_interval: " in config_error(path)
    env = {"STRATAMQ__DURABLE_SESSIONS__HEARTBEAT_INTERVAL": "250ms"}
    assert load_config(env=env).durable_sessions.heartbeat_interval == 0.25


def test_env_overrides(tmp_path: Path) -> None:
    env = {
        "STRATAMQ__DURABLE_STORAGE__MESSAGES__N_SHARDS": "8",
        "STRATAMQ__DURABLE_STORAGE__MESSAGES__SYNC_WRITES": "true",
        "STRATAMQ__DURABLE_STORAGE__MESSAGES__LOCAL_WRITE_BUFFER__FLUSH_INTERVAL": "50ms",
        "STRATAMQ__DURABLE_STORAGE__MESSAGES__LOCAL_WRITE_BUFFER__MAX_BYTES": "1MB",
        "STRATAMQ__DURABLE_STORAGE__MESSAGES__LAYOUT__WILDCARD_THRESHOLDS": "[7, 3]",
        "STRATAMQ__DURABLE_SESSIONS__ENABLE": "false",
        # Not under the prefix (single underscore, other programs): ignored.
        "STRATAMQ_CONFIG": "whatever",
        "PATH": "/usr/bin",
    }
    # The environment wins over the file, and keys the env does not name keep the file's.
    config = load_config(write(tmp_path, FULL_YAML), env=env)
    messages = config.durable_storage.messages
    assert messages.n_shards == 8
    assert messages.sync_writes is True
    assert messages.local_write_buffer.flush_interval == pytest.approx(0.05)
    assert messages.local_write_buffer.max_bytes == 1024 * 1024
    assert messages.local_write_buffer.max_items == 500
    assert messages.layout.wildcard_thresholds == (7, 3)
    assert messages.data_dir == "/var/lib/stratamq"
    assert config.durable_sessions.enable is False


def test_env_overrides_without_a_file() -> None:
    env = {"STRATAMQ__DURABLE_SESSIONS__BATCH_SIZE": "7"}
    assert load_config(env=env).durable_sessions.batch_size == 7


def test_env_list_without_brackets() -> None:
    env = {"STRATAMQ__DURABLE_STORAGE__MESSAGES__LAYOUT__WILDCARD_THRESHOLDS": "100,10,2"}
    assert load_config(env=env).durable_storage.messages.layout.wildcard_thresholds == (
        100, 10, 2)


def test_env_names_are_case_insensitive() -> None:
    env = {"stratamq__Durable_Storage__messages__N_SHARDS": "4"}
    assert load_config(env=env).durable_storage.messages.n_shards == 4


def test_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRATAMQ__DURABLE_SESSIONS__BATCH_SIZE", "42")
    assert load_config().durable_sessions.batch_size == 42


def test_unknown_yaml_key(tmp_path: Path) -> None:
    path = write(tmp_path, "durable_storage:\n  messages:\n    n_shard: 4\nlistener: {}\n")
    message = config_error(path)
    assert "durable_storage.messages.n_shard: unknown key (did you mean 'n_shards'?)" in message
    assert "listener: unknown key" in message


def test_unknown_env_key() -> None:
    message = config_error(env={"STRATAMQ__DURABLE_STORAGE__MESSAGES__N_SHARD": "4"})
    assert "STRATAMQ__DURABLE_STORAGE__MESSAGES__N_SHARD" in message
    assert "durable_storage.messages.n_shard" in message
    assert "did you mean 'n_shards'?" in message


def test_env_key_below_a_value_or_naming_a_section() -> None:
    message = config_error(env={
        "STRATAMQ__DURABLE_SESSIONS__ENABLE__X": "1",
        "STRATAMQ__DURABLE_STORAGE": "1",
    })
    assert "STRATAMQ__DURABLE_SESSIONS__ENABLE__X: unknown key 'durable_sessions.enable.x'" in (
        message)
    assert "STRATAMQ__DURABLE_STORAGE: 'durable_storage' is a section" in message


def test_bad_yaml_value_names_the_dotted_key(tmp_path: Path) -> None:
    path = write(tmp_path, "durable_storage:\n  messages:\n    n_shards: 0\n")
    assert ("durable_storage.messages.n_shards: Input should be greater than or equal to 1 "
            "(got 0)") in config_error(path)


def test_bad_env_value_names_the_dotted_key() -> None:
    variable = "STRATAMQ__DURABLE_STORAGE__MESSAGES__LOCAL_WRITE_BUFFER__FLUSH_INTERVAL"
    message = config_error(env={variable: "5 parsecs"})
    assert "durable_storage.messages.local_write_buffer.flush_interval: invalid duration" in (
        message)
    assert f"[from environment variable {variable}]" in message


def test_all_errors_are_reported_one_per_line(tmp_path: Path) -> None:
    path = write(tmp_path, (
        "durable_storage:\n"
        "  messages:\n"
        "    n_shards: 0\n"
        "    sync_writes: maybe\n"
        "    max_payload_bytes: 268435456\n"
        "    layout:\n"
        "      type: btree\n"
        "      wildcard_thresholds: []\n"
        "durable_sessions:\n"
        "  batch_size: ten\n"
    ))
    lines = config_error(path).splitlines()
    assert lines[0] == f"invalid configuration ({path}):"
    problems = [line.strip().split(":")[0] for line in lines[1:]]
    assert problems == [
        "durable_storage.messages.n_shards",
        "durable_storage.messages.sync_writes",
        "durable_storage.messages.layout.type",
        "durable_storage.messages.layout.wildcard_thresholds",
        "durable_storage.messages.max_payload_bytes",
        "durable_sessions.batch_size",
    ]


def test_list_item_errors_name_the_index(tmp_path: Path) -> None:
    path = write(tmp_path, (
        "durable_storage:\n  messages:\n    layout:\n      wildcard_thresholds: [10, 0]\n"))
    assert "durable_storage.messages.layout.wildcard_thresholds[1]: " in config_error(path)


def test_section_that_is_not_a_mapping(tmp_path: Path) -> None:
    assert "durable_storage: " in config_error(write(tmp_path, "durable_storage: 5\n"))


def test_yaml_syntax_error(tmp_path: Path) -> None:
    path = write(tmp_path, "durable_storage:\n  messages: [\n")
    message = config_error(path)
    assert message.startswith(f"{path}: invalid YAML")


def test_yaml_duplicate_key(tmp_path: Path) -> None:
    path = write(tmp_path, "durable_sessions:\n  batch_size: 1\n  batch_size: 2\n")
    message = config_error(path)
    assert message.startswith(f"{path}: invalid YAML: duplicate key 'batch_size'")


def test_yaml_top_level_not_a_mapping(tmp_path: Path) -> None:
    assert "top level must be a mapping" in config_error(write(tmp_path, "- 1\n- 2\n"))


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    assert config_error(path) == f"{path}: config file not found"


def test_access_control_section(tmp_path: Path) -> None:
    defaults = load_config(env={}).access_control
    assert defaults == AccessControlConfig(
        allow_anonymous=True, password_file=None, acl_file=None, acl_no_match="allow")
    path = write(tmp_path, (
        "access_control:\n"
        "  allow_anonymous: false\n"
        "  password_file: /etc/stratamq/passwd\n"
        "  acl_file: /etc/stratamq/acl.yaml\n"
        "  acl_no_match: deny\n"))
    assert load_config(path, env={}).access_control == AccessControlConfig(
        allow_anonymous=False, password_file="/etc/stratamq/passwd",
        acl_file="/etc/stratamq/acl.yaml", acl_no_match="deny")
    env = {"STRATAMQ__ACCESS_CONTROL__ACL_NO_MATCH": "allow",
           "STRATAMQ__ACCESS_CONTROL__PASSWORD_FILE": "other"}
    overridden = load_config(path, env=env).access_control
    assert (overridden.acl_no_match, overridden.password_file) == ("allow", "other")


def test_access_control_errors(tmp_path: Path) -> None:
    path = write(tmp_path, (
        "access_control:\n  acl_no_match: maybe\n  password_file: ''\n  acl_files: x\n"))
    message = config_error(path)
    assert "access_control.acl_no_match: Input should be 'allow' or 'deny'" in message
    assert "access_control.password_file: String should have at least 1 character" in message
    assert "access_control.acl_files: unknown key (did you mean 'acl_file'?)" in message
    # Refusing anonymous clients without a password file would refuse everyone.
    message = config_error(env={"STRATAMQ__ACCESS_CONTROL__ALLOW_ANONYMOUS": "false"})
    assert "access_control: allow_anonymous is false but no password_file is set" in message


def test_the_kept_log_tail_is_a_positive_count(tmp_path: Path) -> None:
    assert load_config(env={}).cluster.log_retain_entries == 10_000
    path = write(tmp_path, "cluster:\n  log_retain_entries: 500\n")
    assert load_config(path, env={}).cluster.log_retain_entries == 500
    message = config_error(write(tmp_path, "cluster:\n  log_retain_entries: 0\n"))
    assert "cluster.log_retain_entries" in message and "greater than or equal to 1" in message


def test_the_checkpoint_rate_is_a_byte_size_or_unlimited(tmp_path: Path) -> None:
    assert load_config(env={}).cluster.checkpoint_rate is None
    path = write(tmp_path, "cluster:\n  checkpoint_rate: 50MiB\n")
    assert load_config(path, env={}).cluster.checkpoint_rate == 50 * 1024 * 1024
    message = config_error(write(tmp_path, "cluster:\n  checkpoint_rate: fast\n"))
    assert "cluster.checkpoint_rate" in message and "invalid byte size 'fast'" in message


def test_the_zone_is_a_name_or_unknown(tmp_path: Path) -> None:
    assert load_config(env={}).cluster.zone is None
    path = write(tmp_path, "cluster:\n  zone: eu-west-1a\n")
    assert load_config(path, env={}).cluster.zone == "eu-west-1a"
    assert load_config(env={"STRATAMQ__CLUSTER__ZONE": "b"}).cluster.zone == "b"
    message = config_error(write(tmp_path, "cluster:\n  zone: ''\n"))
    assert "cluster.zone" in message

"""Tests for broker/auth/__init__.py: AccessControl built from config and real files."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TypedDict

import pytest

from stratamq.broker.auth import (
    BAD_USER_NAME_OR_PASSWORD,
    NOT_AUTHORIZED,
    SUCCESS,
    AccessControl,
    load_password_file,
    set_password,
)
from stratamq.broker.config import AccessControlConfig, load_config
from stratamq.broker.errors import ConfigError


class Cost(TypedDict):
    iterations: int
    rounds: int


FAST: Cost = {"iterations": 1000, "rounds": 4}


@pytest.fixture
def password_file(tmp_path: Path) -> Path:
    path = tmp_path / "passwd"
    set_password(path, "alice", "alice-pw", **FAST)
    set_password(path, "bob", "bob-pw", "bcrypt", **FAST)
    return path


def access(tmp_path: Path, yaml_section: str) -> AccessControl:
    config_file = tmp_path / "stratamq.yaml"
    config_file.write_text("access_control:\n" + yaml_section, encoding="utf-8")
    return AccessControl.from_config(load_config(config_file, env={}).access_control)


def test_defaults_allow_everyone() -> None:
    control = AccessControl.from_config(AccessControlConfig())
    assert control.authenticate("c", None, None) == SUCCESS
    assert control.authenticate("c", "anyone", b"anything") == SUCCESS  # unchecked claim
    assert control.authorize_publish("c", None, "a/b")
    assert control.authorize_subscribe("c", None, "#")


def test_no_client_publishes_to_sys_whatever_the_acl_says(tmp_path: Path) -> None:
    control = access(tmp_path, "  acl_no_match: allow\n")
    for topic in ("$SYS", "$SYS/broker/uptime", "$SYS/"):
        assert not control.authorize_publish("c", None, topic)
    for topic in ("$SYSTEM/x", "$sys/x", "a/$SYS", "$share-like/x"):
        assert control.authorize_publish("c", None, topic)
    assert control.authorize_subscribe("c", None, "$SYS/#")  # reading stays an ACL matter


def test_anonymous_allowed(tmp_path: Path, password_file: Path) -> None:
    control = access(tmp_path, f"  allow_anonymous: true\n  password_file: {password_file}\n")
    assert control.authenticate("c", None, None) == SUCCESS
    assert control.authenticate("c", None, b"ignored") == SUCCESS
    # A user name is checked even when anonymous clients are allowed.
    assert control.authenticate("c", "alice", b"alice-pw") == SUCCESS
    assert control.authenticate("c", "alice", b"wrong") == BAD_USER_NAME_OR_PASSWORD
    assert control.authenticate("c", "mallory", b"x") == BAD_USER_NAME_OR_PASSWORD


def test_anonymous_refused(tmp_path: Path, password_file: Path) -> None:
    control = access(tmp_path, f"  allow_anonymous: false\n  password_file: {password_file}\n")
    assert control.authenticate("c", None, None) == NOT_AUTHORIZED
    assert control.authenticate("c", None, b"alice-pw") == NOT_AUTHORIZED


@pytest.mark.parametrize(("username", "password", "code"), [
    ("alice", b"alice-pw", SUCCESS),
    ("bob", b"bob-pw", SUCCESS),
    ("alice", b"bob-pw", BAD_USER_NAME_OR_PASSWORD),
    ("alice", b"", BAD_USER_NAME_OR_PASSWORD),
    ("alice", None, BAD_USER_NAME_OR_PASSWORD),
    ("bob", b"wrong", BAD_USER_NAME_OR_PASSWORD),
    ("mallory", b"alice-pw", BAD_USER_NAME_OR_PASSWORD),
    ("mallory", None, BAD_USER_NAME_OR_PASSWORD),
    ("ALICE", b"alice-pw", BAD_USER_NAME_OR_PASSWORD),
])
def test_password_check(tmp_path: Path, password_file: Path, username: str,
                        password: bytes | None, code: int) -> None:
    control = access(tmp_path, f"  allow_anonymous: false\n  password_file: {password_file}\n")
    assert control.authenticate("c", username, password) == code
    assert asyncio.run(control.authenticate_async("c", username, password)) == code


def test_successes_are_cached_and_bounded(tmp_path: Path) -> None:
    path = tmp_path / "passwd"
    set_password(path, "slow", "pw", iterations=200_000)  # ~0.1-0.2 s per check
    set_password(path, "fast", "pw2", **FAST)
    control = AccessControl(allow_anonymous=False, passwords=load_password_file(path),
                            cache_size=1)
    assert control.authenticate("c", "slow", b"pw") == SUCCESS
    started = time.perf_counter()
    for _ in range(20):
        assert asyncio.run(control.authenticate_async("c", "slow", b"pw")) == SUCCESS
    assert time.perf_counter() - started < 1.0  # 20 hashes would take 2 s or more
    # Failures are not cached, and a wrong password never hits a cached success.
    assert control.authenticate("c", "slow", b"pW") == BAD_USER_NAME_OR_PASSWORD
    assert len(control._cache) == 1
    assert control.authenticate("c", "fast", b"pw2") == SUCCESS
    assert len(control._cache) == 1  # bounded: "slow" was evicted


def test_changed_hash_is_not_served_from_cache(tmp_path: Path) -> None:
    path = tmp_path / "passwd"
    set_password(path, "alice", "old", **FAST)
    control = AccessControl(allow_anonymous=False, passwords=load_password_file(path))
    assert control.authenticate("c", "alice", b"old") == SUCCESS
    set_password(path, "alice", "new", **FAST)
    control.passwords = load_password_file(path)  # as a reload would
    assert control.authenticate("c", "alice", b"old") == BAD_USER_NAME_OR_PASSWORD
    assert control.authenticate("c", "alice", b"new") == SUCCESS


def test_acl_from_config(tmp_path: Path, password_file: Path) -> None:
    acl = tmp_path / "acl.yaml"
    acl.write_text('- {permission: allow, action: all, topics: ["users/%u/#"]}\n'
                   '- {permission: allow, action: subscribe, topics: ["public/#"]}\n')
    control = access(tmp_path, f"  password_file: {password_file}\n  acl_file: {acl}\n"
                               "  acl_no_match: deny\n")
    assert control.authorize_publish("c", "alice", "users/alice/x")
    assert not control.authorize_publish("c", "alice", "users/bob/x")
    assert not control.authorize_publish("c", None, "users/alice/x")
    assert control.authorize_subscribe("c", None, "public/+/news")
    assert not control.authorize_publish("c", "alice", "public/x")
    assert not control.authorize_subscribe("c", "alice", "#")


def test_no_acl_file_uses_no_match() -> None:
    control = AccessControl.from_config(AccessControlConfig(acl_no_match="deny"))
    assert not control.authorize_publish("c", "alice", "a")
    assert not control.authorize_subscribe("c", "alice", "a")


def test_bad_files_fail_at_load(tmp_path: Path) -> None:
    bad = tmp_path / "passwd"
    bad.write_text("alice:plaintext\n")
    with pytest.raises(ConfigError, match=f"{bad}:1: user 'alice': not a password hash"):
        AccessControl.from_config(AccessControlConfig(password_file=str(bad)))
    with pytest.raises(ConfigError, match="ACL file not found"):
        AccessControl.from_config(AccessControlConfig(acl_file=str(tmp_path / "nope.yaml")))

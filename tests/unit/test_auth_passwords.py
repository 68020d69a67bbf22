"""Tests for broker/auth/passwords.py: hashes, the password file, `stratamq ctl passwd`."""

from __future__ import annotations

import base64
import io
import stat
import sys
from pathlib import Path
from typing import TypedDict

import pytest

from stratamq.broker.auth.passwords import (
    DEFAULT_PBKDF2_ITERATIONS,
    SCHEMES,
    InvalidHashError,
    Scheme,
    check_hash,
    delete_user,
    hash_password,
    load_password_file,
    passwd_main,
    set_password,
    verify_password,
)
from stratamq.broker.errors import ConfigError


class Cost(TypedDict):
    iterations: int
    rounds: int


# Cheap costs keep the tests fast; the defaults are checked separately.
FAST: Cost = {"iterations": 1000, "rounds": 4}
FAST_CLI = ["--iterations", "1000", "--rounds", "4"]


def fast_hash(password: str | bytes, scheme: Scheme = "pbkdf2") -> str:
    return hash_password(password, scheme, **FAST)


# --- hashes ----------------------------------------------------------------------------

@pytest.mark.parametrize("scheme", ["pbkdf2", "bcrypt"])
def test_round_trip(scheme: Scheme) -> None:
    encoded = fast_hash("s3cret ünïcode", scheme)
    assert check_hash(encoded) == scheme
    assert verify_password("s3cret ünïcode", encoded)
    assert verify_password("s3cret ünïcode".encode(), encoded)  # MQTT gives bytes
    assert not verify_password("s3cret unicode", encoded)
    assert not verify_password("", encoded)


@pytest.mark.parametrize("scheme", ["pbkdf2", "bcrypt"])
def test_salted(scheme: Scheme) -> None:
    assert fast_hash("same", scheme) != fast_hash("same", scheme)


def test_pbkdf2_format_and_default_cost() -> None:
    encoded = hash_password(b"pw", iterations=1000)
    prefix, scheme, iterations, salt, digest = encoded.split("$")
    assert (prefix, scheme, iterations) == ("", "pbkdf2-sha512", "1000")
    assert len(base64.b64decode(salt)) == 16
    assert len(base64.b64decode(digest)) == 64
    assert DEFAULT_PBKDF2_ITERATIONS == 210_000


def test_bcrypt_format() -> None:
    encoded = fast_hash("pw", "bcrypt")
    assert encoded.startswith("$2b$04$") and len(encoded) == 60


def test_binary_password_with_nul() -> None:
    for scheme in SCHEMES:
        encoded = fast_hash(b"a\x00b\xff", scheme)
        assert verify_password(b"a\x00b\xff", encoded)
        assert not verify_password(b"a", encoded)


def test_bcrypt_refuses_long_passwords() -> None:
    with pytest.raises(ValueError, match="72 bytes"):
        fast_hash("x" * 73, "bcrypt")
    assert not verify_password("x" * 80, fast_hash("x" * 72, "bcrypt"))
    assert verify_password("x" * 80, fast_hash("x" * 80))  # pbkdf2 takes any length


def test_bad_parameters() -> None:
    with pytest.raises(ValueError, match="iterations"):
        hash_password("pw", iterations=0)
    with pytest.raises(ValueError, match="rounds"):
        hash_password("pw", "bcrypt", rounds=3)
    with pytest.raises(ValueError, match="unknown password scheme"):
        hash_password("pw", "md5")  # type: ignore[arg-type]


def _flip_last_char(encoded: str) -> str:
    # Keep the result well formed (only the hash value changes).
    last = encoded[-1] if encoded[-1] != "=" else encoded[-3]
    index = len(encoded) - 1 if encoded[-1] != "=" else len(encoded) - 3
    replacement = "A" if last != "A" else "Q"
    return encoded[:index] + replacement + encoded[index + 1:]


@pytest.mark.parametrize("scheme", ["pbkdf2", "bcrypt"])
def test_tampered_hash_does_not_verify(scheme: Scheme) -> None:
    encoded = fast_hash("pw", scheme)
    assert not verify_password("pw", _flip_last_char(encoded))


def test_tampered_pbkdf2_fields() -> None:
    encoded = fast_hash("pw")
    _, _, iterations, salt, digest = encoded.split("$")
    other_salt = base64.b64encode(b"\x01" * 16).decode()
    assert not verify_password("pw", f"$pbkdf2-sha512$1001${salt}${digest}")
    assert not verify_password("pw", f"$pbkdf2-sha512${iterations}${other_salt}${digest}")


@pytest.mark.parametrize(("encoded", "why"), [
    ("", "not a password hash"),
    ("plaintext", "not a password hash"),
    ("$argon2id$v=19$m=65536,t=3,p=4$c2FsdA$aGFzaA", "unknown password hash scheme 'argon2id'"),
    ("$pbkdf2-sha512$", "garbled pbkdf2-sha512"),
    ("$pbkdf2-sha512$0$AAAAAAAAAAAAAAAAAAAAAA==$AAAA", "garbled pbkdf2-sha512"),
    ("$pbkdf2-sha512$1000$AAAAAAAAAAAAAAAAAAAAAA==$AAAA", "hash is 3 bytes, expected 64"),
    ("$pbkdf2-sha512$1000$AAAA$" + "A" * 86 + "==", "salt is 3 bytes"),
    ("$pbkdf2-sha512$1000$A$" + "A" * 86 + "==", "salt is not valid base64"),
    ("$pbkdf2-sha512$1000$AAAAAAAAAAAAAAAAAAAAAA==$" + "A" * 86 + "=", "hash is not valid base64"),
    ("$2b$12$tooshort", "garbled bcrypt"),
    ("$2b$99$" + "a" * 53, "rounds 99"),
])
def test_garbled_or_unknown_hashes(encoded: str, why: str) -> None:
    with pytest.raises(InvalidHashError, match=why.replace("$", r"\$")):
        check_hash(encoded)
    assert not verify_password("pw", encoded)
    assert not verify_password("", encoded)


# --- the password file -----------------------------------------------------------------

def test_load_password_file(tmp_path: Path) -> None:
    alice, bob = fast_hash("a"), fast_hash("b", "bcrypt")
    path = tmp_path / "passwd"
    path.write_text(f"# users\n\nalice:{alice}\n  # indented comment\n  bob:{bob}  \n")
    assert load_password_file(path) == {"alice": alice, "bob": bob}


def test_load_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "passwd"
    path.write_text("")
    assert load_password_file(path) == {}


def test_load_reports_every_bad_line_with_its_number(tmp_path: Path) -> None:
    good = fast_hash("pw")
    path = tmp_path / "passwd"
    path.write_text("\n".join([
        "# comment",
        f"alice:{good}",
        "no colon here",
        f"alice:{good}",
        "carol:plaintext",
        "dave:$argon2id$v=19$x$y",
        f":{good}",
        "erin:",
        "frank:$pbkdf2-sha512$1000$xx",
    ]) + "\n")
    with pytest.raises(ConfigError) as info:
        load_password_file(path)
    lines = info.value.message.splitlines()
    assert lines[0] == "invalid password file:"
    assert lines[1:] == [
        f"  {path}:3: expected `username:hash`",
        f"  {path}:4: duplicate user 'alice' (first on line 2)",
        f"  {path}:5: user 'carol': not a password hash: expected $pbkdf2-sha512$... or "
        "$2b$... (plain-text passwords are not accepted; use `stratamq ctl passwd`)",
        f"  {path}:6: user 'dave': unknown password hash scheme 'argon2id': expected "
        "$pbkdf2-sha512$ or $2b$ (bcrypt)",
        f"  {path}:7: expected `username:hash`",
        f"  {path}:8: expected `username:hash`",
        f"  {path}:9: user 'frank': garbled pbkdf2-sha512 hash: expected "
        "$pbkdf2-sha512$<iterations>$<salt>$<hash>",
    ]


def test_load_missing_or_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="password file not found"):
        load_password_file(tmp_path / "nope")
    path = tmp_path / "latin1"
    path.write_bytes(b"caf\xe9:x\n")
    with pytest.raises(ConfigError, match="cannot read password file"):
        load_password_file(path)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_set_password_creates_replaces_and_keeps_the_rest(tmp_path: Path) -> None:
    path = tmp_path / "passwd"
    set_password(path, "alice", "one", **FAST)
    assert mode(path) == 0o600
    first = load_password_file(path)["alice"]
    assert verify_password("one", first)

    path.write_text(f"# keep me\n{path.read_text()}\n# and me\n")
    path.chmod(0o644)
    set_password(path, "bob", "two", "bcrypt", **FAST)
    set_password(path, "alice", "three", **FAST)
    lines = path.read_text().splitlines()
    assert lines[0] == "# keep me"
    assert lines[1].startswith("alice:$pbkdf2-sha512$1000$")
    assert lines[2:4] == ["", "# and me"]
    assert lines[4].startswith("bob:$2b$04$")
    assert len(lines) == 5
    users = load_password_file(path)
    assert verify_password("three", users["alice"]) and not verify_password("one", users["alice"])
    assert verify_password("two", users["bob"])
    assert mode(path) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["passwd"]  # no temp file left


def test_delete_user(tmp_path: Path) -> None:
    path = tmp_path / "passwd"
    set_password(path, "alice", "a", **FAST)
    set_password(path, "bob", "b", **FAST)
    assert delete_user(path, "alice") is True
    assert list(load_password_file(path)) == ["bob"]
    before = path.read_text()
    assert delete_user(path, "alice") is False
    assert path.read_text() == before
    assert delete_user(tmp_path / "missing", "alice") is False
    assert not (tmp_path / "missing").exists()


def test_set_password_refuses_bad_names_and_broken_files(tmp_path: Path) -> None:
    path = tmp_path / "passwd"
    for name in ["", "a:b", " padded", "#comment", "two\nlines"]:
        with pytest.raises(ValueError, match="user name"):
            set_password(path, name, "pw", **FAST)
    assert not path.exists()
    path.write_text("garbage\n")
    with pytest.raises(ConfigError, match=f"{path}:1"):
        set_password(path, "alice", "pw", **FAST)
    assert path.read_text() == "garbage\n"


# --- stratamq ctl passwd ---------------------------------------------------------------

def passwd(monkeypatch: pytest.MonkeyPatch, argv: list[str], stdin: str = "") -> int:
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    return passwd_main(argv)


def test_passwd_with_password_stdin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "passwd"
    file = ["--file", str(path)]
    assert passwd(monkeypatch, [*file, *FAST_CLI, "--password-stdin", "alice"], "pw one\n") == 0
    assert passwd(monkeypatch, [*file, *FAST_CLI, "--scheme", "bcrypt", "--password-stdin",
                                "bob"], "pw two\r\n") == 0
    users = load_password_file(path)
    assert users["alice"].startswith("$pbkdf2-sha512$1000$")
    assert verify_password("pw one", users["alice"])
    assert users["bob"].startswith("$2b$04$")
    assert verify_password("pw two", users["bob"])
    assert mode(path) == 0o600

    assert passwd(monkeypatch, [*file, "--delete", "alice"]) == 0
    assert list(load_password_file(path)) == ["bob"]
    assert capsys.readouterr().err == ""


def test_passwd_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                       capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "passwd"
    file = ["--file", str(path)]

    assert passwd(monkeypatch, [*file, "--password-stdin", "alice"], "") == 1
    assert "password must not be empty" in capsys.readouterr().err
    assert passwd(monkeypatch, [*file, "--password-stdin", "a:b"], "pw\n") == 1
    assert "must not contain ':'" in capsys.readouterr().err
    assert passwd(monkeypatch, [*file, "--delete", "nobody"]) == 1
    assert f"no user 'nobody' in {path}" in capsys.readouterr().err
    assert passwd(monkeypatch, [*file, "--scheme", "md5", "alice"]) == 2
    assert "invalid choice: 'md5'" in capsys.readouterr().err
    assert passwd(monkeypatch, [*file, "--delete", "--password-stdin", "alice"]) == 2
    assert "not allowed with" in capsys.readouterr().err
    assert passwd(monkeypatch, [*file, "--iterations", "0", "--password-stdin", "a"], "pw\n") == 1
    assert "iterations must be at least 1" in capsys.readouterr().err
    assert not path.exists()

    path.write_text("broken line\n")
    assert passwd(monkeypatch, [*file, *FAST_CLI, "--password-stdin", "alice"], "pw\n") == 1
    assert f"{path}:1: expected `username:hash`" in capsys.readouterr().err
    assert passwd(monkeypatch, ["--file", str(tmp_path / "no" / "dir"), *FAST_CLI,
                                "--password-stdin", "alice"], "pw\n") == 1
    assert "No such file or directory" in capsys.readouterr().err


def test_passwd_help(monkeypatch: pytest.MonkeyPatch,
                     capsys: pytest.CaptureFixture[str]) -> None:
    assert passwd(monkeypatch, ["--help"]) == 0
    assert "stratamq ctl passwd" in capsys.readouterr().out

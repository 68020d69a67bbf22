"""Salted password hashes and the password file (`username:hash` per line).

Two hash formats:

* `$pbkdf2-sha512$<iterations>$<salt base64>$<hash base64>`: PBKDF2-HMAC-SHA512 from
  the standard library (standard base64 with padding; 16-byte salt, 64-byte hash).
* `$2b$<rounds>$...`: bcrypt, through the `bcrypt` package (`$2a$`/`$2y$` are read too).

A hash that is garbled or of an unknown scheme never verifies (`verify_password` returns
False); `check_hash` says why, and `load_password_file` turns that into a ConfigError
naming the file and line, so a broken entry is found at start, not at the first login.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import getpass
import hashlib
import hmac
import os
import re
import secrets
import sys
from pathlib import Path
from typing import Literal, get_args

import bcrypt

from ..errors import ConfigError
from ..files import write_atomically

Scheme = Literal["pbkdf2", "bcrypt"]
SCHEMES: tuple[Scheme, ...] = get_args(Scheme)

# OWASP Password Storage Cheat Sheet, section PBKDF2 ("PBKDF2-HMAC-SHA512: 210,000
# iterations"; 600,000 for SHA-256, 1,300,000 for SHA-1), current as of 2023-2025:
# https://cheatsheetseries.owasp.org/cheatsheets/Password_Storage_Cheat_Sheet.html#pbkdf2
DEFAULT_PBKDF2_ITERATIONS = 210_000
# The same cheat sheet: bcrypt "work factor of 10 or more"; 12 is the bcrypt package's
# default and costs about as much as the PBKDF2 default.
DEFAULT_BCRYPT_ROUNDS = 12
# bcrypt only looks at the first 72 bytes of a password; the package refuses longer ones.
BCRYPT_MAX_PASSWORD_BYTES = 72

PBKDF2_PREFIX = "$pbkdf2-sha512$"
PBKDF2_SALT_BYTES = 16
PBKDF2_HASH_BYTES = 64  # the SHA-512 digest size
_PBKDF2 = re.compile(r"\$pbkdf2-sha512\$([1-9][0-9]{0,9})\$([A-Za-z0-9+/=]+)\$([A-Za-z0-9+/=]+)")
_BCRYPT = re.compile(r"\$2[aby]\$([0-9]{2})\$[./A-Za-z0-9]{53}")

DEFAULT_PASSWORD_FILE = "config/passwd"


class InvalidHashError(ValueError):
    """An encoded password hash that is not one this module writes (unknown scheme, or
    a known scheme with garbled fields). The message says which, without the hash."""


# --- hashing ---------------------------------------------------------------------------

def _to_bytes(password: str | bytes) -> bytes:
    # MQTT passwords are binary data; passwords typed at a prompt are text (UTF-8).
    return password.encode("utf-8") if isinstance(password, str) else password


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def hash_password(password: str | bytes, scheme: Scheme = "pbkdf2", *,
                  iterations: int = DEFAULT_PBKDF2_ITERATIONS,
                  rounds: int = DEFAULT_BCRYPT_ROUNDS) -> str:
    """Hash `password` with a fresh random salt. `iterations` applies to pbkdf2,
    `rounds` (log2 of the cost, 4..31) to bcrypt. Raises ValueError on a bad parameter
    or a bcrypt password longer than 72 bytes (it would be silently truncated)."""
    secret = _to_bytes(password)
    if scheme == "pbkdf2":
        if iterations < 1:
            raise ValueError(f"pbkdf2 iterations must be at least 1, got {iterations}")
        salt = secrets.token_bytes(PBKDF2_SALT_BYTES)
        digest = hashlib.pbkdf2_hmac("sha512", secret, salt, iterations)
        return f"{PBKDF2_PREFIX}{iterations}${_b64(salt)}${_b64(digest)}"
    if scheme == "bcrypt":
        if not 4 <= rounds <= 31:
            raise ValueError(f"bcrypt rounds must be between 4 and 31, got {rounds}")
        if len(secret) > BCRYPT_MAX_PASSWORD_BYTES:
            raise ValueError(f"bcrypt cannot hash passwords longer than "
                             f"{BCRYPT_MAX_PASSWORD_BYTES} bytes; use the pbkdf2 scheme")
        return bcrypt.hashpw(secret, bcrypt.gensalt(rounds)).decode("ascii")
    raise ValueError(f"unknown password scheme {scheme!r}: expected one of {SCHEMES}")


def _decode_b64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except binascii.Error as exc:
        raise InvalidHashError(f"pbkdf2-sha512 hash: {what} is not valid base64") from exc


def _parse_pbkdf2(encoded: str) -> tuple[int, bytes, bytes]:
    match = _PBKDF2.fullmatch(encoded)
    if match is None:
        raise InvalidHashError(
            "garbled pbkdf2-sha512 hash: expected $pbkdf2-sha512$<iterations>$<salt>$<hash>")
    salt = _decode_b64(match.group(2), "salt")
    digest = _decode_b64(match.group(3), "hash")
    if len(salt) < PBKDF2_SALT_BYTES:
        raise InvalidHashError(f"pbkdf2-sha512 hash: salt is {len(salt)} bytes, "
                               f"expected at least {PBKDF2_SALT_BYTES}")
    if len(digest) != PBKDF2_HASH_BYTES:
        raise InvalidHashError(f"pbkdf2-sha512 hash: hash is {len(digest)} bytes, "
                               f"expected {PBKDF2_HASH_BYTES}")
    return int(match.group(1)), salt, digest


def check_hash(encoded: str) -> Scheme:
    """Return the scheme of an encoded hash; raise InvalidHashError when the scheme is
    unknown or the hash is garbled."""
    if encoded.startswith(PBKDF2_PREFIX):
        _parse_pbkdf2(encoded)
        return "pbkdf2"
    if encoded.startswith(("$2a$", "$2b$", "$2y$")):
        match = _BCRYPT.fullmatch(encoded)
        if match is None:
            raise InvalidHashError("garbled bcrypt hash: expected $2b$<rounds>$<53 characters>")
        if not 4 <= int(match.group(1)) <= 31:
            raise InvalidHashError(f"bcrypt hash: rounds {match.group(1)} not in 4..31")
        return "bcrypt"
    scheme = encoded.split("$")[1] if encoded.startswith("$") and encoded.count("$") > 1 else ""
    raise InvalidHashError(
        f"unknown password hash scheme {scheme!r}: expected $pbkdf2-sha512$ or $2b$ (bcrypt)"
        if scheme else
        "not a password hash: expected $pbkdf2-sha512$... or $2b$... (plain-text passwords "
        "are not accepted; use `stratamq ctl passwd`)")


def verify_password(password: str | bytes, encoded: str) -> bool:
    """Whether `password` matches the encoded hash, compared in constant time. False
    for a garbled or unknown hash (use `check_hash` to learn why)."""
    secret = _to_bytes(password)
    try:
        scheme = check_hash(encoded)
    except InvalidHashError:
        return False
    if scheme == "pbkdf2":
        iterations, salt, expected = _parse_pbkdf2(encoded)
        actual = hashlib.pbkdf2_hmac("sha512", secret, salt, iterations)
        return hmac.compare_digest(actual, expected)
    if len(secret) > BCRYPT_MAX_PASSWORD_BYTES:
        return False  # never hashed by us; the bcrypt package refuses it anyway
    return bcrypt.checkpw(secret, encoded.encode("ascii"))  # constant-time inside


# --- the password file -----------------------------------------------------------------

def check_username(username: str) -> None:
    """Raise ValueError for a user name that cannot be written as one `name:hash` line."""
    if not username:
        raise ValueError("user name must not be empty")
    if ":" in username:
        raise ValueError(f"user name must not contain ':': {username!r}")
    if username != username.strip() or any(ch in username for ch in "\r\n\x00"):
        raise ValueError(f"user name must not contain line breaks, NUL, or leading or "
                         f"trailing whitespace: {username!r}")
    if username.startswith("#"):
        raise ValueError(f"user name must not start with '#' (a comment): {username!r}")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: password file not found") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read password file: {exc}") from exc


def _parse(path: Path, text: str) -> dict[str, tuple[int, str]]:
    """username -> (0-based line index, encoded hash). Raises one ConfigError listing
    every bad line as `file:line: why`."""
    entries: dict[str, tuple[int, str]] = {}
    errors: list[str] = []
    for index, raw in enumerate(text.splitlines()):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{path}:{index + 1}"
        username, colon, encoded = line.partition(":")
        if not colon or not username or not encoded:
            errors.append(f"{where}: expected `username:hash`")
            continue
        try:
            check_username(username)
            check_hash(encoded)
        except ValueError as exc:  # InvalidHashError included
            errors.append(f"{where}: user {username!r}: {exc}")
            continue
        if username in entries:
            errors.append(f"{where}: duplicate user {username!r} "
                          f"(first on line {entries[username][0] + 1})")
            continue
        entries[username] = (index, encoded)
    if errors:
        raise ConfigError("invalid password file:\n" + "\n".join(f"  {e}" for e in errors))
    return entries


def load_password_file(path: str | os.PathLike[str]) -> dict[str, str]:
    """Read a password file: `username:hash` per line, blank lines and `#` comments
    ignored. Returns username -> encoded hash. Raises ConfigError naming file:line for
    malformed lines, duplicate users and unknown or garbled hashes."""
    file = Path(path)
    return {user: encoded for user, (_, encoded) in _parse(file, _read_text(file)).items()}


def _edit(path: Path, username: str, new_line: str | None) -> bool:
    """Replace (or, with None, delete) the line of `username`, or append `new_line`.
    Comments, blank lines and the order of the other entries are kept. Returns whether
    the user was in the file. Refuses to touch a file that does not parse."""
    check_username(username)
    text = _read_text(path) if path.exists() else ""
    entries = _parse(path, text)
    lines = text.splitlines()
    found = username in entries
    if found:
        index = entries[username][0]
        if new_line is None:
            del lines[index]
        else:
            lines[index] = new_line
    elif new_line is not None:
        lines.append(new_line)
    if found or new_line is not None:
        write_atomically(path, "".join(line + "\n" for line in lines))
    return found


def set_password(path: str | os.PathLike[str], username: str, password: str | bytes,
                 scheme: Scheme = "pbkdf2", *,
                 iterations: int = DEFAULT_PBKDF2_ITERATIONS,
                 rounds: int = DEFAULT_BCRYPT_ROUNDS) -> None:
    """Add `username` to the password file, or replace its hash; creates the file
    (mode 0600) when missing. Raises ValueError for a bad user name or hash parameter,
    ConfigError when the existing file does not parse."""
    encoded = hash_password(password, scheme, iterations=iterations, rounds=rounds)
    _edit(Path(path), username, f"{username}:{encoded}")


def delete_user(path: str | os.PathLike[str], username: str) -> bool:
    """Remove `username` from the password file; False when it was not there (the file
    is then left untouched)."""
    return _edit(Path(path), username, None)


# --- `stratamq ctl passwd` -------------------------------------------------------------

def _passwd_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stratamq ctl passwd",
        description="Add, change or delete a user in the broker's password file.")
    parser.add_argument("username", metavar="USERNAME")
    parser.add_argument("--file", default=DEFAULT_PASSWORD_FILE,
                        help=f"password file (default: {DEFAULT_PASSWORD_FILE}); "
                             "created with mode 0600 when missing")
    parser.add_argument("--scheme", choices=SCHEMES, default="pbkdf2",
                        help="hash scheme (default: pbkdf2)")
    parser.add_argument("--iterations", type=int, default=DEFAULT_PBKDF2_ITERATIONS,
                        help=f"pbkdf2 iterations (default: {DEFAULT_PBKDF2_ITERATIONS}, "
                             "the OWASP figure for PBKDF2-HMAC-SHA512)")
    parser.add_argument("--rounds", type=int, default=DEFAULT_BCRYPT_ROUNDS,
                        help=f"bcrypt cost, log2 (default: {DEFAULT_BCRYPT_ROUNDS})")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--delete", action="store_true", help="delete the user")
    what.add_argument("--password-stdin", action="store_true",
                      help="read the password from the first line of standard input "
                           "instead of prompting")
    return parser


def _read_password(from_stdin: bool) -> str:
    """The new password, from stdin's first line or from two prompts that must agree.
    Raises ValueError when empty or when the prompts differ."""
    if from_stdin:
        password = sys.stdin.readline().removesuffix("\n").removesuffix("\r")
    else:
        password = getpass.getpass("Password: ")
        if getpass.getpass("Password (again): ") != password:
            raise ValueError("the passwords do not match")
    if not password:
        raise ValueError("the password must not be empty")
    return password


def passwd_main(argv: list[str]) -> int:
    """`stratamq ctl passwd [--file FILE] [--scheme pbkdf2|bcrypt] [--delete]
    [--password-stdin] USERNAME`. Returns the exit code: 0 done, 1 failed, 2 bad usage.
    Errors go to stderr."""
    try:
        arguments = _passwd_parser().parse_args(argv)
    except SystemExit as exit_:  # --help (0) or a usage error (2, message printed)
        return exit_.code if isinstance(exit_.code, int) else 2
    path = Path(arguments.file)
    try:
        if arguments.delete:
            if not delete_user(path, arguments.username):
                print(f"stratamq ctl passwd: no user {arguments.username!r} in {path}",
                      file=sys.stderr)
                return 1
            return 0
        check_username(arguments.username)  # before asking for a password
        password = _read_password(arguments.password_stdin)
        set_password(path, arguments.username, password, arguments.scheme,
                     iterations=arguments.iterations, rounds=arguments.rounds)
    except (ValueError, ConfigError, OSError) as exc:
        message = exc.message if isinstance(exc, ConfigError) else str(exc)
        print(f"stratamq ctl passwd: {message}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, EOFError):
        print("stratamq ctl passwd: cancelled", file=sys.stderr)
        return 1
    return 0

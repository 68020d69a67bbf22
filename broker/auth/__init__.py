"""Access control: who may connect (password file) and what they may publish and
subscribe to (ACL file), configured by the `access_control` config section.

`AccessControl.authenticate` answers a CONNECT with an MQTT 5 CONNACK reason code:

* no user name: success when `allow_anonymous`, else 0x87 (not authorized);
* a user name, with a password file: success only for a user in the file whose password
  verifies; anything else (unknown user, no or wrong password) is 0x86 (bad user name
  or password). Unknown users still cost one hash, so timing does not tell which
  user names exist;
* a user name, without a password file: as without a user name (the config refuses
  `allow_anonymous: false` without a password file). The user name is then an
  unchecked claim, and `%u` ACL rules trust it.

No client publishes to `$SYS` or `$SYS/...` (a PUBLISH or a will): those topics are
the broker's, whatever the ACL says; a refusal there is an ACL deny.

Password hashes are slow on purpose, so a reconnect storm would burn CPU: successful
verifications are remembered (bounded LRU), and `authenticate_async` runs the hash in a
bounded pool of its own and backs off sources whose logins fail (`login_guard`):

* no room in the pool (for the source, or at all): 0x89 Server busy, at once;
* a source backed off after failed logins: 0x9F Connection rate exceeded, no hash.

(MQTT 3.1.1 has neither: both are return code 3, Server unavailable.) A remembered
success is answered before either, so a known password gets through a back-off.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

from ..config import AccessControlConfig
from ..metrics import LOGINS_REFUSED
from ..topic import is_system_topic
from .acl import Acl, AclRule, Permission, load_acl_file, parse_rules
from .login_guard import FailureBackoff, HashPool, ServerBusy
from .passwords import (
    DEFAULT_PBKDF2_ITERATIONS,
    PBKDF2_HASH_BYTES,
    PBKDF2_PREFIX,
    PBKDF2_SALT_BYTES,
    InvalidHashError,
    check_hash,
    delete_user,
    hash_password,
    load_password_file,
    passwd_main,
    set_password,
    verify_password,
)

__all__ = [
    "BAD_USER_NAME_OR_PASSWORD",
    "CONNECTION_RATE_EXCEEDED",
    "NOT_AUTHORIZED",
    "SERVER_BUSY",
    "SUCCESS",
    "AccessControl",
    "Acl",
    "AclRule",
    "FailureBackoff",
    "HashPool",
    "InvalidHashError",
    "check_hash",
    "delete_user",
    "hash_password",
    "load_acl_file",
    "load_password_file",
    "parse_rules",
    "passwd_main",
    "set_password",
    "verify_password",
]

# MQTT 5.0 CONNACK reason codes (the same values as mqtt.reason_codes.ReasonCode).
SUCCESS = 0x00
BAD_USER_NAME_OR_PASSWORD = 0x86
NOT_AUTHORIZED = 0x87
SERVER_BUSY = 0x89
CONNECTION_RATE_EXCEEDED = 0x9F

DEFAULT_CACHE_SIZE = 4096


def _dummy_hash(passwords: Mapping[str, str]) -> str:
    """A pbkdf2 hash no password matches (all-zero salt and hash), as costly as the
    first pbkdf2 entry of the file (the default cost when there is none): unknown users
    are checked against it, so they take as long as known ones."""
    iterations = DEFAULT_PBKDF2_ITERATIONS
    for encoded in passwords.values():
        field = encoded.split("$")[2] if encoded.startswith(PBKDF2_PREFIX) else ""
        if field.isdigit():
            iterations = int(field)
            break
    salt = base64.b64encode(bytes(PBKDF2_SALT_BYTES)).decode("ascii")
    digest = base64.b64encode(bytes(PBKDF2_HASH_BYTES)).decode("ascii")
    return f"{PBKDF2_PREFIX}{iterations}${salt}${digest}"


_CacheKey = tuple[str, bytes, str]


@dataclass(frozen=True)
class _PendingCheck:
    """A password that still has to be checked against a hash."""

    password: bytes
    encoded: str
    cache_entry: _CacheKey | None  # None for an unknown user


class AccessControl:
    """Authentication and topic authorization for the listeners. Thread-safe."""

    def __init__(self, *, allow_anonymous: bool = True,
                 passwords: Mapping[str, str] | None = None,
                 acl: Acl | None = None,
                 acl_no_match: Permission = "allow",
                 cache_size: int = DEFAULT_CACHE_SIZE,
                 hash_pool: HashPool | None = None,
                 backoff: FailureBackoff | None = None) -> None:
        """`passwords`: user name -> encoded hash, None for no password file. `acl`:
        the rules, None for no ACL file (then `acl_no_match` decides everything).
        `hash_pool` and `backoff`: those of the config's defaults when None."""
        self.allow_anonymous = allow_anonymous
        self.passwords = None if passwords is None else dict(passwords)
        self.acl = acl if acl is not None else Acl([], acl_no_match)
        self._dummy_hash = _dummy_hash(self.passwords or {})
        self._cache_size = cache_size
        # Successful checks as (user name, SHA-256 of the password, encoded hash): a
        # changed hash or password misses. A fast hash of a password that worked stays
        # in memory; that is the price of not re-hashing on every reconnect.
        self._cache: OrderedDict[_CacheKey, None] = OrderedDict()
        self._lock = threading.Lock()
        defaults = AccessControlConfig()
        self._hash_pool = hash_pool if hash_pool is not None else HashPool(
            defaults.hash_workers, defaults.hash_queue, defaults.hash_per_source)
        self._backoff = backoff if backoff is not None else FailureBackoff(
            defaults.failure_backoff_max)

    @classmethod
    def from_config(cls, config: AccessControlConfig) -> AccessControl:
        """Load the password and ACL files the config names (paths relative to the
        working directory). Raises ConfigError for a missing or invalid file."""
        passwords = (None if config.password_file is None
                     else load_password_file(config.password_file))
        acl = (None if config.acl_file is None
               else load_acl_file(config.acl_file, config.acl_no_match))
        return cls(allow_anonymous=config.allow_anonymous, passwords=passwords, acl=acl,
                   acl_no_match=config.acl_no_match,
                   hash_pool=HashPool(config.hash_workers, config.hash_queue,
                                      config.hash_per_source),
                   backoff=FailureBackoff(config.failure_backoff_max))

    def close(self) -> None:
        """Stop the hashing threads (checks under way finish on their own)."""
        self._hash_pool.close()

    # --- authentication ----------------------------------------------------------------

    def _precheck(self, username: str | None, password: bytes | None) -> int | _PendingCheck:
        """The reason code when it is known without hashing, else the check to run."""
        if username is None or self.passwords is None:
            return SUCCESS if self.allow_anonymous else NOT_AUTHORIZED
        if password is None:
            return BAD_USER_NAME_OR_PASSWORD
        encoded = self.passwords.get(username)
        if encoded is None:
            return _PendingCheck(password, self._dummy_hash, cache_entry=None)
        entry = (username, hashlib.sha256(password).digest(), encoded)
        with self._lock:
            if entry in self._cache:
                self._cache.move_to_end(entry)
                return SUCCESS
        return _PendingCheck(password, encoded, cache_entry=entry)

    def _finish(self, check: _PendingCheck, verified: bool) -> int:
        if not verified or check.cache_entry is None:
            return BAD_USER_NAME_OR_PASSWORD
        with self._lock:
            self._cache[check.cache_entry] = None
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return SUCCESS

    def authenticate(self, client_id: str, username: str | None,
                     password: bytes | None) -> int:
        """The MQTT 5 CONNACK reason code for a CONNECT. Blocks for the hash (0.1-0.3 s
        on a cache miss); on the event loop, use `authenticate_async`."""
        check = self._precheck(username, password)
        if isinstance(check, int):
            return check
        return self._finish(check, verify_password(check.password, check.encoded))

    async def authenticate_async(self, client_id: str, username: str | None,
                                 password: bytes | None, source: str = "") -> int:
        """`authenticate` for a client at the `source` address, with the hash computed
        in the bounded pool; Server busy or Connection rate exceeded instead of a hash
        when the pool has no room or the source is backed off (module docstring)."""
        check = self._precheck(username, password)
        if isinstance(check, int):
            return check
        if self._backoff.backed_off(source):
            LOGINS_REFUSED.labels("backoff").inc()
            return CONNECTION_RATE_EXCEEDED
        try:
            verified = await self._hash_pool.run(
                source, functools.partial(verify_password, check.password, check.encoded))
        except ServerBusy:
            return SERVER_BUSY
        if not verified:
            self._backoff.failed(source)
        return self._finish(check, verified)

    # --- authorization -----------------------------------------------------------------

    def authorize_publish(self, client_id: str, username: str | None, topic: str,
                          levels: list[str] | None = None) -> bool:
        """Whether the client may publish to the topic name (an invalid one: no), a
        will included. `$SYS` topics are the broker's: no client publishes there,
        whatever the ACL says. `levels`: the topic's levels when the caller has
        validated it already."""
        if is_system_topic(topic):
            return False
        return self.acl.allows("publish", client_id, username, topic, levels)

    def authorize_subscribe(self, client_id: str, username: str | None,
                            topic_filter: str) -> bool:
        """Whether the client may subscribe to the filter (an invalid one: no)."""
        return self.acl.allows("subscribe", client_id, username, topic_filter)

    def authorize_delivery(self, client_id: str, username: str | None, topic: str) -> bool:
        """Whether a message on the topic name may reach the client through a
        subscription `authorize_subscribe` allows (subscribe rules on every delivery)."""
        return self.acl.allows_delivery(client_id, username, topic)

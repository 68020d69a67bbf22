"""Who may call `/api/v1`: a bearer token and/or HTTP basic credentials from the
`admin` config section, or, with neither configured, a token generated on first
start and kept in `<data_dir>/admin-token` (mode 0600)."""

from __future__ import annotations

import base64
import binascii
import hmac
import logging
import secrets
from dataclasses import dataclass
from pathlib import Path

from ..config import AdminConfig
from ..errors import ConfigError
from ..files import write_atomically

log = logging.getLogger(__name__)

TOKEN_FILE = "admin-token"
MIN_TOKEN_LENGTH = 16


@dataclass(frozen=True, slots=True)
class Credentials:
    """What an `Authorization` header must carry: the token (as `Bearer`), or the
    user name and password (as `Basic`). None: that scheme is not accepted."""

    token: str | None = None
    username: str | None = None
    password: str | None = None

    @property
    def basic(self) -> bool:
        return self.username is not None and self.password is not None

    def challenges(self) -> list[str]:
        """`WWW-Authenticate` values for a 401, one per accepted scheme."""
        found = []
        if self.token is not None:
            found.append('Bearer realm="stratamq"')
        if self.basic:
            found.append('Basic realm="stratamq", charset="UTF-8"')
        return found

    def check(self, authorization: str | None) -> bool:
        """True when the header carries valid credentials. Secrets are compared in
        constant time; which part of a basic pair was wrong is not observable."""
        if not authorization:
            return False
        scheme, _, value = authorization.strip().partition(" ")
        value = value.strip()
        if scheme.lower() == "bearer" and self.token is not None:
            return hmac.compare_digest(value.encode(), self.token.encode())
        if scheme.lower() == "basic" and self.username is not None \
                and self.password is not None:
            try:
                decoded = base64.b64decode(value, validate=True).decode("utf-8")
            except (binascii.Error, UnicodeDecodeError):
                return False
            username, colon, password = decoded.partition(":")
            user_ok = hmac.compare_digest(username.encode(), self.username.encode())
            password_ok = hmac.compare_digest(password.encode(), self.password.encode())
            return bool(colon) & user_ok & password_ok
        return False


def resolve_credentials(config: AdminConfig, data_dir: Path) -> Credentials:
    """The configured credentials; with none, the stored (or a new) token."""
    if (config.username is None) != (config.password is None):
        raise ConfigError("admin.username and admin.password must be set together")
    if config.token is not None or config.username is not None:
        return Credentials(config.token, config.username, config.password)
    return Credentials(token=load_or_create_token(data_dir / TOKEN_FILE))


def load_or_create_token(path: Path) -> str:
    """Read the token at `path`; create it (0600, written atomically) when there is
    none, and log it once at WARNING so the operator can find it."""
    try:
        token = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        token = ""
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the admin API token: {exc}") from exc
    if len(token) >= MIN_TOKEN_LENGTH:
        return token
    token = secrets.token_urlsafe(32)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, token + "\n")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot store the admin API token: {exc}") from exc
    # The path only: logs are read by more people than the 0600 file.
    log.warning("admin API token generated and stored in %s", path)
    return token

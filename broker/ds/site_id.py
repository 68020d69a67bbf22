"""The site id: this site's storage identity, a random id created when the storage
first opens and kept in `<data_dir>/site-id` (on the pod's persistent volume),
written atomically with fsync of file and folder."""

from __future__ import annotations

import logging
import re
import secrets
from pathlib import Path

from ..errors import ConfigError
from ..files import write_atomically

log = logging.getLogger(__name__)

SITE_ID_FILE = "site-id"
_SITE_ID = re.compile(r"[0-9A-F]{16}")


def load_or_create_site_id(data_dir: Path) -> str:
    """The id stored in `data_dir/site-id`, or a new one (16 hex digits, as EMQX's)."""
    path = data_dir / SITE_ID_FILE
    try:
        stored = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        stored = None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the site id: {exc}") from exc
    if stored is not None:
        if not _SITE_ID.fullmatch(stored):
            raise ConfigError(f"{path}: not a site id ({stored[:40]!r}); expected 16 hex "
                              f"digits. Restore the file or remove it with the data")
        return stored
    site_id = secrets.token_hex(8).upper()
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        write_atomically(path, site_id + "\n")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot store the site id: {exc}") from exc
    log.info("new site id %s (stored in %s)", site_id, path)
    return site_id

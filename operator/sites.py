"""The sites' admin API, as the operator calls it (blocking; called from Kopf's
thread pool): which site a pod's broker is."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

# A site answers from memory; a slow answer means a stuck site, which must not hold
# up the status of the others for long.
TIMEOUT_SECONDS = 5.0


class SiteUnreachableError(Exception):
    """The pod's admin API did not answer with its site."""


def site_id(ip: str, port: int, token: str) -> str:
    """The id of the site at ip:port (`GET /api/v1/ds/sites`: a site lists itself)."""
    request = urllib.request.Request(f"http://{ip}:{port}/api/v1/ds/sites",
                                     headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_SECONDS) as response:
            body = json.load(response)
    except (urllib.error.URLError, OSError, ValueError) as error:
        raise SiteUnreachableError(f"{ip}:{port}: {error}") from error
    try:
        found: str = body["data"][0]["site"]
    except (KeyError, IndexError, TypeError) as error:
        raise SiteUnreachableError(f"{ip}:{port}: unexpected answer {body!r}") from error
    return found

"""Times as the Kubernetes API writes them (RFC 3339, UTC, whole seconds): in status
fields, conditions and Events. One format for the whole operator."""

from __future__ import annotations

import datetime

FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def timestamp(seconds: float) -> str:
    """RFC 3339, as the API server writes times."""
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime(FORMAT)


def seconds_of(stamp: str) -> float:
    """The inverse of `timestamp`."""
    return datetime.datetime.strptime(stamp, FORMAT).replace(
        tzinfo=datetime.UTC).timestamp()

"""MQTT topic names and filters (MQTT 5.0 section 4.7): validation, splitting, matching."""

from __future__ import annotations

from .errors import InvalidTopicError, InvalidTopicFilterError

MAX_TOPIC_BYTES = 65535
# A shared subscription: `$share/<group>/<filter>` (MQTT 5.0 section 4.8.2).
SHARE_PREFIX = "$share/"
# The broker's own topics (MQTT 5.0 section 4.7.2): no client publishes there.
SYSTEM_TOPIC_ROOT = "$SYS"


def _check_common(text: str, error: type[InvalidTopicError] | type[InvalidTopicFilterError],
                  kind: str) -> None:
    if not text:
        raise error(f"{kind} must not be empty")
    if "\x00" in text:
        raise error(f"{kind} must not contain U+0000: {text!r}")
    # One character is at most 4 bytes: shorter text needs no encoding to check its size.
    if len(text) * 4 > MAX_TOPIC_BYTES or not text.isascii():
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise error(f"{kind} is not valid UTF-8: {text!r}") from exc
        if size > MAX_TOPIC_BYTES:
            raise error(f"{kind} is longer than {MAX_TOPIC_BYTES} bytes")


def check_topic(topic: str) -> None:
    """Check a topic name a client publishes to."""
    _check_common(topic, InvalidTopicError, "topic name")
    if "+" in topic or "#" in topic:
        raise InvalidTopicError(f"topic name must not contain wildcards: {topic!r}")


def validate_topic(topic: str) -> list[str]:
    """Check a topic name a client publishes to and return its levels."""
    check_topic(topic)
    return topic.split("/")


def validate_filter(topic_filter: str) -> list[str]:
    """Check a topic filter a client subscribes to and return its levels."""
    _check_common(topic_filter, InvalidTopicFilterError, "topic filter")
    levels = topic_filter.split("/")
    for position, level in enumerate(levels):
        if level == "#":
            if position != len(levels) - 1:
                raise InvalidTopicFilterError(
                    f"'#' must be the last level of a topic filter: {topic_filter!r}")
        elif level != "+" and ("+" in level or "#" in level):
            raise InvalidTopicFilterError(
                f"a wildcard must occupy a whole level: {topic_filter!r}")
    return levels


def is_system_topic(topic: str) -> bool:
    """Whether a topic name is the broker's: `$SYS` or under `$SYS/`."""
    return topic == SYSTEM_TOPIC_ROOT or topic.startswith(SYSTEM_TOPIC_ROOT + "/")


def is_wildcard(topic_filter: str) -> bool:
    return "+" in topic_filter or "#" in topic_filter


def levels_match(filter_levels: list[str], topic_levels: list[str]) -> bool:
    """Whether a topic (as levels) matches a filter (as levels), with the `$` rule:
    a filter starting with a wildcard never matches a topic starting with `$`."""
    if topic_levels and topic_levels[0].startswith("$") and filter_levels \
            and filter_levels[0] in ("+", "#"):
        return False
    for position, want in enumerate(filter_levels):
        if want == "#":
            return True
        if position >= len(topic_levels):
            return False
        if want != "+" and want != topic_levels[position]:
            return False
    return len(filter_levels) == len(topic_levels)


def topic_matches(topic_filter: str, topic: str) -> bool:
    return levels_match(topic_filter.split("/"), topic.split("/"))

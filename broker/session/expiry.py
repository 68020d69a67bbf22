"""Message expiry (MQTT 5.0 section 3.3.2.3.3): one computation for every place that
asks whether a message has expired or how long it has left."""

from __future__ import annotations

import time

from ..ds import Message


def expiry_left_us(message: Message, now_us: int) -> int | None:
    """Microseconds the message has left before it expires (0 or less: expired), or
    None when it never expires. Its interval counts from its timestamp."""
    expiry = message.properties.message_expiry_interval
    if expiry is None:
        return None
    return expiry * 1_000_000 - (now_us - message.timestamp)


def is_expired(message: Message, now_us: int | None = None) -> bool:
    """Whether the message has expired; the clock is read (when `now_us` is None)
    only for a message that can expire."""
    if message.properties.message_expiry_interval is None:
        return False
    left = expiry_left_us(message, time.time_ns() // 1000 if now_us is None else now_us)
    return left is not None and left <= 0


def remaining_interval(message: Message, now_us: int) -> int | None:
    """The Message Expiry Interval to forward: whole seconds left, rounded up, at
    least 1 (MQTT-3.3.2-6); None when the message never expires."""
    left = expiry_left_us(message, now_us)
    return None if left is None else max(-(-left // 1_000_000), 1)

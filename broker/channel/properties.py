"""MQTT properties of a PUBLISH or a will <-> the properties stored with a message."""

from __future__ import annotations

import time

from ..ds import Message, MessageProperties
from ..mqtt import NO_PROPERTIES, Properties
from ..session.expiry import remaining_interval

__all__ = ["NO_PROPERTIES", "to_message_properties", "to_publish_properties"]


def to_message_properties(properties: Properties) -> MessageProperties:
    return MessageProperties(
        payload_format_indicator=properties.payload_format_indicator,
        message_expiry_interval=properties.message_expiry_interval,
        content_type=properties.content_type,
        response_topic=properties.response_topic,
        correlation_data=properties.correlation_data,
        user_properties=tuple(properties.user_properties),
    )


def to_publish_properties(message: Message, subscription_ids: tuple[int, ...]) -> Properties:
    """The MQTT 5 properties of an outbound PUBLISH; the expiry interval is what is
    left of it (MQTT-3.3.2-6)."""
    properties = Properties()
    source = message.properties
    properties.payload_format_indicator = source.payload_format_indicator
    properties.content_type = source.content_type
    properties.response_topic = source.response_topic
    properties.correlation_data = source.correlation_data
    properties.user_properties = list(source.user_properties)
    if source.message_expiry_interval is not None:
        properties.message_expiry_interval = remaining_interval(message,
                                                                time.time_ns() // 1000)
    properties.subscription_identifiers = list(subscription_ids)
    return properties

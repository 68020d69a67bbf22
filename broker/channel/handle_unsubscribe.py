"""UNSUBSCRIBE: drop and unroute each filter, UNSUBACK."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..mqtt import MQTT_5, ReasonCode, Unsuback, Unsubscribe

if TYPE_CHECKING:
    from .channel import Channel


async def handle_unsubscribe(channel: Channel, packet: Unsubscribe) -> None:
    session = channel.attached_session()
    broker = channel.broker
    codes: list[int] = []
    for raw_filter in packet.topic_filters:
        removed = session.unsubscribe(raw_filter)
        if removed is not None:
            broker.dispatcher.unroute(session, removed)
            codes.append(ReasonCode.SUCCESS)
        else:
            codes.append(ReasonCode.NO_SUBSCRIPTION_EXISTED)
    if session.durable:
        await broker.registry.persist(session)
    channel.send(Unsuback(packet.packet_id, codes if channel.level == MQTT_5 else []))

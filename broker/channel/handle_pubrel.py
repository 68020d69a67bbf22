"""PUBREL: the client releases an inbound QoS 2 message; PUBCOMP once its packet id
is forgotten durably."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from ..mqtt import MQTT_5, Pubcomp, Pubrel, ReasonCode

if TYPE_CHECKING:
    from .channel import Channel


def handle_pubrel(channel: Channel, packet: Pubrel) -> None:
    session = channel.attached_session()
    packet_id = packet.packet_id
    if not session.inbound_qos2.to_release(packet_id):
        channel.send(Pubcomp(packet_id, ReasonCode.SUCCESS if channel.level < MQTT_5
                             else ReasonCode.PACKET_IDENTIFIER_NOT_FOUND))
        return
    released = asyncio.gather(*channel.broker.publisher.release_qos2(
        channel.client_id, packet_id, session.owner_epoch))
    # first: the session knows the outcome before the client hears it
    session.inbound_qos2.releasing(packet_id, released)
    released.add_done_callback(lambda future: _released(channel, packet_id, future))


def _released(channel: Channel, packet_id: int, future: asyncio.Future[list[None]]) -> None:
    """The packet id is forgotten durably: only now may the client reuse it."""
    # Read the outcome even when closing: asyncio logs an exception never read.
    failed = future.cancelled() or future.exception() is not None
    if channel.closing:  # the connection is gone: nobody else asks
        return
    if failed:
        channel.disconnect(ReasonCode.UNSPECIFIED_ERROR)
        channel.close_transport()
        return
    channel.send(Pubcomp(packet_id))

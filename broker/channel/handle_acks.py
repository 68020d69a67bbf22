"""PUBACK, PUBREC and PUBCOMP: the client acknowledges a message the session sent."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..mqtt import Puback, Pubcomp, Pubrec, ReasonCode

if TYPE_CHECKING:
    from .channel import Channel


def handle_puback(channel: Channel, packet: Puback) -> None:
    channel.attached_session().outbox.on_puback(packet.packet_id)


async def handle_pubrec(channel: Channel, packet: Pubrec) -> None:
    await channel.attached_session().outbox.on_pubrec(
        packet.packet_id, packet.reason_code >= ReasonCode.UNSPECIFIED_ERROR)


def handle_pubcomp(channel: Channel, packet: Pubcomp) -> None:
    channel.attached_session().outbox.on_pubcomp(packet.packet_id)

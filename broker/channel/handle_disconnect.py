"""DISCONNECT from the client: a last session expiry, and whether the will goes out."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..mqtt import Disconnect, ReasonCode
from ..net.read_loop import ConnectionClosed

if TYPE_CHECKING:
    from .channel import Channel


def handle_disconnect(channel: Channel, packet: Disconnect) -> None:
    session = channel.attached_session()
    requested = packet.properties.session_expiry_interval
    if requested is not None:
        if session.expiry_interval == 0 and requested > 0:
            channel.disconnect(ReasonCode.PROTOCOL_ERROR)  # may not turn durable at the end
            raise ConnectionClosed()
        session.set_expiry_interval(requested)  # 0: the session ends with this connection
    # Only a normal disconnection discards the will; DISCONNECT_WITH_WILL_MESSAGE asks
    # for it, and an error code leaves it in place (MQTT 5.0 sections 3.1.2.5, 3.14.4).
    channel.will_on_close = packet.reason_code != ReasonCode.NORMAL_DISCONNECTION
    raise ConnectionClosed()

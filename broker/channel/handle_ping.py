"""PINGREQ: answer PINGRESP (the read itself has reset the keep alive deadline)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..mqtt import Pingreq, Pingresp

if TYPE_CHECKING:
    from .channel import Channel


def handle_pingreq(channel: Channel, _packet: Pingreq) -> None:
    channel.send(Pingresp())

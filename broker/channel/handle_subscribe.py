"""SUBSCRIBE: check and route each filter, SUBACK, then the retained messages (sent
by the connection's RetainedSender as the session's queue has room)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..errors import StratamqError
from ..mqtt import ReasonCode, Suback, Subscribe
from ..net.read_loop import ConnectionClosed
from ..session.model import Subscription, split_shared
from ..topic import validate_filter

if TYPE_CHECKING:
    from .channel import Channel


async def handle_subscribe(channel: Channel, packet: Subscribe) -> None:
    session = channel.attached_session()
    broker = channel.broker
    identifiers = packet.properties.subscription_identifiers
    identifier = identifiers[0] if identifiers else None
    codes: list[int] = []
    retained_to_send: list[Subscription] = []
    added: list[Subscription] = []
    for raw_filter, options in packet.subscriptions:
        try:
            group, topic_filter = split_shared(raw_filter)
            levels = validate_filter(topic_filter)
        except (ValueError, StratamqError):
            codes.append(ReasonCode.TOPIC_FILTER_INVALID)
            continue
        if len(levels) > channel.limits.max_topic_levels:
            codes.append(ReasonCode.TOPIC_FILTER_INVALID)
            continue
        if group is not None and options.no_local:
            channel.disconnect(ReasonCode.PROTOCOL_ERROR)  # no local on a shared one
            raise ConnectionClosed()
        if not channel.access.authorize_subscribe(channel.client_id, channel.username,
                                                  raw_filter):
            codes.append(ReasonCode.NOT_AUTHORIZED)
            continue
        subscription = Subscription(topic_filter, options.qos, options.no_local,
                                    options.retain_as_published, options.retain_handling,
                                    identifier, group, time.time_ns() // 1000)
        if subscription.key not in session.subscriptions \
                and len(session.subscriptions) >= channel.limits.max_subscriptions:
            codes.append(ReasonCode.QUOTA_EXCEEDED)  # 0x80 in 3.1.1 (the codec maps it)
            continue
        is_new = session.subscribe(subscription)
        broker.dispatcher.route(session, subscription)
        added.append(subscription)
        codes.append(options.qos)  # the granted QoS is its reason code
        if group is None and (options.retain_handling == 0
                              or (options.retain_handling == 1 and is_new)):
            retained_to_send.append(subscription)
    # Retained messages set from now on reach the routes just made live: the ones to
    # send are those set before (taken here, before anything below awaits).
    asked_us = time.time_ns() // 1000
    # One look for the streams of this packet's filters, not one per filter: each look
    # over all subscriptions made a large SUBSCRIBE quadratic.
    session.streams.renew(added)
    if session.durable:
        await broker.registry.persist(session)
    if session.outlives_connection:
        # Its shared groups are stored with it as a member before the SUBACK: the
        # session can then move to another site at once and take them along.
        joined = {subscription.group_key for subscription in added
                  if subscription.share_group is not None}
        if joined:
            await broker.shared_positions.save_joined(joined)
    for subscription in retained_to_send:
        channel.retained.add(session, subscription, asked_us)
    await channel.retained.read_ahead()
    channel.send(Suback(packet.packet_id, codes))
    channel.retained.start()

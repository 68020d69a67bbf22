"""Bytes on the peer port for reads of a shard held elsewhere: `next` answers and
mirrored generations. Pure: no I/O."""

from __future__ import annotations

import json
import struct

from ...errors import CorruptDataError
from ..generation import GenerationInfo
from ..iterator import END_OF_STREAM, EndOfStream, Iterator
from ..lts import Edge
from ..message import Message, decode_message, encode_message
from ..rocks import blob, read_blob

_U8 = struct.Struct(">B")
_U32 = struct.Struct(">I")

NextAnswer = tuple[Iterator, list[tuple[bytes, Message]]] | EndOfStream


def encode_next(result: NextAnswer) -> bytes:
    if isinstance(result, EndOfStream):
        return _U8.pack(0)
    iterator, batch = result
    parts = [_U8.pack(1), blob(iterator.to_bytes()), _U32.pack(len(batch))]
    for key, message in batch:
        parts += (blob(key), blob(encode_message(message)))
    return b"".join(parts)


def decode_next(raw: bytes) -> NextAnswer:
    try:
        (kind,) = _U8.unpack_from(raw)
        if kind == 0 and len(raw) == 1:
            return END_OF_STREAM
        if kind != 1:
            raise ValueError(f"unknown answer kind {kind}")
        iterator_bytes, pos = read_blob(raw, 1)
        (count,) = _U32.unpack_from(raw, pos)
        pos += 4
        batch = []
        for _ in range(count):
            key, pos = read_blob(raw, pos)
            value, pos = read_blob(raw, pos)
            batch.append((key, decode_message(value)))
        if pos != len(raw):
            raise ValueError("trailing bytes")
        return Iterator.from_bytes(iterator_bytes), batch
    except (ValueError, struct.error, CorruptDataError) as exc:
        raise CorruptDataError(f"a next answer does not decode: {exc}") from exc


MirrorDoc = dict[int, tuple[GenerationInfo, list[Edge]]]


def encode_generations(generations: MirrorDoc) -> bytes:
    return json.dumps([
        {"info": json.loads(info.to_json()),
         "edges": [[edge.parent.hex(), edge.label, edge.child.hex()] for edge in edges]}
        for _id, (info, edges) in sorted(generations.items())]).encode()


def decode_generations(raw: bytes) -> MirrorDoc:
    try:
        found: MirrorDoc = {}
        for item in json.loads(raw):
            info = GenerationInfo(**item["info"])
            found[info.id] = (info, [Edge(bytes.fromhex(parent), label, bytes.fromhex(child))
                                     for parent, label, child in item["edges"]])
        return found
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptDataError(f"mirrored generations do not decode: {exc}") from exc

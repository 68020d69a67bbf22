"""Durable storage: databases, shards, generations, streams and iterators on RocksDB
(see DESIGN.md, "Data model")."""

from .cooked import CookedBatch
from .database import Database, shard_of
from .generation import GenerationInfo
from .iterator import END_OF_STREAM, EndOfStream, Iterator, Rank, Stream
from .message import Message, MessageProperties
from .options import DbOptions
from .storage import DurableStorage

__all__ = [
    "END_OF_STREAM",
    "CookedBatch",
    "Database",
    "DbOptions",
    "DurableStorage",
    "EndOfStream",
    "GenerationInfo",
    "Iterator",
    "Message",
    "MessageProperties",
    "Rank",
    "Stream",
    "shard_of",
]

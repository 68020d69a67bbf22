"""Durable storage: databases, shards, generations, streams and iterators on RocksDB
(see docs/architecture.md, "Data model"). This package's names are the storage's one public
API: the rest of the broker imports from here, never from the modules below."""

from .backend import Backend, Consistency, LocalBackend
from .cooked import CookedBatch
from .database import Database
from .describe import DbDescription, GenerationDescription, ShardDescription
from .digest import DIGEST_DIR, ShardDigest
from .fence import Fence, FencedError
from .generation import GenerationInfo
from .iterator import END_OF_STREAM, EndOfStream, Iterator, Rank, Stream
from .kv import KvDatabase, kv_options
from .message import (
    Message,
    MessageProperties,
    decode_message,
    encode_message,
    peek_timestamp,
    peek_topic,
)
from .options import DbOptions
from .replication.remote import RemoteReads
from .replication.replica_context import ReplicaSettings
from .replication.site_replication import PeerService, SiteReplication
from .retention import RetentionRules
from .rocks import blob, read_blob
from .shard import now_us
from .shard_set import DropListener, NextResult, PreDropListener, shard_of
from .snapshot import MANIFEST_FILE, ShardSnapshot, Snapshot
from .storage import BackendOf, DurableStorage

__all__ = [
    "DIGEST_DIR",
    "END_OF_STREAM",
    "MANIFEST_FILE",
    "Backend",
    "BackendOf",
    "Consistency",
    "CookedBatch",
    "Database",
    "DbDescription",
    "DbOptions",
    "DropListener",
    "DurableStorage",
    "EndOfStream",
    "Fence",
    "FencedError",
    "GenerationDescription",
    "GenerationInfo",
    "Iterator",
    "KvDatabase",
    "LocalBackend",
    "Message",
    "MessageProperties",
    "NextResult",
    "PeerService",
    "PreDropListener",
    "Rank",
    "RemoteReads",
    "ReplicaSettings",
    "RetentionRules",
    "ShardDescription",
    "ShardDigest",
    "ShardSnapshot",
    "SiteReplication",
    "Snapshot",
    "Stream",
    "blob",
    "decode_message",
    "encode_message",
    "kv_options",
    "now_us",
    "peek_timestamp",
    "peek_topic",
    "read_blob",
    "shard_of",
]

"""Storage metrics (prometheus-client), named after EMQX's `emqx_ds_builtin_metrics`
where they map. Labels are the database and the shard."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from ..metrics import LoopCounter

_LABELS = ("db", "shard")
_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                    0.25, 0.5, 1.0, 2.5, 5.0)

BUFFER_BATCHES = Counter("stratamq_ds_buffer_batches", "Write-buffer flushes committed",
                         _LABELS)
BUFFER_INLINE_REFUSED = Counter(
    "stratamq_ds_buffer_inline_refused",
    "Small write-buffer flushes RocksDB would have stalled on the event loop, "
    "written from the executor instead", _LABELS)
BUFFER_BATCHES_FAILED = Counter("stratamq_ds_buffer_batches_failed",
                                "Write-buffer flushes whose commit failed", _LABELS)
BUFFER_MESSAGES = Counter("stratamq_ds_buffer_messages", "Messages committed from the buffer",
                          _LABELS)
BUFFER_BYTES = Counter("stratamq_ds_buffer_bytes", "Payload bytes committed from the buffer",
                       _LABELS)
BUFFER_RECORD_BYTES = Counter(
    "stratamq_ds_buffer_record_bytes",
    "Record bytes committed from the buffer: keys and values put, keys deleted "
    "(key-value databases, QoS 2 records; owner epochs not counted)", _LABELS)
# Read when /metrics is scraped (set_function): nothing on the write path.
BUFFER_QUEUED_BYTES = Gauge("stratamq_ds_buffer_queued_bytes",
                            "Bytes queued in a shard's write buffer, not written yet", _LABELS)
BUFFER_QUEUED_BYTES_PEAK = Gauge("stratamq_ds_buffer_queued_bytes_peak",
                                 "Most bytes a shard's write buffer has held queued", _LABELS)
BUFFER_FLUSH_TIME = Histogram("stratamq_ds_buffer_flush_time_seconds",
                              "Time to cook and commit one buffer flush", _LABELS,
                              buckets=_LATENCY_BUCKETS)
STORE_BATCH_TIME = Histogram("stratamq_ds_store_batch_time_seconds",
                             "Time from store_batch to durable, per call", ("db",),
                             buckets=_LATENCY_BUCKETS)
NEXT_TIME = Histogram("stratamq_ds_next_time_seconds", "Time of one iterator next call",
                      ("db",), buckets=_LATENCY_BUCKETS)
# Counted on the event loop after each read (lock-free, see LoopCounter), per
# database and layout, so layouts can be compared on one dashboard.
LAYOUT_SEEK = LoopCounter("stratamq_ds_layout_seek", "RocksDB seeks made by layout reads",
                          ("db", "layout"))
LAYOUT_NEXT = LoopCounter("stratamq_ds_layout_next", "Entries stepped over by layout reads",
                          ("db", "layout"))
LTS_FOLDED_TOPICS = LoopCounter(
    "stratamq_ds_lts_folded_topics",
    "Topics mapped into a folded stream of the learned topic structure: past its "
    "learned_topic_max_levels or learned_topic_bytes (counted per mapping not cached)",
    ("db",))
# Read when /metrics is scraped (set_function).
LTS_BYTES = Gauge("stratamq_ds_lts_bytes",
                  "Estimated bytes of a shard's learned topic structures, all generations",
                  _LABELS)
LAYOUT_HASH_COLLISIONS = LoopCounter(
    "stratamq_ds_layout_hash_collisions",
    "Entries a layout read found under the reader's key whose topic the reader did not "
    "want (level hashes or topic index bytes shared by another topic)", ("db", "layout"))
COMMIT_LATENCY = Histogram(
    "stratamq_ds_commit_latency_seconds",
    "Time from a write entering a shard's buffer to durable, for the oldest write of each "
    "flush: the slowest acknowledgement (PUBACK, PUBREC, session write) the flush releases",
    _LABELS, buckets=_LATENCY_BUCKETS)
# Measured off the event loop just before each scrape (DurableStorage.refresh_disk_metrics).
DISK_BYTES = Gauge("stratamq_ds_disk_bytes", "Bytes a database's shards take on disk",
                   ("db",))
FILESYSTEM_FREE_BYTES = Gauge("stratamq_ds_filesystem_free_bytes",
                              "Bytes free on the filesystem of the data directory")
FILESYSTEM_SIZE_BYTES = Gauge("stratamq_ds_filesystem_size_bytes",
                              "Size of the filesystem of the data directory")
GENERATIONS = Gauge("stratamq_ds_generations", "Generations held by a shard", _LABELS)
# Replication (cluster.enable), read at scrape time (set_function) per shard replica.
REPLICA_LAG = Gauge("stratamq_ds_replica_lag",
                    "Entries of a shard's log on this site not applied to its data yet",
                    _LABELS)
UNDER_REPLICATED = Gauge(
    "stratamq_ds_under_replicated",
    "1 on a shard's leader while some replica does not hold every committed entry",
    _LABELS)
QUORUM_AGE = Gauge(
    "stratamq_ds_quorum_age_seconds",
    "On a shard's leader: seconds since a majority of its replicas last answered it "
    "(0 elsewhere); the controller fails the shard over once it passes a site's "
    "allowance of missed heartbeats",
    _LABELS)
REPLICA_ROLE = Gauge("stratamq_ds_replica_leader",
                     "1 while this site leads the shard, else 0", _LABELS)
LOG_CUTS_REFUSED = Counter(
    "stratamq_ds_log_cuts_refused",
    "Cuts of a shard log's committed entries refused on this site (a leader without "
    "them, a truncate below the commit offset, a bootstrap that would roll back what was "
    "applied): a replica was asked to diverge", _LABELS)
BOOTSTRAPS_REFUSED = Counter(
    "stratamq_ds_bootstraps_refused",
    "Bootstrap requests refused on this site because they came from a leader of an "
    "older epoch than this replica has seen (a deposed leader's late request)", _LABELS)
LEADER_CHANGES = Counter("stratamq_ds_leader_changes",
                         "Times this site started or stopped leading a shard", _LABELS)

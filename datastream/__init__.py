"""The data plane: record formats, sources, the shard producer and the trainers' consumer.

Sources (:func:`load_source`) become shards (:func:`encode_shard`) produced to a Kafka topic
(:func:`produce`); :class:`ShardConsumer` hands trainers :class:`Batch` objects with exact offset
ranges and sends what it cannot decode (:class:`DecodeError`) to ``<topic>.dlq``. See docs/records.md
(a trainer's loop: *Consuming: batches with exact offset ranges*).
"""

from .clicks import ClickStream
from .consumer import Batch, ConsumerClosedError, ConsumerStats, ShardConsumer
from .dlq import DeadLetterError, DeadLetterWriter, DlqEntry, parse_dlq_headers
from .examples import Examples
from .jagged import Jagged, concat_features
from .producer import ProduceReport, default_producer_id, iter_shards, produce
from .records import (
    DEFAULT_MAX_RECORD_BYTES,
    DENSE_SHARD_VERSION,
    LABEL_KINDS,
    MAX_ID_FEATURES,
    MAX_IDS_PER_FEATURE,
    REASONS,
    SHARD_VERSION,
    DecodeError,
    Records,
    decode_record,
    encode_json_record,
    encode_msgpack_record,
    encode_shard,
    hash_id,
)
from .sources import SPLITS, TEST_EVERY, Source, SourceError, load_source, split_mask
from .topics import dlq_topic, ensure_topic, reliable_producer, topic_replication

__all__ = [
    # consumer and its messages
    "Batch", "ConsumerClosedError", "ConsumerStats", "ShardConsumer",
    # producer
    "ProduceReport", "default_producer_id", "iter_shards", "produce",
    # record formats
    "DEFAULT_MAX_RECORD_BYTES", "DENSE_SHARD_VERSION", "LABEL_KINDS", "MAX_IDS_PER_FEATURE", "MAX_ID_FEATURES",
    "REASONS", "SHARD_VERSION", "DecodeError", "Records", "decode_record", "encode_json_record",
    "encode_msgpack_record", "encode_shard", "hash_id",
    # categorical IDs and examples
    "Examples", "Jagged", "concat_features",
    # sources
    "SPLITS", "TEST_EVERY", "ClickStream", "Source", "SourceError", "load_source", "split_mask",
    # dead letters and topics
    "DeadLetterError", "DeadLetterWriter", "DlqEntry", "dlq_topic", "ensure_topic", "parse_dlq_headers",
    "reliable_producer", "topic_replication",
]

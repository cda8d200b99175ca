"""The data plane: record formats, sources, the shard producer and the trainers' consumer.

Sources (:func:`load_source`) become shards (:func:`encode_shard`) produced to
a Kafka topic (:func:`produce`); :class:`ShardConsumer` hands trainers
:class:`Batch` objects with exact offset ranges, and sends what it cannot
decode (:class:`DecodeError`) to ``<topic>.dlq``. Formats: ``docs/records.md``.

A trainer's loop::

    with ShardConsumer(bootstrap, topic, max_records_per_batch=256, group_id=job) as consumer:
        consumer.assign({0: committed_offset_or_None, 3: None})   # from the coordinator
        while True:
            batch = consumer.poll(1.0)          # Batch | None; decoded in the background
            if batch is None:
                continue
            ...                                  # train on batch.x / batch.y / batch.ids (may be 0 rows)
            ...                                  # push with batch.offsets, batch.samples
            consumer.commit(batch.next_offsets)  # optional: lag in kafka-consumer-groups

On reassignment call ``assign`` again with the new ``partition -> start offset``.
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

"""Embedding tables that live only in the parameter plane (see ``docs/embeddings.md``).

Rows keyed by raw 64-bit IDs, created the first time an ID is admitted (no
hashing into a fixed-size table: two IDs never share a row), placed by ID
across the shard groups, pulled by a trainer for the IDs of its batch only,
and updated by a row optimizer where a gradient touches them.
"""

from .grads import RowGrads, decode_row_grads, encode_row_grads, split_by_group
from .optim import step_rows
from .rows import decode_values, encode_values, group_of_ids, initial_rows, pull_dtype, row_dtype
from .spec import (
                   POOLINGS,
                   ROW_OPTIMIZERS,
                   VALUE_DTYPES,
                   RowOptimizerConfig,
                   TableSpec,
                   tables_from_json,
                   tables_to_json,
)

__all__ = [
    # declaring tables
    "TableSpec",
    "RowOptimizerConfig",
    "ROW_OPTIMIZERS",
    "POOLINGS",
    "VALUE_DTYPES",
    "tables_to_json",
    "tables_from_json",
    # rows
    "row_dtype",
    "pull_dtype",
    "decode_values",
    "encode_values",
    "group_of_ids",
    "initial_rows",
    "step_rows",
    # row gradients on the wire
    "RowGrads",
    "encode_row_grads",
    "decode_row_grads",
    "split_by_group",
]

"""What one apply writes to a table's rows in its group (pure): :class:`TableWrites`, made by
``services.tables.apply.RowBatch`` and written by the group's atomic apply (``services.server.apply``);
a server's row memory (``services.tables.memory``) keeps the rows it wrote from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["TableWrites"]


@dataclass(frozen=True)
class TableWrites:
    """What one table's batch writes (all IDs int64; records as stored)."""

    table: str
    """Table name."""
    record_size: int
    """Bytes per row record."""
    row_ids: np.ndarray
    """IDs of the rows written (changed or born)."""
    rows: bytes
    """Their ``row_dtype`` records, concatenated in ``row_ids`` order."""
    seen_ids: np.ndarray
    """IDs whose sighting record changed."""
    seen: bytes
    """Their ``SEEN_DTYPE`` records."""
    unseen_ids: np.ndarray
    """IDs admitted by this batch whose sighting record goes."""
    steps: int
    """The table's step count after the batch."""
    admitted: int
    """Rows born."""
    dropped: int
    """Gradient rows dropped because their ID was not admitted yet."""

    @property
    def empty(self) -> bool:
        """Nothing to write but, perhaps, the step count."""
        return not (self.row_ids.size or self.seen_ids.size or self.unseen_ids.size)

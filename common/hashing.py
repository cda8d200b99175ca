"""SplitMix64's finaliser over numpy arrays: the one 64-bit mix of IDs (pure; numpy only).

Used where a fixed, well-spread bijection of 64-bit values is needed: the
``clicks`` source maps popularity ranks to IDs and derives its hidden per-ID
weights with it, and the parameter plane places rows across shard groups and
draws their initial values with it.
"""

from __future__ import annotations

import numpy as np

__all__ = ["mix64"]

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser of each uint64 of ``z`` (a bijection that spreads every bit), computed in
    place on a copy."""
    z = np.array(z, dtype=np.uint64)
    z ^= z >> _S30
    z *= _M1
    z ^= z >> _S27
    z *= _M2
    z ^= z >> _S31
    return z

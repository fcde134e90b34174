"""Caption dropout: whether a sample trains on the empty caption at a given place in the run.

The decision is a pure function of (seed, optimizer step, micro-batch, sample index), a keyed hash rather
than a draw from the loop's generator: the training's random stream is the same with dropout on or off,
chained and resumed runs make the same decisions as one long run, and every rank of a data-parallel run
agrees on them without communicating.
"""
from __future__ import annotations

import hashlib
import struct

_SCALE = float(2**64)


def uniform(seed: int, step: int, micro: int, index: int) -> float:
    """A number in [0, 1) that depends only on the four integers (blake2b of their 64-bit encodings)."""
    key = struct.pack("<4Q", *(int(v) % 2**64 for v in (seed, step, micro, index)))
    digest = hashlib.blake2b(key, digest_size=8, person=b"precision_cdrop").digest()
    return int.from_bytes(digest, "little") / _SCALE


def dropped(p: float, seed: int, step: int, micro: int, index: int) -> bool:
    """True when sample ``index`` trains on the empty caption in micro-batch ``micro`` of optimizer step
    ``step`` (0-based, counted over the whole run) of the run seeded with ``seed``; ``p`` in [0, 1]."""
    if p <= 0.0:
        return False
    return p >= 1.0 or uniform(seed, step, micro, index) < p

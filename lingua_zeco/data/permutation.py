"""A seeded permutation of range(n), computed one index at a time.

Used to shuffle a map-style dataset per epoch: the read position is just an index into the
permutation, and nothing of size n is ever held (an index array for a billion rows would be 8 GB per
rank and its shuffle an epoch-start stall). A balanced Feistel network is a bijection on [0, 4**h);
"cycle walking" (apply it again until the value lands below n) restricts it to a bijection on [0, n).
Pure integer arithmetic on a key hashed from a string: the same order on every machine and version.
"""
from __future__ import annotations

import hashlib

_M64 = (1 << 64) - 1
ROUNDS = 4  # Luby-Rackoff: four rounds of a pseudo-random function give a pseudo-random permutation


def _mix(x: int) -> int:
    """splitmix64's finalizer: a cheap 64-bit bijective mixer."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _M64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _M64
    return x ^ (x >> 31)


class Permutation:
    def __init__(self, n: int, key: str):
        if n < 1:
            raise ValueError(f"a permutation of {n} items")
        self.n = n
        self.half = max(1, ((n - 1).bit_length() + 1) // 2)  # 4**half >= n, so walks average < 4 steps
        self.mask = (1 << self.half) - 1
        digest = hashlib.blake2b(key.encode(), digest_size=8 * ROUNDS).digest()
        self.keys = [int.from_bytes(digest[8 * r:8 * r + 8], "little") for r in range(ROUNDS)]

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(i)
        x = i
        while True:
            left, right = x >> self.half, x & self.mask
            for k in self.keys:
                left, right = right, left ^ (_mix(right ^ k) & self.mask)
            x = (left << self.half) | right
            if x < self.n:
                return x

"""A keyed bijection of ``0..n-1`` evaluated per index in O(1) memory: the order of an epoch.

An epoch of 10^10 windows cannot keep a shuffled index (80 GB of int64) on every rank, and a
micro-batch must be able to say which windows it holds without anyone having drawn the ones
before it. A Feistel network on the smallest even number of bits that covers ``n`` is a bijection
of ``0..2^(2h)-1`` (each round only xors one half with a hash of the other, which is undone by
doing it again); cycle-walking -- applying it again while the value is ``>= n`` -- restricts it to a
bijection of ``0..n-1``, because following the cycle of an in-range point through out-of-range
points always comes back in range. ``2^(2h) < 4n``, so a walk takes fewer than 4 steps on average.
The round function is splitmix64 of (key, round, half): statistically random enough that a
window's position in one epoch says nothing of its position in the next.
"""
from __future__ import annotations

import numpy as np

from elaswave import rng

ROUNDS = 6
"""Four rounds already make a pseudorandom permutation (Luby-Rackoff); two more for a cheap margin."""

_U = np.uint64


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrap-around arithmetic is what it is made of)."""
    x = x + _U(0x9E3779B97F4A7C15)
    x = (x ^ (x >> _U(30))) * _U(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U(27))) * _U(0x94D049BB133111EB)
    return x ^ (x >> _U(31))


class Permutation:
    """``perm[i]`` for ``i`` in ``0..n-1``: a bijection keyed by ``keys`` (e.g. seed, purpose, epoch)."""

    def __init__(self, n: int, *keys: int):
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half_bits = (bits + 1) // 2
        self._mask = _U((1 << self.half_bits) - 1)
        self._round_keys = [_U(rng.stream_seed(*keys, r)) for r in range(ROUNDS)]

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        h = _U(self.half_bits)
        left, right = x >> h, x & self._mask
        for key in self._round_keys:
            left, right = right, left ^ (_mix(right ^ key) & self._mask)
        return (left << h) | right

    def __call__(self, index) -> np.ndarray:
        """The images of ``index`` (an int or an array of them), as int64."""
        i = np.asarray(index, dtype=np.int64)
        if i.size and (int(i.min()) < 0 or int(i.max()) >= self.n):
            raise IndexError(f"index {index} is out of range 0..{self.n - 1}")
        with np.errstate(over="ignore"):
            x = self._feistel(i.astype(_U).reshape(-1))
            out = x >= _U(self.n)
            while out.any():  # cycle-walking: ends, since every cycle through 0..n-1 comes back
                x[out] = self._feistel(x[out])
                out = x >= _U(self.n)
        return x.astype(np.int64).reshape(i.shape)

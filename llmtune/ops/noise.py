"""Counter-based random bits: a hash of (key, counter) in int32 tensor ops, so a draw is a pure function of where it
is drawn (an element's index, a row's seed and step), the same on every device, in every batch, compiled or not.

Used where noise must not depend on a generator's history: BF16AdamW's rounding (the same on DDP replicas, whole
or chunked) and GRPO's sampling (a completion the same whatever the rest of its batch), drawn on the device that
uses it with no host copy. Two strengths: `hashed_bits`, independent-looking bits for every element (sampling), and
`fast_bits`, a third of the work, uniform per element under a random key (rounding).
"""

from __future__ import annotations

import torch

# lowbias32 (C. Wellons' hash prospector): two multiply-xorshift rounds, full avalanche on 32 bits. In int32
# tensors (the width every backend vectorises): multiplication wraps, and the right shifts are masked into logical
# ones. 0x846CA68B as a signed int32.
_MUL1, _MUL2 = 0x7FEB352D, 0x846CA68B - 2**32
# 2^32 / the golden ratio, odd (0x9E3779B9 as a signed int32): successive multiples spread evenly over 2^32.
_GOLDEN = 0x9E3779B9 - 2**32


def mix(x: torch.Tensor) -> torch.Tensor:
    """32 hashed bits of each int32 element of `x`."""
    x = (x ^ ((x >> 16) & 0xFFFF)) * _MUL1
    x = (x ^ ((x >> 15) & 0x1FFFF)) * _MUL2
    return x ^ ((x >> 16) & 0xFFFF)


def hashed_bits(counter: torch.Tensor, key0: torch.Tensor | int, key1: torch.Tensor | int) -> torch.Tensor:
    """32 random bits per element of int32 `counter` under the key (key0, key1) (int32, broadcast)."""
    return mix(mix(counter ^ key0) ^ key1)


def fast_bits(counter: torch.Tensor, key: torch.Tensor | int) -> torch.Tensor:
    """32 bits per element of int32 `counter` under `key`: (counter ^ key) x an odd constant, its high half xored into
    its low, x another odd constant. Every step is a bijection of 32-bit words, so under a uniformly random key each
    element's word is exactly uniform: its two halves are independent 16-bit draws, independent of any other key's.
    The second multiply decorrelates neighbouring elements, except in the lowest bits of the low half (a product's low
    bits depend only on its factors' low bits: BF16AdamW's noise folds the high half in; tests/test_precision.py checks
    every pair of bits). One round, not lowbias32's full avalanche: enough for stochastic rounding, whose unbiasedness
    is per element and key, not for sampling. ~6 int ops, where `hashed_bits` takes ~25: on a CPU BF16AdamW's step is
    bound by this arithmetic."""
    x = (counter ^ key) * _GOLDEN
    return (x ^ ((x >> 16) & 0xFFFF)) * _MUL1


def uniform(bits: torch.Tensor) -> torch.Tensor:
    """Uniform fp32 in (0, 1) from the top 24 bits of `bits`: never 0 nor 1, so logs of it stay finite."""
    return (((bits >> 8) & 0xFFFFFF).float() + 0.5) * 2.0**-24

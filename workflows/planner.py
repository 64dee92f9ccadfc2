"""Every scaling decision, as pure functions: no I/O, no clocks, no randomness.

The TrainingJob workflow asks; this module answers. Being pure, it is safe in the workflow
sandbox, deterministic under replay, and exhaustively property-tested.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchSplit:
    """small*n_small + large*(world - n_small) == global; large == small + 1 (or equal)."""

    small: int
    large: int
    n_small: int


def uneven_batch(global_batch: int, world: int) -> BatchSplit:
    """Split a global batch over `world` ranks as evenly as integers allow."""
    if world < 1 or global_batch < world:
        raise ValueError(f"cannot split a batch of {global_batch} over {world} ranks")
    small, remainder = divmod(global_batch, world)
    return BatchSplit(small=small, large=small + (1 if remainder else 0), n_small=world - remainder)


def local_batch_size(global_batch: int, world: int, rank: int) -> int:
    """This rank's share: the first n_small ranks take the small batch, the rest the large."""
    split = uneven_batch(global_batch, world)
    return split.small if rank < split.n_small else split.large

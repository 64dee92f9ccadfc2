"""Every scaling decision, as pure functions: no I/O, no clocks, no randomness.

The TrainingJob workflow asks; this module answers. Being pure, it is safe in the workflow
sandbox, deterministic under replay, and exhaustively property-tested.
"""

from __future__ import annotations

from collections import Counter
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


def allowed_sizes(
    min_nodes: int, max_nodes: int, step: int | None, discrete: list[int] | None
) -> list[int]:
    """Node counts the job may run at, ascending."""
    if discrete is not None:
        return sorted(set(discrete))
    return list(range(min_nodes, max_nodes + 1, step or 1))


def best_size(available: int, sizes: list[int], cap: int | None = None) -> int | None:
    """The largest allowed size that `available` ready nodes can fill, at most `cap`."""
    limit = available if cap is None else min(available, cap)
    fitting = [s for s in sizes if s <= limit]
    return max(fitting) if fitting else None


@dataclass(frozen=True)
class Candidate:
    """A ready node as the planner sees it."""

    slot: int
    lifecycle: str  # "spot" | "on-demand"
    base: bool = False


def choose_members(current: list[int], ready: list[Candidate], size: int) -> list[int]:
    """Pick `size` ready slots in rank order for the next generation.

    Preference: on-demand base nodes (never reclaimed), then spot, then on-demand fallback;
    within each, current members first so ranks (and rank 0, the master) stay stable.
    The chosen set keeps the current members' relative order; newcomers go last.
    """
    position = {slot: i for i, slot in enumerate(current)}

    def preference(c: Candidate) -> tuple[int, int, int]:
        tier = 0 if c.base else (1 if c.lifecycle == "spot" else 2)
        return (tier, position.get(c.slot, len(current)), c.slot)

    chosen = {c.slot for c in sorted(ready, key=preference)[:size]}
    return [s for s in current if s in chosen] + sorted(chosen - set(current))


def scale_in_victims(members: list[str], count: int | None, named: list[str] | None) -> list[str]:
    """Nodes to remove: exactly the named ones, or the `count` highest ranks."""
    if named is not None:
        return [n for n in members if n in set(named)]
    return list(reversed(members))[: count or 0]


def diversify(
    offers: list[tuple[str, str]], held: dict[tuple[str, str], int], count: int
) -> list[tuple[str, str]]:
    """Assign `count` new nodes to (type, zone) pools, spreading over pools instead of piling
    into one: each goes to the pool holding fewest nodes, ties broken by offer order."""
    load = {pool: held.get(pool, 0) for pool in offers}
    picks = []
    for _ in range(count):
        if not offers:
            break
        pool = min(offers, key=lambda p: (load[p], offers.index(p)))
        load[pool] += 1
        picks.append(pool)
    return picks


def spot_pools(
    offers: list[tuple[str, str]],
    gpus: dict[str, int],
    need: int,
    held: dict[tuple[str, str], int],
    *,
    fill_zones: bool = False,
) -> list[tuple[str, str]]:
    """Where to buy the next spot node, best first ([]: nowhere, fall back or wait).

    Only pools whose shape holds the node's share of GPUs (`need`); the snuggest shape first
    (fewest idle GPUs); among pools of that shape the one holding fewest of the job's nodes
    first (diversified over pools); then every other fitting pool, to fall over to. With
    `fill_zones` (a job that may span zones), pools in the zones holding most of the job's
    nodes come first, so that each step's ring crosses as few zones as the capacity allows;
    the other zones' pools are where it falls over to once those run out."""
    fitting = sorted((p for p in offers if gpus[p[0]] >= need), key=lambda p: gpus[p[0]])
    if not fitting:
        return []
    if fill_zones:
        in_zone = Counter[str]()
        for (_, zone), count in held.items():
            in_zone[zone] += count
        fitting.sort(key=lambda p: (gpus[p[0]], -in_zone[p[1]]))  # (stable: offer order)
    shape, zone = gpus[fitting[0][0]], fitting[0][1]
    snug = [p for p in fitting if gpus[p[0]] == shape and (not fill_zones or p[1] == zone)]
    (pick,) = diversify(snug, held, 1)
    return [pick, *(p for p in fitting if p != pick)]


def pack_gpus(total: int, shapes: list[int]) -> list[tuple[int, int]]:
    """Pack `total` GPUs onto node shapes (GPUs per node): (shape, GPUs used) per node.

    Fewest nodes first: fill the largest shape while the rest exceeds it, then take the
    smallest shape that holds the remainder (15 over {10, 8} -> (10,10) + (8,5)). The waste
    is explicit in the result: a node never runs more processes than GPUs it was asked for.
    """
    usable = sorted({s for s in shapes if s > 0})
    if total < 1 or not usable:
        raise ValueError(f"cannot pack {total} GPUs onto shapes {shapes}")
    nodes = []
    remaining = total
    while remaining > 0:
        if remaining >= usable[-1]:
            nodes.append((usable[-1], usable[-1]))
            remaining -= usable[-1]
        else:
            shape = next(s for s in usable if s >= remaining)
            nodes.append((shape, remaining))
            remaining = 0
    return nodes


def grace_for_notice(seconds_left: float, graceful_timeout: float, margin: float = 5.0) -> float:
    """Time workers get to checkpoint: the job's graceful timeout, cut short by the notice."""
    return max(0.0, min(graceful_timeout, seconds_left - margin))

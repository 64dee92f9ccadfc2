"""Rebalance recommendations for the goodput benchmark, false positives included.

A real fleet's recommendations are often not followed by a reclaim. The default is the one
published sample we have: 30 recommendations, 15 terminations (21 nodes recommended and never
taken), leads from 17 min to 8 h 42 min. So by default half the recommendations are false
(`fp_rate` 0.5) and a true one's lead is drawn log-uniformly over [17 min, 8 h 42 min] (the
sample gives only its range; log-uniform puts its median at 1.6 h).

The benchmark plays the cloud: each drop in the trace is preceded, one lead earlier, by a
recommendation to the nodes it will take (if the job already holds them), and each true
recommendation brings a geometric number of false ones (mean fp / (1 - fp)) to other spot
nodes the job holds at that moment, any zone (in one zone, a drop to zero leaves no node the
trace will not take); those that find no such node yet go with the next true one. A false
one may still come true: the trace takes what it takes. So the row counts what came of them
(`report`): the false ones (sent to nodes no drop was due to take), and the recommended
nodes reclaimed within the longest lead after their recommendation. Pure apart from its
seeded random stream."""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, field

SAMPLE_RECOMMENDATIONS = 30
SAMPLE_TERMINATIONS = 15
FP_RATE = 1 - SAMPLE_TERMINATIONS / SAMPLE_RECOMMENDATIONS  # 0.5
LEAD_MIN_S = 17 * 60.0
LEAD_MAX_S = 8 * 3600 + 42 * 60.0
MAX_FP_RATE = 0.95  # a geometric count's mean, fp / (1 - fp), stays finite (19 per true one)


def log_uniform(lo: float, hi: float, rng: random.Random) -> float:
    """A lead between `lo` and `hi`, uniform in its logarithm (`lo` == `hi`: that lead)."""
    if hi <= lo:
        return lo
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def false_count(fp_rate: float, rng: random.Random) -> int:
    """False recommendations that come with one true one: geometric, P(n) = fp^n (1 - fp), so
    that false ones are `fp_rate` of all recommendations in expectation."""
    n = 0
    while rng.random() < min(fp_rate, MAX_FP_RATE):
        n += 1
    return n


@dataclass
class Recommendations:
    """The recommendations one run sends, and what came of them."""

    fp_rate: float = FP_RATE
    lead_min_s: float = LEAD_MIN_S
    lead_max_s: float = LEAD_MAX_S
    seed: int = 1
    rng: random.Random = field(init=False)
    sent: dict[str, float] = field(default_factory=dict)  # node -> when recommended
    doomed: set[str] = field(default_factory=set)  # recommended because a drop will take it
    taken: set[str] = field(default_factory=set)  # recommended, then reclaimed by the cloud
    owed: int = 0  # false recommendations drawn that found no node yet: sent at the next chance

    def __post_init__(self) -> None:
        self.rng = random.Random(f"rebalance-{self.seed}")

    def warnings(self, drops: Iterable[tuple[float, str]]) -> list[tuple[float, str, float]]:
        """(when, zone, drop offset) of the recommendation ahead of each drop that comes late
        enough for its lead."""
        out = []
        for offset, zone in drops:
            lead = log_uniform(self.lead_min_s, self.lead_max_s, self.rng)
            if offset >= lead:
                out.append((offset - lead, zone, offset))
        return out

    def send(self, doomed: list[str], others: list[str], now: float) -> list[str]:
        """The nodes to recommend at `now`: `doomed` (the drop's victims, not yet
        recommended) and false recommendations among `others` (the job's other spot nodes)."""
        fresh = [n for n in doomed if n not in self.sent]
        spare = sorted(n for n in others if n not in self.sent and n not in doomed)
        self.owed += sum(false_count(self.fp_rate, self.rng) for _ in fresh)
        false = self.rng.sample(spare, min(len(spare), self.owed))
        self.owed -= len(false)
        self.doomed |= set(fresh)
        self.sent |= dict.fromkeys(fresh + false, now)
        return fresh + false

    def reclaimed(self, node_id: str, now: float) -> None:
        """The cloud takes `node_id` at `now` (its notice, or its loss without one)."""
        if node_id in self.sent and now - self.sent[node_id] <= self.lead_max_s:
            self.taken.add(node_id)

    def report(self) -> dict[str, int]:
        return {
            "recommended": len(self.sent),
            "false": len(self.sent.keys() - self.doomed),
            "followed_by_reclaim": len(self.taken),
            "never_taken": len(self.sent.keys() - self.taken),
        }

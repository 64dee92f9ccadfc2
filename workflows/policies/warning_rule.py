"""Is an early warning worth a replacement? make-before-break's rule for rebalance
recommendations, in money (cost per unit of work; docs/make-before-break-rule.md).

A rebalance recommendation is often not followed by a reclaim: in one published sample, 15 of
30 recommendations were, with leads from 17 min to 8 h 42 min. Acting on one (ordering a
replacement and swapping onto it when ready) costs the same whether or not the reclaim comes:
the replacement's boot, billed while it overlaps the warned node, and the swap's resize, every
member paused. Ignoring it costs nothing unless the reclaim comes; then the notice's own path
pays that boot anyway, plus one resize if the notice can still swap in time (make-before-break
on the notice) or two if it shrinks and grows back. So, with p the probability of a reclaim
within the horizon:

    gain = p x (resizes avoided) x (a resize's pause x the members' price)
    cost = (1 - p) x (surge price x boot + a resize's pause x the members' price)

and the job acts only when gain > cost. With the sample's p = 0.5 that never holds (at best
the gain is one pause, the cost a pause plus a boot); it takes a fleet whose warnings are
reliable (p well above one half) and a notice path that shrinks. Time is not in it: while a
replacement boots the job trains one node short, which delays it but wastes no node-hour.

A scheduled change (an AWS Health scheduledChange or an EC2 scheduled event: retirement, stop,
reboot, maintenance) is not a guess: it comes at its start time, so it is weighed with p = 1
and no later notice to swap on, and the rule acts on it whenever a resize costs anything.

Pure: the workflow's `Swapper` asks, and applies the verdict behind a patch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from spotrain.workflows.job import orders
from spotrain.workflows.job.state import JobState, NodeRecord
from spotrain.workflows.policies.make_before_break import NOTICE_MARGIN_S, checkpoint_s

# The stated prior (docs/make-before-break-rule.md). p itself is the spec's
# `elastic.warning_reclaim_probability` (default 0.5: 15 of 30 in the published sample).
HORIZON_S = 8 * 3600 + 42 * 60  # the sample's longest lead: "a reclaim within the horizon"
BOOT_S = 60.0  # a replacement's launch to ready, billed as overlap (the benchmark's median)
NOTICE_S = 120.0  # the reclaim notice that would follow (EC2's two minutes)
PAUSE_S = {"live": 1.0, "restart": 120.0}  # one resize, every member idle (live: measured
# 0.2-0.7 s at 100M parameters, rounded up; restart: processes start, build, load)


@dataclass(frozen=True)
class Case:
    """What a warning's verdict depends on."""

    p: float  # probability of a reclaim within the horizon
    members_price_h: float  # USD/h of the generation's nodes together
    surge_price_h: float  # USD/h of the replacement
    pause_s: float  # one resize's pause
    boot_s: float  # the replacement's boot, overlapping the warned node
    notice_swaps: bool  # the notice alone would swap in time: one resize, not two


@dataclass(frozen=True)
class Verdict:
    act: bool
    gain_usd: float
    cost_usd: float

    def describe(self) -> str:
        sign = ">" if self.act else "<="
        return f"expected gain ${self.gain_usd:.4f} {sign} surge cost ${self.cost_usd:.4f}"


def weigh(case: Case) -> Verdict:
    """Act on the warning only when its expected gain beats its expected surge cost."""
    pause_usd = case.members_price_h * case.pause_s / 3600
    resizes_avoided = 0 if case.notice_swaps else 1  # two (shrink, growth) become one swap
    gain = case.p * resizes_avoided * pause_usd
    cost = (1 - case.p) * (case.surge_price_h * case.boot_s / 3600 + pause_usd)
    return Verdict(gain > cost, gain, cost)


def case_for(state: JobState, node: NodeRecord) -> Case:
    """The warning on `node` from the spec's prices (the market's where the spec gives none,
    as any node is billed), the spec's probability and the stated prior."""
    e = state.spec.elastic
    zone = node.zone or ""
    swap_window = NOTICE_S - NOTICE_MARGIN_S - checkpoint_s(state)
    return Case(
        p=e.warning_reclaim_probability,
        members_price_h=sum(n.price for n in state.member_nodes),
        surge_price_h=orders.node_price(state, "spot", node.instance_type, zone),
        pause_s=PAUSE_S[e.resize],
        boot_s=BOOT_S,
        notice_swaps=e.reclaim_notice == "make_before_break" and swap_window >= BOOT_S,
    )


def as_certain(case: Case) -> Case:
    """A scheduled change (retirement, stop, reboot, maintenance) comes for sure (p = 1), and
    no reclaim notice follows it to swap later: at its start the node just goes (a loss, then
    a growth), so acting avoids at least one resize and pays no false positive."""
    return replace(case, p=1.0, notice_swaps=False)


def worth_acting(state: JobState, node: NodeRecord, certain: bool = False) -> Verdict:
    """The verdict on an early warning for `node`, a rebalance recommendation or, with
    `certain`, a scheduled change (`elastic.warning_rule: always`: act, whatever the
    figures)."""
    case = case_for(state, node)
    verdict = weigh(as_certain(case) if certain else case)
    if state.spec.elastic.warning_rule == "always":
        return Verdict(True, verdict.gain_usd, verdict.cost_usd)
    return verdict

"""Breaks of the suite's own guards and the benchmarks' instruments."""

from __future__ import annotations

from tests.breaks.model import Break, _in

# --- the suite's own guards: step-time records, hypothesis, long-list diffs ------------------
SUITE_BREAKS = [
    Break(
        "bench links: each host's sending is capped",
        "bench/netns.py",
        'shape = ["root", "tbf", "rate", f"{gbit}gbit",',
        'shape = ["root", "tbf", "rate", f"{gbit * 10}gbit",',
        _in("bench/test_handover_bench.py")("test_over_links_of_their_own_each_sender_is_capped"),
    ),
    Break(
        "a stuck record is rewritten at the next step",
        "workers/elastic/__init__.py",
        "if force or _clock.stale() or now - _last_step_times",
        "if force or now - _last_step_times",
        _in("elastic/test_elastic_lib.py")(
            "test_a_section_written_as_stuck_is_rewritten_at_the_next_step"
        ),
    ),
    Break(
        "hypothesis keeps no wall-clock deadline",
        "tests/conftest.py",
        'settings.register_profile("spotrain", deadline=None,',
        'settings.register_profile("spotrain", deadline=200,',
        _in("test_suite_hygiene.py")("test_a_slow_example_is_not_a_failure"),
    ),
    Break(
        "a long list's failed == explains itself briefly",
        "tests/assert_diff.py",
        "    return long_sequence_diff(left, right)",
        "    return None",
        _in("test_suite_hygiene.py")("test_a_long_list_that_differs_says_where_in_a_few_lines"),
    ),
]

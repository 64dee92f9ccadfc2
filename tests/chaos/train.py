"""A training rank for the chaos suite: no torch, 20 ms steps, the real training library.

It writes every step it does to `$CHAOS_RECORD_DIR/gen-<g>-rank-<r>.steps` (first line:
where it started, its world size and node), so the test can prove steps add up exactly from
the ranks' own record, whatever the controller did. CHAOS_ACK_DELAY_S stretches the
checkpoint after an elastic event (to make a resize last long enough to interrupt).
CHAOS_HOLD_AT: ranks stop stepping at that step (still answering elastic events) until the
file `go` appears in the record directory, so a slow machine cannot finish the job before
the scenario under test has played out.
"""

import os
import sys
import time
from pathlib import Path

from spotrain import elastic

STEP_S = 0.02
CHECKPOINT_EVERY = 10

s = elastic.wait_for_gang()
latest = elastic.latest_checkpoint()
step = latest["step"] if latest else 0
hold_at = int(os.environ.get("CHAOS_HOLD_AT", "-1"))
records = Path(os.environ["CHAOS_RECORD_DIR"])
record = records / f"gen-{s.generation}-rank-{s.rank}.steps"
with record.open("a", buffering=1) as out:
    out.write(f"start {step} world {s.world_size} node {s.node_id}\n")
    while step < s.total_steps:
        time.sleep(STEP_S)
        if step != hold_at or (records / "go").exists():
            step += 1
            out.write(f"{step}\n")
            if step % CHECKPOINT_EVERY == 0:
                elastic.mark_checkpoint(step, f"ckpt-{step}")
            elastic.report_progress(step)
        if elastic.elastic_event_detected():
            time.sleep(float(os.environ.get("CHAOS_ACK_DELAY_S", "0")))
            elastic.mark_checkpoint(step, f"ckpt-{step}")
            elastic.ack_checkpoint(step)
            out.write("acked\n")
            sys.exit(0)
    elastic.mark_done(step)
    while elastic.store().done() is None:  # stands in for the barrier after mark_done
        time.sleep(STEP_S)
    out.write("done\n")

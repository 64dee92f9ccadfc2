"""TrainingJob end to end on the time-skipping server, simulated cloud and runtime."""

from __future__ import annotations

from temporalio.testing import WorkflowEnvironment

from .jobs import job_spec, simulated


async def test_job_runs_to_completion_and_releases_everything(ts_env: WorkflowEnvironment) -> None:
    async with simulated(ts_env.client) as sim:
        spec = job_spec()
        handle = await sim.start(spec)
        result = await handle.result()
    assert result.phase == "Succeeded"
    assert result.steps_done == spec["total_steps"]
    assert result.generations == 1
    assert result.steps_lost == 0
    assert sim.cloud.running() == []
    assert len(sim.cloud.launches) == 4
    assert all(launch.lifecycle == "spot" for launch in sim.cloud.launches)
    # Diversified over both zones instead of piling into one.
    assert {launch.zone for launch in sim.cloud.launches} == {"us-east-1a", "us-east-1b"}
    # 36,000 steps at 4 nodes x 3,600 steps/h = 2.5 h of 4 nodes (+ 60 s start-up).
    assert 9.9 < result.node_hours["spot"] < 10.5
    assert result.cost["on-demand"] == 0
    assert abs(result.savings - (1 - 0.97 / 3.06)) < 1e-6

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


async def test_total_gpus_are_packed_onto_node_shapes(ts_env: WorkflowEnvironment) -> None:
    types = [
        {"name": "p4.big", "gpus": 10, "on_demand_price": 30.0, "spot_price": 9.0},
        {"name": "p4.mid", "gpus": 8, "on_demand_price": 24.0, "spot_price": 7.0},
    ]
    spec = job_spec(
        total_gpus=15,
        total_steps=3_600,
        elastic={"min_nodes": 1, "max_nodes": 2},
        spot={"instance_types": types},
    )
    async with simulated(ts_env.client) as sim:
        handle = await sim.start(spec)
        result = await handle.result()
    launched = sorted((launch.instance_type, launch.slot) for launch in sim.cloud.launches)
    assert [t for t, _ in launched] == ["p4.big", "p4.mid"]  # 10 + 5 GPUs, never 10 + 10
    started = next(e for e in result.timeline if e.event == "generation started")
    assert "world size 15" in started.detail
    assert result.steps_done == 3_600

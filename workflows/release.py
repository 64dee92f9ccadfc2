"""ReleaseJob: a job's teardown, for a job whose workflow ended without running its own
(terminated, timed out): every node the provider finds labelled or tagged with the job goes,
listed in the job's state or not (a launch in flight when the workflow ended), then what the
runtime holds for it, as `spotrain release` does. The operator starts it for such a
TrainingJob under the id `release/<the job's workflow id>`, so a repeated start finds the first.
"""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from spotrain.workflows.contract import CleanupRequest, ReleaseJobRequest, ReleaseRequest
    from spotrain.workflows.job import calls


def release_job_id(job_workflow_id: str) -> str:
    return f"release/{job_workflow_id}"


@workflow.defn(name="ReleaseJob")
class ReleaseJob:
    @workflow.run
    async def run(self, req: ReleaseJobRequest) -> list[str]:
        """The ids of the nodes released."""
        everything = ReleaseRequest(
            job=req.job,
            node_ids=[],
            everything=True,
            region=req.region,
            more_regions=req.more_regions,
        )
        released = await calls.release_nodes(everything, "release every node of the job")
        await calls.cleanup_job(CleanupRequest(job=req.job, keep=req.keep), "clean up the runtime")
        return released

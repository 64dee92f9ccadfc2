"""One workflow worker process for `bench.scale`: spotrain's workflows on the benchmark's task
queue and no activities (the driver runs those, on the simulated cloud and runtime), so that
its CPU is the workflows' alone and N of them show the controller scaling out.

    python -m bench.scale_worker ADDRESS TASK_QUEUE MAX_CACHED_WORKFLOWS

Prints `ready` once it polls; runs until it is signalled.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from temporalio.client import Client
from temporalio.worker import Worker

from spotrain.workers.worker import WORKFLOW_RUNNER, WORKFLOWS


async def serve(address: str, task_queue: str, max_cached: int) -> None:
    client = await Client.connect(address)
    async with Worker(
        client,
        task_queue=task_queue,
        workflows=WORKFLOWS,
        workflow_runner=WORKFLOW_RUNNER,
        max_cached_workflows=max_cached,
    ):
        print("ready", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    logging.getLogger("temporalio").setLevel(logging.ERROR)
    asyncio.run(serve(sys.argv[1], sys.argv[2], int(sys.argv[3])))

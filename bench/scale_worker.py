"""One workflow worker process for `bench.scale`: spotrain's workflows on the benchmark's task
queue and no activities (the driver runs those, on the simulated cloud and runtime), so that
its CPU is the workflows' alone and N of them show the controller scaling out.

    TEMPORAL_ADDRESS=host:port python -m bench.scale_worker TASK_QUEUE MAX_CACHED_WORKFLOWS

It connects as the spotrain worker does (`workers.connect`: the pydantic converter the
workflows need). Prints `ready` once it polls; runs until it is signalled.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import warnings

from temporalio.worker import Worker

from spotrain.workers.connect import connect
from spotrain.workers.worker import WORKFLOW_RUNNER, WORKFLOWS, freeze_heap


async def serve(task_queue: str, max_cached: int) -> None:
    client = await connect()
    freeze_heap()  # as `spotrain worker` does
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
    warnings.simplefilter("error", UserWarning)  # e.g. the wrong converter: figures not valid
    logging.getLogger("temporalio").setLevel(logging.ERROR)
    asyncio.run(serve(sys.argv[1], int(sys.argv[2])))

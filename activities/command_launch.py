"""What a runtime starts for a node of a generation: the job's command, or for `type: command`
jobs (plain torchrun scripts, no spotrain import) torchrun with the generation's settings.

One pure function for both runtimes. Kubernetes runs one pod per node, so torchrun starts the
node's `procs` workers, and a `type: pytorch` node of several processes runs its command
through spotrain.elastic.procs, once per process; the local runtime tracks every rank as a
process of its own, so each rank is a one-worker torchrun "node" (all of them on this
machine; LOCAL_RANK is then 0), or its command, once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # keeps pydantic out of every training process's start-up
    from spotrain.workflows.contract import GenerationPlan

COMMAND_NODE = "spotrain.elastic.torchrun"
NODE_PROCS = "spotrain.elastic.procs"
BARE_PYTHON = ("python", "python3")


def job_command(command: list[str], python: str | None) -> list[str]:
    """The job's command, a bare `python` or `python3` as its first word replaced by `python`
    (locally: the interpreter spotrain runs under, which has torch and spotrain, not whichever
    `python` PATH finds first). A path (`/usr/bin/python3`, `.venv/bin/python`) is kept."""
    if python is not None and command and command[0] in BARE_PYTHON:
        return [python, *command[1:]]
    return list(command)


def launch_command(
    plan: GenerationPlan, node_index: int, python: str | None, local_rank: int | None = None
) -> list[str]:
    """argv for the node at `node_index` (rank order), or with `local_rank` for that one rank
    alone. `python` is the interpreter that has spotrain and torch (locally ours); None: the
    image's own `python`, and the command runs as written. MASTER_ADDR and MASTER_PORT come
    from the rank environment."""
    command = job_command(plan.command, python)
    if plan.job_type == "pytorch" and local_rank is None and plan.members[node_index].procs > 1:
        # (the launcher under the interpreter that runs the command, where it is one: it has
        # spotrain, and a bare `python` may be another one)
        interpreter = command[0] if "python" in command[0].rsplit("/", 1)[-1] else "python"
        return [python or interpreter, "-m", NODE_PROCS, "--", *command]
    if plan.job_type != "command":
        return command
    if local_rank is None:
        nnodes, node_rank, nproc = len(plan.members), node_index, plan.members[node_index].procs
    else:
        first = sum(m.procs for m in plan.members[:node_index])
        nnodes, node_rank, nproc = plan.world_size, first + local_rank, 1
    return [
        python or "python",
        "-m",
        COMMAND_NODE,
        "node",
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        f"--nproc-per-node={nproc}",
        "--",
        *command,
    ]

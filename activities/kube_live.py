"""Live resize on Kubernetes (`elastic.resize: live`): pods whose ranks park stay, and the
next generation adopts them instead of starting new ones. Pure: the calls are in kube.py.

- A live stop raises the elastic event through the control record only: the pod annotation
  (the downwardAPI fallback) would stay in a parked pod's file and stop its next generation
  too. Each rank finishes its step, acks and parks. A pod is parked when it still runs and
  every one of its ranks acked; the others are deleted as in restart mode.
- Starting generation g, each parked pod on a member node keeps its name and its process: it
  is relabelled into g (generation, first rank, member count) and its ranks read their new
  environment in `gen-<g-1>/next.json`. A parked pod whose node left the membership is told
  to leave (its ranks exit 0) and is deleted. Pods are made only for the other members; they
  take the state from the survivors (SPOTRAIN_STATE_FROM=peers). The placement is written
  with the pods' names before anything changes, so a retried start does what the first
  attempt decided.
- Head start (`prepare_generation`): the new members' pods are made while the running
  generation trains, exactly as the start would make them; the start keeps a pod it finds
  under a name only if it was made the same (its spec digest).
- Each live generation meets on a port of its own (`base + generation % PORT_SPAN`): a
  survivor that was rank 0 may still hold the previous generation's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kubernetes import client

from spotrain.activities.kube_objects import NODE_ID, PROCS, pod_env, pod_name, pod_ranks
from spotrain.workflows.contract import GenerationPlan

PORT_SPAN = 50  # a NetworkPolicy between a job's pods must allow base .. base + PORT_SPAN - 1


def rendezvous_port(base: int, plan: GenerationPlan) -> int:
    """The generation's MASTER_PORT: the base in restart mode (every process is new)."""
    return base + plan.generation % PORT_SPAN if plan.resize == "live" else base


@dataclass(frozen=True)
class ParkedPod:
    """Where a parked pod runs and which ranks it holds."""

    node_id: str
    first_rank: int
    procs: int

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.procs)

    @classmethod
    def of(cls, pod: client.V1Pod) -> ParkedPod:
        annotations = pod.metadata.annotations
        return cls(annotations[NODE_ID], min(pod_ranks(pod)), int(annotations[PROCS]))


def parked_pods(pods: Iterable[client.V1Pod], acked: set[int]) -> dict[str, ParkedPod]:
    """The pods that still run and whose every rank acked (parked, holding its state)."""
    return {
        p.metadata.name: ParkedPod.of(p)
        for p in pods
        if p.status.phase == "Running"
        and not p.metadata.deletion_timestamp
        and pod_ranks(p) <= acked
    }


@dataclass(frozen=True)
class Adoption:
    """Where the previous generation's parked pods go in the next one."""

    # parked pod -> its member index in the next generation; None: it leaves
    pods: dict[str, int | None]
    # old rank -> its environment in the next generation; None: it leaves
    ranks: dict[str, dict[str, str] | None]

    @property
    def adopted(self) -> dict[int, str]:
        """Member index -> the parked pod that serves it."""
        return {index: name for name, index in self.pods.items() if index is not None}

    @property
    def leaving(self) -> set[str]:
        return {name for name, index in self.pods.items() if index is None}

    def record(self, generation: int) -> dict[str, Any]:
        """`next.json` as the training library reads it (`ranks`), with the pods' names."""
        return {"generation": generation, "ranks": self.ranks, "pods": self.pods}

    @classmethod
    def recorded(cls, record: dict[str, Any] | None, generation: int) -> Adoption | None:
        """The placement an earlier attempt of this start wrote, if any."""
        if not record or record.get("generation") != generation or "pods" not in record:
            return None
        return cls(record["pods"], record["ranks"])


def place(plan: GenerationPlan, parked: dict[str, ParkedPod], ns: str, port: int) -> Adoption:
    """Each member keeps the parked pod on its node (same process count); the rest leave.
    A rank's environment is its pod's in the new generation, less the job's own variables."""
    on_node = {p.node_id: name for name, p in parked.items()}
    pods: dict[str, int | None] = dict.fromkeys(parked)
    for index, member in enumerate(plan.members):
        name = on_node.get(member.node_id)
        if name is not None and parked[name].procs == member.procs:
            pods[name] = index
    master = master_pod(plan, Adoption(pods, {}).adopted)
    ranks: dict[str, dict[str, str] | None] = {}
    for name, p in parked.items():
        index = pods[name]
        for local, rank in enumerate(p.ranks):
            env = None
            if index is not None:
                env = pod_env(plan, index, local, ns, port, master)
                env = {k: v for k, v in env.items() if k not in plan.env}
            ranks[str(rank)] = env
    return Adoption(pods, ranks)


def master_pod(plan: GenerationPlan, adopted: dict[int, str]) -> str:
    """The pod that holds rank 0: an adopted one keeps its name."""
    return adopted.get(0) or pod_name(plan.job, plan.generation, 0)

"""Which of a live job's pods are parked (hold their ranks' state for the next generation):
pure, on V1Pod objects, without a cluster."""

from __future__ import annotations

from kubernetes import client

from spotrain.activities.kube_live import ParkedPod, parked_pods
from spotrain.activities.kube_objects import NODE_ID, PROCS, RANK


def pod(name: str, first_rank: int, procs: int, phase: str = "Running") -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(
            name=name,
            labels={RANK: str(first_rank)},
            annotations={NODE_ID: f"i-{name}", PROCS: str(procs)},
        ),
        status=client.V1PodStatus(phase=phase),
    )


def test_a_pod_is_parked_only_once_every_one_of_its_ranks_acked() -> None:
    """With two ranks to a pod, one rank's ack is not enough: adopting that pod would carry a
    rank that never parked (still stepping, or gone) into the next generation."""
    pods = [pod("a", 0, 2), pod("b", 2, 2), pod("c", 4, 2, phase="Failed")]
    assert parked_pods(pods, {0, 1, 2, 4, 5}) == {"a": ParkedPod("i-a", 0, 2)}
    assert parked_pods(pods, {0, 1, 2, 3}).keys() == {"a", "b"}
    assert parked_pods(pods, set()) == {}

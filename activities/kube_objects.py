"""The objects the Kubernetes runtime asks the API server for, as plain bodies: pods, the
headless Service, the Horovod hostfile ConfigMap, their names and ownership labels. Pure: the
calls that create, watch and delete them are in activities/kube.py."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from spotrain.activities.command_launch import launch_command
from spotrain.elastic import environment
from spotrain.elastic.environment import rank_env
from spotrain.workflows.contract import GenerationPlan

MANAGED = "spotrain.io/managed"
JOB = "spotrain.io/job"
GENERATION = "spotrain.io/generation"
RANK = "spotrain.io/rank"
CONTROL = "spotrain.io/control"  # annotation: the elastic event
NODE_ID = "spotrain.io/node-id"  # annotation: the member's instance id
NODE_LABEL = "spotrain.io/node"  # a node's label: its node id (a NodeClaim spotrain made)
DO_NOT_DISRUPT = "karpenter.sh/do-not-disrupt"  # annotation: Karpenter leaves the pod's node
PROCS = "spotrain.io/procs"  # annotation: processes (ranks) in this pod
MEMBERS = "spotrain.io/members"  # annotation: pods in this generation
SPEC = "spotrain.io/spec"  # annotation: a digest of the pod as it was made
STOP = "stop"

CONTROL_DIR = "/etc/spotrain"
CONTROL_PATH = f"{CONTROL_DIR}/control"
HOSTS_DIR = "/etc/spotrain/hosts"
HOSTFILE_ENV = "SPOTRAIN_HOSTFILE"
DISCOVER_HOSTS_ENV = "SPOTRAIN_DISCOVER_HOSTS"
SSH_DIR = "/etc/spotrain/ssh"
SSH_DIR_ENV = "SPOTRAIN_SSH_DIR"
LOGIN_TYPES = ("horovod", "mpi")  # a launcher (mpirun, horovodrun) logs in to the workers


def pod_name(job: str, generation: int, index: int) -> str:
    return f"{job}-g{generation}-{index}"


def service_name(job: str) -> str:
    """DNS-1035 label (must start with a letter; job names may start with a digit)."""
    return f"spotrain-{job}"


def pod_dns(pod: str, job: str, ns: str) -> str:
    """A pod's name in the job's headless Service's DNS (hostname.subdomain.namespace.svc)."""
    return f"{pod}.{service_name(job)}.{ns}.svc"


def hosts_name(job: str) -> str:
    return f"spotrain-{job}-hosts"


def ssh_name(job: str) -> str:
    return f"spotrain-{job}-ssh"


def owner_labels(job: str) -> dict[str, str]:
    return {MANAGED: "true", JOB: job}


def owner_selector(job: str, generation: int | None = None) -> str:
    selector = f"{MANAGED}=true,{JOB}={job}"
    return selector if generation is None else f"{selector},{GENERATION}={generation}"


def pod_env(
    plan: GenerationPlan, index: int, local_rank: int, ns: str, master_port: int, master_pod: str
) -> dict[str, str]:
    """The rank environment of process `local_rank` in member `index`'s pod. MASTER_ADDR is
    rank 0's pod's DNS name (the gang start also records its IP, which the library prefers)."""
    env = rank_env(plan, index, local_rank, master_port=master_port, control_file=CONTROL_PATH)
    env["MASTER_ADDR"] = pod_dns(master_pod, plan.job, ns)
    if plan.resize == "live":
        env[environment.RESIZE] = "live"
    return env


def pod_ranks(pod: Any) -> set[int]:
    """The ranks a pod (a V1Pod) runs: from its first rank, one per process."""
    first = int(pod.metadata.labels[RANK])
    return set(range(first, first + int(pod.metadata.annotations[PROCS])))


def pod_body(
    plan: GenerationPlan,
    index: int,
    hostname: str,
    ns: str,
    master_port: int,
    tolerations: tuple[dict[str, str], ...],
    *,
    master_pod: str | None = None,
    state_from: str | None = None,
) -> dict[str, Any]:
    """The pod of member `index`: pinned to its node, the rank contract's environment, the
    control annotation projected as a file, and the hostfile for Horovod jobs. `master_pod`:
    rank 0's pod (default: this generation's first); `state_from`: live resize's
    SPOTRAIN_STATE_FROM."""
    member = plan.members[index]
    name = pod_name(plan.job, plan.generation, index)
    master_pod = master_pod or pod_name(plan.job, plan.generation, 0)
    env = pod_env(plan, index, 0, ns, master_port, master_pod)
    if state_from is not None:
        env[environment.STATE_FROM] = state_from
    mounts = [
        {"name": "control", "mountPath": CONTROL_DIR, "readOnly": True},
        # A container's /dev/shm is 64 MB: too small for data loader workers and the
        # background checkpoint's shared-memory copy of the state (checkpoint_writer.py).
        {"name": "shm", "mountPath": "/dev/shm"},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "shm", "emptyDir": {"medium": "Memory"}},
        {
            "name": "control",
            "downwardAPI": {
                "items": [
                    {
                        "path": CONTROL_PATH.rsplit("/", 1)[1],
                        "fieldRef": {"fieldPath": f"metadata.annotations['{CONTROL}']"},
                    }
                ]
            },
        },
    ]
    if plan.job_type in LOGIN_TYPES:
        env[HOSTFILE_ENV] = f"{HOSTS_DIR}/hostfile"
        env[DISCOVER_HOSTS_ENV] = f"{HOSTS_DIR}/discover_hosts.sh"
        env[SSH_DIR_ENV] = SSH_DIR
        mounts.append({"name": "hosts", "mountPath": HOSTS_DIR, "readOnly": True})
        mounts.append({"name": "ssh", "mountPath": SSH_DIR, "readOnly": True})
        volumes.append(
            {"name": "hosts", "configMap": {"name": hosts_name(plan.job), "defaultMode": 0o755}}
        )
        # ssh refuses a private key others may read: 0400, for the container's root user
        volumes.append(
            {"name": "ssh", "secret": {"secretName": ssh_name(plan.job), "defaultMode": 0o400}}
        )
    container: dict[str, Any] = {
        "name": "rank",
        "image": plan.image,
        "command": launch_command(plan, index, None),
        "env": [{"name": k, "value": v} for k, v in sorted(env.items())],
        "ports": [{"name": "rendezvous", "containerPort": master_port}],
        "volumeMounts": mounts,
    }
    if plan.gpus_per_proc:
        gpus = str(plan.gpus_per_proc * member.procs)
        container["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
    first_rank = sum(m.procs for m in plan.members[:index])
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": {
                **owner_labels(plan.job),
                GENERATION: str(plan.generation),
                RANK: str(first_rank),
            },
            "annotations": {
                NODE_ID: member.node_id,
                DO_NOT_DISRUPT: "true",
                PROCS: str(member.procs),
                MEMBERS: str(len(plan.members)),
            },
        },
        "spec": {
            "restartPolicy": "Never",
            "hostname": name,
            "subdomain": service_name(plan.job),
            "nodeSelector": {"kubernetes.io/hostname": hostname},
            "tolerations": [dict(t) for t in tolerations],
            "automountServiceAccountToken": False,
            # SIGTERM is an elastic event: the kubelet waits this long after it
            **(
                {"terminationGracePeriodSeconds": math.ceil(plan.graceful_shutdown_s)}
                if plan.graceful_shutdown_s is not None
                else {}
            ),
            "containers": [container],
            "volumes": volumes,
        },
    }
    # What the pod was made as: a pod found under this name (a live resize's head start) is
    # kept only if it was made the same.
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
    body["metadata"]["annotations"][SPEC] = digest
    return body


def service_body(job: str, master_port: int) -> dict[str, Any]:
    """Headless, publishing not-ready pods: rendezvous needs DNS before readiness."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": service_name(job), "labels": owner_labels(job)},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {JOB: job},
            "ports": [{"name": "rendezvous", "port": master_port}],
        },
    }


def hosts_body(plan: GenerationPlan, ns: str) -> dict[str, Any]:
    """The hostfile ConfigMap (and discover_hosts.sh) of a Horovod job's generation."""
    names = [pod_name(plan.job, plan.generation, i) for i in range(len(plan.members))]
    dns = [pod_dns(name, plan.job, ns) for name in names]
    slots = [m.procs for m in plan.members]
    listing = "".join(f"{host}:{n}\n" for host, n in zip(dns, slots, strict=True))
    data = {
        "hostfile": "".join(f"{host} slots={n}\n" for host, n in zip(dns, slots, strict=True)),
        "discover_hosts.sh": f"#!/bin/sh\ncat <<'EOF'\n{listing}EOF\n",
    }
    tags = {**owner_labels(plan.job), GENERATION: str(plan.generation)}
    return {"metadata": {"name": hosts_name(plan.job), "labels": tags}, "data": data}


def ssh_secret_body(job: str, ns: str, private_key: str, public_key: str) -> dict[str, Any]:
    """The job's SSH key pair, for its launcher's login to its workers: authorized_keys (the
    pair's public key), known_hosts (the same key as every pod's host key, for any name in
    the job's headless Service: the hosts of every generation) and an ssh_config using both
    (`ssh -F $SPOTRAIN_SSH_DIR/ssh_config`; sshd: `HostKey $SPOTRAIN_SSH_DIR/id_ed25519`)."""
    hosts = f"*.{service_name(job)}.{ns}.svc"
    config = (
        f"Host {hosts}\n  IdentityFile {SSH_DIR}/id_ed25519\n"
        f"  UserKnownHostsFile {SSH_DIR}/known_hosts\n  StrictHostKeyChecking yes\n"
    )
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": ssh_name(job), "labels": owner_labels(job)},
        "type": "Opaque",
        "stringData": {
            "id_ed25519": private_key,
            "id_ed25519.pub": public_key,
            "authorized_keys": public_key,
            "known_hosts": f"{hosts} {public_key}",
            "ssh_config": config,
        },
    }

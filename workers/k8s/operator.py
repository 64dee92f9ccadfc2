"""The TrainingJob operator: `kubectl` on one side, the TrainingJob workflows on the other.

Level-triggered: every pass reads each resource whole and makes the world match it, so a
restarted operator needs no memory of what it did. Every effect is idempotent by a name
derived from the resource: the workflow id (namespace, name, uid: a retried start finds the
one it started), the update id of a scale (the resource's generation, or the ScaleIn/ScaleOut's
uid: Temporal answers a repeated update id with the first one's outcome), the Event's name (a
digest of the timeline entry: a repeated post is refused, 409). The finalizer goes on before
the workflow starts and comes off only once the workflow has ended with every node released.

The reconcile loop is the official client's: a list, then a watch from the list's
resourceVersion that wakes the next pass on any change (a 410 Gone only means a fresh list),
with a pass at least every `resync_s` for the status mirror. kopf would add a dependency and
keep its own progress in annotations; here all state is in the resource and the workflow.

Run: `python -m spotrain.workers.k8s.operator --task-queue spotrain` (KUBECONFIG or in-cluster;
TEMPORAL_ADDRESS etc. as for every spotrain command).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import time
from datetime import timedelta
from typing import Any

from kubernetes import client, watch
from temporalio.api.enums.v1 import WorkflowExecutionStatus
from temporalio.client import Client, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.common import WorkflowIDReusePolicy
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from spotrain.activities.kube_api import default_api_client
from spotrain.workers.connect import connect
from spotrain.workers.k8s.crd import API_VERSION, FINALIZER, GROUP, VERSION
from spotrain.workers.k8s.operator_status import (
    SPEC_IGNORED,
    ScaleStatus,
    ended_without_teardown,
    event_plan,
    invalid_message,
    job_input,
    job_name,
    mirror,
    needs_release,
    scale_request,
    spec_applied,
    workflow_id,
)
from spotrain.workflows.contract import ReleaseJobRequest, ScaleIn, ScaleOut
from spotrain.workflows.job import attributes
from spotrain.workflows.job.state import JobStatus
from spotrain.workflows.release import release_job_id
from spotrain.workflows.spec import SpecError, digest, parse_spec

log = logging.getLogger("spotrain.operator")
RUNNING = WorkflowExecutionStatus.WORKFLOW_EXECUTION_STATUS_RUNNING
COMPLETED = WorkflowExecutionStatus.WORKFLOW_EXECUTION_STATUS_COMPLETED
QUERY_TIMEOUT = timedelta(seconds=10)
HOLDING = "holding the finalizer until the job ends with every node released"
TIMELINE_AT = "spotrain.io/timeline-time"  # an Event's timeline entry, to the microsecond


def ids(resource: dict[str, Any]) -> dict[str, str]:
    """What names a resource's workflow: its namespace, name and uid."""
    meta = resource["metadata"]
    return {"namespace": meta["namespace"], "name": meta["name"], "uid": meta["uid"]}


def crash_point(step: str) -> None:
    """Tests kill the operator right after a step's effect (SPOTRAIN_OPERATOR_CRASH_AT=step),
    as a SIGKILL or a node loss would, to prove the next operator neither repeats nor leaks."""
    if step in os.environ.get("SPOTRAIN_OPERATOR_CRASH_AT", "").split(","):
        log.warning("crash point %s: exiting", step)
        os._exit(3)


class Operator:
    def __init__(
        self,
        api: client.ApiClient,
        temporal: Client,
        task_queue: str,
        resync_s: float = 5,
        orphans: str = "cancel",
        sweep_s: float = 60,
    ) -> None:
        self.custom = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)
        self.temporal = temporal
        self.task_queue = task_queue
        self.resync_s = resync_s
        self.orphans = orphans  # "cancel" or "report" a workflow whose TrainingJob is gone
        self.sweep_s = sweep_s
        self.swept_at = -math.inf
        self.suspects: set[str] = set()  # workflows without a resource at the last sweep
        self.posted: set[str] = set()  # Events already posted (a cache: a repeat gets 409)
        self.requests: dict[str, asyncio.Task[None]] = {}  # ScaleIn/ScaleOut uid -> its update

    # --- the loop --------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            version = await self.reconcile_all()
            await asyncio.to_thread(self._wait_for_change, version)

    def _list(self, plural: str) -> dict[str, Any]:
        return self.custom.list_cluster_custom_object(GROUP, VERSION, plural)

    def _wait_for_change(self, version: str) -> None:
        """Until a TrainingJob changes after `version`, or `resync_s` passes."""
        stream = watch.Watch().stream(
            self.custom.list_cluster_custom_object,
            GROUP,
            VERSION,
            "trainingjobs",
            resource_version=version,
            timeout_seconds=max(1, int(self.resync_s)),
            allow_watch_bookmarks=False,
        )
        try:
            for _ in stream:
                return
        except client.ApiException as err:
            if err.status != 410:  # 410 Gone: the version was compacted; list afresh
                raise

    async def reconcile_all(self) -> str:
        jobs = await asyncio.to_thread(self._list, "trainingjobs")
        for job in jobs["items"]:
            try:
                await self.reconcile(job)
            except (client.ApiException, RPCError) as err:  # the next pass tries again
                log.warning("%s: %s", job["metadata"]["name"], err)
        for kind in ("ScaleIn", "ScaleOut"):
            for req in (await asyncio.to_thread(self._list, f"{kind.lower()}s"))["items"]:
                self._start_request(kind, req)
        if time.monotonic() - self.swept_at >= self.sweep_s:
            self.swept_at = time.monotonic()
            try:
                await self._sweep({workflow_id(**ids(job)) for job in jobs["items"]})
            except RPCError as err:
                log.warning("orphan sweep: %s", err.message)
        return jobs["metadata"]["resourceVersion"]

    async def _sweep(self, known: set[str]) -> None:
        """Running job workflows of this task queue whose TrainingJob no longer exists (its
        finalizer removed by hand, or deleted while no operator ran): the job trains on and
        bills with nothing to show for it. One missing at two sweeps in a row (not a resource
        created between the list and this sweep) is cancelled, so that its own teardown
        releases its nodes, or with `--orphans report` only logged."""
        query = (
            f"WorkflowType = 'TrainingJob' AND ExecutionStatus = 'Running' "
            f"AND TaskQueue = '{self.task_queue}'"
        )
        running = {w.id async for w in self.temporal.list_workflows(query)}
        missing = {wid for wid in running if wid.startswith("k8s/")} - known
        confirmed, self.suspects = missing & self.suspects, missing - self.suspects
        for wid in sorted(confirmed):
            if self.orphans == "cancel":
                await self.temporal.get_workflow_handle(wid).cancel()
                log.warning("%s: its TrainingJob no longer exists: cancelled", wid)
            else:
                log.warning("%s: its TrainingJob no longer exists: left running", wid)

    # --- one TrainingJob ---------------------------------------------------------------------

    async def reconcile(self, job: dict[str, Any]) -> None:
        meta = job["metadata"]
        wid = workflow_id(**ids(job))
        handle = self.temporal.get_workflow_handle(wid)
        if meta.get("deletionTimestamp"):
            await self._finalize(job, handle)
            return
        status = job.get("status") or {}  # (only to leave unchanged what is already written)
        if FINALIZER not in meta.get("finalizers", []):
            await self._patch(
                job, {"metadata": {"finalizers": [*meta.get("finalizers", []), FINALIZER]}}
            )
            crash_point("finalizer-added")
            return  # the patch is a change: the next pass goes on
        spec = job_input(job)
        try:  # every pass: the spec decides, not a verdict the status remembers
            wanted = digest(parse_spec(spec))
        except SpecError as err:
            invalid = {"phase": "Invalid", "message": invalid_message(str(err)), "workflowId": None}
            await self._status(job, invalid | {"observedGeneration": meta["generation"]})
            return
        try:
            await self.temporal.start_workflow(
                "TrainingJob",
                spec,
                id=wid,
                task_queue=self.task_queue,
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                search_attributes=attributes.at_start(spec["name"]),
                static_summary=f"TrainingJob {meta['namespace']}/{meta['name']}",
            )
            crash_point("workflow-started")
        except WorkflowAlreadyStartedError:
            pass
        if status.get("phase") == "Invalid":  # fixed: no longer what the resource shows
            await self._status(job, {"phase": "Pending", "message": None, "workflowId": wid})
        try:
            s = await handle.query("status", result_type=JobStatus, rpc_timeout=QUERY_TIMEOUT)
        except RPCError as err:  # no worker has run it yet
            log.info("%s: no status yet: %s", wid, err.message)
            return
        observed = status.get("observedGeneration")
        if needs_release(s) and (how := await self._ended(handle)) is not None:
            released = await self._release(job, handle)
            final = ended_without_teardown(s, wid, observed, how, released)
            await self._status(job, final.model_dump(mode="json", by_alias=True))
            await self._events(job, s)
            return
        if meta["generation"] != observed and not s.phase.is_final:
            s = await self._scale(job, handle, s)
            observed = meta["generation"]
        mirrored = mirror(s, wid, observed, wanted)
        await self._status(job, mirrored.model_dump(mode="json", by_alias=True))
        crash_point("status-written")
        await self._events(job, s)
        if spec_applied(s, wanted).status == "False":  # one Warning per edit (generation)
            ignored = f"spec-ignored-{meta['generation']}"
            await self._event(job, "Warning", "SpecIgnored", SPEC_IGNORED, ignored)

    async def _scale(
        self, job: dict[str, Any], handle: WorkflowHandle[Any, Any], s: JobStatus
    ) -> JobStatus:
        """`kubectl scale`: the update that moves the target to spec.replicas, under an id of
        this generation (sent again after a crash, Temporal answers with the first outcome)."""
        replicas = job["spec"].get("replicas")
        ask = scale_request(replicas, s.target_nodes) if replicas is not None else None
        if ask is None:
            return s
        name, req = ask
        try:
            await handle.execute_update(
                name, req, id=f"replicas-{job['metadata']['generation']}", result_type=str
            )
        except WorkflowUpdateFailedError as err:
            reason = err.cause.message if isinstance(err.cause, ApplicationError) else str(err)
            await self._event(
                job, "Warning", "ScaleRefused", reason, f"refused-{job['metadata']['generation']}"
            )
            return s
        crash_point("scale-sent")
        # The update queued the change; the target moves on the workflow's next turn.
        for _ in range(50):
            s = await handle.query("status", result_type=JobStatus, rpc_timeout=QUERY_TIMEOUT)
            if s.target_nodes == replicas:
                break
            await asyncio.sleep(0.1)
        return s

    async def _finalize(self, job: dict[str, Any], handle: WorkflowHandle[Any, Any]) -> None:
        """Cancel the job; take the finalizer off once it ended with every node released."""
        if FINALIZER not in job["metadata"].get("finalizers", []):
            return
        try:
            described = await handle.describe()
        except RPCError as err:
            if err.status != RPCStatusCode.NOT_FOUND:
                raise
            described = None  # never started: nothing to release
        if described is not None:
            if described.status == RUNNING:
                await handle.cancel()
                crash_point("cancel-sent")
                log.info("%s: cancel requested; %s", handle.id, HOLDING)
                return
            s = await handle.query("status", result_type=JobStatus, rpc_timeout=QUERY_TIMEOUT)
            if needs_release(s) and await self._release(job, handle) is None:
                log.info("%s: ended without its teardown; %s", handle.id, HOLDING)
                return
            await self._events(job, s)
        left = [f for f in job["metadata"]["finalizers"] if f != FINALIZER]
        await self._patch(job, {"metadata": {"finalizers": left}})
        crash_point("finalizer-removed")

    async def _ended(self, handle: WorkflowHandle[Any, Any]) -> str | None:
        """How the job's workflow ended (TERMINATED, TIMED_OUT, ...); None while it runs."""
        described = await handle.describe()
        return None if described.status == RUNNING else described.status.name

    async def _release(
        self, job: dict[str, Any], handle: WorkflowHandle[Any, Any]
    ) -> list[str] | None:
        """For a job whose workflow ended without its teardown: start ReleaseJob (once: its id
        is the job's), and the ids it released once it is done; None until then."""
        try:
            spec = parse_spec(job_input(job))
        except SpecError as err:  # edited since the start: its regions are not known here
            log.warning("%s: cannot release its nodes, the spec is invalid now: %s", handle.id, err)
            return None
        req = ReleaseJobRequest(
            job=spec.name,
            region=spec.spot.region,
            more_regions=spec.spot.more_regions,
            keep=spec.cleanup != "always",
        )
        release = self.temporal.get_workflow_handle(
            release_job_id(handle.id), result_type=list[str]
        )
        try:
            await self.temporal.start_workflow(
                "ReleaseJob",
                req,
                id=release.id,
                task_queue=self.task_queue,
                id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE_FAILED_ONLY,
                static_summary=f"release the nodes of TrainingJob {job['metadata']['name']}",
            )
            crash_point("release-started")
            log.info("%s: the workflow ended without its teardown: releasing its nodes", handle.id)
        except WorkflowAlreadyStartedError:
            pass
        if (await release.describe()).status != COMPLETED:
            return None
        return await release.result()

    # --- ScaleIn and ScaleOut ----------------------------------------------------------------

    def _start_request(self, kind: str, req: dict[str, Any]) -> None:
        uid = req["metadata"]["uid"]
        done = (req.get("status") or {}).get("phase") in ("Succeeded", "Failed")
        if done or (uid in self.requests and not self.requests[uid].done()):
            return
        self.requests[uid] = asyncio.create_task(self._request(kind, req))

    async def _request(self, kind: str, req: dict[str, Any]) -> None:
        meta, spec = req["metadata"], req["spec"]
        ns, plural = meta["namespace"], f"{kind.lower()}s"
        try:
            job = await asyncio.to_thread(
                self.custom.get_namespaced_custom_object,
                GROUP,
                VERSION,
                ns,
                "trainingjobs",
                spec["trainingJob"],
            )
        except client.ApiException as err:
            if err.status != 404:
                raise
            outcome = ScaleStatus(phase="Failed", message=f"no TrainingJob {spec['trainingJob']!r}")
        else:
            handle = self.temporal.get_workflow_handle(workflow_id(**ids(job)))
            update: ScaleIn | ScaleOut
            if kind == "ScaleOut":
                update = ScaleOut(count=spec["count"], timeout_s=spec.get("timeoutSeconds"))
            else:
                update = ScaleIn(count=spec.get("count"), node_ids=spec.get("workers"))
            if (req.get("status") or {}).get("phase") != "Pending":
                await self._patch_status(plural, ns, meta["name"], ScaleStatus(phase="Pending"))
                crash_point(f"{kind.lower()}-pending")  # (seen, not yet acted on)
            try:
                said = await handle.execute_update(
                    "scale_out" if kind == "ScaleOut" else "scale_in",
                    update,
                    id=f"{plural}-{meta['uid']}",
                    result_type=str,
                )
                crash_point(f"{kind.lower()}-sent")
                failed = said.startswith("timed out")
                outcome = ScaleStatus(phase="Failed" if failed else "Succeeded", message=said)
            except WorkflowUpdateFailedError as err:
                cause = err.cause
                why = cause.message if isinstance(cause, ApplicationError) else str(cause)
                outcome = ScaleStatus(phase="Failed", message=why)
            except RPCError as err:
                if err.status != RPCStatusCode.NOT_FOUND:
                    log.warning("%s %s/%s: %s", kind, ns, meta["name"], err.message)
                    return  # the next pass retries under the same update id
                # never started, or ended: nothing will ever take the request
                why = f"no workflow runs TrainingJob {spec['trainingJob']!r}: {err.message}"
                outcome = ScaleStatus(phase="Failed", message=why)
        await self._patch_status(plural, ns, meta["name"], outcome)

    # --- the API calls -----------------------------------------------------------------------

    async def _patch(self, job: dict[str, Any], body: dict[str, Any]) -> None:
        meta = job["metadata"]
        # The resourceVersion read: a change since is a conflict (409), never overwritten.
        body["metadata"]["resourceVersion"] = meta["resourceVersion"]
        await asyncio.to_thread(
            self.custom.patch_namespaced_custom_object,
            GROUP,
            VERSION,
            meta["namespace"],
            "trainingjobs",
            meta["name"],
            body,
        )

    async def _status(self, job: dict[str, Any], status: dict[str, Any]) -> None:
        if (job.get("status") or {}) == status:
            return
        meta = job["metadata"]
        await asyncio.to_thread(
            self.custom.patch_namespaced_custom_object_status,
            GROUP,
            VERSION,
            meta["namespace"],
            "trainingjobs",
            meta["name"],
            {"status": status},
        )

    async def _patch_status(self, plural: str, ns: str, name: str, status: ScaleStatus) -> None:
        body = {"status": status.model_dump(mode="json", by_alias=True)}
        await asyncio.to_thread(
            self.custom.patch_namespaced_custom_object_status,
            GROUP,
            VERSION,
            ns,
            plural,
            name,
            body,
        )

    async def _events(self, job: dict[str, Any], s: JobStatus) -> None:
        for entry in s.timeline:
            plan = event_plan(job["metadata"]["uid"], entry)
            await self._event(
                job, plan.type, plan.reason, plan.message, plan.name, entry.time.isoformat()
            )

    async def _event(
        self,
        job: dict[str, Any],
        kind: str,
        reason: str,
        message: str,
        name: str,
        at: str | None = None,
    ) -> None:
        meta = job["metadata"]
        if not name.startswith("spotrain."):
            name = f"spotrain.{meta['uid'][:8]}.{name}"
        if name in self.posted:
            return
        body = {
            "metadata": {
                "name": name,
                "labels": {  # (the job's name as its pods carry it: a label of <= 50)
                    "spotrain.io/job": job_name(meta["name"], meta["uid"]),
                    "app.kubernetes.io/managed-by": "spotrain-operator",
                },
                # (an Event's timestamps keep whole seconds: the timeline entry's own instant,
                # so two alike entries a moment apart read as two, and one posted twice as one)
                "annotations": {TIMELINE_AT: at} if at else {},
            },
            "involvedObject": {
                "apiVersion": API_VERSION,
                "kind": "TrainingJob",
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta["uid"],
            },
            "reason": reason,
            "message": message,
            "type": kind,
            "count": 1,
            "firstTimestamp": at,
            "lastTimestamp": at,
            "source": {"component": "spotrain-operator"},
        }
        try:
            await asyncio.to_thread(self.core.create_namespaced_event, meta["namespace"], body)
        except client.ApiException as err:
            if err.status != 409:
                raise
        self.posted.add(name)


def main() -> None:
    parser = argparse.ArgumentParser(prog="spotrain-operator", description=__doc__.split("\n")[0])
    parser.add_argument("--task-queue", default=os.environ.get("SPOTRAIN_TASK_QUEUE", "spotrain"))
    parser.add_argument("--resync-s", type=float, default=5)
    parser.add_argument(
        "--orphans",
        choices=("cancel", "report"),
        default=os.environ.get("SPOTRAIN_OPERATOR_ORPHANS", "cancel"),
        help="a running job workflow whose TrainingJob is gone: cancel it (its teardown "
        "releases its nodes) or only log it",
    )
    parser.add_argument("--orphan-sweep-s", type=float, default=60, help="how often to look")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    default_api_client()  # (loads the configuration the clients below use)

    async def serve() -> None:
        temporal = await connect()
        await Operator(
            client.ApiClient(),
            temporal,
            args.task_queue,
            args.resync_s,
            orphans=args.orphans,
            sweep_s=args.orphan_sweep_s,
        ).run()

    asyncio.run(serve())


if __name__ == "__main__":
    main()

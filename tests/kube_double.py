"""An in-process HTTP double of the kube-apiserver paths spotrain's Kubernetes runtime calls.

It is a DOUBLE, not a cluster: no kube-apiserver (nor kind, k3s, minikube) can run on these
machines. The runtime under test talks to it through the official `kubernetes` client over real
HTTP on a loopback port, so the same code runs unchanged against a real cluster.

What it keeps like the real server: objects per (resource, namespace, name), a global
monotonically increasing resourceVersion, uid and creationTimestamp, 409 AlreadyExists on
create, 404 NotFound on get/patch/delete, `Status` error bodies, list + watch from a
resourceVersion (newline-delimited JSON events, `timeoutSeconds`), equality label selectors,
and JSON merge patch (RFC 7386; other patch types get 415). Namespaces are implicit (no 404
for a missing one); no fieldSelector, no 410 Gone (every event is kept). Paths:
create/get/list/watch/patch/delete of pods, services and configmaps in a namespace; get/list
of nodes.

What stands in for the rest of the control plane (clearly simplified):
- a scheduler: a pod binds to the node whose labels match its `nodeSelector` and whose
  NoSchedule/NoExecute taints it tolerates; otherwise it stays Pending with the
  `PodScheduled=False, reason=Unschedulable` condition and a kube-style message;
- a kubelet: a bound pod becomes Running and Ready at once (`auto_start`), or is held in
  ContainerCreating until `start_pod`, or waits with a fault set for its node
  (`kubelet_faults`, e.g. ErrImagePull); `finish_pod` terminates its container;
  `projected_file` renders a downwardAPI volume file the way the kubelet writes it;
- deletion is immediate (no terminating phase); the grace period asked for is recorded in
  `deletes` so tests can check it.

Every request is recorded as a Kubernetes RBAC (verb, resource) pair in `calls`.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

from kubernetes import client

NAMESPACED = {"pods": "Pod", "services": "Service", "configmaps": "ConfigMap"}
PATH = re.compile(
    r"^/api/v1/(?:namespaces/(?P<ns>[^/]+)/(?P<res>pods|services|configmaps)|(?P<nodes>nodes))"
    r"(?:/(?P<name>[^/]+))?$"
)
Key = tuple[str, str, str]  # (resource, namespace, name); nodes have namespace ""


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge key by key, null deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _matches(labels: dict[str, str], selector: str | None) -> bool:
    """Equality-based label selectors (`a=b,c==d,e!=f`): the ones the runtime sends."""
    for term in filter(None, (selector or "").split(",")):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        else:
            key, value = re.split(r"==?", term, maxsplit=1)
            if labels.get(key) != value:
                return False
    return True


def _tolerates(tolerations: list[dict[str, Any]], taint: dict[str, Any]) -> bool:
    for t in tolerations:
        if t.get("key") not in (None, taint["key"]):
            continue
        if t.get("effect") not in (None, "", taint.get("effect")):
            continue
        if t.get("operator", "Equal") == "Exists" or t.get("value") == taint.get("value"):
            return True
    return False


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message

    def body(self) -> dict[str, Any]:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }


class KubeDouble:
    """The state and the control-plane stand-ins; `serve()` exposes it over HTTP."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._rv = 0
        self._objects: dict[Key, dict[str, Any]] = {}
        self._events: list[tuple[int, Key, str, dict[str, Any]]] = []
        self._closing = False
        self.calls: list[tuple[str, str]] = []
        self.deletes: list[tuple[str, str, int | None]] = []  # (resource, name, grace seconds)
        self.patches: list[tuple[str, str, str]] = []  # (resource, name, content type)
        self.deny: set[tuple[str, str]] = set()  # (verb, resource) answered 403 Forbidden
        self.auto_start = True
        self.kubelet_faults: dict[str, tuple[str, str]] = {}  # node -> (reason, message)
        self.url = ""

    # --- HTTP ------------------------------------------------------------------------------

    @contextmanager
    def serve(self) -> Iterator[KubeDouble]:
        """Listen on a free loopback port for the duration of the block."""
        double = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, and chunked watch streams

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                double._handle(self, "GET")

            def do_POST(self) -> None:
                double._handle(self, "POST")

            def do_PATCH(self) -> None:
                double._handle(self, "PATCH")

            def do_DELETE(self) -> None:
                double._handle(self, "DELETE")

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
        thread.start()
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        try:
            yield self
        finally:
            with self._cond:
                self._closing = True
                self._cond.notify_all()
            server.shutdown()
            server.server_close()

    def api_client(self) -> client.ApiClient:
        """A real `kubernetes` client pointed at this double."""
        return client.ApiClient(client.Configuration(host=self.url))

    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        url = urlparse(h.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        match = PATH.match(url.path)
        try:
            if not match:
                raise ApiError(404, "NotFound", f"the double does not serve {url.path}")
            resource = match["res"] or "nodes"
            ns, name = match["ns"] or "", match["name"]
            length = int(h.headers.get("Content-Length") or 0)
            body = json.loads(h.rfile.read(length)) if length else None
            watching = query.get("watch", "").lower() == "true"
            verb = {"POST": "create", "PATCH": "patch", "DELETE": "delete"}.get(method)
            verb = verb or ("get" if name else "watch" if watching else "list")
            with self._cond:
                self.calls.append((verb, resource))
            if (verb, resource) in self.deny:
                raise ApiError(403, "Forbidden", f'cannot {verb} resource "{resource}"')
            if resource == "nodes" and verb not in ("get", "list"):
                raise ApiError(405, "MethodNotAllowed", "the double serves nodes read-only")
            if verb == "watch":
                self._watch(h, resource, ns, query)
                return
            code, out = self._dispatch(verb, resource, ns, name, body, query, h)
        except ApiError as err:
            code, out = err.code, err.body()
        data = json.dumps(out).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _dispatch(
        self,
        verb: str,
        resource: str,
        ns: str,
        name: str | None,
        body: Any,
        query: dict[str, str],
        h: BaseHTTPRequestHandler,
    ) -> tuple[int, dict[str, Any]]:
        with self._cond:
            if verb == "list":
                items = self._select(resource, ns, query.get("labelSelector"))
                return 200, {
                    "kind": f"{NAMESPACED.get(resource, 'Node')}List",
                    "apiVersion": "v1",
                    "metadata": {"resourceVersion": str(self._rv)},
                    "items": items,
                }
            if verb == "create":
                return 201, self._create(resource, ns, body)
            assert name is not None
            obj = self._get((resource, ns, name))
            if verb == "get":
                return 200, copy.deepcopy(obj)
            if verb == "patch":
                content_type = h.headers.get("Content-Type", "")
                self.patches.append((resource, name, content_type))
                if content_type != "application/merge-patch+json":
                    raise ApiError(415, "UnsupportedMediaType", f"double: {content_type}")
                patched = merge_patch(obj, body)
                patched["metadata"]["name"] = name
                return 200, self._store((resource, ns, name), patched, "MODIFIED")
            grace = query.get("gracePeriodSeconds") or (body or {}).get("gracePeriodSeconds")
            self.deletes.append((resource, name, None if grace is None else int(grace)))
            return 200, self._delete((resource, ns, name))

    def _watch(
        self, h: BaseHTTPRequestHandler, resource: str, ns: str, query: dict[str, str]
    ) -> None:
        """Stream events after `resourceVersion` (or the current state first, as ADDED)."""
        selector = query.get("labelSelector")
        timeout = float(query.get("timeoutSeconds", 60))
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        with self._cond:
            since = int(query.get("resourceVersion") or 0)
            if since == 0:
                backlog = [("ADDED", obj) for obj in self._select(resource, ns, selector)]
                since = self._rv
            else:
                backlog = []
            end = time.monotonic() + timeout
        pending = backlog
        while True:
            for kind, obj in pending:
                line = json.dumps({"type": kind, "object": obj}).encode() + b"\n"
                h.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                h.wfile.flush()
            with self._cond:
                while True:
                    pending = []
                    for rv, key, kind, obj in self._events:
                        if rv > since and key[:2] == (resource, ns):
                            if _matches(obj["metadata"].get("labels") or {}, selector):
                                pending.append((kind, copy.deepcopy(obj)))
                            since = rv
                    left = end - time.monotonic()
                    if pending or left <= 0 or self._closing:
                        break
                    self._cond.wait(left)
            if not pending:
                h.wfile.write(b"0\r\n\r\n")
                return

    # --- store -----------------------------------------------------------------------------

    def _select(self, resource: str, ns: str, selector: str | None) -> list[dict[str, Any]]:
        return [
            copy.deepcopy(obj)
            for (res, obj_ns, _), obj in sorted(self._objects.items())
            if (res, obj_ns) == (resource, ns)
            and _matches(obj["metadata"].get("labels") or {}, selector)
        ]

    def _get(self, key: Key) -> dict[str, Any]:
        if key not in self._objects:
            raise ApiError(404, "NotFound", f'{key[0]} "{key[2]}" not found')
        return self._objects[key]

    def _store(self, key: Key, obj: dict[str, Any], kind: str) -> dict[str, Any]:
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        self._objects[key] = obj
        self._events.append((self._rv, key, kind, copy.deepcopy(obj)))
        self._cond.notify_all()
        return copy.deepcopy(obj)

    def _create(self, resource: str, ns: str, body: dict[str, Any]) -> dict[str, Any]:
        name = (body.get("metadata") or {}).get("name")
        if not name:
            raise ApiError(422, "Invalid", "metadata.name: Required value")
        key = (resource, ns, name)
        if key in self._objects:
            raise ApiError(409, "AlreadyExists", f'{resource} "{name}" already exists')
        obj = copy.deepcopy(body)
        obj.setdefault("apiVersion", "v1")
        obj.setdefault("kind", NAMESPACED.get(resource, "Node"))
        obj["metadata"].update(
            namespace=ns or None, uid=str(uuid.uuid4()), creationTimestamp=_now()
        )
        if resource == "pods":
            obj["status"] = {"phase": "Pending"}
        created = self._store(key, obj, "ADDED")
        if resource == "pods":
            self._schedule(key)
        return created

    def _delete(self, key: Key) -> dict[str, Any]:
        obj = self._get(key)
        del self._objects[key]
        self._rv += 1
        obj["metadata"]["resourceVersion"] = str(self._rv)
        self._events.append((self._rv, key, "DELETED", copy.deepcopy(obj)))
        self._cond.notify_all()
        return obj

    # --- scheduler and kubelet stand-ins ---------------------------------------------------

    def add_node(
        self,
        name: str,
        instance_id: str,
        zone: str = "us-east-1a",
        taints: list[dict[str, Any]] | None = None,
    ) -> None:
        """Register a node the way an EKS kubelet does: providerID `aws:///<zone>/<id>`."""
        node = {
            "metadata": {
                "name": name,
                "labels": {
                    "kubernetes.io/hostname": name,
                    "topology.kubernetes.io/zone": zone,
                },
            },
            "spec": {"providerID": f"aws:///{zone}/{instance_id}", "taints": taints or []},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        }
        with self._cond:
            self._create("nodes", "", node)

    def remove_node(self, name: str) -> None:
        """The node object is deleted (instance terminated); its pods are left to pod GC."""
        with self._cond:
            self._delete(("nodes", "", name))

    def _schedule(self, key: Key) -> None:
        pod = copy.deepcopy(self._objects[key])
        spec = pod["spec"]
        nodes = [o for (res, _, _), o in sorted(self._objects.items()) if res == "nodes"]
        for node in nodes:
            fits = _matches(
                node["metadata"]["labels"],
                ",".join(f"{k}={v}" for k, v in (spec.get("nodeSelector") or {}).items()),
            )
            taints = [
                t
                for t in node["spec"].get("taints") or []
                if t.get("effect") in ("NoSchedule", "NoExecute")
            ]
            if fits and all(_tolerates(spec.get("tolerations") or [], t) for t in taints):
                spec["nodeName"] = node["metadata"]["name"]
                pod["status"] = self._kubelet_status(pod)
                self._store(key, pod, "MODIFIED")
                return
        pod["status"]["conditions"] = [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": f"0/{len(nodes)} nodes are available: {len(nodes)} node(s) didn't "
                "match Pod's node affinity/selector or had untolerated taints.",
            }
        ]
        self._store(key, pod, "MODIFIED")

    def _kubelet_status(self, pod: dict[str, Any]) -> dict[str, Any]:
        fault = self.kubelet_faults.get(pod["spec"]["nodeName"])
        if fault or not self.auto_start:
            reason, message = fault or ("ContainerCreating", "")
            return {
                "phase": "Pending",
                "conditions": [{"type": "PodScheduled", "status": "True"}],
                "containerStatuses": [
                    {
                        "name": c["name"],
                        "image": c.get("image", ""),
                        "imageID": "",
                        "ready": False,
                        "restartCount": 0,
                        "state": {"waiting": {"reason": reason, "message": message}},
                    }
                    for c in pod["spec"]["containers"]
                ],
            }
        return self._container_status(pod, "Running", {"running": {"startedAt": _now()}})

    @staticmethod
    def _container_status(pod: dict[str, Any], phase: str, state: dict[str, Any]) -> dict[str, Any]:
        ready = "True" if phase == "Running" else "False"
        return {
            "phase": phase,
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": ready},
            ],
            "containerStatuses": [
                {
                    "name": c["name"],
                    "image": c.get("image", ""),
                    "imageID": "",
                    "ready": ready == "True",
                    "restartCount": 0,
                    "state": state,
                }
                for c in pod["spec"]["containers"]
            ],
        }

    def start_pod(self, ns: str, name: str) -> None:
        """The kubelet started the containers: Running and Ready."""
        with self._cond:
            pod = copy.deepcopy(self._get(("pods", ns, name)))
            state = {"running": {"startedAt": _now()}}
            pod["status"] = self._container_status(pod, "Running", state)
            self._store(("pods", ns, name), pod, "MODIFIED")

    def finish_pod(self, ns: str, name: str, exit_code: int) -> None:
        """The container exited: Succeeded on 0, Failed otherwise (restartPolicy Never)."""
        with self._cond:
            pod = copy.deepcopy(self._get(("pods", ns, name)))
            phase = "Succeeded" if exit_code == 0 else "Failed"
            state = {"terminated": {"exitCode": exit_code, "reason": "Completed"}}
            if exit_code:
                state["terminated"]["reason"] = "Error"
            pod["status"] = self._container_status(pod, phase, state)
            self._store(("pods", ns, name), pod, "MODIFIED")

    # --- inspection ------------------------------------------------------------------------

    def get(self, resource: str, ns: str, name: str) -> dict[str, Any] | None:
        with self._cond:
            obj = self._objects.get((resource, ns, name))
            return copy.deepcopy(obj)

    def list(self, resource: str, ns: str, selector: str | None = None) -> list[dict[str, Any]]:
        with self._cond:
            return self._select(resource, ns, selector)

    def events(self, resource: str, name: str) -> list[str]:
        """Watch event types recorded for one object, oldest first."""
        with self._cond:
            return [kind for _, key, kind, _ in self._events if key[0::2] == (resource, name)]

    def projected_file(self, ns: str, pod: str, path: str) -> str:
        """The content the kubelet writes for a downwardAPI volume item of this pod."""
        obj = self.get("pods", ns, pod)
        assert obj is not None, f"no pod {pod}"
        for volume in obj["spec"].get("volumes") or []:
            for item in (volume.get("downwardAPI") or {}).get("items") or []:
                if item["path"] == path:
                    field = re.fullmatch(
                        r"metadata\.annotations\['(.+)'\]", item["fieldRef"]["fieldPath"]
                    )
                    assert field, f"unsupported fieldPath {item['fieldRef']['fieldPath']}"
                    return (obj["metadata"].get("annotations") or {}).get(field[1], "")
        raise KeyError(path)

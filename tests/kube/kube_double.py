"""An in-process HTTP double of the kube-apiserver paths spotrain's Kubernetes runtime calls.

The Kubernetes tests run against a real control plane (tests/kube/k8s_cluster.py). This double is
kept only for what that control plane cannot do here: a kubelet's downwardAPI refresh
(`projected_file`; tests/kube/test_kube_runtime.py), and for tests that need a node lookup without
building the control plane (tests/webhook/test_webhook.py). The runtime talks to it through the
official `kubernetes` client over real HTTP on a loopback port.

What it keeps like the real server: objects per (resource, namespace, name), a global
monotonically increasing resourceVersion, uid and creationTimestamp, 409 AlreadyExists on
create, 404 NotFound on get/patch/delete, `Status` error bodies, list + watch from a
resourceVersion (newline-delimited JSON events, `timeoutSeconds`), equality label selectors,
and JSON merge patch (RFC 7386; other patch types get 415). Namespaces are implicit (no 404
for a missing one); no fieldSelector, no 410 Gone (every event is kept). Paths:
create/get/list/watch/patch/delete of pods, services and configmaps in a namespace; get/list
of nodes.

What stands in for the rest of the control plane (clearly simplified):
- a scheduler: a pod binds to the node whose labels match its `nodeSelector`;
- a kubelet: a bound pod becomes Running and Ready at once; `projected_file` renders a
  downwardAPI volume file the way the kubelet writes it;
- deletion is immediate (no terminating phase).
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
                if content_type != "application/merge-patch+json":
                    raise ApiError(415, "UnsupportedMediaType", f"double: {content_type}")
                patched = merge_patch(obj, body)
                patched["metadata"]["name"] = name
                return 200, self._store((resource, ns, name), patched, "MODIFIED")
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

    def add_node(self, name: str, instance_id: str, zone: str = "us-east-1a") -> None:
        """Register a node the way an EKS kubelet does: providerID `aws:///<zone>/<id>`."""
        node = {
            "metadata": {
                "name": name,
                "labels": {
                    "kubernetes.io/hostname": name,
                    "topology.kubernetes.io/zone": zone,
                },
            },
            "spec": {"providerID": f"aws:///{zone}/{instance_id}", "taints": []},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        }
        with self._cond:
            self._create("nodes", "", node)

    def _schedule(self, key: Key) -> None:
        """Bind to the node its nodeSelector names; the kubelet starts it at once."""
        pod = copy.deepcopy(self._objects[key])
        spec = pod["spec"]
        selector = ",".join(f"{k}={v}" for k, v in (spec.get("nodeSelector") or {}).items())
        for (res, _, name), node in sorted(self._objects.items()):
            if res == "nodes" and _matches(node["metadata"]["labels"], selector):
                spec["nodeName"] = name
                pod["status"] = {
                    "phase": "Running",
                    "conditions": [
                        {"type": "PodScheduled", "status": "True"},
                        {"type": "Ready", "status": "True"},
                    ],
                    "containerStatuses": [
                        {
                            "name": c["name"],
                            "image": c.get("image", ""),
                            "imageID": "",
                            "ready": True,
                            "restartCount": 0,
                            "state": {"running": {"startedAt": _now()}},
                        }
                        for c in spec["containers"]
                    ],
                }
                self._store(key, pod, "MODIFIED")
                return

    # --- inspection ------------------------------------------------------------------------

    def get(self, resource: str, ns: str, name: str) -> dict[str, Any] | None:
        with self._cond:
            obj = self._objects.get((resource, ns, name))
            return copy.deepcopy(obj)

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

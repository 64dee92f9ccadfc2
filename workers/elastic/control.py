"""The control channel: how a rank hears the orchestrator (and EC2) within a second.

The orchestrator raises a generation's elastic event by writing a control record to the job's
checkpoint store (`gen-<g>/control.json`, JSON: `{"kind": "stop", "event_id", "time", ...}`;
more kinds, such as the next membership, can follow). The training library polls that record
from a daemon thread of each rank, every `SPOTRAIN_CONTROL_POLL_S` where set, else by what
a poll costs:

- `file://`: one `stat` per poll, every 0.05 s (a microsecond of CPU each); the file is read
  only when its inode, mtime or size change;
- `s3://`: one `GetObject` with `If-None-Match` on the last ETag, answered `304 Not Modified`
  (no body) while unchanged, or `404` before the record exists, every 0.25 s: 4 requests/s
  per rank are 14,400 GETs per rank-hour, $0.0058 per rank-hour at S3 Standard's $0.0004 per
  1,000 GETs.

A runtime whose own control file is written with the record and read promptly (the local
runtime's) sets `SPOTRAIN_STORE_POLL_S` (1 s there) for a billed store: the record is then the
backup, and S3 answers a quarter of the requests (on the embedded stack, moto's S3 is in the demo's
own process, and its answers were about half of that process's CPU).

The same threads poll the fallbacks, each in its own thread so a slow one delays no other:
the runtime's control file (`SPOTRAIN_CONTROL_FILE`: locally a file the runtime writes; on
Kubernetes the pod annotation projected by a downwardAPI volume, which the kubelet refreshes
only on its sync period) and, where configured, EC2 instance metadata (workers/elastic/imds.py).

Whatever raised it, the event latches: `Channel.latched` is a plain attribute, so checking it
in the training loop costs a few hundred nanoseconds. A source that fails (store unreachable,
bad credentials) does not stop the rank: it keeps training and says so in its log, once per
outage, and once when the source answers again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from spotrain.elastic.job_store import FileStore, JobStore, S3Store

log = logging.getLogger("spotrain.elastic")

POLL_ENV = "SPOTRAIN_CONTROL_POLL_S"
STORE_POLL_ENV = "SPOTRAIN_STORE_POLL_S"  # the store's record only, set by the runtime
LOCAL_POLL_S = 0.05  # a stat: the poll's wait is most of a notice's way to the ranks
S3_POLL_S = 0.25  # a billed request
STOP = "stop"


def poll_interval(store: JobStore | None = None) -> float:
    """How often a rank polls `store` for its control record (None: a local file, the
    runtime's control file): the environment's setting, else as often as a poll's cost
    allows."""
    if os.environ.get(POLL_ENV):
        return float(os.environ[POLL_ENV])
    if store is None or not isinstance(store.store, S3Store):
        return LOCAL_POLL_S
    return float(os.environ.get(STORE_POLL_ENV) or S3_POLL_S)


class Source(Protocol):
    """Something a rank polls for its elastic event: a record when there is one, else None;
    any exception means 'could not ask this time'."""

    name: str
    interval_s: float

    def poll(self) -> dict[str, Any] | None: ...


class _Changes:
    """Re-reads a local file only when its stat changes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.seen: tuple[int, int, int] | None = None

    def read_if_changed(self) -> str | None:
        """The file's text if it changed since the last call; None if unchanged or absent."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key == self.seen:
            return None
        self.seen = key
        try:
            with open(self.path) as f:
                return f.read()
        except FileNotFoundError:
            return None


class ControlFile:
    """The runtime's control file: non-empty content is the elastic event (the control record
    as JSON where the runtime writes it, any text otherwise)."""

    name = "control file"

    def __init__(self, path: str, interval_s: float) -> None:
        self.changes = _Changes(path)
        self.interval_s = interval_s

    def poll(self) -> dict[str, Any] | None:
        text = (self.changes.read_if_changed() or "").strip()
        if not text:
            return None
        with contextlib.suppress(json.JSONDecodeError):  # the control record itself (local)
            record = json.loads(text)
            if isinstance(record, dict) and record.get("kind") == STOP:
                return record
        return {"kind": STOP, "detail": text}


class StoreRecord:
    """The generation's control record in the checkpoint store."""

    def __init__(self, store: JobStore, generation: int, interval_s: float) -> None:
        self.key = JobStore.control_key(generation)
        self.name = f"control record {store.uri.rstrip('/')}/{self.key}"
        self.interval_s = interval_s
        self._read = changed_reader(store, self.key)

    def poll(self) -> dict[str, Any] | None:
        text = self._read()
        if not text:
            return None
        try:
            record = json.loads(text)
        except json.JSONDecodeError:
            return None  # writers replace the whole object: a torn read cannot last
        return record if isinstance(record, dict) and record.get("kind") == STOP else None


def changed_reader(store: JobStore, key: str) -> Callable[[], str | None]:
    """A cheap reader of one key of the store: its text when it changed since the last call,
    else None (stat on file://, a conditional GET on s3://)."""
    backend = store.store
    if isinstance(backend, FileStore):
        return _Changes(str(backend.root / key)).read_if_changed
    if isinstance(backend, S3Store):
        return _S3Conditional(backend, key).read_if_changed
    raise TypeError(f"no control channel for {type(backend).__name__}")


class _S3Conditional:
    """GetObject with If-None-Match on the last ETag: 304 (no body) while unchanged. Its own
    client fails fast (1 s timeouts, no retries): the next poll is the retry."""

    def __init__(self, store: S3Store, key: str) -> None:
        import boto3
        from botocore.config import Config

        self.bucket, self.key = store.bucket, store._key(key)
        self.s3 = boto3.client(
            "s3",
            config=Config(connect_timeout=1, read_timeout=1, retries={"total_max_attempts": 1}),
        )
        self.etag: str | None = None

    def read_if_changed(self) -> str | None:
        from botocore.exceptions import ClientError

        args = {"Bucket": self.bucket, "Key": self.key}
        if self.etag:
            args["IfNoneMatch"] = self.etag
        try:
            got = self.s3.get_object(**args)
        except ClientError as err:
            status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status in (304, 404):  # unchanged; or no record yet
                return None
            raise
        self.etag = got["ETag"]
        return got["Body"].read().decode()


class Channel:
    """The latched elastic event of this rank, and the threads that poll for it."""

    def __init__(self) -> None:
        self.latched = False  # read on every training step: a plain attribute
        self.event: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        # called with the event once latched, from the thread that latched it (live.py
        # aborts a collective waiting on a lost peer): must be quick and never raise
        self.listeners: list[Callable[[dict[str, Any]], None]] = []

    def raise_event(self, source: str, record: dict[str, Any]) -> bool:
        """Latch the event (the first source wins); True if this call latched it. Safe from
        a signal handler: the lock is never held across anything that can block."""
        with self._lock:
            if self.latched:
                return False
            self.event = {**record, "source": source, "seen": time.time()}
            self.latched = True
        log.warning("elastic event from %s: %s", source, record)
        for listener in self.listeners:
            listener(self.event)
        return True

    def watch(self, source: Source) -> None:
        thread = threading.Thread(
            target=self._poll, args=(source,), name=f"spotrain {source.name}", daemon=True
        )
        thread.start()
        self._threads.append(thread)

    def _poll(self, source: Source) -> None:
        failing = False
        while not self.latched and not self._closed.is_set():
            try:
                record = source.poll()
            except Exception as err:  # any failure: keep training, say so once per outage
                if not failing:
                    log.warning(
                        "cannot reach the %s (%s); training goes on, other sources still heard",
                        source.name,
                        err,
                    )
                failing = True
            else:
                if failing:
                    log.warning("the %s answers again", source.name)
                failing = False
                if record is not None:
                    self.raise_event(source.name, record)
            self._closed.wait(source.interval_s)

    def close(self) -> None:
        self._closed.set()
        for thread in self._threads:
            thread.join()

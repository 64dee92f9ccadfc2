"""The checkpoint store: where workers leave acks, progress and completion for the orchestrator.

Both runtimes (local processes, Kubernetes pods) and the training library see the job through
the same keys under the job's `checkpoint` location (`file:///path` or `s3://bucket/prefix`):

    gen-00003/started.json        {"time": t}              every node of the gang is up
    gen-00003/ack/<rank>.json     {"step": n, "time": t}   rank checkpointed after an event
    gen-00003/progress.json       {"step": n, "time": t}   rank 0, throttled
    ckpt/latest.json              {"step": n, "path": p}   last complete checkpoint
    done.json                     {"step": n, "time": t}   training finished

No torch, no temporalio: training code imports this too.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse


class ObjectStore(Protocol):
    def put_json(self, key: str, value: Any) -> None: ...
    def get_json(self, key: str) -> Any | None: ...
    def list_keys(self, prefix: str) -> list[str]: ...


class FileStore:
    """Local files; each write is atomic (temp file + rename) so readers never see half a JSON."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def put_json(self, key: str, value: Any) -> None:
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            json.dump(value, f)
        os.replace(tmp, path)

    def get_json(self, key: str) -> Any | None:
        try:
            return json.loads((self.root / key).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def list_keys(self, prefix: str) -> list[str]:
        base = self.root / prefix
        if not base.is_dir():
            return []
        return sorted(
            str(p.relative_to(self.root))
            for p in base.rglob("*")
            if p.is_file() and not p.name.startswith(".tmp-")
        )


class S3Store:
    """S3 through boto3's standard credential chain; `AWS_ENDPOINT_URL_S3` points it at moto."""

    def __init__(self, bucket: str, prefix: str, client: Any = None) -> None:
        import boto3

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.s3 = client or boto3.client("s3")

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put_json(self, key: str, value: Any) -> None:
        self.s3.put_object(Bucket=self.bucket, Key=self._key(key), Body=json.dumps(value).encode())

    def get_json(self, key: str) -> Any | None:
        try:
            body = self.s3.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except self.s3.exceptions.NoSuchKey:
            return None
        try:
            return json.loads(body)
        except json.JSONDecodeError:
            return None

    def list_keys(self, prefix: str) -> list[str]:
        keys: list[str] = []
        strip = len(self._key(""))
        pages = self.s3.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self._key(prefix)
        )
        for page in pages:
            keys += [o["Key"][strip:] for o in page.get("Contents", [])]
        return sorted(keys)


def open_store(uri: str) -> ObjectStore:
    """`file:///path` or `s3://bucket/prefix` -> a store rooted there."""
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return FileStore(parsed.path)
    if parsed.scheme == "s3":
        return S3Store(parsed.netloc, parsed.path)
    raise ValueError(f"unsupported checkpoint location {uri!r}: use file:///path or s3://bucket")


class JobStore:
    """The key layout above, for one job."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.store = open_store(uri)

    @staticmethod
    def _gen(generation: int) -> str:
        return f"gen-{generation:05d}"

    def mark_started(self, generation: int, time: float) -> None:
        self.store.put_json(f"{self._gen(generation)}/started.json", {"time": time})

    def started(self, generation: int) -> bool:
        return self.store.get_json(f"{self._gen(generation)}/started.json") is not None

    def write_ack(self, generation: int, rank: int, step: int, time: float) -> None:
        self.store.put_json(
            f"{self._gen(generation)}/ack/{rank}.json", {"step": step, "time": time}
        )

    def acked_ranks(self, generation: int) -> list[int]:
        keys = self.store.list_keys(f"{self._gen(generation)}/ack/")
        return sorted(int(Path(k).stem) for k in keys)

    def write_progress(self, generation: int, step: int, time: float) -> None:
        self.store.put_json(f"{self._gen(generation)}/progress.json", {"step": step, "time": time})

    def progress(self, generation: int) -> dict[str, Any] | None:
        return self.store.get_json(f"{self._gen(generation)}/progress.json")

    def write_latest_checkpoint(self, step: int, path: str) -> None:
        self.store.put_json("ckpt/latest.json", {"step": step, "path": path})

    def latest_checkpoint(self) -> dict[str, Any] | None:
        return self.store.get_json("ckpt/latest.json")

    def write_done(self, step: int, time: float) -> None:
        self.store.put_json("done.json", {"step": step, "time": time})

    def done(self) -> dict[str, Any] | None:
        return self.store.get_json("done.json")

    # --- control channel (workers/control.py): orchestrator -> ranks, ranks -> orchestrator --
    #   gen-00003/control.json               {"kind": "stop", "event_id", "time", ...}
    #   gen-00003/notice/<event id>.json     a reclaim notice a rank found (EC2 metadata)

    @classmethod
    def control_key(cls, generation: int) -> str:
        return f"{cls._gen(generation)}/control.json"

    def write_control(self, generation: int, record: dict[str, Any]) -> None:
        self.store.put_json(self.control_key(generation), record)

    def report_notice(self, generation: int, notice: dict[str, Any]) -> None:
        """One object per event id: every rank of the node writes the same one (idempotent)."""
        name = re.sub(r"[^A-Za-z0-9._-]", "_", notice["event_id"])
        self.store.put_json(f"{self._gen(generation)}/notice/{name}.json", notice)

    def notices(self, generation: int) -> list[dict[str, Any]]:
        keys = self.store.list_keys(f"{self._gen(generation)}/notice/")
        return [n for k in keys if (n := self.store.get_json(k)) is not None]

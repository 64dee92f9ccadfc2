"""The checkpoint store: where workers leave acks, progress and completion for the orchestrator.

Both runtimes (local processes, Kubernetes pods) and the training library see the job through
the same keys under the job's `checkpoint` location (`file:///path` or `s3://bucket/prefix`):

    probe.json                    {"time": t}              the runtime can write and read here
    gen-00003/started.json        {"time": t}              every node of the gang is up
    gen-00003/waiting/<rank>.json {"time": t}              rank up, waiting for the start
    gen-00003/ack/<rank>.json     {"step": n, "time": t}   rank checkpointed after an event
    gen-00003/progress.json       {"step": n, "time": t}   rank 0, throttled
    gen-00003/steps/<rank>.json   {"step", "time", "recent_s", "usual_s"}  every rank, throttled
    gen-00003/loaded.json         {"step": n}              the checkpoint it resumed from
    ckpt/latest.json              {"step": n, "path": p}   last complete checkpoint
    ckpt/step-0000050/...         DCP files of the checkpoint at step 50
    ckpt/complete/0000050.json    {"step", "path", "kind", "duration_s", "blocked_s", "bytes",
                                   "world_size", "generation", "time"}: complete and timed
    ckpt/skipped/0000050.json     {"step", "path", "reason", "generation", "time"}: failed to load
    done.json                     {"step": n, "time": t}   training finished

No torch, no temporalio: training code imports this too.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

# A control record's "checkpoint" on a live resize's notice: not before stopping, but by the
# survivors once resized, beside training (live.checkpoint_owed).
AFTER_RESIZE = "after resize"


class ObjectStore(Protocol):
    def put_json(self, key: str, value: Any) -> None: ...
    def get_json(self, key: str) -> Any | None: ...
    def list_keys(self, prefix: str) -> list[str]: ...
    def delete_prefix(self, prefix: str) -> None: ...


class StoreUnusable(Exception):
    """The location refuses spotrain (no such bucket, access denied, unreachable): a job
    cannot run there, and retrying will not help. The message is the store's own."""


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
        """Keys starting with `prefix`, as S3 lists them (a prefix need not be a folder)."""
        base = self.root / prefix
        folder = base if not prefix or prefix.endswith("/") else base.parent
        if not folder.is_dir():
            return []
        keys = (
            str(p.relative_to(self.root))
            for p in folder.rglob("*")
            if p.is_file() and not p.name.startswith(".tmp-")
        )
        return sorted(k for k in keys if k.startswith(prefix))

    def delete_prefix(self, prefix: str) -> None:
        """Remove every key under `prefix` (a folder: the folder itself too)."""
        path = self.root / prefix
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


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

    def delete_prefix(self, prefix: str) -> None:
        keys = [{"Key": self._key(k)} for k in self.list_keys(prefix)]
        for i in range(0, len(keys), 1000):  # DeleteObjects takes up to 1000 keys
            self.s3.delete_objects(Bucket=self.bucket, Delete={"Objects": keys[i : i + 1000]})


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

    def check(self, time: float) -> None:
        """Write and read back a probe: a location that refuses either raises StoreUnusable
        with the store's message (so a job fails at start, not at its first checkpoint)."""
        try:
            self.store.put_json("probe.json", {"time": time})
            self.store.get_json("probe.json")
        except Exception as err:
            if _refused(err):
                raise StoreUnusable(f"checkpoint location {self.uri}: {err}") from err
            raise

    def mark_started(
        self, generation: int, time: float, rendezvous: dict[str, str] | None = None
    ) -> None:
        """The gang is up: its ranks go. `rendezvous`: where rank 0 is known to be reachable
        now that it runs (Kubernetes: its pod's IP), over the environment's MASTER_ADDR."""
        record: dict[str, Any] = {"time": time}
        if rendezvous:
            record["rendezvous"] = rendezvous
        self.store.put_json(f"{self._gen(generation)}/started.json", record)

    def start_record(self, generation: int) -> dict[str, Any] | None:
        return self.store.get_json(f"{self._gen(generation)}/started.json")

    def started(self, generation: int) -> bool:
        return self.start_record(generation) is not None

    def mark_waiting(self, generation: int, rank: int, time: float) -> None:
        """A rank is up and waits for its generation's start (what a head start waits for)."""
        self.store.put_json(f"{self._gen(generation)}/waiting/{rank}.json", {"time": time})

    def waiting_ranks(self, generation: int) -> set[int]:
        keys = self.store.list_keys(f"{self._gen(generation)}/waiting/")
        return {int(Path(k).stem) for k in keys}

    def write_ack(self, generation: int, rank: int, step: int, time: float) -> None:
        self.store.put_json(
            f"{self._gen(generation)}/ack/{rank}.json", {"step": step, "time": time}
        )

    def acks(self, generation: int) -> list[dict[str, Any]]:
        """The generation's acks, {"step", "time"} each (written once the ack's checkpoint
        was durable)."""
        keys = self.store.list_keys(f"{self._gen(generation)}/ack/")
        return [a for a in (self.store.get_json(k) for k in keys) if a]

    def ended(self, generation: int) -> tuple[list[int], int | None, int | None, bool]:
        """For a stop: the generation's acked ranks, the latest checkpoint's step, the step
        its ranks had reached (rank 0's last progress) and whether the job is done. A location
        that refuses reads reports none, so that the stop still ends (the start failed, or
        will, with the store's message) instead of retrying forever."""
        try:
            latest, progress = self.latest_checkpoint(), self.progress(generation)
            return (
                self.acked_ranks(generation),
                latest["step"] if latest else None,
                progress["step"] if progress else None,
                self.done() is not None,
            )
        except Exception as err:
            if _refused(err):
                return [], None, None, False
            raise

    def acked_ranks(self, generation: int) -> list[int]:
        keys = self.store.list_keys(f"{self._gen(generation)}/ack/")
        return sorted(int(Path(k).stem) for k in keys)

    def ack_steps(self, generation: int) -> dict[int, int]:
        """Rank -> the step it acked (live resize: the step a parked rank holds)."""
        keys = self.store.list_keys(f"{self._gen(generation)}/ack/")
        acks = {int(Path(k).stem): self.store.get_json(k) for k in keys}
        return {rank: a["step"] for rank, a in acks.items() if a}

    def write_progress(self, generation: int, step: int, time: float) -> None:
        self.store.put_json(f"{self._gen(generation)}/progress.json", {"step": step, "time": time})

    def progress(self, generation: int) -> dict[str, Any] | None:
        return self.store.get_json(f"{self._gen(generation)}/progress.json")

    def write_rank_steps(self, generation: int, rank: int, record: dict[str, Any]) -> None:
        self.store.put_json(f"{self._gen(generation)}/steps/{rank}.json", record)

    def rank_steps(self, generation: int, now: float) -> list[Any]:
        """Every rank's step times as `RankSteps` (for the runtimes' watch), ages as of `now`."""
        from spotrain.workflows.policies.stragglers import (
            RankSteps,  # pydantic: not in training code
        )

        keys = self.store.list_keys(f"{self._gen(generation)}/steps/")
        records = {int(Path(k).stem): self.store.get_json(k) for k in keys}
        return [RankSteps.of(rank, r, now) for rank, r in sorted(records.items()) if r]

    def write_latest_checkpoint(self, step: int, path: str) -> None:
        self.store.put_json("ckpt/latest.json", {"step": step, "path": path})

    def latest_checkpoint(self) -> dict[str, Any] | None:
        return self.store.get_json("ckpt/latest.json")

    def write_loaded(self, generation: int, step: int) -> None:
        self.store.put_json(f"{self._gen(generation)}/loaded.json", {"step": step})

    def newest_generation(self) -> int | None:
        """The newest generation the runtime has started, or None."""
        gens = [k.split("/", 1)[0] for k in self.store.list_keys("gen-") if "/started" in k]
        return max((int(g.removeprefix("gen-")) for g in gens), default=None)

    def loaded_step(self, generation: int) -> int | None:
        loaded = self.store.get_json(f"{self._gen(generation)}/loaded.json")
        return loaded["step"] if loaded else None

    def record_checkpoint(self, record: dict[str, Any]) -> None:
        """A checkpoint complete and timed (all ranks' files and its metadata are written)."""
        self.store.put_json(f"ckpt/complete/{record['step']:07d}.json", record)

    def forget_checkpoint(self, step: int) -> None:
        """Retention: first the record (no reader picks it any more), then its files."""
        self.store.delete_prefix(f"ckpt/complete/{step:07d}.json")
        self.store.delete_prefix(f"ckpt/step-{step:07d}/")

    def checkpoints(self) -> list[dict[str, Any]]:
        """Records of the complete checkpoints still kept, oldest first."""
        records = (self.store.get_json(k) for k in self.store.list_keys("ckpt/complete/"))
        return sorted((r for r in records if r), key=lambda r: r["step"])

    def checkpoint_dirs(self) -> list[int]:
        """Steps that have checkpoint files, complete or not."""
        steps = {k.split("/")[1] for k in self.store.list_keys("ckpt/step-")}
        return sorted(int(s.removeprefix("step-")) for s in steps)

    def record_skipped(self, record: dict[str, Any]) -> None:
        self.store.put_json(f"ckpt/skipped/{record['step']:07d}.json", record)

    def skipped_checkpoints(self) -> list[dict[str, Any]]:
        records = (self.store.get_json(k) for k in self.store.list_keys("ckpt/skipped/"))
        return sorted((r for r in records if r), key=lambda r: r["step"])

    def checkpoint_stats(self) -> Any:
        """The records above as `CheckpointStats` (for the runtimes' watch), or None."""
        from spotrain.workflows.job.checkpoints import summarize  # pydantic: not in training code

        records, skipped = self.checkpoints(), self.skipped_checkpoints()
        return summarize(records, skipped) if records or skipped else None

    def checkpoint_path(self, step: int) -> str:
        """Where the checkpoint at `step` lives: a file path or an s3:// URI (for DCP)."""
        parsed = urlparse(self.uri)
        if parsed.scheme == "file":
            return str(Path(parsed.path) / "ckpt" / f"step-{step:07d}")
        return f"{self.uri.rstrip('/')}/ckpt/step-{step:07d}"

    def write_done(self, step: int, time: float) -> None:
        self.store.put_json("done.json", {"step": step, "time": time})

    def reopen(self) -> dict[str, Any] | None:
        """Forget that training finished (`spotrain submit --resume`), so that the next ranks
        train on from the latest checkpoint; the marker it removed, or None."""
        done = self.done()
        if done is not None:
            self.store.delete_prefix("done.json")
        return done

    def done(self) -> dict[str, Any] | None:
        return self.store.get_json("done.json")

    # --- control channel (control.py): orchestrator -> ranks, ranks -> orchestrator ---------
    #   gen-00003/control.json               {"kind": "stop", "event_id", "time", ...}
    #   gen-00003/notice/<event id>.json     a reclaim notice a rank found (EC2 metadata)
    #   gen-00003/next.json                  live resize: {"generation": 4, "ranks": {"<rank
    #                                        in 3>": its environment in 4, or null: leave}}

    @classmethod
    def control_key(cls, generation: int) -> str:
        return f"{cls._gen(generation)}/control.json"

    def write_control(self, generation: int, record: dict[str, Any]) -> None:
        self.store.put_json(self.control_key(generation), record)

    def control_record(self, generation: int) -> dict[str, Any] | None:
        return self.store.get_json(self.control_key(generation))

    def stopping(self, generation: int) -> bool:
        """The generation's control record asks it to stop (its elastic event is raised)."""
        return (self.control_record(generation) or {}).get("kind") == "stop"

    @classmethod
    def next_key(cls, generation: int) -> str:
        return f"{cls._gen(generation)}/next.json"

    def write_next(self, generation: int, record: dict[str, Any]) -> None:
        self.store.put_json(self.next_key(generation), record)

    def next_generation(self, generation: int) -> dict[str, Any] | None:
        return self.store.get_json(self.next_key(generation))

    def report_notice(self, generation: int, notice: dict[str, Any]) -> None:
        """One object per event id: every rank of the node writes the same one (idempotent)."""
        name = re.sub(r"[^A-Za-z0-9._-]", "_", notice["event_id"])
        self.store.put_json(f"{self._gen(generation)}/notice/{name}.json", notice)

    def notices(self, generation: int) -> list[dict[str, Any]]:
        keys = self.store.list_keys(f"{self._gen(generation)}/notice/")
        return [n for k in keys if (n := self.store.get_json(k)) is not None]


def reap_checkpoints(root: str, job_exists: Callable[[str], bool], apply: bool) -> list[str]:
    """Job stores directly under `root` (`<root>/<job>/gen-*/...`, as jobs that share a
    checkpoint root keep them) whose job no longer exists: their names. Only with `apply` are
    they deleted, checkpoints and all; folders that hold no job store are never touched."""
    store = open_store(root)
    jobs = sorted({k.split("/")[0] for k in store.list_keys("") if "/gen-" in k})
    gone = [job for job in jobs if not job_exists(job)]
    if apply:
        for job in gone:
            store.delete_prefix(f"{job}/")
    return gone


def checked_store(uri: str, now: float, generation: int) -> JobStore:
    """For the activities that start a generation: the job's store once `check` passed; a
    location that refuses spotrain fails the job (a non-retryable ConfigError) at once, and
    so does a first generation where a finished job left its completion marker (a reused
    name, however the job was started: `spotrain submit --resume` removes the marker)."""
    from temporalio.exceptions import ApplicationError  # activities only, not training code

    from spotrain.workflows.contract import CONFIG_ERROR

    store = JobStore(uri)
    try:
        store.check(now)
    except StoreUnusable as err:
        raise ApplicationError(str(err), type=CONFIG_ERROR, non_retryable=True) from None
    if generation == 1 and (done := store.done()) is not None:
        raise ApplicationError(
            f"{uri} holds a job that already finished (step {done.get('step')}): resume it "
            "with `spotrain submit --resume`, or give this run a new checkpoint location",
            type=CONFIG_ERROR,
            non_retryable=True,
        )
    return store


# Error codes (S3's, and botocore's connection errors) that no retry will cure.
REFUSED = {
    "NoSuchBucket",
    "AccessDenied",
    "AllAccessDisabled",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidBucketName",
    "PermanentRedirect",
}


def _refused(err: Exception) -> bool:
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

    if isinstance(err, ClientError):
        return err.response.get("Error", {}).get("Code") in REFUSED
    return isinstance(err, EndpointConnectionError | NoCredentialsError | PermissionError)

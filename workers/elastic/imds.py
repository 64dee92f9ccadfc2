"""EC2 instance metadata as a notice path of its own, independent of the webhook.

With `SPOTRAIN_IMDS_ENDPOINT` set (on EC2: `http://169.254.169.254`; unset, nothing polls),
each rank's library polls IMDSv2 every `SPOTRAIN_IMDS_POLL_S` (0.5 s; AWS suggests every 5 s,
termination handlers poll every 2 s; IMDS is on the instance and free): a session token
(`PUT /latest/api/token`, renewed before its 6 h TTL or on a 401), then
`GET /latest/meta-data/spot/instance-action` and `/latest/meta-data/events/recommendations/
rebalance` (404 while there is none). A 1 s timeout keeps a missing endpoint cheap.

- An interruption notice raises this rank's elastic event at once, and is reported to the
  checkpoint store (`gen-<g>/notice/<event id>.json`), where the runtime's watch finds it and
  the workflow queues it as a `reclaim`: the workflow learns of it with no webhook.
- A rebalance recommendation is only reported: the job's `early_warning` policy decides, and if
  it acts, the control record brings the event back within a second.

Event ids are stable (`imds-<instance>-<action>-<time>`): every rank of the node, and every
poll, reports the same notice, so one reclaim has one effect.

Pods reach IMDS only if the instance allows it (on EKS: `HttpPutResponseHopLimit` 2 for IMDSv2
from a pod network namespace).
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from spotrain.elastic.control import STOP, log

ENDPOINT_ENV = "SPOTRAIN_IMDS_ENDPOINT"
POLL_ENV = "SPOTRAIN_IMDS_POLL_S"
POLL_S = 0.5
TIMEOUT_S = 1.0
TOKEN_TTL_S = 21600
INTERRUPTION = "spot/instance-action"
REBALANCE = "events/recommendations/rebalance"


class Imds:
    """A control-channel source (workers/elastic/control.py) over IMDSv2."""

    name = "EC2 instance metadata"

    def __init__(
        self,
        endpoint: str,
        node_id: str,
        report: Callable[[dict[str, Any]], None],
        interval_s: float = POLL_S,
    ) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.node_id = node_id
        self.report = report
        self.interval_s = interval_s
        self._token: str | None = None
        self._token_until = 0.0
        self._reported: set[str] = set()

    @classmethod
    def from_env(cls, node_id: str, report: Callable[[dict[str, Any]], None]) -> Imds | None:
        endpoint = os.environ.get(ENDPOINT_ENV)
        if not endpoint:
            return None
        return cls(endpoint, node_id, report, float(os.environ.get(POLL_ENV) or POLL_S))

    def poll(self) -> dict[str, Any] | None:
        action = self._get(INTERRUPTION)
        if action is not None:
            notice = {
                "kind": "interruption",
                "node_id": self.node_id,
                "deadline": action.get("time"),
                "event_id": f"imds-{self.node_id}-{action.get('action')}-{action.get('time')}",
            }
            self._report_once(notice)
            return {"kind": STOP, "event_id": notice["event_id"], "detail": action}
        rebalance = self._get(REBALANCE)
        if rebalance is not None:
            self._report_once(
                {
                    "kind": "rebalance",
                    "node_id": self.node_id,
                    "deadline": None,
                    "event_id": f"imds-{self.node_id}-rebalance-{rebalance.get('noticeTime')}",
                }
            )
        return None

    def _report_once(self, notice: dict[str, Any]) -> None:
        """Report a notice to the store once; a store that fails is no reason to miss the
        event (the webhook, if any, still tells the workflow)."""
        if notice["event_id"] in self._reported:
            return
        try:
            self.report(notice)
        except Exception as err:
            log.warning("cannot report %s to the checkpoint store (%s)", notice["event_id"], err)
            return
        self._reported.add(notice["event_id"])

    def _get(self, path: str) -> dict[str, Any] | None:
        """The JSON at a metadata path, or None on 404 (no such notice now)."""
        if self._token is None or time.monotonic() >= self._token_until:
            self._new_token()
        req = urllib.request.Request(
            f"{self.endpoint}/latest/meta-data/{path}",
            headers={"X-aws-ec2-metadata-token": self._token or ""},
        )
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as err:
            if err.code == 404:
                return None
            if err.code == 401:
                self._token = None  # expired or revoked: a new one next poll
            raise

    def _new_token(self) -> None:
        req = urllib.request.Request(
            f"{self.endpoint}/latest/api/token",
            method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)},
        )
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
            self._token = resp.read().decode()
        self._token_until = time.monotonic() + TOKEN_TTL_S - 60

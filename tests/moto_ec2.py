"""Where the tests' moto differs from EC2 in ways that matter to the suite, made to match."""

from __future__ import annotations

import threading
from typing import Any

from moto.core import DEFAULT_ACCOUNT_ID
from moto.core.responses import ActionResult
from moto.ec2 import models as ec2_models
from moto.ec2.responses.instances import InstanceResponse


def honour_client_tokens() -> None:
    """EC2 answers a RunInstances whose ClientToken an earlier launch used with that launch;
    moto launches again (its placeholder token for none is "ABCDE"). Beside the chaos sweep's
    16 workers moto's server drops connections and botocore retries the call: without this,
    each retry that AWS would absorb showed as a duplicate node."""
    launch = InstanceResponse.run_instances
    lock = threading.Lock()

    def run_instances(self: InstanceResponse) -> Any:
        token = self._get_param("ClientToken")
        with lock:
            if token:
                for reservation in list(self.ec2_backend.reservations.values()):
                    if any(i.client_token == token for i in reservation.instances):
                        return ActionResult(reservation)
            return launch(self)

    InstanceResponse.run_instances = run_instances  # type: ignore[method-assign]


def forget_terminated_instances() -> int:
    """EC2 stops listing a terminated instance within the hour; moto keeps each one, and its
    tag filter reads every tag of every resource per instance, so DescribeInstances grows with
    the square of all the instances the session ever launched (250 ms at 200 here). Late in a
    CI run the chaos sweep's 16 jobs then ground past their activity deadlines: it calls this
    where each scenario starts. How many were forgotten."""
    forgotten = 0
    for backend in dict.values(ec2_models.ec2_backends[DEFAULT_ACCOUNT_ID]):  # regions in use
        for reservation_id, reservation in list(backend.reservations.items()):
            live = [i for i in reservation.instances if i.state != "terminated"]
            for instance in set(reservation.instances) - set(live):
                backend.tags.pop(instance.id, None)
            forgotten += len(reservation.instances) - len(live)
            if live:
                reservation.instances = live
            else:
                del backend.reservations[reservation_id]
    return forgotten

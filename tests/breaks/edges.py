"""Breaks at the edges: webhook auth, notice parsing, EC2 ownership, the CLI and the
operator."""

from __future__ import annotations

from tests.breaks.model import Break, _in

AUTH = _in("webhook/test_webhook_auth.py")
EC2 = _in("aws/test_ec2.py")

# --- webhook auth: who may send a notice -------------------------------------------------------
AUTH_PY = "workers/webhook/auth.py"
AUTH_BREAKS = [
    Break(
        "bearer token compared whole",
        AUTH_PY,
        "ok = hmac.compare_digest(_bytes(auth[7:]), _bytes(config.bearer_token))",
        "ok = _bytes(config.bearer_token).startswith(_bytes(auth[7:]))",
        AUTH("test_a_bearer_token_must_match_exactly"),
    ),
    Break(
        "signature binds method and path",
        AUTH_PY,
        'return f"v2\\n{timestamp}\\n{method.upper()}\\n{path}\\n".encode() + body',
        'return f"v2\\n{timestamp}\\n".encode() + body',
        AUTH("test_a_signature_binds_method_and_path"),
    ),
    Break(
        "signature cut short refused",
        AUTH_PY,
        "if hmac.compare_digest(given, expected.encode()):",
        "if given and expected.encode().startswith(given):",
        AUTH("test_a_signature_cut_short_or_lengthened_is_refused"),
    ),
    Break(
        "signature dated ahead refused",
        AUTH_PY,
        "if not -HMAC_FUTURE_SKEW_S <= age <= config.replay_window_s:",
        "if not age <= config.replay_window_s:",
        AUTH("test_a_signature_too_old_or_dated_ahead_is_refused"),
    ),
    Break(
        "signature older than the replay window refused",
        AUTH_PY,
        "if not -HMAC_FUTURE_SKEW_S <= age <= config.replay_window_s:",
        "if not -HMAC_FUTURE_SKEW_S <= age:",
        AUTH("test_a_signature_too_old_or_dated_ahead_is_refused"),
    ),
    Break(
        "legacy signature only when asked for",
        AUTH_PY,
        "if config.hmac_legacy:",
        "if True:",
        AUTH("test_the_legacy_signature_only_when_asked_for"),
    ),
]

# --- notice parsing: a deadline is read in its own zone ---------------------------------------
EVENTS_PY = "workers/webhook/events.py"
NOTICE_BREAKS = [
    Break(
        "deadline offset converted, not relabelled",
        EVENTS_PY,
        "utc = value.astimezone(UTC)",
        "utc = value.replace(tzinfo=UTC)",
        AUTH("test_a_deadline_with_an_offset_is_converted_not_relabelled"),
    ),
    Break(
        "deadline kept in UTC",
        EVENTS_PY,
        "return utc\n",
        "return value\n",
        AUTH("test_a_deadline_with_an_offset_is_converted_not_relabelled"),
    ),
    Break(
        "deadline without a zone refused",
        EVENTS_PY,
        "Instant = Annotated[AwareDatetime, AfterValidator(_sane_time)]",
        "Instant = Annotated[datetime, AfterValidator(_sane_time)]",
        AUTH("test_a_deadline_without_a_zone_or_out_of_range_is_refused"),
    ),
    Break(
        "EventBridge spot warning: deadline two minutes on",
        EVENTS_PY,
        "deadline = event.time + SPOT_NOTICE\n",
        "deadline = event.time\n",
        AUTH("test_an_eventbridge_warning_comes_two_minutes_before_in_utc"),
    ),
    Break(
        "NTH queue mode: StartTime is the notice's time",
        EVENTS_PY,
        "return notice.start_time + SPOT_NOTICE if from_queue else notice.start_time",
        "return notice.start_time",
        AUTH("test_an_eventbridge_warning_comes_two_minutes_before_in_utc"),
    ),
]

# --- EC2 ownership: tags gc and release look for, client tokens --------------------------------
OWN_PY = "activities/ec2_ownership.py"
EC2_PY = "activities/ec2.py"
EC2_BREAKS = [
    Break(
        "client token differs per attempt",
        OWN_PY,
        'digest = hashlib.sha256(f"{job}/{slot}/{attempt}".encode()).hexdigest()',
        'digest = hashlib.sha256(f"{job}/{slot}".encode()).hexdigest()',
        EC2("test_the_client_token_is_stable_per_attempt_and_new_per_attempt"),
    ),
    Break(
        "the managed tag",
        OWN_PY,
        '[{"Key": MANAGED, "Value": "true"}, {"Key": TAG_JOB, "Value": job}]',
        '[{"Key": TAG_JOB, "Value": job}]',
        EC2("test_launch_lifecycle_and_tags"),
    ),
    Break(
        "gc spares the nodes of running jobs",
        OWN_PY,
        "if not running.get(job, False):",
        "if True:",
        EC2("test_gc_reaps_orphans_and_spares_live_jobs"),
    ),
    Break(
        "gc reaps stopped instances too",
        OWN_PY,
        'LIVE_STATES = ("pending", "running", "stopping", "stopped")',
        'LIVE_STATES = ("pending", "running")',
        EC2("test_gc_reaps_orphans_and_spares_live_jobs"),
    ),
    Break(
        "run_instances tags the volumes",
        EC2_PY,
        'for kind in ("instance", "volume")',
        'for kind in ("instance",)',
        EC2("test_launch_lifecycle_and_tags"),
    ),
    Break(
        "a fleet's node carries the ownership tags",
        EC2_PY,
        '            TagSpecifications=[{"ResourceType": "instance", "Tags": ownership_tags(req)}],\n',
        "",
        EC2("test_fleet_launch_offers_every_pool_tags_and_is_idempotent"),
    ),
    Break(
        "a fleet's volumes carry the ownership tags",
        EC2_PY,
        "ec2.create_tags(Resources=volumes, Tags=ownership_tags(req))",
        "volumes.clear()",
        EC2("test_fleet_launch_offers_every_pool_tags_and_is_idempotent"),
    ),
    Break(
        "the EC2 model loads before the worker freezes its heap",
        EC2_PY,
        "        self.client()  # its service model loads now",
        "        pass  # its service model loads now",
        EC2("test_the_ec2_model_is_frozen_with_the_worker_s_heap"),
    ),
]

# --- the CLI ---------------------------------------------------------------------------------
CLI_BREAKS = [
    Break(
        "an update aborted by a failed workflow task is tried again",
        "workers/cli/support.py",
        "if not task_failed(e) or time.monotonic() > deadline:",
        "if True:",
        _in("cli/test_update_retry.py")(
            "test_an_update_aborted_by_a_failed_workflow_task_is_tried_again"
        ),
    ),
    Break(
        "gc finds an operator's job running by its name (its workflow id is k8s/...)",
        "workers/cli/support.py",
        "    if not re.fullmatch(NAME_PATTERN, job):  # (a tag no job wrote: nothing to ask)\n",
        "    if True:\n",
        _in("kube/test_kube_watch.py")(
            "test_gc_releases_the_objects_of_jobs_that_do_not_run_and_no_others"
        ),
    ),
]

# --- Kubernetes: the operator, live pods ------------------------------------------------------
KUBE_BREAKS = [
    Break(
        "the finalizer stays while an ended job still lists a node it holds",
        "workers/k8s/operator_status.py",
        "return not s.phase.is_final or any(n.state.is_alive for n in s.nodes)",
        "return not s.phase.is_final",
        _in("kube/operator/test_operator_status.py")(
            "test_a_job_needs_a_release_until_it_is_over_and_holds_no_node"
        ),
    ),
    Break(
        "a live pod is adopted only once all its ranks parked",
        "activities/kube_live.py",
        "and pod_ranks(p) <= acked",
        "and bool(pod_ranks(p) & acked)",
        _in("kube/test_parked_pods.py")(
            "test_a_pod_is_parked_only_once_every_one_of_its_ranks_acked"
        ),
    ),
]

"""The control plane's own configuration files (tests/kube/k8s_cluster.py writes them per
run): kwok's stages and the apiserver's audit policy."""

# kwok's stages: nodes become Ready (capacity comes from add_node); pods on them Running and
# Ready; a pod deleted with a grace period is removed at its deletionTimestamp (like a
# container that ignores SIGTERM). Not one deleted with none: the apiserver removes it itself,
# and kwok's delete, by name, came late enough under load to remove the pod made anew under
# that name (test_a_pod_deleted_at_once_is_not_deleted_again).
KWOK_STAGES = """
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata: {name: node-ready}
spec:
  resourceRef: {apiGroup: v1, kind: Node}
  selector:
    matchExpressions:
    - {key: '.status.conditions.[] | select( .type == "Ready" ) | .status', operator: NotIn,
       values: ["True"]}
  next:
    statusTemplate: |
      {{ $now := Now }}
      conditions:
      {{ range NodeConditions }}
      - {lastHeartbeatTime: {{ $now | Quote }}, lastTransitionTime: {{ $now | Quote }},
         message: {{ .message | Quote }}, reason: {{ .reason | Quote }},
         status: {{ .status | Quote }}, type: {{ .type | Quote }}}
      {{ end }}
      addresses: [{address: {{ NodeIP | Quote }}, type: InternalIP}]
      phase: Running
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata: {name: pod-ready}
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
    - {key: .metadata.deletionTimestamp, operator: DoesNotExist}
    - {key: .status.phase, operator: In, values: [Pending]}
    - {key: '.status.conditions.[] | select( .type == "Ready" ) | .status', operator: NotIn,
       values: ["True"]}
  next:
    statusTemplate: |
      {{ $now := Now }}
      conditions:
      - {lastTransitionTime: {{ $now | Quote }}, status: "True", type: Initialized}
      - {lastTransitionTime: {{ $now | Quote }}, status: "True", type: Ready}
      - {lastTransitionTime: {{ $now | Quote }}, status: "True", type: ContainersReady}
      containerStatuses:
      {{ range .spec.containers }}
      - {image: {{ .image | Quote }}, name: {{ .name | Quote }}, ready: true, restartCount: 0,
         state: {running: {startedAt: {{ $now | Quote }}}}}
      {{ end }}
      {{ $ips := PodIPsWith .spec.nodeName false .metadata.uid .metadata.name .metadata.namespace }}
      podIP: {{ index $ips 0 | Quote }}
      phase: Running
      startTime: {{ $now | Quote }}
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata: {name: pod-delete}
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
    - {key: .metadata.deletionTimestamp, operator: Exists}
    - {key: '.metadata.deletionGracePeriodSeconds > 0', operator: In, values: ['true']}
  delay:
    durationMilliseconds: 0
    durationFrom: {expressionFrom: .metadata.deletionTimestamp}
  next: {delete: true}
"""


AUDIT_POLICY = """
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived, ResponseStarted]
rules: [{level: Metadata}]
"""

"""KWOK (Kubernetes WithOut Kubelet) in front of the tests' real API server: one process that
plays the kubelet of every node annotated `kwok.x-k8s.io/node: fake`, for the scale benchmark
(bench/kube_bench.py --kubelet kwok) and tests/test_kube_kwok.py.

KWOK moves pods through their phases as its Stages say; these are Berth's, written here:

- `pod-run`: a pod bound to a KWOK node starts at once (Running, its container running and
  ready, a pod IP), as a kubelet with the image already pulled would.
- `pod-succeed`: each of Berth's running pods (label app.kubernetes.io/managed-by=berth) ends
  with exit code 0 after `run_ms` plus up to `jitter_ms` (KWOK draws the jitter per pod, so a
  gang's replicas end at different times, as real ones do).
- `pod-fail`: a Berth pod annotated `berth.io/kwok-exit-code` ends with that code instead
  (after the same delay), so a test can make one replica of a gang fail.
- `pod-delete`: a pod being deleted goes at once (no grace period is simulated).

Nodes are created Ready with their capacity (kubelet_standin.make_node); `node-ready` makes one
that is not Ready ready again (KWOK plays the pods only of nodes it has a stage for), and KWOK
keeps no lease. The binary is built by scripts/build-kwok.sh (cached); without it the tests
skip, and with BERTH_REQUIRE_KUBE=1 (CI) they fail.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kubeapi import REPO, KubeAPI, _Process, _wait_until_ok, unavailable
from ports import free_port

TOOLS = REPO / "tools" / "kwok"
FAKE = "kwok.x-k8s.io/node"  # the annotation (value `fake`) of the nodes KWOK plays
EXIT_CODE = "berth.io/kwok-exit-code"


def kwok_version(go_mod: Path = TOOLS / "go.mod") -> str:
    for line in go_mod.read_text().splitlines():
        words = line.split()
        if "sigs.k8s.io/kwok" in words[:-1] and "=>" not in words:
            return words[words.index("sigs.k8s.io/kwok") + 1]
    raise ValueError(f"{go_mod} requires no sigs.k8s.io/kwok version")


def kwok_path(tools: Path = TOOLS) -> Path:
    """Where scripts/build-kwok.sh caches kwok (the same rule, kept in step)."""
    digest = hashlib.sha256()
    for name in ("go.mod", "go.sum", "main.go"):
        digest.update((tools / name).read_bytes())
    cache = Path(os.environ.get("BERTH_KWOK_CACHE") or Path.home() / ".cache/berth/kwok")
    return cache / f"{kwok_version(tools / 'go.mod')}-{digest.hexdigest()[:12]}" / "kwok"


_RUNNING = """\
{{ $now := Now }}
conditions:
- {type: Initialized, status: "True", lastTransitionTime: {{ $now | Quote }}}
- {type: Ready, status: "True", lastTransitionTime: {{ $now | Quote }}}
- {type: ContainersReady, status: "True", lastTransitionTime: {{ $now | Quote }}}
containerStatuses:
{{ range .spec.containers }}
- image: {{ .image | Quote }}
  imageID: ""
  name: {{ .name | Quote }}
  ready: true
  restartCount: 0
  started: true
  state: {running: {startedAt: {{ $now | Quote }}}}
{{ end }}
hostIP: {{ NodeIPWith .spec.nodeName | Quote }}
{{ $meta := .metadata }}
podIP: {{ PodIPWith .spec.nodeName false
  (or $meta.uid "") (or $meta.name "") (or $meta.namespace "") | Quote }}
phase: Running
startTime: {{ $now | Quote }}
"""

_ENDED = """\
{{ $now := Now }}
{{ $code := %(code)s }}
conditions:
- {type: Ready, status: "False", lastTransitionTime: {{ $now | Quote }}}
- {type: ContainersReady, status: "False", lastTransitionTime: {{ $now | Quote }}}
containerStatuses:
{{ range .spec.containers }}
- image: {{ .image | Quote }}
  imageID: ""
  name: {{ .name | Quote }}
  ready: false
  restartCount: 0
  started: false
  state:
    terminated:
      exitCode: {{ $code }}
      reason: %(reason)s
      startedAt: {{ $now | Quote }}
      finishedAt: {{ $now | Quote }}
{{ end }}
phase: %(phase)s
"""


def _indent(text: str, spaces: int) -> str:
    pad = " " * spaces
    return "".join(pad + line if line.strip() else line for line in text.splitlines(True))


def stages(run_ms: int, jitter_ms: int) -> str:
    """The Stages of the module docstring, as KWOK's --config reads them."""
    berth_running = """\
    matchExpressions:
    - {key: '.metadata.deletionTimestamp', operator: DoesNotExist}
    - {key: '.status.phase', operator: In, values: [Running]}
    - {key: '.metadata.labels["app.kubernetes.io/managed-by"]', operator: In, values: [berth]}
"""
    delay = f"""\
  delay:
    durationMilliseconds: {run_ms}
    jitterDurationMilliseconds: {run_ms + jitter_ms}
"""
    succeed = _ENDED % {"code": "0", "reason": "Completed", "phase": "Succeeded"}
    failed_code = f'(index .metadata.annotations "{EXIT_CODE}")'
    fail = _ENDED % {"code": failed_code, "reason": "Error", "phase": "Failed"}
    return f"""\
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata: {{name: node-ready}}
spec:
  resourceRef: {{apiGroup: v1, kind: Node}}
  selector:
    matchExpressions:
    - {{key: '.status.conditions.[] | select( .type == "Ready" ) | .status', operator: NotIn,
       values: ["True"]}}
  next:
    statusTemplate: |
      conditions:
      - {{type: Ready, status: "True", reason: KubeletReady, message: kwok,
         lastHeartbeatTime: {{{{ Now | Quote }}}}, lastTransitionTime: {{{{ Now | Quote }}}}}}
      phase: Running
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata: {{name: pod-run}}
spec:
  resourceRef: {{apiGroup: v1, kind: Pod}}
  selector:
    matchExpressions:
    - {{key: '.metadata.deletionTimestamp', operator: DoesNotExist}}
    - {{key: '.status.podIP', operator: DoesNotExist}}
  next:
    statusTemplate: |
{_indent(_RUNNING, 6)}---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata: {{name: pod-succeed}}
spec:
  resourceRef: {{apiGroup: v1, kind: Pod}}
  selector:
{berth_running}    - {{key: '.metadata.annotations["{EXIT_CODE}"]', operator: DoesNotExist}}
{delay}  next:
    statusTemplate: |
{_indent(succeed, 6)}---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata: {{name: pod-fail}}
spec:
  resourceRef: {{apiGroup: v1, kind: Pod}}
  selector:
{berth_running}    - {{key: '.metadata.annotations["{EXIT_CODE}"]', operator: Exists}}
{delay}  next:
    statusTemplate: |
{_indent(fail, 6)}---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata: {{name: pod-delete}}
spec:
  resourceRef: {{apiGroup: v1, kind: Pod}}
  selector:
    matchExpressions:
    - {{key: '.metadata.deletionTimestamp', operator: Exists}}
  next:
    finalizers: {{empty: true}}
    delete: true
"""


@contextmanager
def run_kwok(
    kube: KubeAPI, workdir: Path, *, run_ms: int = 2000, jitter_ms: int = 0
) -> Iterator[_Process]:
    """KWOK playing the kubelets of the `kwok.x-k8s.io/node=fake` nodes of `kube`, with Berth's
    pods running `run_ms` (+ up to `jitter_ms`), until the block ends."""
    binary = kwok_path()
    if not binary.is_file():
        unavailable(f"kwok is not built at {binary} (scripts/build-kwok.sh)")
    workdir.mkdir(parents=True, exist_ok=True)
    kubeconfig = kube.write_kubeconfig(workdir / "kwok-kubeconfig.yaml")
    config = workdir / "kwok-stages.yaml"
    config.write_text(stages(run_ms, jitter_ms))
    address = f"127.0.0.1:{free_port()}"
    argv = [
        str(binary), f"--kubeconfig={kubeconfig}", f"--config={config}",
        f"--manage-nodes-with-annotation-selector={FAKE}=fake", f"--server-address={address}",
        "--node-lease-duration-seconds=0",
    ]  # fmt: skip
    # Its log says "a watch stream was requested ... RequestWatchProgress is disabled" now and
    # then: client-go asks for a watch stream, which the tests' etcd 3.4 cannot serve
    # (scripts/build-kube.sh), and falls back to a list and a watch.
    proc = _Process("kwok", argv, workdir / "kwok.log")
    try:
        _wait_until_ok(proc, f"http://{address}/healthz")
        yield proc
    finally:
        proc.stop()

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

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from go_binaries import cached_binary
from kubeapi import REPO, KubeAPI, _Process, _wait_until_ok, unavailable
from ports import free_port

TOOLS = REPO / "tools" / "kwok"
FAKE = "kwok.x-k8s.io/node"  # the annotation (value `fake`) of the nodes KWOK plays
EXIT_CODE = "berth.io/kwok-exit-code"


def kwok_path(tools: Path = TOOLS) -> Path:
    """Where scripts/build-kwok.sh caches kwok (the same rule, kept in step)."""
    return cached_binary(tools, "sigs.k8s.io/kwok", "BERTH_KWOK_CACHE", "kwok", "kwok")


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
{{ $code := {code} }}
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
      reason: {reason}
      startedAt: {{ $now | Quote }}
      finishedAt: {{ $now | Quote }}
{{ end }}
phase: {phase}
"""


def _ended(code: str, reason: str, phase: str) -> str:
    """The status of a pod whose containers ended with `code` (a template expression)."""
    return _ENDED.replace("{code}", code).replace("{reason}", reason).replace("{phase}", phase)


_READY = """\
conditions:
- {type: Ready, status: "True", reason: KubeletReady, message: kwok,
   lastHeartbeatTime: {{ Now | Quote }}, lastTransitionTime: {{ Now | Quote }}}
phase: Running
"""


def _stage(
    name: str,
    kind: str,
    match: list[dict[str, Any]],
    then: dict[str, Any],
    delay_ms: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """One KWOK Stage: objects of `kind` matching every expression of `match` get `then`
    (after a delay drawn from `delay_ms`, least and most, when given)."""
    spec: dict[str, Any] = {
        "resourceRef": {"apiGroup": "v1", "kind": kind},
        "selector": {"matchExpressions": match},
        "next": then,
    }
    if delay_ms is not None:
        spec["delay"] = {
            "durationMilliseconds": delay_ms[0],
            "jitterDurationMilliseconds": delay_ms[1],
        }
    return {
        "apiVersion": "kwok.x-k8s.io/v1alpha1",
        "kind": "Stage",
        "metadata": {"name": name},
        "spec": spec,
    }


def _is(key: str, operator: str, *values: str) -> dict[str, Any]:
    return {"key": key, "operator": operator, **({"values": list(values)} if values else {})}


def stages(run_ms: int, jitter_ms: int) -> str:
    """The Stages of the module docstring, as KWOK's --config reads them."""
    not_deleted = _is(".metadata.deletionTimestamp", "DoesNotExist")
    berth_running = [
        not_deleted,
        _is(".status.phase", "In", "Running"),
        _is('.metadata.labels["app.kubernetes.io/managed-by"]', "In", "berth"),
    ]
    code = f'.metadata.annotations["{EXIT_CODE}"]'
    delay = (run_ms, run_ms + jitter_ms)
    ready = '.status.conditions.[] | select( .type == "Ready" ) | .status'
    return yaml.safe_dump_all(
        [
            _stage("node-ready", "Node", [_is(ready, "NotIn", "True")], {"statusTemplate": _READY}),
            _stage(
                "pod-run",
                "Pod",
                [not_deleted, _is(".status.podIP", "DoesNotExist")],
                {"statusTemplate": _RUNNING},
            ),
            _stage(
                "pod-succeed",
                "Pod",
                [*berth_running, _is(code, "DoesNotExist")],
                {"statusTemplate": _ended("0", "Completed", "Succeeded")},
                delay,
            ),
            _stage(
                "pod-fail",
                "Pod",
                [*berth_running, _is(code, "Exists")],
                {
                    "statusTemplate": _ended(
                        f'(index .metadata.annotations "{EXIT_CODE}")', "Error", "Failed"
                    )
                },
                delay,
            ),
            _stage(
                "pod-delete",
                "Pod",
                [_is(".metadata.deletionTimestamp", "Exists")],
                {"finalizers": {"empty": True}, "delete": True},
            ),
        ],
        sort_keys=False,
    )


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

"""Helm for the tests of Berth's chart (docker/chart) and of the pod template the Airflow chart
renders from docker/helm/values.yaml: `helm template`, which renders charts with no cluster.

Helm is built from its Go module by scripts/build-helm.sh (cached, tools/helm/go.mod pins the
version); without it these tests skip, and with BERTH_REQUIRE_KUBE=1 (CI) they fail.

The Apache Airflow chart itself cannot be downloaded here, so the pod template is rendered by a
one-template chart that does what that chart's ConfigMap does with the value `podTemplate`:
`tpl .Values.podTemplate .`, with the release name and the values given. The template reads
only `.Release` and the values it is given, so Helm's own `tpl` renders it as the chart would.
"""

from __future__ import annotations

import copy
import functools
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import yaml
from go_binaries import cached_binary
from kubeapi import REPO, unavailable

TOOLS = REPO / "tools" / "helm"
CHART = REPO / "docker" / "chart"
VALUES = REPO / "docker" / "helm" / "values.yaml"
NAMESPACE = "berth-system"


class HelmError(Exception):
    """`helm` refused: its message (a failed `required`, a template error) is the exception's."""


def helm_path(tools: Path = TOOLS) -> Path:
    """Where scripts/build-helm.sh caches helm (the same rule, kept in step)."""
    return cached_binary(tools, "helm.sh/helm/v3", "BERTH_HELM_CACHE", "helm", "helm")


def helm(*args: str | Path) -> str:
    """Runs the cached helm with `args` and returns its output; HelmError when it fails. Its
    own files (repositories, cache) go to a temporary folder, not the user's home."""
    binary = helm_path()
    if not os.access(binary, os.X_OK):
        unavailable(f"helm is not built at {binary} (scripts/build-helm.sh)")
    with tempfile.TemporaryDirectory(prefix="berth-helm-") as home:
        env = {
            **os.environ,
            **{f"HELM_{k}_HOME": f"{home}/{k.lower()}" for k in ("CACHE", "CONFIG", "DATA")},
        }
        done = subprocess.run(
            [str(binary), *map(str, args)], capture_output=True, text=True, env=env, timeout=120
        )
    if done.returncode != 0:
        raise HelmError(done.stderr.strip())
    return done.stdout


def _set_flags(sets: dict[str, str] | None) -> list[str]:
    return [f for key, value in (sets or {}).items() for f in ("--set", f"{key}={value}")]


def render(
    chart: Path,
    release: str,
    *,
    values: tuple[Path, ...] = (VALUES,),
    sets: dict[str, str] | None = None,
    namespace: str = NAMESPACE,
) -> list[dict[str, Any]]:
    """The objects `helm template` renders from `chart`, in order."""
    args = ["template", release, chart, "--namespace", namespace]
    for path in values:
        args += ["-f", path]
    out = helm(*args, *_set_flags(sets))
    return [doc for doc in yaml.safe_load_all(out) if doc]


@functools.cache
def _berth_chart(
    sets: tuple[tuple[str, str], ...], values: tuple[Path, ...], namespace: str
) -> list[dict[str, Any]]:
    return render(CHART, "berth", values=values, sets=dict(sets), namespace=namespace)


def render_berth_chart(
    sets: dict[str, str] | None = None,
    values: tuple[Path, ...] = (VALUES,),
    namespace: str = NAMESPACE,
) -> list[dict[str, Any]]:
    """Berth's chart as docker/README.md installs it: release `berth`, the Airflow values. The
    files do not change within a session, so each render is made once (the Kubernetes tests
    ask for the PriorityClass often); the caller gets its own copy."""
    key = tuple(sorted((sets or {}).items()))
    return copy.deepcopy(_berth_chart(key, values, namespace))


def chart_object(kind: str, name: str, sets: dict[str, str] | None = None) -> dict[str, Any]:
    """The one object of `kind` called `name` that Berth's chart renders."""
    [doc] = [
        d for d in render_berth_chart(sets) if d["kind"] == kind and d["metadata"]["name"] == name
    ]
    return doc


_TPL_CHART = """\
apiVersion: v2
name: airflow-pod-template
version: 0.0.0
"""


@functools.cache
def _pod_template(
    sets: tuple[tuple[str, str], ...], values: tuple[Path, ...], release: str
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="berth-tpl-chart-") as tmp:
        chart = Path(tmp)
        (chart / "Chart.yaml").write_text(_TPL_CHART)
        (chart / "templates").mkdir()
        (chart / "templates" / "pod.yaml").write_text("{{ tpl .Values.podTemplate . }}\n")
        [pod] = render(chart, release, values=values, sets=dict(sets))
    return pod


def render_pod_template(
    sets: dict[str, str] | None = None,
    values: tuple[Path, ...] = (VALUES,),
    release: str = "airflow",
) -> dict[str, Any]:
    """The Pod the Airflow chart makes of `podTemplate` for the release `release` (rendered once
    per session, as Berth's chart; the caller gets its own copy)."""
    key = tuple(sorted((sets or {}).items()))
    return copy.deepcopy(_pod_template(key, values, release))


# Placement values for Berth's triggerers (a node selector, a toleration, a node affinity), as an
# admin would set them: rendered and dry-run by tests/test_deployment_files.py and
# tests/test_kube_manifests.py.
PLACEMENT = {
    "triggerers.berth.nodeSelector.pool": "system",
    "triggerers.berth.tolerations[0].key": "dedicated",
    "triggerers.berth.tolerations[0].operator": "Exists",
    "triggerers.berth.affinity.nodeAffinity"
    ".requiredDuringSchedulingIgnoredDuringExecution"
    ".nodeSelectorTerms[0].matchExpressions[0].key": "zone",
    "triggerers.berth.affinity.nodeAffinity"
    ".requiredDuringSchedulingIgnoredDuringExecution"
    ".nodeSelectorTerms[0].matchExpressions[0].operator": "Exists",
}

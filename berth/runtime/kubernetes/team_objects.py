"""The objects a cluster needs per team, made from the teams file: what an admin otherwise
copy-edits by hand for every team (docker/README.md, steps 2 and 7).

- per team namespace (`KubeSettings.namespace_template` or `team_namespaces`): the Namespace,
  labelled to enforce Pod Security "restricted" (Berth's pods pass it), or "baseline" with
  "restricted" warned and audited where the cluster's image builds run (Kaniko needs root,
  docker/README.md section 11) or where the settings turn `restricted` off;
- there, the RoleBinding that gives Berth's ServiceAccount the ClusterRole
  `berth-runtime-team` (Berth's chart, docker/chart), and with builds `berth-builder-team`
  (the chart with `builds.enabled`) where they run;
- the team's volumes (`data_volume`, `checkpoint_volume`): a ReadWriteMany
  PersistentVolumeClaim per claim, when a storage class is given (else they are the admin's
  to create, and `notes` says which);
- the ConfigMap every Airflow container mounts at /etc/berth: the teams file, the Kubernetes
  settings and, when given, the policy and access files, each validated first;
- with a storage class, `berth-home`: the ReadWriteMany claim that Airflow's containers and
  task pods mount as BERTH_HOME, where MLflow writes wait out an outage (the tracking spool)
  and collected artifacts stay, which an emptyDir loses with each pod.

Pure: files in, dicts out. `berth kube manifests` prints them for `kubectl apply -f -`, and
tests/test_kube_team_objects.py applies them to a real API server. Why a generator and not a
chart: docs/decisions/0018.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from berth.runtime.kubernetes.config import KubeConfig
from berth.runtime.kubernetes.pods import namespace_for
from scheduling.quota import Team

MANAGED = {"app.kubernetes.io/managed-by": "berth", "app.kubernetes.io/part-of": "berth"}
TEAM_LABEL = "berth.io/team"
RUNTIME_ROLE, BUILDER_ROLE = "berth-runtime-team", "berth-builder-team"
PSS = "pod-security.kubernetes.io"
# A Kubernetes quantity as a PVC's storage request takes it (e.g. 500Gi, 1Ti, 2e12).
_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?([eE][0-9]+|Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")
_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")


class TeamObjectsError(ValueError):
    """An option or a file that cannot make valid objects; the message names it and the fix."""


@dataclass(frozen=True)
class Options:
    system_namespace: str = "berth-system"  # where Berth's ServiceAccount and Airflow run
    service_account: str = "berth-runtime"
    config_map: str = "berth-config"
    home_claim: str = "berth-home"  # BERTH_HOME of Airflow's containers and task pods
    home_size: str = "20Gi"
    storage_class: str | None = None  # None: the team volumes are not created here
    volume_size: str = "100Gi"
    builds: bool = False  # bind berth-builder-team where builds run
    build_namespace: str | None = None  # BERTH_BUILD_NAMESPACE: one for all builds

    def check(self) -> None:
        for name, value in (
            ("--system-namespace", self.system_namespace),
            ("--build-namespace", self.build_namespace),
        ):
            if value is not None and not _DNS_LABEL.fullmatch(value):
                raise TeamObjectsError(
                    f"{name}: {value!r} is not a namespace name (1-63 lowercase letters, "
                    "digits or '-', starting with a letter)"
                )
        for name, size in (("--volume-size", self.volume_size), ("--home-size", self.home_size)):
            if not _QUANTITY.fullmatch(size):
                raise TeamObjectsError(f"{name}: {size!r} is not a Kubernetes quantity; e.g. 500Gi")


@dataclass
class TeamObjects:
    objects: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)  # what the admin must still do


def team_objects(
    teams: Mapping[str, Team],
    kube: KubeConfig,
    files: Mapping[str, str],
    options: Options = Options(),
) -> TeamObjects:
    """The objects for `teams` under the settings `kube`; `files` (name -> text, already
    validated) become the ConfigMap. TeamObjectsError names what cannot be made."""
    options.check()
    settings = kube.pods
    namespaces: dict[str, list[str]] = {}  # namespace -> its teams (team_namespaces may share)
    for team in sorted(teams):
        try:
            ns = namespace_for(settings, team)
        except ValueError as e:
            raise TeamObjectsError(str(e)) from None
        namespaces.setdefault(ns, []).append(team)
    if options.system_namespace in namespaces:
        raise TeamObjectsError(
            f"--system-namespace: {options.system_namespace!r} is also team "
            f"{namespaces[options.system_namespace][0]!r}'s namespace; Airflow's and a team's "
            "pods must not share one (set team_namespaces in the Kubernetes settings)"
        )
    build_in = set()
    if options.builds:
        build_in = {options.build_namespace} if options.build_namespace else set(namespaces)
    out = TeamObjects([])
    if options.build_namespace and options.builds and options.build_namespace not in namespaces:
        out.objects.append(_namespace(options.build_namespace, [], baseline=True))
    for ns, members in namespaces.items():
        baseline = ns in build_in or not settings.restricted
        out.objects.append(_namespace(ns, members, baseline=baseline))
        out.objects.append(_binding(ns, "berth-runtime", RUNTIME_ROLE, options))
        out.objects.extend(_claims(ns, members, kube, options, out.notes))
    for ns in sorted(build_in):
        out.objects.append(_binding(ns, "berth-builder", BUILDER_ROLE, options))
    if options.builds:
        out.notes.append(
            "builds: install Berth's chart with builds.enabled=true, and create the push Secret "
            f"(BERTH_BUILD_PUSH_SECRET) in {', '.join(sorted(build_in))}"
        )
    if options.storage_class is None:
        out.notes.append(
            f"{options.system_namespace}: create the ReadWriteMany PersistentVolumeClaim "
            f"{options.home_claim!r} (BERTH_HOME), or give --storage-class to have it made here"
        )
    else:
        out.objects.append(_claim(options.home_claim, options.system_namespace, options, home=True))
    out.objects.append(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _meta(options.config_map, options.system_namespace),
            "data": dict(files),
        }
    )
    return out


def _meta(name: str, namespace: str | None = None, **labels: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {**MANAGED, **labels}}
    if namespace is not None:
        meta["namespace"] = namespace
    return meta


def _namespace(ns: str, teams: list[str], *, baseline: bool) -> dict[str, Any]:
    # A namespace of several teams (team_namespaces) gets no team label: it has none.
    labels = {TEAM_LABEL: teams[0]} if len(teams) == 1 else {}
    if baseline:  # what the builder (or the admin's own pods) need; warn where it falls short
        labels |= {f"{PSS}/enforce": "baseline", f"{PSS}/warn": "restricted"}
        labels |= {f"{PSS}/audit": "restricted"}
    else:
        labels |= {f"{PSS}/enforce": "restricted"}
    labels |= {f"{PSS}/enforce-version": "latest"}
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": _meta(ns, **labels)}


def _binding(ns: str, name: str, role: str, options: Options) -> dict[str, Any]:
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(name, ns),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
        "subjects": [
            {
                "kind": "ServiceAccount",
                "name": options.service_account,
                "namespace": options.system_namespace,
            }
        ],
    }


def _claims(
    ns: str, teams: list[str], kube: KubeConfig, options: Options, notes: list[str]
) -> list[dict[str, Any]]:
    """The namespace's team volumes: one ReadWriteMany claim per distinct name."""
    names: dict[str, list[str]] = {}  # claim -> the settings that use it
    for setting, volume in (
        ("data_volume", kube.pods.data_volume),
        ("checkpoint_volume", kube.pods.checkpoint_volume),
        ("outputs_volume", kube.pods.outputs_volume),
    ):
        if volume is None:
            continue
        for team in teams:
            try:
                claim = volume.claim_for(team)
            except ValueError as e:
                raise TeamObjectsError(str(e)) from None
            if setting not in names.setdefault(claim, []):
                names[claim].append(setting)
    if options.storage_class is None:
        notes.extend(
            f"{ns}: create the ReadWriteMany PersistentVolumeClaim {claim!r} "
            f"({' and '.join(used)}), or give --storage-class to have it made here"
            for claim, used in names.items()
        )
        return []
    return [_claim(claim, ns, options) for claim in names]


def _claim(name: str, ns: str, options: Options, *, home: bool = False) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _meta(name, ns),
        "spec": {
            "accessModes": ["ReadWriteMany"],  # a writer and readers on many nodes
            "storageClassName": options.storage_class,
            "resources": {
                "requests": {"storage": options.home_size if home else options.volume_size}
            },
        },
    }

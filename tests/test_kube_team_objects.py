"""`berth kube manifests`: the per-team objects made from the teams file
(berth/runtime/kubernetes/team_objects.py), as objects, as the command prints them, and
applied for real to the test kube-apiserver, where RBAC and Pod Security judge them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from helm import chart_object
from kubeapi import KubeAPI, kube_api  # noqa: F401 (the session fixture)
from kubernetes import client, dynamic
from typer.testing import CliRunner

from berth.cli import app
from berth.runtime.kubernetes.config import KubeConfig
from berth.runtime.kubernetes.team_objects import Options, TeamObjectsError, team_objects
from scheduling.config import parse_teams

REPO = Path(__file__).resolve().parents[1]
PSS = "pod-security.kubernetes.io"
BOUND = ("berth-runtime-team", "berth-builder-team")  # what the made RoleBindings name
TEAMS = {
    "teams": [
        {"name": "vision", "nominal": {"gpus": 4}},
        {"name": "language", "nominal": {"gpus": 2}},
        {"name": "research", "nominal": {"gpus": 2}},
    ]
}


def kube_config(**pods: Any) -> KubeConfig:
    return KubeConfig.model_validate({"pods": pods})


def by_kind(objects: list[dict[str, Any]], kind: str) -> dict[tuple[str | None, str], dict]:
    return {
        (o["metadata"].get("namespace"), o["metadata"]["name"]): o
        for o in objects
        if o["kind"] == kind
    }


# --- the objects --------------------------------------------------------------------------------


def test_a_namespace_and_a_binding_per_team_and_the_config_map() -> None:
    files = {"teams.yaml": yaml.safe_dump(TEAMS), "kube.yaml": "{}\n"}
    made = team_objects(parse_teams(TEAMS), kube_config(), files)
    namespaces = by_kind(made.objects, "Namespace")
    assert sorted(name for _, name in namespaces) == [
        "berth-language",
        "berth-research",
        "berth-vision",
    ]
    labels = namespaces[None, "berth-vision"]["metadata"]["labels"]
    assert labels["berth.io/team"] == "vision"
    assert labels[f"{PSS}/enforce"] == "restricted"  # Berth's pods pass it
    bindings = by_kind(made.objects, "RoleBinding")
    assert set(bindings) == {(ns, "berth-runtime") for _, ns in namespaces}
    binding = bindings["berth-vision", "berth-runtime"]
    assert binding["roleRef"]["name"] == "berth-runtime-team"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "berth-runtime", "namespace": "berth-system"}
    ]
    (cm,) = by_kind(made.objects, "ConfigMap").values()
    assert cm["metadata"] == {**cm["metadata"], "name": "berth-config", "namespace": "berth-system"}
    assert cm["data"] == files
    assert by_kind(made.objects, "PersistentVolumeClaim") == {}
    assert made.notes == [  # no storage class: BERTH_HOME's claim is the admin's to make
        "berth-system: create the ReadWriteMany PersistentVolumeClaim 'berth-home' (BERTH_HOME),"
        " or give --storage-class to have it made here"
    ]


def test_namespaces_follow_the_settings() -> None:
    kube = kube_config(
        namespace_template="ml-{team}",
        team_namespaces={"language": "nlp", "research": "nlp"},  # two teams, one namespace
    )
    made = team_objects(parse_teams(TEAMS), kube, {})
    namespaces = by_kind(made.objects, "Namespace")
    assert {name for _, name in namespaces} == {"ml-vision", "nlp"}
    assert "berth.io/team" not in namespaces[None, "nlp"]["metadata"]["labels"]  # two teams
    assert {ns for ns, _ in by_kind(made.objects, "RoleBinding")} == {"ml-vision", "nlp"}


def test_volumes_are_made_once_per_claim_with_a_storage_class_and_noted_without() -> None:
    kube = kube_config(
        data_volume={"claim": "berth-data"},
        checkpoint_volume={"claim": "berth-data"},  # the same claim: one PVC
    )
    teams = parse_teams(TEAMS)
    opts = Options(storage_class="nfs-rwx", volume_size="2Ti")
    claims = by_kind(team_objects(teams, kube, {}, opts).objects, "PersistentVolumeClaim")
    home = claims.pop(("berth-system", "berth-home"))  # BERTH_HOME, where the spool survives
    assert home["spec"]["resources"]["requests"]["storage"] == "20Gi"
    assert set(claims) == {(f"berth-{t}", "berth-data") for t in teams}
    spec = claims["berth-vision", "berth-data"]["spec"]
    assert spec == {
        "accessModes": ["ReadWriteMany"],
        "storageClassName": "nfs-rwx",
        "resources": {"requests": {"storage": "2Ti"}},
    }
    per_team = kube_config(checkpoint_volume={"claim": "ckpt-{team}"}, data_volume={})
    claims = by_kind(team_objects(teams, per_team, {}, opts).objects, "PersistentVolumeClaim")
    assert ("berth-vision", "ckpt-vision") in claims and ("berth-vision", "berth-data") in claims
    noted = team_objects(teams, kube, {})  # no storage class: the admin's to make, said so
    assert by_kind(noted.objects, "PersistentVolumeClaim") == {}
    assert any("berth-vision" in n and "'berth-data'" in n for n in noted.notes)
    assert "data_volume and checkpoint_volume" in noted.notes[0]
    assert "'berth-home'" in noted.notes[-1]


def test_builds_relax_pod_security_only_where_they_run() -> None:
    teams = parse_teams(TEAMS)
    made = team_objects(teams, kube_config(), {}, Options(builds=True))
    for _, ns in by_kind(made.objects, "Namespace"):
        labels = by_kind(made.objects, "Namespace")[None, ns]["metadata"]["labels"]
        assert labels[f"{PSS}/enforce"] == "baseline"  # Kaniko runs as root
        assert labels[f"{PSS}/warn"] == labels[f"{PSS}/audit"] == "restricted"
        assert (ns, "berth-builder") in by_kind(made.objects, "RoleBinding")
    one = team_objects(teams, kube_config(), {}, Options(builds=True, build_namespace="builds"))
    namespaces = by_kind(one.objects, "Namespace")
    assert namespaces[None, "builds"]["metadata"]["labels"][f"{PSS}/enforce"] == "baseline"
    assert namespaces[None, "berth-vision"]["metadata"]["labels"][f"{PSS}/enforce"] == "restricted"
    assert [ns for ns, name in by_kind(one.objects, "RoleBinding") if name == "berth-builder"] == [
        "builds"
    ]


@pytest.mark.parametrize(
    ("teams", "kube", "options", "names"),
    [
        (  # a team name that is no namespace name: the setting that maps it is named
            {"teams": [{"name": "vision_team", "nominal": {"gpus": 1}}]},
            {},
            Options(),
            ["vision_team", "team_namespaces"],
        ),
        (TEAMS, {}, Options(volume_size="lots"), ["--volume-size", "500Gi"]),
        (TEAMS, {}, Options(home_size="20 GB"), ["--home-size"]),
        (TEAMS, {}, Options(system_namespace="Berth"), ["--system-namespace"]),
        (  # Airflow's pods and a team's in one namespace
            TEAMS,
            {"team_namespaces": {"vision": "berth-system"}},
            Options(),
            ["--system-namespace", "vision", "team_namespaces"],
        ),
        (  # a per-team claim that a team name makes invalid
            {"teams": [{"name": "vision_team", "nominal": {"gpus": 1}}]},
            {"team_namespaces": {"vision_team": "vision"}, "data_volume": {"claim": "d-{team}"}},
            Options(storage_class="x"),
            ["data_volume.claim", "d-vision_team"],
        ),
    ],
)
def test_what_cannot_be_made_is_refused_naming_the_field(
    teams: dict, kube: dict, options: Options, names: list[str]
) -> None:
    with pytest.raises(TeamObjectsError) as err:
        team_objects(parse_teams(teams), kube_config(**kube), {}, options)
    for name in names:
        assert name in str(err.value)


# --- the command --------------------------------------------------------------------------------


def write(tmp_path: Path, name: str, data: Any) -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def test_the_command_prints_objects_that_read_back(tmp_path: Path) -> None:
    teams = write(tmp_path, "teams.yaml", "# our teams\n" + yaml.safe_dump(TEAMS))
    kube = write(tmp_path, "kube.yaml", {"pods": {"data_volume": {"claim": "berth-data"}}})
    policy = write(tmp_path, "policy.yaml", {"base": "berth", "starvation_s": 3600})
    result = CliRunner().invoke(
        app,
        [
            *("kube", "manifests", "--teams", str(teams)),
            *("--kube-settings", str(kube), "--policy", str(policy)),
        ],
    )
    assert result.exit_code == 0, result.output
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    # The files go in as they are, comments too, readable as literal blocks.
    assert cm["data"]["teams.yaml"] == teams.read_text()
    assert cm["data"]["policy.yaml"] == policy.read_text()
    assert "teams.yaml: |" in result.stdout
    assert parse_teams(yaml.safe_load(cm["data"]["teams.yaml"])).keys() == {
        "vision",
        "language",
        "research",
    }
    assert "PersistentVolumeClaim 'berth-data'" in result.stderr  # no storage class given


def test_the_command_refuses_a_bad_file_before_printing_anything(tmp_path: Path) -> None:
    teams = write(tmp_path, "teams.yaml", TEAMS)
    bad_kube = write(tmp_path, "kube.yaml", {"pods": {"namespace_templat": "x-{team}"}})
    bad_policy = write(tmp_path, "policy.yaml", {"base": "berth", "starvation_s": -1})
    for extra, named in (
        (["--kube-settings", str(bad_kube)], "namespace_templat"),
        (["--policy", str(bad_policy)], "starvation_s"),
    ):
        result = CliRunner().invoke(app, ["kube", "manifests", "--teams", str(teams), *extra])
        assert result.exit_code == 2
        assert result.stdout == ""
        assert named in result.stderr


# --- applied for real ---------------------------------------------------------------------------


def server_side_apply(kube: KubeAPI, doc: dict[str, Any]) -> Any:
    dyn = dynamic.DynamicClient(kube.admin, cache_file=str(kube.workdir / "discovery.json"))
    resource = dyn.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
    return resource.server_side_apply(
        body=doc,
        name=doc["metadata"]["name"],
        namespace=doc["metadata"].get("namespace"),
        field_manager="berth-kube-manifests-test",
        force_conflicts=True,
    )


def cluster_roles(kube: KubeAPI) -> None:
    """The ClusterRoles of Berth's chart that the bindings name, for real (cluster-wide,
    shared by the session's tests: applying them again changes nothing; the others, which a
    test of the dry run expects absent, are left out)."""
    for name in BOUND:
        server_side_apply(kube, chart_object("ClusterRole", name, {"builds.enabled": "true"}))


def may(kube: KubeAPI, user: str, namespace: str, verb: str, resource: str) -> bool:
    review = client.V1SubjectAccessReview(
        spec=client.V1SubjectAccessReviewSpec(
            user=user,
            groups=["system:serviceaccounts", "system:authenticated"],
            resource_attributes=client.V1ResourceAttributes(
                namespace=namespace, verb=verb, resource=resource
            ),
        )
    )
    done = client.AuthorizationV1Api(kube.admin).create_subject_access_review(review)
    return bool(done.status.allowed)


def root_pod(namespace: str) -> dict[str, Any]:
    """A pod that Pod Security "baseline" admits and "restricted" refuses (as Kaniko's)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "root", "namespace": namespace},
        "spec": {"containers": [{"name": "c", "image": "busybox", "securityContext": {}}]},
    }


def test_applied_to_a_real_api_server_they_grant_what_the_runtime_needs_there_only(
    kube_api: KubeAPI,  # noqa: F811
) -> None:
    kube = kube_api
    prefix = kube.unique_name("tm")
    system = f"{prefix}-system"
    settings = kube_config(namespace_template=f"{prefix}-{{team}}", data_volume={})
    kube.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=system)))
    cluster_roles(kube)
    options = Options(system_namespace=system, storage_class="rwx", builds=True)
    options_research = Options(system_namespace=system, storage_class="rwx")
    files = {"teams.yaml": yaml.safe_dump(TEAMS)}
    made = team_objects(parse_teams(TEAMS), settings, files, options).objects
    for doc in made:
        server_side_apply(kube, doc)
    user = f"system:serviceaccount:{system}:berth-runtime"
    vision = f"{prefix}-vision"
    assert may(kube, user, vision, "create", "pods")
    assert may(kube, user, vision, "get", "persistentvolumeclaims")
    assert not may(kube, user, vision, "list", "secrets")
    assert not may(kube, user, system, "create", "pods")  # not a team namespace
    assert not may(kube, f"system:serviceaccount:{system}:default", vision, "create", "pods")
    pvc = kube.core.read_namespaced_persistent_volume_claim("berth-data", vision)
    assert pvc.spec.access_modes == ["ReadWriteMany"] and pvc.spec.storage_class_name == "rwx"
    home = kube.core.read_namespaced_persistent_volume_claim("berth-home", system)
    assert home.spec.access_modes == ["ReadWriteMany"]
    cm = kube.core.read_namespaced_config_map("berth-config", system)
    assert cm.data == files

    # Pod Security as labelled: builds (root) admitted where they run, refused elsewhere.
    kube.create_service_account(vision, "default")
    pod = root_pod(vision)
    created = kube.core.create_namespaced_pod(vision, pod, dry_run="All")
    assert created.metadata.name == "root"
    restricted = team_objects(parse_teams(TEAMS), settings, files, options_research).objects
    for doc in restricted:
        server_side_apply(kube, doc)  # the same teams without builds: restricted again
    with pytest.raises(client.ApiException) as err:
        kube.core.create_namespaced_pod(vision, pod, dry_run="All")
    assert err.value.status == 403 and "PodSecurity" in err.value.body

    # Applying the same output again changes nothing.
    before = kube.core.read_namespace(vision).metadata.resource_version
    for doc in restricted:
        server_side_apply(kube, doc)
    assert kube.core.read_namespace(vision).metadata.resource_version == before

"""A job's secrets (the spec's `secrets`, 'Secret name/key' per variable): checked in the spec,
refused before anything is queued where they cannot be read, and on Kubernetes written into
each replica's pod as a reference the kubelet resolves, never as a value. Against the real
kube-apiserver: what it admits and stores under Pod Security "restricted", and a missing
Secret failing the attempt with the kubelet's words (the kubelet is a stand-in here)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kube_gang import Gang, ensure_priority_class
from kubeapi import KubeAPI, kube_api  # noqa: F401 (the session fixture)
from test_kube_manifests import DryRun
from test_kube_volumes import RESTRICTED

from berth.runtime.base import LaunchError
from berth.runtime.kubernetes.pods import pod_manifest
from berth.spec import SpecError, parse_spec

REPO = Path(__file__).resolve().parents[1]
SPEC = {
    "name": "train",
    "team": "vision",
    "command": ["python", "train.py"],
    "image": "ghcr.io/org/train:1.0",
    "gpus_per_replica": 1,
}


# --- the spec -----------------------------------------------------------------------------------


def test_secrets_are_variable_names_and_secret_keys() -> None:
    spec = parse_spec(SPEC | {"secrets": {"HF_TOKEN": "hf-token/token", "DB": "db.creds/pass_1"}})
    assert spec.secrets == {"HF_TOKEN": "hf-token/token", "DB": "db.creds/pass_1"}
    assert parse_spec(SPEC).secrets == {}


@pytest.mark.parametrize(
    ("secrets", "field", "words"),
    [
        ({"HF_TOKEN": "hf-token"}, "secrets.HF_TOKEN", "'<Secret name>/<key>'"),
        ({"HF_TOKEN": "HF/token"}, "secrets.HF_TOKEN", "is not a Secret name"),
        ({"HF_TOKEN": "hf/to ken"}, "secrets.HF_TOKEN", "is not a Secret key"),
        ({"BERTH_TOKEN": "hf/token"}, "secrets.BERTH_TOKEN", "set by the platform"),
        ({"1TOKEN": "hf/token"}, "secrets['1TOKEN']", "not a valid variable name"),
    ],
)
def test_a_bad_secret_is_refused_naming_it(secrets: dict, field: str, words: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(SPEC | {"secrets": secrets})
    [problem] = err.value.problems
    assert problem.field == field and words in problem.message


def test_a_variable_is_either_plain_or_secret() -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(SPEC | {"env": {"TOKEN": "x"}, "secrets": {"TOKEN": "t/v"}})
    assert [p.field for p in err.value.problems] == ["secrets.TOKEN"]


def test_the_local_runtime_refuses_secrets_before_queueing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    from operators.steps import ValidateSpecOperator

    monkeypatch.setenv("BERTH_HOME", str(tmp_path))
    monkeypatch.delenv("BERTH_RUNTIME", raising=False)
    spec = SPEC | {"secrets": {"HF_TOKEN": "hf-token/token"}, "image": None}
    spec |= {"environment": {"requirements": []}}
    validate = ValidateSpecOperator(task_id="validate", spec=spec)
    with pytest.raises(AirflowFailException, match=r"^secrets: HF_TOKEN name Kubernetes Secrets"):
        validate.execute({"params": {}})
    assert not (tmp_path / "berth.db").exists()  # no store touched: nothing queued


# --- on Kubernetes ------------------------------------------------------------------------------


@pytest.fixture
def gang(kube_api: KubeAPI) -> Iterator[Gang]:  # noqa: F811
    ensure_priority_class(kube_api.admin)
    g = Gang(kube_api)
    kube_api.core.patch_namespace(g.ns, {"metadata": {"labels": RESTRICTED}})
    yield g


def env_of(pod: Any) -> list[Any]:
    return pod.spec.containers[0].env


def test_pods_name_the_secret_and_never_hold_its_value(gang: Gang) -> None:
    secrets = {"HF_TOKEN": "hf-token/token", "WANDB_API_KEY": "wandb/key"}
    launch = gang.launch(secrets=secrets)
    pods = gang.pods(launch)
    assert len(pods) == 2
    for pod in pods.values():  # stored by the API server, admitted under "restricted"
        by_name = {e.name: e for e in env_of(pod)}
        token = by_name["HF_TOKEN"]
        assert token.value is None
        ref = token.value_from.secret_key_ref
        assert (ref.name, ref.key) == ("hf-token", "token")
        assert by_name["WANDB_API_KEY"].value_from.secret_key_ref.name == "wandb"
        assert by_name["LR"].value == "0.1"  # the plain ones as before
        names = [e.name for e in env_of(pod)]
        assert names == sorted(names)  # one sorted list, whatever its sources


def test_a_bad_secret_at_launch_creates_nothing(gang: Gang) -> None:
    before = gang.services()
    with pytest.raises(LaunchError, match=r"^secrets\.TOKEN: "):
        gang.launch(secrets={"TOKEN": "no-key"})
    with pytest.raises(LaunchError, match=r"secrets\.LR: also set as a plain variable"):
        gang.launch(secrets={"LR": "lr/value"})
    assert gang.services() == before


def test_a_missing_secret_fails_the_attempt_with_the_kubelets_words(gang: Gang) -> None:
    launch = gang.launch(secrets={"HF_TOKEN": "hf-token/token"})
    waiting = {
        "reason": "CreateContainerConfigError",
        "message": 'secret "hf-token" not found',
    }
    for name in gang.pods(launch):  # as the kubelet reports a Secret it cannot find
        gang.report(
            name,
            {
                "phase": "Pending",
                "containerStatuses": [
                    {
                        "name": "main",
                        "image": "ghcr.io/org/train:1.0",
                        "imageID": "",
                        "ready": False,
                        "restartCount": 0,
                        "state": {"waiting": waiting},
                    }
                ],
            },
        )
    status = gang.runtime.poll(launch)
    assert status.state == "failed"
    assert 'secret "hf-token" not found' in (status.message or "")


def test_the_pod_with_secrets_passes_a_strict_server_side_dry_run(gang: Gang) -> None:
    launch = gang.launch(secrets={"HF_TOKEN": "hf-token/token"}, job_id="dry-run")
    rep = launch.replicas[0]
    body = pod_manifest(
        gang.runtime.settings, launch, rep, ["python", "t.py"], {"A": "1"}, 1000, 1024, "uid-1",
        {"HF_TOKEN": "hf-token/token"},
    )  # fmt: skip
    body["metadata"]["name"] += "-dry"
    del body["metadata"]["ownerReferences"]  # the owner's uid is made up here
    stored = DryRun(gang.kube).apply(body)
    env = {e["name"]: e for e in stored["spec"]["containers"][0]["env"]}
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    assert "value" not in env["HF_TOKEN"]

"""Where tasks get the store's URL on Kubernetes (operators/store_access.py). The pod template
every task's pod is made from carries none. With Berth's queue (the deployment's values) Berth's
steps do their work in Berth's triggerers (decision 0030) and no task's pod gets the URL or
Berth's account; without it, Berth's operators add both through the KubernetesExecutor's
pod_override, and the provider's own code (PodGenerator, the DAG serializer) merges and keeps
them. The pod template is the one docker/helm/values.yaml holds,
rendered with Helm as the Airflow chart renders it (tests/helm.py). No kubelet runs here: the
pods are rendered, not started."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from airflow.configuration import conf
from airflow.providers.cncf.kubernetes.pod_generator import PodGenerator
from airflow.providers.standard.operators.empty import EmptyOperator
from airflow.sdk import DAG, task
from airflow.serialization.serialized_objects import DagSerialization
from helm import render_pod_template
from kubernetes.client import models as k8s

from berth.trigger_queue import TRIGGER_QUEUE, queue_violation
from operators import gpu_job
from operators.steps import ValidateSpecOperator
from operators.store_access import (
    RUNTIME_ACCOUNT,
    STORE_KEY,
    STORE_SECRET,
    STORE_URL,
)

REPO = Path(__file__).resolve().parent.parent
SPEC = {
    "name": "bert",
    "team": "vision",
    "image": "ghcr.io/org/train:1",
    "command": ["python", "train.py"],
    "gpus_per_replica": 1,
}


@pytest.fixture(autouse=True)
def _no_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    """No queue of Berth's unless a test names it (the machine's environment may)."""
    monkeypatch.delenv(TRIGGER_QUEUE, raising=False)


def _env(pod: k8s.V1Pod) -> dict[str, Any]:
    (base,) = [c for c in pod.spec.containers if c.name == "base"]
    return {e.name: e for e in base.env or []}


def _dag() -> DAG:
    with DAG("t_store_access", schedule=None) as dag:
        gpu_job(SPEC)  # every step of a job's lifecycle

        @task
        def users_own() -> None:  # any task of a DAG's own
            pass

        users_own()
    return dag


@pytest.fixture(scope="module")
def pod_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The rendered pod template, as a file where the executor's [kubernetes_executor]
    pod_template_file points."""
    path = tmp_path_factory.mktemp("pod-template") / "pod_template_file.yaml"
    path.write_text(yaml.safe_dump(render_pod_template()))
    return path


def test_the_pod_template_gives_no_task_the_store(pod_template: Path) -> None:
    template = yaml.safe_load(pod_template.read_text())
    (base,) = template["spec"]["containers"]
    assert STORE_URL not in {e["name"] for e in base["env"]}
    assert STORE_URL not in pod_template.read_text()


def test_berths_tasks_get_the_store_from_the_secret_and_a_dags_own_task_does_not(
    monkeypatch: pytest.MonkeyPatch, pod_template: Path
) -> None:
    monkeypatch.setenv("BERTH_RUNTIME", "kubernetes")
    # The DAG as the scheduler and the executor read it: serialized, then deserialized.
    dag = DagSerialization.from_dict(DagSerialization.to_dict(_dag()))
    template = PodGenerator.deserialize_model_file(str(pod_template))
    berths = [t.task_id for t in dag.tasks if t.task_id != "users_own"]
    assert len(berths) >= 6, berths  # validate, prepare, stage, wait, run, collect, clean up
    for task_id in [*berths, "users_own"]:
        override = (dag.get_task(task_id).executor_config or {}).get("pod_override")
        pod = PodGenerator.reconcile_pods(template, override)  # what the executor does
        env = _env(pod)
        assert env["BERTH_RUNTIME"].value == "kubernetes", task_id  # the template's, kept
        if task_id == "users_own":
            assert STORE_URL not in env
            # The template's account, which has no rights (Berth's chart, docker/chart).
            assert pod.spec.service_account_name == "berth-task"
            continue
        ref = env[STORE_URL].value_from.secret_key_ref
        assert (ref.name, ref.key) == (STORE_SECRET, STORE_KEY), task_id
        assert pod.spec.service_account_name == RUNTIME_ACCOUNT, task_id  # Berth's rights


def _values_env() -> dict[str, str]:
    """The plain variables the deployment's values give every Airflow container."""
    values = yaml.safe_load((REPO / "docker" / "helm" / "values.yaml").read_text())
    return {e["name"]: e["value"] for e in values["env"] if "value" in e}


def test_with_the_deployments_queue_no_tasks_pod_gets_the_store_or_berths_account(
    monkeypatch: pytest.MonkeyPatch, pod_template: Path
) -> None:
    env = _values_env()
    assert (env["BERTH_RUNTIME"], env[TRIGGER_QUEUE]) == ("kubernetes", "berth")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    dag = DagSerialization.from_dict(DagSerialization.to_dict(_dag()))
    template = PodGenerator.deserialize_model_file(str(pod_template))
    for t in dag.tasks:
        override = (t.executor_config or {}).get("pod_override")
        pod = PodGenerator.reconcile_pods(template, override)
        assert STORE_URL not in _env(pod), t.task_id
        assert pod.spec.service_account_name == "berth-task", t.task_id  # bound to nothing
        assert t.queue == ("default" if t.task_id == "users_own" else "berth"), t.task_id


def test_a_dags_own_pod_override_is_kept_beside_the_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BERTH_RUNTIME", "kubernetes")
    mine = k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(labels={"cost-center": "nlp"}),
        spec=k8s.V1PodSpec(
            containers=[k8s.V1Container(name="base", env=[k8s.V1EnvVar(name="X", value="1")])]
        ),
    )
    mine.spec.service_account_name = "someone-else"
    op = ValidateSpecOperator(task_id="validate", spec=SPEC, executor_config={"pod_override": mine})
    pod = op.executor_config["pod_override"]
    assert pod.metadata.labels == {"cost-center": "nlp"}
    assert set(_env(pod)) == {"X", STORE_URL}
    assert pod.spec.service_account_name == RUNTIME_ACCOUNT  # Berth's task needs Berth's rights


def test_an_override_of_metadata_only_gets_the_store_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BERTH_RUNTIME", "kubernetes")
    mine = k8s.V1Pod(metadata=k8s.V1ObjectMeta(labels={"cost-center": "nlp"}))
    op = ValidateSpecOperator(task_id="validate", spec=SPEC, executor_config={"pod_override": mine})
    assert set(_env(op.executor_config["pod_override"])) == {STORE_URL}


def test_elsewhere_no_executor_config_is_added(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BERTH_RUNTIME", "local")
    op = ValidateSpecOperator(task_id="validate", spec=SPEC)
    assert not op.executor_config


def test_berths_tasks_run_on_its_trigger_queue_and_a_dags_own_keep_theirs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BERTH_RUNTIME", "kubernetes")
    monkeypatch.setenv(TRIGGER_QUEUE, "berth")
    with DAG("t_queue", schedule=None) as built:
        gpu_job(SPEC)
        # A queue passed to Berth's operator gives way: its trigger must reach the store.
        ValidateSpecOperator(task_id="asked_elsewhere", spec=SPEC, queue="gpu-a")

        @task(queue="etl")
        def users_own() -> None:
            pass

        users_own()
    dag = DagSerialization.from_dict(DagSerialization.to_dict(built))  # as the scheduler reads
    queues = {t.task_id: t.queue for t in dag.tasks}
    assert queues.pop("users_own") == "etl"
    assert len(queues) >= 7 and set(queues.values()) == {"berth"}, queues


def test_without_a_trigger_queue_berths_tasks_keep_airflows_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(TRIGGER_QUEUE, raising=False)
    op = ValidateSpecOperator(task_id="validate", spec=SPEC)
    assert op.queue == conf.get("operators", "default_queue")


def test_a_dags_own_task_on_berths_queue_is_refused_naming_the_task_and_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cluster policy's check (plugins/airflow_local_settings.py `task_policy`; the real DAG
    processor applies it in tests/test_triggerer_queues.py)."""
    from airflow.exceptions import AirflowClusterPolicyViolation

    from plugins.airflow_local_settings import task_policy

    monkeypatch.setenv(TRIGGER_QUEUE, "berth")
    with DAG("t_policy", schedule=None) as dag:
        gpu_job(SPEC)
        own = EmptyOperator(task_id="sneaky", queue="berth")
        elsewhere = EmptyOperator(task_id="fine", queue="etl")
    with pytest.raises(AirflowClusterPolicyViolation) as err:
        task_policy(own)
    assert "'sneaky'" in str(err.value) and "another queue" in str(err.value)
    assert queue_violation(elsewhere) is None
    berths = [t for t in dag.tasks if t.task_id not in ("sneaky", "fine")]
    assert len(berths) >= 7 and all(queue_violation(t) is None for t in berths), berths
    monkeypatch.delenv(TRIGGER_QUEUE)
    assert queue_violation(own) is None  # no queue of Berth's: nothing to guard


def test_an_override_a_dag_shares_with_its_own_tasks_gives_them_nothing_of_berths(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BERTH_RUNTIME", "kubernetes")
    shared = k8s.V1Pod(
        spec=k8s.V1PodSpec(
            containers=[k8s.V1Container(name="base", env=[k8s.V1EnvVar(name="X", value="1")])]
        )
    )
    config = {"pod_override": shared}
    berths = ValidateSpecOperator(task_id="validate", spec=SPEC, executor_config=config)
    with DAG("t_shared", schedule=None):

        @task(executor_config=config)
        def users_own() -> None:
            pass

        own = users_own().operator
    assert set(_env(berths.executor_config["pod_override"])) == {"X", STORE_URL}
    for pod in (shared, own.executor_config["pod_override"]):
        assert set(_env(pod)) == {"X"}
        assert pod.spec.service_account_name is None


def test_only_berths_triggers_may_defer_onto_berths_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    """What plugins/berth_api/queue_guard.py refuses on the API server (for real, on Airflow's
    components, in tests/test_triggerer_queues.py)."""
    import importlib

    from berth.trigger_queue import BERTH_TRIGGERS, deferral_violation

    for path in BERTH_TRIGGERS:  # each names a trigger class of Berth's that exists
        module, _, name = path.rpartition(".")
        assert hasattr(importlib.import_module(module), name), path
    own = "airflow.providers.standard.triggers.temporal.TimeDeltaTrigger"
    assert deferral_violation("berth", own) is None  # no queue of Berth's named: nothing to guard
    monkeypatch.setenv(TRIGGER_QUEUE, "berth")
    said = deferral_violation("berth", own)
    assert said and "TimeDeltaTrigger" in said and "another queue" in said
    assert deferral_violation("default", own) is None
    assert deferral_violation(None, own) is None
    assert all(deferral_violation("berth", path) is None for path in BERTH_TRIGGERS)


def test_the_guard_refuses_only_a_foreign_trigger_on_berths_queue_and_passes_the_rest_intact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import asyncio
    import json

    from plugins.berth_api.queue_guard import BerthQueueGuard

    monkeypatch.setenv(TRIGGER_QUEUE, "berth")
    seen: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:  # Airflow's API, standing in
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        seen.append(body)
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    def call(path: str, update: dict[str, Any], method: str = "PATCH") -> tuple[int, bytes]:
        raw = json.dumps(update).encode()
        chunks = [raw[:10], raw[10:]]  # a body that arrives in two parts
        incoming = [
            {"type": "http.request", "body": c, "more_body": i == 0} for i, c in enumerate(chunks)
        ]
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return incoming.pop(0)

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "http", "method": method, "path": path}
        asyncio.run(BerthQueueGuard(app)(scope, receive, send))
        return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])

    state = "/execution/task-instances/0199-abc/state"
    foreign = {
        "state": "deferred",
        "queue": "berth",
        "classpath": "mine.Trigger",
        "next_method": "r",
    }
    status, body = call(state, foreign)
    assert status == 409 and b"'mine.Trigger' may not run on queue 'berth'" in body
    assert seen == []  # Airflow never saw it
    ours = foreign | {"classpath": "operators.step_trigger.StepTrigger"}
    for path, update in [
        (state, ours),
        (state, foreign | {"queue": "default"}),
        (state, {"state": "success"}),
        ("/api/v2/dags", foreign),
    ]:
        assert call(path, update)[0] == 204, (path, update)
        assert seen.pop() == json.dumps(update).encode()  # the same bytes, handed on

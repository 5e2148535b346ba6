"""The Airflow side's parts, each alone: triggers' serialization, the retry policy, job ids,
params -> spec, team pools' sizes, the environment cache and data staging (real venvs, real
files, real concurrent processes). The whole lifecycle under real Airflow is in
tests/test_airflow_dag.py."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
from airflow.sdk import RetryAction
from airflow.sdk.exceptions import AirflowFailException
from hypothesis import given
from hypothesis import strategies as st

from berth.pools import CONF_DEFAULTS, pool_for_conf, team_pools
from berth.spec import SpecError, parse_spec
from operators.environment import env_key, prepare_environment
from operators.job import job_id_for, resolve_spec
from operators.launching import LaunchPlan
from operators.params import FROM_PARAMS, form_cohorts, form_models, job_params, spec_from_params
from operators.retries import JobAttemptFailed, SpecRetryPolicy, run_task_defaults
from operators.staging import StagingError, collect_attempt, stage_inputs
from operators.tracking import TaskRef
from operators.triggers import AdmissionTrigger, CompletionTrigger
from scheduling.config import load_cluster, load_teams, parse_cluster, parse_teams

REPO = Path(__file__).resolve().parent.parent

CLUSTER = load_cluster(REPO / "config" / "local-cluster.yaml")
TEAMS = load_teams(REPO / "config" / "teams.yaml")
SPEC = {
    "name": "t",
    "team": "vision",
    "environment": {"requirements": []},
    "command": ["python", "-c", "pass"],
    "gpus_per_replica": 1,
}


def _roundtrip(trigger):
    """What the triggerer does: import the class path, build it from the kwargs (via JSON,
    as they are stored), and serialize again."""
    path, kwargs = trigger.serialize()
    module, _, name = path.rpartition(".")
    cls = getattr(__import__(module, fromlist=[name]), name)
    again = cls(**json.loads(json.dumps(kwargs)))
    return (path, kwargs), again.serialize()


def test_admission_trigger_serialize_round_trips() -> None:
    task = TaskRef("d", "r1", "g.run", 2)
    plan = LaunchPlan(parse_spec(SPEC).model_dump(mode="json"), {"PATH": "/env/bin"}, task)
    first, second = _roundtrip(AdmissionTrigger("job-1", plan.to_dict(), poll_s=0.5))
    assert first == second
    assert first[0] == "operators.triggers.AdmissionTrigger"
    kwargs = {"job_id": "job-1", "plan": plan.to_dict(), "poll_s": 0.5, "notify_at": None}
    assert first[1] == kwargs
    # What the trigger launches from is what the task planned, after the trip through JSON.
    assert LaunchPlan.from_dict(json.loads(json.dumps(first[1]["plan"]))) == plan
    # No store URL or credential in the row: only the spec, the replicas' variables, the task.
    assert set(first[1]["plan"]) == {"spec", "env", "task"}


def test_completion_trigger_serialize_round_trips() -> None:
    launch = {"runtime": "local", "job_id": "job-1", "attempt": 2, "replicas": [{"rank": 0}]}
    cursor = {"offsets": {"0": 120}}
    trigger = CompletionTrigger("job-1", 2, launch, poll_s=1.0, heartbeat_s=5.0, cursor=cursor)
    first, second = _roundtrip(trigger)
    assert first == second
    assert first[1]["launch"] == launch and first[1]["attempt"] == 2
    assert first[1]["cursor"] == cursor


def test_retry_policy_follows_the_spec() -> None:
    policy = SpecRetryPolicy()
    failed = JobAttemptFailed("boom", retries=2, backoff_s=7.5)
    first = policy.evaluate(failed, try_number=1, max_tries=20)
    assert first.action == RetryAction.RETRY and first.retry_delay.total_seconds() == 7.5
    assert policy.evaluate(failed, try_number=2, max_tries=20).action == RetryAction.RETRY
    assert policy.evaluate(failed, try_number=3, max_tries=20).action == RetryAction.FAIL
    assert policy.evaluate(ValueError("x"), 1, 20).action == RetryAction.DEFAULT


def test_run_task_defaults_from_a_spec_known_at_parse_time() -> None:
    spec = {**SPEC, "replicas": 3, "gpus_per_replica": 0.5, "retries": 4, "retry_backoff_s": 9}
    got = run_task_defaults(spec)
    assert got["retries"] == 4 and got["retry_delay"].total_seconds() == 9
    assert got["pool"] == "berth-vision" and got["pool_slots"] == 2  # 1.5 GPUs rounded up
    # From params, or unparsable: the ceiling of retries, the policy applies the spec's own.
    # Failures that are not the job's (Airflow's, the platform's) are retried after 15 s.
    form = {"retries": 20, "retry_delay": timedelta(seconds=15)}
    assert run_task_defaults(FROM_PARAMS) == form
    assert run_task_defaults({"name": "BAD"}) == form


def _ctx(**over: object) -> dict:
    ti = SimpleNamespace(dag_id="d", run_id="r1", map_index=-1, try_number=1)
    for k, v in over.items():
        setattr(ti, k, v)
    return {"ti": ti}


def test_job_id_is_deterministic_and_tells_runs_apart() -> None:
    a = job_id_for(_ctx(), "g.run", "train-x")
    assert a == job_id_for(_ctx(try_number=3), "g.run", "train-x")  # a retry finds its job
    assert a.startswith("train-x-")
    others = {
        job_id_for(_ctx(run_id="r2"), "g.run", "train-x"),
        job_id_for(_ctx(map_index=0), "g.run", "train-x"),
        job_id_for(_ctx(), "h.run", "train-x"),
        job_id_for(_ctx(dag_id="e"), "g.run", "train-x"),
    }
    assert a not in others and len(others) == 4


def _form_defaults(teams: list[str], command: list[str]) -> dict:
    """The params a run gets from the form's defaults (a field with none is left out)."""
    return {k: p.value for k, p in job_params(teams, command).items() if p.has_value}


def test_params_defaults_make_a_valid_spec_once_a_team_is_picked() -> None:
    params = _form_defaults(sorted(TEAMS), ["python", "t.py"])
    # No default team: a user who does not pick one is told, not charged to the first team.
    assert "team" not in params
    with pytest.raises(SpecError, match="team"):
        parse_spec(spec_from_params(params))
    spec = parse_spec(spec_from_params({**params, "team": "language"}))
    assert spec.environment is not None and spec.image is None and spec.team == "language"
    assert (tuple(spec.inputs), tuple(spec.artifacts), spec.env) == ((), (), {})
    conf = {**params, "team": "vision", "replicas": 2, "image": "ghcr.io/o/t:1", "env": {"A": "1"}}
    spec = parse_spec(spec_from_params(conf))
    assert (spec.image, spec.environment, spec.replicas, spec.env) == (
        "ghcr.io/o/t:1",
        None,
        2,
        {"A": "1"},
    )


def test_bad_params_fail_without_retry_naming_the_field() -> None:
    params = {**_form_defaults(["vision"], ["python"]), "team": "vision"}
    with pytest.raises(AirflowFailException) as e:
        resolve_spec(FROM_PARAMS, {"params": {**params, "replicas": 0, "topology": "rak"}})
    assert "replicas" in str(e.value) and "did you mean 'rack'" in str(e.value)
    with pytest.raises(AirflowFailException) as e:  # only the cluster can tell: too big
        resolve_spec({**SPEC, "gpus_per_replica": 16}, {}, cluster=CLUSTER, teams=TEAMS)
    assert "replicas: job needs 16 gpus" in str(e.value) and "may hold at most 8" in str(e.value)


def test_team_pools_are_each_teams_reach_capped_at_the_cluster() -> None:
    pools = {p.name: p.slots for p in team_pools(TEAMS, CLUSTER)}
    # vision: 4 + 4 = 8; language 2 + 2; research 2 + 0 (config/teams.yaml)
    assert pools == {"berth-vision": 8, "berth-language": 4, "berth-research": 2}
    unlimited = parse_teams([{"name": "a", "nominal": {"gpus": 6}}])  # no borrowing limit
    assert [p.slots for p in team_pools(unlimited, CLUSTER)] == [8]  # the cluster has 8


def test_a_run_launched_with_a_conf_gets_its_teams_pool_one_slot_per_gpu() -> None:
    assert pool_for_conf({"team": "vision", "replicas": 2, "gpus_per_replica": 4}) == (
        "berth-vision",
        8,
    )
    assert pool_for_conf({"team": "language", "replicas": 3, "gpus_per_replica": 0.25}) == (
        "berth-language",
        1,  # a share rounds up to a whole slot
    )
    # Fields the conf leaves out take the form's defaults, the very ones the form shows.
    form = job_params(sorted(TEAMS), ["true"])
    assert {k: form[k].value for k in CONF_DEFAULTS} == CONF_DEFAULTS
    assert pool_for_conf({"team": "research"}) == ("berth-research", 1)
    # No team, or sizes the validate task will refuse: no pool decided here.
    for bad in (None, [], {}, {"team": 3}, {"team": "a", "replicas": 0},
                {"team": "a", "gpus_per_replica": "x"}, {"team": "a", "gpus_per_replica": -1},
                {"team": "a", "gpus_per_replica": float("inf")}):  # fmt: skip
        assert pool_for_conf(bad) is None, bad


def test_the_cluster_policy_sets_the_pool_of_a_form_launched_run_task_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """plugins/airflow_local_settings.py on stand-ins for Airflow's task instance and run (the
    real scheduler applies it in tests/test_standalone.py)."""
    from plugins import airflow_local_settings as policy

    exists = {"berth-vision"}
    monkeypatch.setattr(policy, "_pool_exists", lambda run, pool: pool in exists)

    class TI:
        def __init__(self, operator: str, pool: str = "default_pool") -> None:
            self.operator, self.pool, self.pool_slots = operator, pool, 1

    class Run:
        def __init__(self, note: str | None = None) -> None:
            self.conf = {"name": "train-a", "team": "vision", "replicas": 2, "gpus_per_replica": 2}
            self.note, self.run_id = note, "manual__1"

    run_ti, run = TI("BerthRunOperator"), Run()
    policy.task_instance_mutation_hook(run_ti, run)
    assert (run_ti.pool, run_ti.pool_slots) == ("berth-vision", 4)
    assert run.note is None  # left to the user (Airflow's API sets it after: see the hook)
    for ti, dag_run in (
        (TI("WaitForAdmissionOperator"), Run()),  # only the run task takes the team's slots
        (TI("BerthRunOperator", pool="berth-language"), Run()),  # set by the DAG file: kept
        (TI("BerthRunOperator"), None),
    ):
        policy.task_instance_mutation_hook(ti, dag_run)
        assert ti.pool_slots == 1 and ti.pool in ("default_pool", "berth-language")
    exists.clear()  # not synced yet: Airflow would never schedule from a missing pool
    late = TI("BerthRunOperator")
    policy.task_instance_mutation_hook(late, Run())
    assert (late.pool, late.pool_slots) == ("default_pool", 1)


@given(
    st.lists(st.sampled_from(["numpy", "torch==2.3.1", "pandas>=2", "rich"]), unique=True),
    st.sampled_from([None, "3.11", "3.12"]),
    st.randoms(),
)
def test_env_key_ignores_order_only(reqs: list[str], python: str | None, rnd) -> None:
    shuffled = list(reqs)
    rnd.shuffle(shuffled)
    assert env_key(tuple(reqs), python) == env_key(tuple(shuffled), python)
    assert env_key(tuple(reqs), python) != env_key((*reqs, "extra-pkg"), python)


BUILD = """
import json, logging, sys
from pathlib import Path
logging.basicConfig(level=logging.INFO)  # the "built environment" line is an INFO record
from operators.environment import prepare_environment
from berth.spec import parse_spec

spec = parse_spec(json.loads(sys.argv[1]))
print("RESULT " + json.dumps(prepare_environment(spec, Path(sys.argv[2])).to_dict()))
"""


def test_environment_built_once_for_two_concurrent_tasks(tmp_path: Path) -> None:
    spec = {**SPEC, "environment": {"requirements": ["numpy"]}}
    cmd = [sys.executable, "-c", BUILD, json.dumps(spec), str(tmp_path)]
    procs = [
        subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)
    ]
    texts = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), texts
    outs = [json.loads(t.split("RESULT ", 1)[1]) for t in texts]
    assert sum(t.count("built environment") for t in texts) == 1  # one built, one waited
    assert outs[0] == outs[1] and outs[0]["kind"] == "venv"
    built = [d for d in tmp_path.iterdir() if d.is_dir()]
    assert [d.name for d in built] == [outs[0]["key"]]
    # numpy comes from the platform underneath the venv, and the venv's python runs.
    check = [outs[0]["python"], "-c", "import numpy, sys; print(sys.prefix)"]
    assert subprocess.run(check, capture_output=True, text=True).stdout.strip() == str(built[0])
    # A second call finds it ready and does not rebuild (the ready marker is unchanged).
    marker = built[0] / ".berth-env.json"
    before = marker.stat().st_mtime_ns
    prepare_environment(parse_spec(spec), tmp_path)
    assert marker.stat().st_mtime_ns == before


def test_image_job_runs_in_the_platform_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    spec = parse_spec({**{k: v for k, v in SPEC.items() if k != "environment"}, "image": "o/t:1"})
    got = prepare_environment(spec, Path("/nonexistent"))
    assert got.kind == "platform" and got.python == sys.executable
    assert "no container runtime" in caplog.text


def test_bad_requirement_fails_naming_the_field(tmp_path: Path) -> None:
    from operators.environment import EnvironmentBuildError

    spec = parse_spec({**SPEC, "environment": {"requirements": ["berth-no-such-pkg-x==0.0.1"]}})
    with pytest.raises(EnvironmentBuildError, match=r"environment.requirements"):
        prepare_environment(spec, tmp_path)  # pip fails (no such package, or no network)
    assert not (
        tmp_path / env_key(spec.environment.requirements, None) / ".berth-env.json"
    ).exists()


def test_stage_data_gives_the_replicas_their_paths(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "a.txt").write_text("hello")
    single = tmp_path / "one.csv"
    single.write_text("x,y\n1,2\n")
    env = stage_inputs([src.as_uri(), single.as_uri()], tmp_path / "cache")
    assert Path(env["BERTH_INPUT_0"], "sub", "a.txt").read_text() == "hello"
    assert Path(env["BERTH_INPUT_1"]).read_text() == "x,y\n1,2\n"
    assert env["BERTH_INPUT_ONE_CSV"] == env["BERTH_INPUT_1"] and env["BERTH_INPUT_COUNT"] == "2"
    assert stage_inputs([src.as_uri()], tmp_path / "cache")["BERTH_INPUT_0"] == env["BERTH_INPUT_0"]


def test_stage_data_names_the_input_that_cannot_be_read(tmp_path: Path) -> None:
    ok = tmp_path / "ok.txt"
    ok.write_text("1")
    with pytest.raises(StagingError, match=r"inputs\[1\] file:///no/such/berth/path"):
        stage_inputs([ok.as_uri(), "file:///no/such/berth/path"], tmp_path / "cache")


def test_collect_artifacts_copies_files_and_folders_and_reports_missing(tmp_path: Path) -> None:
    work = tmp_path / "work"
    (work / "outputs" / "ckpt").mkdir(parents=True)
    (work / "outputs" / "metrics.json").write_text("{}")
    (work / "outputs" / "ckpt" / "step1").write_text("w")
    got = collect_attempt(
        ["outputs/metrics.json", "outputs/ckpt", "outputs/model.npz"], work, tmp_path / "d"
    )
    assert sorted(f.path for f in got.files) == ["outputs/ckpt/step1", "outputs/metrics.json"]
    assert got.missing == ("outputs/model.npz",)
    assert (tmp_path / "d" / "outputs" / "ckpt" / "step1").read_text() == "w"


def test_a_bad_spec_in_the_dag_file_fails_its_import_naming_every_problem() -> None:
    from airflow.sdk import DAG

    from operators import gpu_job

    bad = {**SPEC, "name": "Bad_Name", "gpus_per_replica": -1}
    with DAG("t_bad", schedule=None), pytest.raises(ValueError) as e:
        gpu_job(bad)
    said = str(e.value)
    assert said.startswith("gpu_job: the job spec cannot run")
    assert "name" in said and "gpus_per_replica" in said
    with DAG("t_str", schedule=None), pytest.raises(ValueError, match="the string 'parms'"):
        gpu_job("parms")
    # Templates are rendered at run time: such a spec is checked then, by the validate task.
    templated = {**bad, "command": ["python", "-c", "print('{{ ds }}')"]}
    with DAG("t_templated", schedule=None) as dag:
        gpu_job(templated, group_id="later")
    assert "later.validate" in dag.task_dict


def test_the_task_group_is_named_after_the_job() -> None:
    from airflow.sdk import DAG

    from operators import gpu_job

    with DAG("t_named", schedule=None) as dag:
        gpu_job({**SPEC, "name": "train-bert"})
        gpu_job(FROM_PARAMS)
    assert {"train-bert.run", "gpu_job.run"} <= set(dag.task_dict)


def test_the_trigger_form_has_sections_titles_and_descriptions_and_no_required_extras() -> None:
    params = job_params(sorted(TEAMS), ["python", "t.py"])
    sections = {p.schema.get("section") for p in params.values()}
    assert sections == {"Job", "Resources", "Environment", "Data", "Advanced"}
    assert all(p.schema.get("title") and p.description for p in params.values())
    # Airflow's form marks a field required unless its type accepts null: only what every job
    # must say is required, and the team is the one without a default.
    required = {k for k, p in params.items() if "null" not in p.schema["type"]}
    assert {"inputs", "artifacts", "requirements", "env", "image"}.isdisjoint(required)
    no_default = {k for k, p in params.items() if p.dump()["value"] is None}
    assert no_default & required == {"team"}
    assert params["name"].schema["pattern"] and params["team"].schema["enum"] == sorted(TEAMS)


def test_the_gpu_model_box_lists_the_clusters_models_fastest_first() -> None:
    cluster = parse_cluster(
        {
            "nodes": [
                {"name": "v", "gpus": 8, "gpu_model": "V100"},
                {"name": "a", "gpus": 8, "gpu_model": "A100"},
                {"name": "h", "gpus": 8, "gpu_model": "H100"},
            ],
            "gpu_speed": {"H100": 3.0, "V100": 0.5},
        }
    )
    models = form_models(cluster)
    assert models == ["H100", "A100", "V100"]
    box = job_params(sorted(TEAMS), ["true"], models=models)["gpu_model"]
    # Airflow's form renders an array Param with `examples` as a multi-select.
    assert box.schema["examples"] == models and box.schema["items"]["enum"] == models
    assert box.value is None  # empty: any model
    params = {**_form_defaults(sorted(TEAMS), ["true"]), "team": "language"}
    spec = parse_spec(spec_from_params({**params, "gpu_model": ["A100", "H100"]}))
    assert spec.gpu_model == ("A100", "H100")
    # One model, or none known (a discovered cluster): free text, with a hint.
    one = job_params(sorted(TEAMS), ["true"], models=["declared"])["gpu_model"]
    assert "examples" not in one.schema and "this cluster's: declared" in one.description
    assert form_models(None) is None


def test_the_team_box_shows_where_each_team_sits_in_the_organization_tree() -> None:
    teams = parse_teams(
        {
            "cohorts": [{"name": "research"}, {"name": "nlp", "parent": "research"}],
            "teams": [
                {"name": "language", "cohort": "nlp", "nominal": {"gpus": 2}},
                {"name": "vision", "nominal": {"gpus": 2}},
            ],
        }
    )
    cohorts = form_cohorts(teams)
    assert cohorts == {"language": "nlp < research"}
    box = job_params(sorted(teams), ["true"], cohorts=cohorts)["team"]
    assert box.schema["values_display"] == {
        "language": "language (cohort nlp < research)",
        "vision": "vision",
    }
    assert "values_display" not in job_params(sorted(teams), ["true"])["team"].schema

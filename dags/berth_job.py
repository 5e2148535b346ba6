"""`berth_job`: launch any GPU job from Airflow's trigger form or the REST API.

Every JobSpec field a UI user needs is a Param (operators.params), so a job can be launched from
"Trigger DAG" or with

    curl -X POST $AIRFLOW/api/v2/dags/berth_job/dagRuns -H "Authorization: Bearer $TOKEN" \\
         -H 'Content-Type: application/json' \\
         -d '{"logical_date": null, "conf": {"name": "train-a", "team": "vision", "replicas": 2}}'

The lifecycle (validate, environment, data, run, artifacts, cleanup) is `gpu_job` reading the
run's params; a bad form fails the validate task with every field and its fix.
"""

from __future__ import annotations

from pathlib import Path

from airflow.sdk import DAG

from operators import FROM_PARAMS, gpu_job, job_params
from operators.context import settings
from operators.params import form_cohorts, form_mig_profiles, form_models

TRAIN = str(Path(__file__).parent / "training" / "train_mlp.py")
# The same script in docker/job-base's image (BERTH_JOB_IMAGE), where a pod runs it.
IMAGE_TRAIN = "/opt/berth/examples/train_mlp.py"
if settings().runtime_kind == "kubernetes":  # the pods run an image, not this DAG folder
    DEFAULTS = (["python", IMAGE_TRAIN, "--epochs", "10"], settings().job_image)
else:
    DEFAULTS = (["python", TRAIN, "--epochs", "10"], None)

# A declared cluster's models and MIG profiles fill the form's pick lists; a discovered one is
# not read at parse time (that would reach the store).
DECLARED = settings().cluster() if settings().cluster_path else None

with DAG(
    dag_id="berth_job",
    schedule=None,
    catchup=False,
    tags=["berth"],
    params=job_params(
        sorted(settings().teams()),
        *DEFAULTS,
        models=form_models(DECLARED),
        cohorts=form_cohorts(settings().teams()),
        mig_profiles=form_mig_profiles(DECLARED),
    ),
    doc_md=__doc__,
    # Berth's queue is the queue: a cap here (Airflow's default is 16) would hold the runs past
    # it as queued DAG runs outside Berth, with no reason, position or fair share. The run task
    # waits deferred, holding no worker slot and not counting towards max_active_tasks.
    max_active_runs=10_000,
) as dag:
    gpu_job(FROM_PARAMS, group_id="job")

"""Staged data's pure parts on Kubernetes (docs/decisions/0008): where a staged path lands in
the replicas' mount, the inputs' variables moved there, the data volume's settings, the
staging pod's name and the problems it reports in a termination message. The volume on the
real API server: test_kube_volumes.py."""

from __future__ import annotations

from pathlib import PurePosixPath

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from pydantic import ValidationError

from berth.runtime.kubernetes.staging import (
    MAX_RESULT,
    decode_result,
    encode_problems,
    staging_name,
)
from berth.runtime.kubernetes.volumes import (
    DataVolume,
    pod_input_env,
    pod_path,
    replica_input_env,
)
from berth.staging import StagingError, StagingProblem

MOUNT = "/berth/data"
KEYS = st.text(alphabet="0123456789abcdef", min_size=40, max_size=40)
NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789._-", min_size=1, max_size=40)


@given(KEYS, NAMES, st.sampled_from(["/opt/airflow/berth/data", "/berth/data", "/c"]))
def test_a_staged_path_maps_into_the_mount_with_its_entry(key: str, name: str, root: str) -> None:
    assume(name not in (".", ".."))
    staged = PurePosixPath(root, "entries", key, name)
    assert pod_path(staged, root, "/mnt/x") == PurePosixPath("/mnt/x/entries", key, name)
    with pytest.raises(ValueError, match="is not inside the staging cache"):
        pod_path(PurePosixPath("/elsewhere/entries", key, name), root, "/mnt/x")


def test_the_inputs_variables_move_into_the_mount_and_nothing_else() -> None:
    env = {
        "BERTH_INPUT_0": "/home/b/data/entries/k1/train.csv",
        "BERTH_INPUT_TRAIN_CSV": "/home/b/data/entries/k1/train.csv",
        "BERTH_INPUT_COUNT": "1",
        "LR": "0.1",
    }
    assert pod_input_env(env, "/home/b/data", MOUNT) == env | {
        "BERTH_INPUT_0": f"{MOUNT}/entries/k1/train.csv",
        "BERTH_INPUT_TRAIN_CSV": f"{MOUNT}/entries/k1/train.csv",
    }
    with pytest.raises(ValueError, match=r"^BERTH_INPUT_1: '/tmp/x' is not inside"):
        pod_input_env({"BERTH_INPUT_1": "/tmp/x"}, "/home/b/data", MOUNT)
    with pytest.raises(ValueError, match=r"^data_volume: the job has 2 input\(s\)"):
        replica_input_env(env, 2, None)
    with pytest.raises(ValueError, match=r"\['BERTH_INPUT_1'\] were not passed"):
        replica_input_env(env, 2, DataVolume(), "/home/b/data")
    assert replica_input_env({"A": "b"}, 0, None) == {"A": "b"}  # no inputs, no volume needed


def test_bad_data_volume_settings_name_the_field() -> None:
    with pytest.raises(ValidationError, match="mount_path: 'data' must be an absolute"):
        DataVolume(mount_path="data")
    with pytest.raises(ValidationError, match="claim: 'Berth_Data' must name a"):
        DataVolume(claim="Berth_Data")
    assert DataVolume(claim="data-{team}").claim_for("vision") == "data-vision"
    with pytest.raises(ValueError, match=r"data_volume.claim: team 'NLP' makes 'data-NLP'"):
        DataVolume(claim="data-{team}").claim_for("NLP")


def test_a_staging_pod_is_named_for_its_inputs_and_the_claim_it_writes() -> None:
    inputs = ["s3://datasets/mini/", "https://example.com/w.bin"]
    assert staging_name(inputs) == staging_name(list(inputs), "berth-data")  # the default claim
    assert staging_name(inputs, "data-vision") != staging_name(inputs, "data-speech")
    assert staging_name(inputs) != staging_name(inputs[::-1])
    assert staging_name(inputs).startswith("berth-stage-") and len(staging_name(inputs)) == 32


@given(st.lists(st.text(min_size=0, max_size=3000), min_size=1, max_size=60))
def test_the_problems_a_staging_pod_reports_fit_a_termination_message(texts: list[str]) -> None:
    problems = [StagingProblem(i, f"s3://b/{i}", t, i % 2 == 0) for i, t in enumerate(texts)]
    message = encode_problems(problems)
    assert len(message.encode()) <= MAX_RESULT
    # What may pass on a retry comes back from the pod as it went in.
    with pytest.raises(StagingError) as caught:
        decode_result(message, [p.uri for p in problems], MOUNT)
    assert [p.transient for p in caught.value.problems] == [p.transient for p in problems]

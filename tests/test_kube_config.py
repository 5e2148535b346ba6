"""BERTH_KUBE_SETTINGS (berth/runtime/kubernetes/config.py): a bad file is refused with the
file and the field named, before any pod or discovery uses it."""

from __future__ import annotations

from pathlib import Path

import pytest

from berth.runtime.kubernetes.config import KubeConfig, load_kube_config
from berth.settings import BerthSettings
from scheduling.config import ConfigError


def test_no_file_means_every_default() -> None:
    assert load_kube_config(None) == KubeConfig()


def test_a_file_sets_pods_topology_and_discovery(tmp_path: Path) -> None:
    path = tmp_path / "kube.yaml"
    path.write_text(
        "pods:\n  grace_s: 90\n  data_volume: {claim: shared-data}\n"
        "topology: {rack: topology.kubernetes.io/zone}\n"
        "node_selector: berth.io/pool=training\ndiscovery_ttl_s: 3\n"
    )
    got = load_kube_config(path)
    assert got.pods.grace_s == 90 and got.pods.data_volume is not None
    assert got.pods.data_volume.claim == "shared-data"
    assert got.topology.rack == "topology.kubernetes.io/zone"
    assert (got.node_selector, got.discovery_ttl_s) == ("berth.io/pool=training", 3)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("pods: {grace_s: -1}\n", "pods.grace_s"),
        ("pods: {namespace: ml}\n", "pods.namespace"),  # a typo of namespace_template
        ("discovery_ttl_s: soon\n", "discovery_ttl_s"),
        ("pods: {gpu_resource: amd.com/gpu}\n", "topology.gpu_resource"),
    ],
)
def test_a_bad_field_is_named_with_the_file(tmp_path: Path, text: str, field: str) -> None:
    path = tmp_path / "kube.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_kube_config(path)
    assert str(path) in str(err.value) and field in str(err.value)


def test_settings_name_a_missing_file(tmp_path: Path) -> None:
    s = BerthSettings.from_env(
        {
            "BERTH_HOME": str(tmp_path),
            "BERTH_RUNTIME": "kubernetes",
            "BERTH_KUBE_SETTINGS": str(tmp_path / "absent.yaml"),
        }
    )
    with pytest.raises(ConfigError, match=r"absent\.yaml: no such file"):
        s.kube_config()


def test_the_forms_job_image_is_checked_as_a_specs_image(tmp_path: Path) -> None:
    image = "registry.example.com/berth/job-base:0.1.0"
    s = BerthSettings.from_env({"BERTH_HOME": str(tmp_path), "BERTH_JOB_IMAGE": image})
    assert s.job_image == image
    with pytest.raises(ValueError) as err:
        BerthSettings.from_env({"BERTH_HOME": str(tmp_path), "BERTH_JOB_IMAGE": "https://r/x:1"})
    assert "BERTH_JOB_IMAGE" in str(err.value) and "scheme" in str(err.value)

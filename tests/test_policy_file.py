"""policy.yaml: knobs an admin sets over a named policy, every mistake named with its fix."""

from __future__ import annotations

import math
from dataclasses import fields, replace
from pathlib import Path

import pytest

from berth.settings import BerthSettings
from scheduling.config import ConfigError
from scheduling.policy import BERTH, Policy
from scheduling.policy_file import PolicyFile, load_policy, parse_policy
from scheduling.simulator.baselines import FIFO
from scheduling.simulator.baselines import POLICIES as SIM_POLICIES


def test_an_empty_file_is_the_berth_policy_under_its_own_name():
    assert parse_policy({}) == replace(BERTH, name="berth-custom")


def test_knobs_override_the_base_and_keep_the_rest(tmp_path: Path):
    f = tmp_path / "policy.yaml"
    f.write_text(
        "base: berth\nname: patient\nstarvation_s: 7200\nmax_reservations: 2\n"
        "min_runtime_s: 900\nmax_preemptions: 0\n"
    )
    p = load_policy(f)
    assert (p.name, p.starvation_s, p.max_reservations, p.min_runtime_s) == (
        "patient",
        7200,
        2,
        900,
    )
    assert p.max_preemptions == 0
    assert p.preemption_delay_s == BERTH.preemption_delay_s  # not set: the base's value
    assert p.ordering == BERTH.ordering and p.placement == BERTH.placement


def test_every_scalar_knob_of_a_policy_can_be_set_in_the_file():
    # A knob added to Policy but not to the file would run only in code: an admin could not
    # compare it in the simulator nor run it in the store.
    # `quotas` off is what the fifo baselines are (simulator only): Berth always enforces them.
    scalars = {
        f.name for f in fields(Policy) if f.type in ("bool", "int", "float") and f.name != "quotas"
    }
    assert scalars, "Policy's annotations changed form; this test must still find its knobs"
    assert scalars <= set(PolicyFile.model_fields)


def test_kueues_preempt_mode_is_a_knob():
    p = parse_policy({"base": "berth", "preempts_beyond_nominal": False})
    assert p.preempts_beyond_nominal is False and BERTH.preempts_beyond_nominal is True


def test_the_hierarchical_reclaim_is_a_knob():
    p = parse_policy({"base": "berth", "tree_reclaim": "strict"})
    assert p.tree_reclaim == "strict" and BERTH.tree_reclaim == "prefer"


def test_an_ordering_is_named_among_berths_own():
    p = parse_policy({"ordering": "drf-smallest-first", "easy_backfill": False})
    assert p.ordering.name == "drf-smallest-first" and p.easy_backfill is False
    assert parse_policy({}).ordering is BERTH.ordering


def test_infinity_turns_the_starvation_guard_off():
    assert math.isinf(parse_policy({"starvation_s": float("inf")}).starvation_s)


def test_a_baseline_can_be_the_base_in_the_simulator_only():
    p = parse_policy({"base": "fifo"}, known=SIM_POLICIES)
    assert (p.quotas, p.queue.backfills, p.name) == (FIFO.quotas, False, "fifo-custom")
    with pytest.raises(ConfigError, match="kueue-tas, run only in the simulator"):
        parse_policy({"base": "fifo"})  # what the store reads


@pytest.mark.parametrize(
    ("data", "field", "fix"),
    [
        ({"base": "kueue"}, "base", "start from one of: berth"),
        ({"starvation_s": 0}, "starvation_s", "greater than 0"),
        ({"min_runtime_s": -1}, "min_runtime_s", "greater than or equal to 0"),
        ({"preemption_delay_s": float("inf")}, "preemption_delay_s", "preemption: false"),
        ({"max_reservations": 1.5}, "max_reservations", "integer"),
        ({"starvation": 10}, "starvation", "Extra inputs are not permitted"),
        ({"ordering": "kueue"}, "ordering", "choose one of: drf, drf-smallest-first"),
        ({"easy_backfill": "sometimes"}, "easy_backfill", "valid boolean"),
        ({"tree_reclaim": "kueue"}, "tree_reclaim", "'prefer' or 'strict'"),
    ],
)
def test_each_mistake_names_its_field_and_the_fix(data: dict, field: str, fix: str):
    with pytest.raises(ConfigError) as e:
        parse_policy(data, "policy.yaml")
    line = next(ln for ln in str(e.value).splitlines() if ln.strip().startswith(f"{field}:"))
    assert fix in line


def test_a_file_that_is_not_a_mapping_says_what_it_should_be(tmp_path: Path):
    f = tmp_path / "policy.yaml"
    f.write_text("- berth\n")
    with pytest.raises(ConfigError, match="must be a mapping of knobs to values"):
        load_policy(f)


def test_the_store_runs_the_policy_file_it_is_given(tmp_path: Path):
    f = tmp_path / "policy.yaml"
    f.write_text("name: patient\nstarvation_s: 7200\n")
    env = {"BERTH_HOME": str(tmp_path / "home"), "BERTH_POLICY_FILE": str(f)}
    s = BerthSettings.from_env(env)
    store = s.store()
    try:
        assert (store.policy.name, store.policy.starvation_s) == ("patient", 7200)
    finally:
        store.close()
    assert BerthSettings.from_env({"BERTH_HOME": str(tmp_path)}).policy() == BERTH


def test_a_bad_policy_file_is_named_before_anything_runs(tmp_path: Path):
    f = tmp_path / "policy.yaml"
    f.write_text("min_runtime_s: -5\n")
    s = BerthSettings.from_env({"BERTH_HOME": str(tmp_path), "BERTH_POLICY_FILE": str(f)})
    with pytest.raises(ConfigError, match=r"policy.yaml: 1 problem.*\n  min_runtime_s: "):
        s.policy()

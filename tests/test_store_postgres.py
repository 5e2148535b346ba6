"""The store on a real PostgreSQL server (tests/pg.py starts a throwaway one).

The scenario tests of test_store.py run here again, each on a fresh database; then the
concurrency test: pollers in separate processes, serialised by the engine row's lock.
"""

from __future__ import annotations

import pytest
from pg import PostgresServer, postgres  # noqa: F401 (the session fixture)
from store_workload import run_workers
from test_loop import (  # noqa: F401 (collected again, on PostgreSQL)
    TAKEOVER_BOUND_S,
    check_failover,
    test_a_committed_change_wakes_a_listener_and_a_burst_wakes_it_once,
    test_one_loop_leads_the_other_stands_by_and_a_stale_leader_cannot_write,
    test_the_loop_admits_a_submission_when_woken_not_by_polling,
)
from test_mirror import random_run
from test_store import (  # noqa: F401 (collected again, on PostgreSQL)
    make_store,
    store,
    test_a_job_placed_where_a_victim_still_stops_waits_for_it_too,
    test_a_job_that_can_never_run_is_refused_and_nothing_is_written,
    test_a_job_that_fits_the_quota_but_not_the_free_gpus_waits_for_placement,
    test_a_job_waits_on_its_teams_model_key_and_the_reason_names_it,
    test_a_queued_job_of_a_removed_team_is_rejected_by_the_next_cycle,
    test_admits_on_free_gpus_and_explains_who_waits,
    test_bad_arguments_name_the_field,
    test_cancel_frees_gpus_for_the_next_cycle,
    test_events_tell_the_story,
    test_preemption_waits_for_the_victim_to_stop_then_requeues_it_in_place,
    test_submit_is_idempotent_per_job_id,
)
from test_store_retries import (  # noqa: F401 (collected again, on PostgreSQL)
    test_a_preempting_job_silent_past_the_lease_counts_as_stopped,
    test_failed_attempt_is_retried_as_a_new_attempt,
    test_reap_requeues_a_silent_job_and_refuses_its_old_worker,
    test_retry_honours_its_backoff,
)
from test_store_sqlite import check_concurrent_history


@pytest.fixture
def store_url(postgres: PostgresServer) -> str:  # noqa: F811
    return postgres.new_database()


def test_the_store_really_runs_on_postgresql(store_url: str) -> None:
    assert store_url.startswith("postgresql+psycopg://")


def test_concurrent_pollers_never_give_a_gpu_twice_postgres(store_url: str) -> None:
    run_workers(store_url, workers=4, jobs=100)
    check_concurrent_history(store_url, jobs=100)


@pytest.fixture
def loop_url(postgres: PostgresServer) -> str:  # noqa: F811
    return postgres.new_database()


def test_the_state_in_memory_never_differs_from_a_rebuild_postgres(
    postgres: PostgresServer,  # noqa: F811
) -> None:
    for seed in (1, 2):
        random_run(seed, steps=300, url=postgres.new_database())


def test_a_standby_loop_takes_over_when_the_leader_dies_mid_cycle_postgres(
    loop_url: str, tmp_path
) -> None:
    takeover = check_failover(loop_url, tmp_path)
    print(f"standby took over {takeover:.2f} s after the kill")
    assert takeover <= TAKEOVER_BOUND_S

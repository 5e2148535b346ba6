"""A throwaway PostgreSQL server for the store's tests (import `postgres` into a test module).

Order of preference:
1. `BERTH_TEST_PG_URL` (an existing server; its user needs CREATEDB): each test gets a new
   database there, dropped at the end.
2. `initdb` and `pg_ctl` from PATH or /usr/lib/postgresql/*/bin: a server in a temp dir
   (bench/postgres.py, which the store benchmark uses too).
3. Neither: the tests skip, saying why; with BERTH_REQUIRE_POSTGRES=1 (CI) they fail instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from sqlalchemy.engine import make_url

from bench.postgres import PostgresServer, Unavailable, throwaway

__all__ = ["PostgresServer", "postgres"]


def _unavailable(why: str) -> None:
    if os.environ.get("BERTH_REQUIRE_POSTGRES") == "1":
        pytest.fail(f"PostgreSQL is required (BERTH_REQUIRE_POSTGRES=1) but {why}")
    pytest.skip(f"no PostgreSQL: {why}; install postgresql or set BERTH_TEST_PG_URL")


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    given = os.environ.get("BERTH_TEST_PG_URL")
    if given:
        server = PostgresServer(make_url(given).set(drivername="postgresql+psycopg"))
        yield server
        server.drop_created()
        return
    try:
        with throwaway() as server:
            yield server
    except Unavailable as e:
        _unavailable(str(e))
    except RuntimeError as e:  # it should have started and did not
        pytest.fail(str(e))

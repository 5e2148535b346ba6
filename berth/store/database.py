"""Connections and the store's one lock, on SQLite and PostgreSQL.

Every state-changing operation runs in one transaction that first takes the store's lock, so
concurrent pollers (Airflow triggers, workers, several machines) see and change the state one
at a time and a cycle never works from a stale view:

- PostgreSQL: `SELECT ... FROM engine WHERE id = 1 FOR UPDATE` (the lock row), at READ
  COMMITTED, so every later statement of the transaction sees what the previous holder committed.
- SQLite: WAL (readers do not block the writer), and `BEGIN IMMEDIATE` for writers (SQLAlchemy's
  documented recipe: the driver in autocommit mode, BEGIN emitted on SQLAlchemy's "begin"), so
  the write lock is taken at the start rather than at the first write, with a busy timeout.

Readers (status, jobs, events, usage) take no lock: they see the last committed state. The
scheduling loop reads several tables at once outside the lock (`snapshot`): REPEATABLE READ on
PostgreSQL, a read transaction on SQLite (WAL gives it one snapshot), so what it reads is one
committed state.

Every locked transaction that changes what the engine sees bumps the store's version once
(`bump_version`, called by the first event it writes and by every cycle): the scheduling
loop's in-memory state knows which version it reflects, and the locked section of a cycle
checks that nothing moved under it (mirror.py). Such a transaction wakes the listeners once it
has committed (wakeup.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import Column, Connection, Engine, create_engine, event, inspect, select, update
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from berth.store import wakeup
from berth.store.schema import engine_row, metadata

READ = "berth_read"  # execution option: a read-only transaction (no BEGIN IMMEDIATE)
_VERSION = "berth_version"  # Connection.info: the version this locked transaction made


class StoreURLError(ValueError):
    """The database URL is malformed or names a database the store does not support."""


class StaleSchemaError(RuntimeError):
    """The database was made by an older Berth: a table lacks columns this one writes."""


def connect(url: str, busy_timeout_s: float = 60.0) -> Engine:
    """An Engine for `url` (sqlite:///path or postgresql+psycopg://...), set up for locking."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise StoreURLError(
            f"url: cannot parse {url!r}; write sqlite:///path/berth.db or "
            "postgresql+psycopg://user:password@host:5432/berth"
        ) from None
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        if parsed.database in (None, "", ":memory:"):
            raise StoreURLError(
                f"url: {url!r} is an in-memory SQLite database, which other processes cannot "
                "share; give a file, e.g. sqlite:///path/berth.db"
            )
        engine = create_engine(parsed, connect_args={"timeout": busy_timeout_s})
        _sqlite_locking(engine, busy_timeout_s)
        return engine
    if backend == "postgresql":
        if parsed.get_driver_name() != "psycopg":
            parsed = parsed.set(drivername="postgresql+psycopg")
        return create_engine(parsed, isolation_level="READ COMMITTED", pool_pre_ping=True)
    raise StoreURLError(
        f"url: {backend!r} databases are not supported; use sqlite:///path/berth.db or "
        "postgresql+psycopg://..."
    )


def _sqlite_locking(engine: Engine, busy_timeout_s: float) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record) -> None:
        dbapi_conn.isolation_level = None  # let SQLAlchemy's "begin" below issue BEGIN
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA synchronous=NORMAL")  # WAL keeps commits atomic; fewer fsyncs
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        read = conn.get_execution_options().get(READ, False)
        conn.exec_driver_sql("BEGIN" if read else "BEGIN IMMEDIATE")


@contextmanager
def locked(engine: Engine) -> Iterator[Connection]:
    """A transaction holding the store's lock; commits on success, rolls back on error."""
    changed = False
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(select(engine_row.c.id).where(engine_row.c.id == 1).with_for_update())
        # info lives as long as the pooled DBAPI connection: reset it for this transaction
        conn.info[_VERSION] = None
        try:
            yield conn
            changed = conn.info.get(_VERSION) is not None
            if changed:
                wakeup.notify_in(conn)  # PostgreSQL delivers it on commit
        finally:
            conn.info.pop(_VERSION, None)
    if changed:
        wakeup.woken_after_commit(engine)  # SQLite's listeners


def bump_version(conn: Connection) -> int:
    """The version this locked transaction makes: the engine row's, plus one, taken once."""
    version = conn.info.get(_VERSION)
    if version is None:
        version = conn.info[_VERSION] = increment(conn, engine_row.c.version)
    return version


def increment(conn: Connection, counter: Column[int]) -> int:
    """Add one to a counter of the engine row (under the lock); returns its new value."""
    return conn.execute(
        update(engine_row)
        .where(engine_row.c.id == 1)
        .values({counter.name: counter + 1})
        .returning(counter)
    ).scalar_one()


@contextmanager
def reading(engine: Engine) -> Iterator[Connection]:
    """A read-only transaction, no lock (on PostgreSQL each statement sees the latest commit)."""
    with engine.execution_options(**{READ: True}).begin() as conn:
        yield conn


@contextmanager
def snapshot(engine: Engine) -> Iterator[Connection]:
    """A read-only transaction whose statements all see one committed state, no lock."""
    options: dict = {READ: True}
    if engine.dialect.name == "postgresql":
        options["isolation_level"] = "REPEATABLE READ"
    with engine.execution_options(**options).begin() as conn:
        yield conn


def create_schema(engine: Engine) -> None:
    """Create missing tables and the engine row; safe when several processes start at once."""
    with engine.begin() as conn:  # SQLite: BEGIN IMMEDIATE serialises the creators
        if conn.dialect.name == "postgresql":
            # CREATE TABLE IF NOT EXISTS races on PostgreSQL's catalog; serialise creators.
            conn.exec_driver_sql("SELECT pg_advisory_xact_lock(7412503)")
        metadata.create_all(conn)
        _check_columns(conn)
        if conn.execute(select(engine_row.c.id).where(engine_row.c.id == 1)).first() is None:
            conn.execute(
                engine_row.insert().values(id=1, reservations={}, cycles=0, next_seq=1, version=0)
            )


def _check_columns(conn: Connection) -> None:
    """`create_all` makes missing tables, not missing columns, and there are no migrations yet
    (schema.py): an older database would fail at the first write with "no such column". Say
    so at once, with the fix."""
    found = inspect(conn)
    for table in metadata.sorted_tables:
        have = {c["name"]: c["type"] for c in found.get_columns(table.name)}
        missing = [c.name for c in table.columns if c.name not in have]
        # A text column made narrower than this version writes (PostgreSQL refuses what
        # does not fit, at the first such write).
        narrow = [
            f"{c.name} ({have[c.name].length} < {c.type.length} characters)"
            for c in table.columns
            if c.name in have
            and getattr(c.type, "length", None)
            and getattr(have[c.name], "length", None)
            and have[c.name].length < c.type.length
        ]
        if missing or narrow:
            lacks = f"lacks column(s) {', '.join(missing)}" if missing else ""
            short = f"has column(s) too narrow: {', '.join(narrow)}" if narrow else ""
            raise StaleSchemaError(
                f"store database {conn.engine.url.render_as_string(hide_password=True)}: table "
                f"{table.name!r} {' and '.join(x for x in (lacks, short) if x)}, which this "
                "version of Berth writes; it was made by an older version and there are no "
                "migrations yet. Point BERTH_STORE_URL (or BERTH_HOME) at a new database, or "
                "drain this one and remove it"
            )

"""Durable state of the cluster scheduler.

One ``Store`` hides the database: SQLite by default (one embedded file, WAL journal, explicit
transactions) or PostgreSQL through psycopg 3 when opened with a ``postgresql://`` DSN.  The same
SQL runs on both; statements are written with ``?`` placeholders and translated for psycopg.

Writers that must see a consistent picture of free resources (placement, device release) open
``store.transaction(exclusive=True)``: on SQLite that is ``BEGIN IMMEDIATE`` (one writer across
threads and processes), on PostgreSQL a transaction-scoped advisory lock, so concurrent RunTask
callers on one or many machines serialize and never hand out the same device twice.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

# Advisory lock key that serializes placement on PostgreSQL ("kiln" in ASCII).
_PG_LOCK_KEY = 0x6B696C6E

_TABLES = [
    """CREATE TABLE IF NOT EXISTS clusters (
        name TEXT PRIMARY KEY,
        arn TEXT NOT NULL,
        status TEXT NOT NULL,
        created_at {real} NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS task_definitions (
        family TEXT NOT NULL,
        revision INTEGER NOT NULL,
        arn TEXT NOT NULL UNIQUE,
        status TEXT NOT NULL,
        body TEXT NOT NULL,
        registered_at {real} NOT NULL,
        deregistered_at {real},
        PRIMARY KEY (family, revision)
    )""",
    """CREATE TABLE IF NOT EXISTS container_instances (
        arn TEXT PRIMARY KEY,
        cluster TEXT NOT NULL,
        ec2_instance_id TEXT NOT NULL,
        instance_type TEXT,
        status TEXT NOT NULL,
        agent_connected INTEGER NOT NULL,
        agent_version TEXT NOT NULL,
        attributes TEXT NOT NULL,
        cpu INTEGER NOT NULL,
        memory INTEGER NOT NULL,
        simulated INTEGER NOT NULL,
        device_root TEXT,
        registered_at {real} NOT NULL,
        heartbeat_at {real},
        version INTEGER NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS devices (
        instance_arn TEXT NOT NULL,
        device_id TEXT NOT NULL,
        kind TEXT NOT NULL,
        idx INTEGER NOT NULL,
        path TEXT,
        cores INTEGER NOT NULL,
        memory_mib INTEGER NOT NULL,
        name TEXT NOT NULL,
        uuid TEXT,
        task_arn TEXT,
        PRIMARY KEY (instance_arn, device_id)
    )""",
    """CREATE TABLE IF NOT EXISTS tasks (
        arn TEXT PRIMARY KEY,
        cluster TEXT NOT NULL,
        instance_arn TEXT NOT NULL,
        taskdef_arn TEXT NOT NULL,
        family TEXT NOT NULL,
        grp TEXT NOT NULL,
        started_by TEXT,
        last_status TEXT NOT NULL,
        desired_status TEXT NOT NULL,
        cpu INTEGER NOT NULL,
        memory INTEGER NOT NULL,
        containers TEXT NOT NULL,
        overrides TEXT NOT NULL,
        pid INTEGER,
        pid_start {real},
        exit_code INTEGER,
        stop_code TEXT,
        stopped_reason TEXT,
        work_dir TEXT,
        created_at {real} NOT NULL,
        started_at {real},
        stopping_at {real},
        stopped_at {real},
        version INTEGER NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS client_tokens (
        cluster TEXT NOT NULL,
        token TEXT NOT NULL,
        request TEXT NOT NULL,
        response TEXT NOT NULL,
        created_at {real} NOT NULL,
        PRIMARY KEY (cluster, token)
    )""",
    """CREATE TABLE IF NOT EXISTS services (
        arn TEXT PRIMARY KEY,
        cluster TEXT NOT NULL,
        name TEXT NOT NULL,
        taskdef_arn TEXT NOT NULL,
        desired_count INTEGER NOT NULL,
        status TEXT NOT NULL,
        spec TEXT NOT NULL,
        created_at {real} NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS tags (
        resource_arn TEXT NOT NULL,
        key TEXT NOT NULL,
        value TEXT NOT NULL,
        PRIMARY KEY (resource_arn, key)
    )""",
    "CREATE INDEX IF NOT EXISTS tasks_by_instance ON tasks (instance_arn, last_status)",
    "CREATE INDEX IF NOT EXISTS tasks_by_cluster ON tasks (cluster, last_status)",
    "CREATE INDEX IF NOT EXISTS devices_by_task ON devices (task_arn)",
]


def _is_postgres(url: str) -> bool:
    return url.startswith(("postgresql://", "postgres://"))


def default_path() -> str:
    """Where the store lives unless told otherwise: ``~/.kiln/cluster.db``."""
    return os.path.join(os.path.expanduser("~"), ".kiln", "cluster.db")


class Tx:
    """A cursor inside one open transaction: ``execute`` runs a statement and returns its rows."""

    def __init__(self, raw: Any, postgres: bool) -> None:
        self._raw = raw
        self._postgres = postgres
        self.rowcount = 0

    def execute(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        if self._postgres:
            sql = sql.replace("?", "%s")
        cur = self._raw.execute(sql, tuple(params))
        self.rowcount = cur.rowcount
        if cur.description is None:
            return []
        names = [d[0] for d in cur.description]
        return [dict(zip(names, row)) for row in cur.fetchall()]

    def one(self, sql: str, params: Sequence[Any] = ()) -> dict[str, Any] | None:
        rows = self.execute(sql, params)
        return rows[0] if rows else None


class StoreDamaged(RuntimeError):
    """The store file is not a healthy SQLite database; the message says how to recover."""


_SQLITE_HEADER = b"SQLite format 3\x00"


def _recovery_hint(path: str) -> str:
    return (
        f"stop every kiln cluster process using it, keep a copy, then recover what SQLite can"
        f" read:  sqlite3 {path} .recover | sqlite3 {path}.recovered  and start with"
        f" --store {path}.recovered (tasks missing from it are stopped by the agent's orphan"
        " sweep only if their task directories remain)"
    )


class Store:
    """Connection manager for the scheduler state (one connection per thread and process).

    A SQLite store is checked when opened: a file that is not a database, is empty, or fails
    ``PRAGMA quick_check`` raises ``StoreDamaged`` naming the file and the recovery command,
    never a silent empty start.  New store files are created 0600 (their directory 0700 when
    Kiln creates it).
    """

    def __init__(self, url: str | None = None) -> None:
        self.url = url or default_path()
        self.postgres = _is_postgres(self.url)
        self._local = threading.local()
        if not self.postgres:
            path = self.url.removeprefix("sqlite:///").removeprefix("sqlite://")
            self.path = os.path.abspath(path)
            os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
            self._check_file()
        else:
            self.path = ""
        try:
            self._create_schema()
            if not self.postgres:
                self._quick_check()
        except sqlite3.DatabaseError as e:
            raise StoreDamaged(
                f"the cluster store {self.path} is damaged ({e}); {_recovery_hint(self.path)}"
            ) from e

    def _check_file(self) -> None:
        try:
            with open(self.path, "rb") as f:
                header = f.read(len(_SQLITE_HEADER))
        except FileNotFoundError:
            self._create_file()
            return
        if header != _SQLITE_HEADER:
            what = "is empty" if not header else "is not a SQLite database"
            raise StoreDamaged(
                f"the cluster store {self.path} {what}; refusing to start on it (that would"
                f" forget every task). If it is really unused, delete it; otherwise"
                f" {_recovery_hint(self.path)}"
            )

    def _create_file(self) -> None:
        """Create a new store with its schema, then link it into place atomically (0600)."""
        tmp = f"{self.path}.new-{os.getpid()}-{threading.get_ident()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.close(fd)
        try:
            conn = sqlite3.connect(tmp, isolation_level=None)
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                for ddl in _TABLES:
                    conn.execute(ddl.format(real="REAL"))
            finally:
                conn.close()
            with contextlib.suppress(FileExistsError):  # another process created it first
                os.link(tmp, self.path)
        finally:
            for leftover in (tmp, tmp + "-wal", tmp + "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(leftover)

    def _quick_check(self) -> None:
        rows = self.query("PRAGMA quick_check")
        verdict = [str(next(iter(r.values()))) for r in rows]
        if verdict != ["ok"]:
            raise StoreDamaged(
                f"the cluster store {self.path} failed its integrity check"
                f" ({'; '.join(verdict[:3])}); {_recovery_hint(self.path)}"
            )

    # -- connections --------------------------------------------------------------------------
    def _connect(self) -> Any:
        if self.postgres:
            import psycopg

            return psycopg.connect(self.url, autocommit=True)
        conn = sqlite3.connect(self.path, timeout=60.0, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA busy_timeout=60000")
        return conn

    def _conn(self) -> Any:
        conn = getattr(self._local, "conn", None)
        if conn is None or getattr(self._local, "pid", None) != os.getpid():
            conn = self._connect()
            self._local.conn = conn
            self._local.pid = os.getpid()
        return conn

    def close(self) -> None:
        """Close this thread's connection (others close when their threads end)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None and getattr(self._local, "pid", None) == os.getpid():
            conn.close()
        self._local.conn = None

    def _create_schema(self) -> None:
        real = "DOUBLE PRECISION" if self.postgres else "REAL"
        with self.transaction(exclusive=True) as tx:
            for ddl in _TABLES:
                tx.execute(ddl.format(real=real))

    # -- transactions -------------------------------------------------------------------------
    @contextlib.contextmanager
    def transaction(self, exclusive: bool = False) -> Iterator[Tx]:
        """Open a transaction; ``exclusive`` serializes it against every other exclusive writer."""
        conn = self._conn()
        if getattr(self._local, "depth", 0):
            raise RuntimeError("nested Store.transaction() in one thread")
        self._local.depth = 1
        try:
            if self.postgres:
                with conn.transaction():
                    tx = Tx(conn, postgres=True)
                    if exclusive:
                        tx.execute("SELECT pg_advisory_xact_lock(?)", (_PG_LOCK_KEY,))
                    yield tx
            else:
                yield from self._sqlite_tx(conn, exclusive)
        finally:
            self._local.depth = 0

    def _sqlite_tx(self, conn: sqlite3.Connection, exclusive: bool) -> Iterator[Tx]:
        begin = "BEGIN IMMEDIATE" if exclusive else "BEGIN"
        for attempt in range(600):
            try:
                conn.execute(begin)
                break
            except sqlite3.OperationalError as e:  # busy beyond busy_timeout on a hot lock
                if "locked" not in str(e) or attempt == 599:
                    raise
                time.sleep(0.05)
        try:
            yield Tx(conn, postgres=False)
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        """Run one read in its own short transaction."""
        with self.transaction() as tx:
            return tx.execute(sql, params)


def dumps(value: Any) -> str:
    """JSON for storing structured columns (stable key order so rows compare equal)."""
    return json.dumps(value, sort_keys=True, default=str)


def loads(text: str | None) -> Any:
    return json.loads(text) if text else None

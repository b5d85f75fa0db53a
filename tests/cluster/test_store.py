"""The SQLite store: WAL, transactions, serialization of exclusive writers."""

from __future__ import annotations

import threading

import pytest

from kiln.cluster.store import Store


def test_sqlite_uses_wal_and_schema_is_idempotent(tmp_path):
    db = str(tmp_path / "c.db")
    store = Store(db)
    assert store.query("PRAGMA journal_mode")[0]["journal_mode"] == "wal"
    Store(db)  # opening again keeps the schema
    assert store.query("SELECT COUNT(*) AS n FROM tasks")[0]["n"] == 0


def test_transaction_rolls_back_on_error(tmp_path):
    store = Store(str(tmp_path / "c.db"))
    with pytest.raises(RuntimeError), store.transaction(exclusive=True) as tx:
        tx.execute("INSERT INTO clusters VALUES ('a', 'arn', 'ACTIVE', 0)")
        raise RuntimeError("boom")
    assert store.query("SELECT * FROM clusters") == []
    with store.transaction(exclusive=True) as tx:
        tx.execute("INSERT INTO clusters VALUES ('a', 'arn', 'ACTIVE', 0)")
    assert [r["name"] for r in store.query("SELECT name FROM clusters")] == ["a"]


def test_nested_transaction_is_refused(tmp_path):
    store = Store(str(tmp_path / "c.db"))
    with store.transaction(), pytest.raises(RuntimeError), store.transaction():
        pass


def test_exclusive_transactions_serialize_read_modify_write(tmp_path):
    store = Store(str(tmp_path / "c.db"))
    with store.transaction(exclusive=True) as tx:
        tx.execute("INSERT INTO clusters VALUES ('counter', '0', 'ACTIVE', 0)")

    def bump() -> None:
        for _ in range(25):
            with store.transaction(exclusive=True) as tx:
                n = int(tx.one("SELECT arn FROM clusters WHERE name = 'counter'")["arn"])
                tx.execute("UPDATE clusters SET arn = ? WHERE name = 'counter'", (str(n + 1),))

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert store.query("SELECT arn FROM clusters WHERE name = 'counter'")[0]["arn"] == "100"

"""Durable state of files and batches under `--file-storage-path` (default: `default_folder`, the
port's own under xlaserve_storage/; docs/internals.md, Durable state).

    metadata.db    SQLite in WAL mode: files (id, bytes, created_at, filename, purpose) and
                   batches (id, the batch object as JSON), each with an insertion order for lists, and
                   responses (id, the stored /v1/responses object and its input items as JSON)
    files/<id>     the bytes of each file, named by its id only: a client's filename is metadata
                   and never reaches a path
    tmp/           uploads being written; renamed into files/ once complete and fsync'd
    .lock          held (flock) by the server that uses the folder: a second one is refused, so
                   two servers never resume the same batch

The database is used from the event loop; each call is one short statement (results of batch
lines go to their output files, not here), so a lock is all the threads need.
"""
from __future__ import annotations

import fcntl
import os
import re
import sqlite3
import threading
import uuid
from typing import Iterable

import orjson

_FILE_ID = re.compile(r"file-[0-9a-f]{32}")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, status TEXT NOT NULL,
    data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, status TEXT NOT NULL,
    data TEXT NOT NULL);
"""


class StorageBusy(ValueError):
    """Another server process holds the storage folder."""


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


DEFAULT_ROOT = "xlaserve_storage"  # under the working directory


def default_folder(port: int) -> str:
    """A server's folder without --file-storage-path: its port's own, so servers on other ports
    started from one working directory each have theirs, and a restart on the port finds its
    batches again."""
    return os.path.join(DEFAULT_ROOT, f"port-{port}")


class Storage:
    def __init__(self, root: str):
        self.root = os.path.abspath(os.path.expanduser(root))
        self.files_dir = os.path.join(self.root, "files")
        self.tmp_dir = os.path.join(self.root, "tmp")
        for path in (self.files_dir, self.tmp_dir):
            os.makedirs(path, exist_ok=True)
        self._lock_fd = os.open(os.path.join(self.root, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise StorageBusy(f"--file-storage-path {self.root} is in use by another server "
                              "process; give each server its own folder") from None
        for name in os.listdir(self.tmp_dir):  # uploads cut off by a crash
            os.unlink(os.path.join(self.tmp_dir, name))
        self._db = sqlite3.connect(os.path.join(self.root, "metadata.db"), isolation_level=None,
                                   check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._mutex = threading.Lock()

    def close(self) -> None:
        with self._mutex:
            self._db.close()
        os.close(self._lock_fd)  # releases the flock

    def _query(self, sql: str, args: Iterable = ()) -> list[tuple]:
        with self._mutex:
            return self._db.execute(sql, tuple(args)).fetchall()

    # --- blobs ----------------------------------------------------------------------------------

    def blob_path(self, file_id: str) -> str:
        """Where a file's bytes are. Ids are checked against their exact shape first, so no id
        can name a path outside files/."""
        if not _FILE_ID.fullmatch(file_id):
            raise KeyError(file_id)
        return os.path.join(self.files_dir, file_id)

    def temp_path(self) -> str:
        return os.path.join(self.tmp_dir, uuid.uuid4().hex)

    # --- files ----------------------------------------------------------------------------------

    def add_file(self, record: dict) -> None:
        self._query("INSERT INTO files (id, bytes, created_at, filename, purpose) "
                    "VALUES (?, ?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET bytes = excluded.bytes",
                    (record["id"], record["bytes"], record["created_at"], record["filename"],
                     record["purpose"]))

    def file(self, file_id: str) -> dict | None:
        rows = self._query("SELECT id, bytes, created_at, filename, purpose FROM files WHERE id = ?",
                           (file_id,))
        return _file_record(rows[0]) if rows else None

    def files(self, *, purpose: str | None, after: str | None, limit: int,
              order: str = "desc") -> tuple[list[dict], bool]:
        where, args = [], []
        if purpose is not None:
            where.append("purpose = ?")
            args.append(purpose)
        if after is not None:
            where.append(f"seq {'<' if order == 'desc' else '>'} ?")
            args.append(self._seq("files", after))
        sql = ("SELECT id, bytes, created_at, filename, purpose FROM files"
               + (" WHERE " + " AND ".join(where) if where else "")
               + f" ORDER BY seq {'DESC' if order == 'desc' else 'ASC'} LIMIT ?")
        rows = self._query(sql, [*args, limit + 1])
        return [_file_record(r) for r in rows[:limit]], len(rows) > limit

    def delete_file(self, file_id: str) -> bool:
        with self._mutex:
            deleted = self._db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount
        if deleted:
            self.discard_blob(file_id)
        return bool(deleted)

    def discard_blob(self, file_id: str) -> None:
        try:
            os.unlink(self.blob_path(file_id))
        except FileNotFoundError:
            pass

    # --- batches --------------------------------------------------------------------------------

    def save_batch(self, batch: dict) -> None:
        self._save("batches", batch)

    def batch(self, batch_id: str) -> dict | None:
        return self._load("batches", batch_id)

    def batches(self, *, after: str | None, limit: int) -> tuple[list[dict], bool]:
        """Newest first, as OpenAI lists them."""
        seq = self._seq("batches", after) if after is not None else (1 << 62)
        rows = self._query("SELECT data FROM batches WHERE seq < ? ORDER BY seq DESC LIMIT ?",
                           (seq, limit + 1))
        return [orjson.loads(r[0]) for r in rows[:limit]], len(rows) > limit

    def batches_with_status(self, statuses: Iterable[str]) -> list[dict]:
        return self._with_status("batches", list(statuses))

    # Tables of records kept as JSON with their status (table names are ours, never a client's).

    def _save(self, table: str, record: dict) -> None:
        self._query(f"INSERT INTO {table} (id, status, data) VALUES (?, ?, ?) ON CONFLICT(id) "
                    "DO UPDATE SET status = excluded.status, data = excluded.data",
                    (record["id"], record["status"], orjson.dumps(record).decode()))

    def _load(self, table: str, record_id: str) -> dict | None:
        rows = self._query(f"SELECT data FROM {table} WHERE id = ?", (record_id,))
        return orjson.loads(rows[0][0]) if rows else None

    def _with_status(self, table: str, statuses: list[str]) -> list[dict]:
        rows = self._query(f"SELECT data FROM {table} WHERE status IN "
                           f"({','.join('?' * len(statuses))}) ORDER BY seq", statuses)
        return [orjson.loads(r[0]) for r in rows]

    # --- responses (http/responses/) ---------------------------------------------------------

    def save_response(self, record: dict) -> None:
        self._save("responses", record)

    def response(self, response_id: str) -> dict | None:
        return self._load("responses", response_id)

    def delete_response(self, response_id: str) -> bool:
        with self._mutex:
            return bool(self._db.execute("DELETE FROM responses WHERE id = ?",
                                         (response_id,)).rowcount)

    def responses_with_status(self, statuses: Iterable[str]) -> list[dict]:
        return self._with_status("responses", list(statuses))

    def _seq(self, table: str, object_id: str) -> int:
        rows = self._query(f"SELECT seq FROM {table} WHERE id = ?", (object_id,))
        if not rows:
            raise KeyError(object_id)
        return rows[0][0]


def _file_record(row: tuple) -> dict:
    return dict(zip(("id", "bytes", "created_at", "filename", "purpose"), row, strict=True))

"""PostgreSQL behind one adapter: the pool, named queries, migrations.

No ``psycopg`` error escapes: ``Database.connection()`` translates them into
``parley_platform.errors``. Never await the network inside an open transaction.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import struct
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import orjson
import psycopg
import psycopg.errors
import psycopg.types.json
from psycopg.adapt import Dumper
from psycopg.generators import send
from psycopg.pq import Format
from psycopg.rows import dict_row
from psycopg.types import TypeInfo
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from . import codes
from .errors import ParleyError
from .logging import get_logger

log = get_logger(__name__)

# One lock for every service's migrations: schemas and extensions are
# database-wide objects, so replicas of different services must not race either.
MIGRATION_LOCK = 0x7061726C  # "parl"

Row = dict[str, Any]
Params = Sequence[Any] | dict[str, Any] | None

# The most statements of concurrent callers sent and committed together (``fetchone_grouped``).
GROUP_MAX = 64


class _OneWritePipeline(psycopg.AsyncPipeline):
    """psycopg's pipeline writes each statement to the socket as it is queued, then its Sync, then
    a flush request: a send, and a wake-up of the server's backend, each. This one keeps the
    statements until their results are first asked for (the block's end, or a fetch inside it),
    then puts them in libpq's buffer, where the Sync writes them all at once (libpq flushes at a
    Sync, and by itself only past 8 KB); no flush request follows a Sync, after which the server
    sends every result anyway. While a write waits for room in the socket, what the server answers
    is read, as in psycopg's.

    A block that raises before anything was sent sends none of its statements (``discard``): with
    psycopg's pipeline those queued before the error were sent, and committed by the Sync on the
    way out.

    It overrides two private methods of psycopg's pipeline (pinned at 3.3.9 in pyproject.toml);
    ``tests/integration/test_postgres_pipeline.py`` counts the writes."""

    _synced = False  # the last statement queued was a Sync
    _sent = False  # some statement has gone to libpq

    def _queue(self) -> None:
        while self.command_queue:
            command = self.command_queue.popleft()
            command()
            self._sent = True
            self._synced = command == self.pgconn.pipeline_sync

    def _communicate_gen(self) -> Any:
        return  # the statements wait in the command queue
        yield  # a generator, as psycopg's is

    def _fetch_gen(self, *, flush: bool) -> Any:
        self._queue()
        if flush and self.result_queue and not self._synced:
            self.pgconn.send_flush_request()
        yield from send(self.pgconn)
        yield from super()._fetch_gen(flush=False)

    def discard(self) -> None:
        """Forget the statements not sent yet, when none has been: the Sync that ends the block
        then commits nothing. psycopg records a statement as prepared when it queues its Parse,
        so the names of the Parses forgotten here leave its cache of prepared statements too."""
        if self._sent:
            return
        unprepared = {
            command.args[0]
            for command in self.command_queue
            if isinstance(command, partial) and command.func == self.pgconn.send_prepare
        }
        names = self._conn._prepared._names
        for key in [key for key, name in names.items() if name in unprepared]:
            del names[key]
        self.command_queue.clear()
        self.result_queue.clear()


@asynccontextmanager
async def pipeline(conn: psycopg.AsyncConnection[Any]) -> AsyncIterator[psycopg.AsyncPipeline]:
    """``conn.pipeline()`` whose statements go to the server in one write, and not at all when the
    block raises before they were sent (``_OneWritePipeline``)."""
    async with conn.pipeline() as piped:
        if type(piped) is psycopg.AsyncPipeline and piped.level == 1:
            piped.__class__ = _OneWritePipeline
        try:
            yield piped
        except BaseException:
            if isinstance(piped, _OneWritePipeline):
                piped.discard()
            raise


# Every byte to a space but digits (to "9") and minus signs: 20 nines in a row may be an integer
# beyond 2**64 - 1, a minus and 19 nines one below -2**63 (orjson reads either as a float).
_DIGITS = bytes(0x39 if 0x30 <= b <= 0x39 else b if b == 0x2D else 0x20 for b in range(256))
_LONG_NUMBERS = (b"9" * 20, b"-" + b"9" * 19)


def _json_loads(data: bytes | str) -> Any:
    """json and jsonb values as Python values, read with orjson (several times faster than json;
    a turn reads its room's history as JSON). Where the two differ, json reads it: orjson reads an
    integer beyond 64 bits as a float (so a document with 20 digits in a row anywhere, or a minus
    and 19, goes to json, which keeps it exact) and refuses numbers beyond a double (jsonb's are
    numeric; json reads them as infinity)."""
    raw = data.encode() if isinstance(data, str) else data
    digits = raw.translate(_DIGITS)
    if not any(long in digits for long in _LONG_NUMBERS):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return json.loads(raw)


psycopg.types.json.set_json_loads(_json_loads)


def translate(exc: BaseException, what: str = "database") -> ParleyError:
    if isinstance(exc, psycopg.errors.UniqueViolation):
        return codes.ALREADY_EXISTS(f"{what}: already exists")
    if isinstance(exc, psycopg.errors.SerializationFailure | psycopg.errors.DeadlockDetected):
        return codes.SERIALIZATION_FAILURE(f"{what}: concurrent update, retry")
    if isinstance(
        exc,
        psycopg.errors.CheckViolation
        | psycopg.errors.NotNullViolation
        | psycopg.errors.ForeignKeyViolation
        | psycopg.errors.InvalidTextRepresentation
        # Every SQLSTATE class 22 error (bad characters, out of range, ...): the data is wrong, not the
        # database, so retrying cannot help.
        | psycopg.DataError,
    ):
        diag = getattr(exc, "diag", None)
        constraint = getattr(diag, "constraint_name", None) or ""
        return codes.CONSTRAINT_VIOLATION(
            f"{what}: rejected by the database ({constraint or type(exc).__name__})"
        )
    if isinstance(exc, psycopg.errors.ProgramLimitExceeded):
        return codes.VALUE_TOO_LARGE(f"{what}: a value is too large for the database")
    if isinstance(exc, PoolTimeout):
        return codes.DB_POOL_EXHAUSTED(f"{what}: no database connection available in time")
    if isinstance(exc, psycopg.OperationalError):
        return codes.DB_UNAVAILABLE(f"{what}: database unavailable ({type(exc).__name__})")
    return codes.DB_ERROR(f"{what}: {type(exc).__name__}")


class Vector:
    """A pgvector value as a query parameter, sent in pgvector's binary form (a count, then
    big-endian 4-byte floats): packing it costs a few microseconds where its text form, a ``repr``
    per value, cost a quarter of a millisecond for 384 dimensions. Lists of them are ``vector[]``.
    Works on connections of a database with the ``vector`` extension (``Database`` registers it)."""

    __slots__ = ("values",)

    def __init__(self, values: Sequence[float]) -> None:
        self.values = values

    @classmethod
    def of(cls, values: Sequence[float] | None) -> Vector | None:
        return None if values is None else cls(values)


class _VectorDumper(Dumper):
    format = Format.BINARY

    def dump(self, obj: Vector) -> bytes:
        values = obj.values
        return struct.pack(f">HH{len(values)}f", len(values), 0, *values)


@dataclass(slots=True)
class _Grouped:
    sql: str
    params: Params
    what: str
    future: asyncio.Future[Row | None]


# psycopg_pool retries a lost connection with a delay that doubles from 1 s until
# ``reconnect_timeout``. At its default (5 minutes) a pool could wait about as long again as an
# outage had lasted before its next attempt; giving up after 10 s leaves the slot free, and the
# next request for a connection (the host's probe, every 2 s) starts a fresh attempt at once.
RECONNECT_TIMEOUT = 10.0


class Database:
    def __init__(self, url: str, *, name: str = "parley", min_size: int = 2, max_size: int = 10) -> None:
        self.url = url
        self._vector: TypeInfo | None = None
        self._waiting: list[_Grouped] = []  # fetchone_grouped's statements not sent yet
        self._grouping: asyncio.Task[None] | None = None
        self.pool = AsyncConnectionPool(
            url,
            min_size=min_size,
            max_size=max_size,
            open=False,
            kwargs={"autocommit": True, "application_name": name},
            configure=self._configure,
            name=name,
            timeout=10,
            reconnect_timeout=RECONNECT_TIMEOUT,
        )

    async def _configure(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Each new connection reads timestamps in UTC and knows pgvector's type, when the database
        has it (looked up once).

        In UTC whatever the server's default zone (often ``Etc/UTC``, which psycopg reads as a
        ``ZoneInfo``): psycopg then returns Python's own ``timezone.utc``, whose datetimes convert
        and compare faster (``datetime.timestamp()`` 0.3 against 1.0 µs); the scheduler converts
        nine per run. Every statement's timestamps are absolute (``timestamptz``), so nothing else
        changes."""
        await conn.execute("SET TimeZone = 'UTC'")
        if not isinstance(self._vector, TypeInfo):  # until its migration has created it
            self._vector = await TypeInfo.fetch(conn, "vector")
        if self._vector is not None:
            self._vector.register(conn)
            dumper = type("VectorDumper", (_VectorDumper,), {"oid": self._vector.oid})
            conn.adapters.register_dumper(Vector, dumper)

    async def open(self, timeout: float = 30.0) -> None:
        try:
            await self.pool.open(wait=True, timeout=timeout)
        except (psycopg.Error, PoolTimeout) as exc:
            raise codes.DB_UNAVAILABLE(
                "cannot connect to PostgreSQL",
                hint="check PARLEY_DATABASE_URL, or start it with `parley infra up`",
            ) from exc

    async def close(self) -> None:
        await self.pool.close()

    async def ping(self, timeout: float = 5.0) -> None:
        """One ``SELECT 1`` through the pool, waiting at most ``timeout`` for a connection."""
        try:
            async with self.pool.connection(timeout=timeout) as conn:
                await conn.execute("SELECT 1")
        except (psycopg.Error, PoolTimeout) as exc:
            raise translate(exc, "ping") from exc

    @asynccontextmanager
    async def connection(self, what: str = "database") -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        try:
            async with self.pool.connection() as conn:
                yield conn
        except ParleyError:
            raise
        except (psycopg.Error, PoolTimeout) as exc:
            raise translate(exc, what) from exc

    async def fetchone(
        self, sql: str, params: Sequence[Any] | dict[str, Any] | None = None, *, what: str = "query"
    ) -> Row | None:
        async with self.connection(what) as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(sql, params, prepare=True)
            return await cur.fetchone()

    async def fetchone_grouped(self, sql: str, params: Params = None, *, what: str = "query") -> Row | None:
        """``fetchone`` for a single-statement compare-and-swap under concurrency: the statements of
        callers that arrive while a group is at the database go together as the next group, in
        pipeline mode on one connection, in arrival order, and **commit together** (one implicit
        transaction, so one WAL flush and one round trip for the group).

        What a caller sees is what its statement alone would give: each statement sees the ones
        before it in the group, so of two claims of one row the first wins and the second finds it
        claimed; rows come back only once the group has committed. When a statement fails, the
        group's transaction rolls back and each statement runs again on its own, so only the
        failing one's caller gets the error. A lost connection fails the whole group with
        DB_UNAVAILABLE, as it would each statement. A lone caller runs as ``fetchone``. Use it only
        for short statements of a row or a few, whose locks may be held until the group commits;
        not for long ones, nor for any that takes an exclusive lock another replica's group could
        take in the opposite order (advisory locks, several rows in no fixed order)."""
        future: asyncio.Future[Row | None] = asyncio.get_running_loop().create_future()
        self._waiting.append(_Grouped(sql, params, what, future))
        if self._grouping is None or self._grouping.done():
            self._grouping = asyncio.create_task(self._run_groups())
        return await future

    async def _run_groups(self) -> None:
        while self._waiting:
            group, self._waiting = self._waiting[:GROUP_MAX], self._waiting[GROUP_MAX:]
            group = [g for g in group if not g.future.done()]  # callers gone before it was sent
            try:
                if len(group) == 1:
                    await self._run_alone(group[0])
                elif group:
                    await self._run_group(group)
            except Exception as exc:  # a bug here, not the database's answer: its callers see it
                log.exception("grouped statements failed unexpectedly")
                for g in group:
                    if not g.future.done():
                        g.future.set_exception(codes.DB_ERROR(f"{g.what}: {type(exc).__name__}"))
            except BaseException:  # this task cancelled (shutdown): nobody is left waiting
                for g in group:
                    if not g.future.done():
                        g.future.set_exception(codes.DB_UNAVAILABLE(f"{g.what}: stopped before it ran"))
                raise

    async def _run_alone(self, grouped: _Grouped) -> None:
        try:
            row = await self.fetchone(grouped.sql, grouped.params, what=grouped.what)
        except Exception as exc:
            if not grouped.future.done():
                grouped.future.set_exception(exc)
        else:
            if not grouped.future.done():
                grouped.future.set_result(row)

    async def _run_group(self, group: list[_Grouped]) -> None:
        used: psycopg.AsyncConnection[Any] | None = None
        try:
            async with self.pool.connection() as conn:
                used = conn
                cursors = []
                async with pipeline(conn):
                    for grouped in group:
                        cursor = conn.cursor(row_factory=dict_row)
                        await cursor.execute(grouped.sql, grouped.params, prepare=True)
                        cursors.append(cursor)
                # Leaving the pipeline sent its Sync and read every result up to it: the group has
                # committed, and each cursor holds its statement's rows.
                rows = [await cursor.fetchone() for cursor in cursors]
        except (psycopg.Error, PoolTimeout) as exc:
            if used is None or used.broken or used.closed:
                # No connection, or it was lost: whether the group committed is unknown.
                for grouped in group:
                    if not grouped.future.done():
                        grouped.future.set_exception(translate(exc, grouped.what))
                return
            # A statement failed (or the group deadlocked with another transaction) and the group's
            # transaction rolled back: nothing of it happened, so each statement runs on its own.
            for grouped in group:
                await self._run_alone(grouped)
            return
        for grouped, row in zip(group, rows, strict=True):
            if not grouped.future.done():
                grouped.future.set_result(row)

    async def fetchall(
        self,
        sql: str,
        params: Sequence[Any] | dict[str, Any] | None = None,
        *,
        what: str = "query",
        prepare: bool = True,
    ) -> list[Row]:
        """Every row of ``sql``. Statements are prepared on the server, and after five executions
        PostgreSQL's plan cache may run one generic plan for every value. ``prepare=False`` plans
        each execution for its values instead: for a page with optional filters (``%(x)s IS NULL OR
        …``), whose generic plan cannot use the index of a filter that may be absent and walks every
        row of the agent to find one room's."""
        async with self.connection(what) as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(sql, params, prepare=prepare)
            return await cur.fetchall()

    async def execute(
        self, sql: str, params: Sequence[Any] | dict[str, Any] | None = None, *, what: str = "statement"
    ) -> int:
        async with self.connection(what) as conn:
            cur = await conn.execute(sql, params, prepare=True)
            return cur.rowcount


_QUERY_HEADER = re.compile(r"^--\s*([a-z_][a-z0-9_]*)\s*--\s*$", re.MULTILINE)


def load_queries(path: Path) -> dict[str, str]:
    """Parse a ``queries.sql`` whose statements are headed by ``-- name --`` lines."""
    text = path.read_text()
    parts = _QUERY_HEADER.split(text)
    queries: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise codes.QUERY_DUPLICATE(f"query {name!r} is defined twice in {path}")
        lines = [ln for ln in body.strip().splitlines() if not ln.lstrip().startswith("--")]
        queries[name] = "\n".join(lines).strip().rstrip(";")
    return queries


def _migrations(directory: Path) -> list[tuple[int, str, str]]:
    if not directory.is_dir():
        raise codes.MIGRATION_INVALID(f"migrations directory {directory} does not exist")
    found = []
    for path in sorted(directory.glob("*.sql")):
        match = re.match(r"^(\d+)_([a-z0-9_]+)\.sql$", path.name)
        if not match:
            raise codes.MIGRATION_INVALID(f"migration file name {path.name!r} is not NNNN_name.sql")
        found.append((int(match.group(1)), path.name, path.read_text()))
    versions = [v for v, _, _ in found]
    if len(set(versions)) != len(versions):
        raise codes.MIGRATION_INVALID(f"duplicate migration versions in {directory}")
    # By version, not by file name: "10_x.sql" sorts before "2_y.sql" as text.
    return sorted(found, key=lambda m: m[0])


async def migrate(url: str, schema: str, directory: Path) -> list[str]:
    """Apply the pending migrations of ``schema``; safe when replicas start at once.

    Everything runs in one transaction under an advisory lock, so a second
    replica waits, then finds the migrations applied.
    """
    if not re.fullmatch(r"[a-z_][a-z0-9_]*", schema):
        raise codes.INVALID_ARGUMENT(f"invalid schema name {schema!r}")
    migrations = _migrations(directory)
    applied: list[str] = []
    try:
        async with (
            await psycopg.AsyncConnection.connect(url, autocommit=False) as conn,
            conn.transaction(),
        ):
            await conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
            await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")
            await conn.execute(
                f"CREATE TABLE IF NOT EXISTS {schema}.schema_migrations ("
                " version integer PRIMARY KEY, name text NOT NULL, checksum text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now())"
            )
            cur = await conn.execute(f"SELECT version, name, checksum FROM {schema}.schema_migrations")
            done = {row[0]: (row[1], row[2]) for row in await cur.fetchall()}
            for version, name, sql in migrations:
                checksum = hashlib.sha256(sql.encode()).hexdigest()
                if version in done:
                    if done[version][1] != checksum:
                        raise codes.MIGRATION_CHANGED(
                            f"migration {name} changed after it was applied to schema {schema}"
                        )
                    continue
                await conn.execute(sql.encode())
                await conn.execute(
                    f"INSERT INTO {schema}.schema_migrations (version, name, checksum) VALUES (%s, %s, %s)",
                    (version, name, checksum),
                )
                applied.append(name)
    except ParleyError:
        raise
    except psycopg.Error as exc:
        raise translate(exc, f"migrate {schema}") from exc
    if applied:
        log.info("migrations applied", schema=schema, applied=",".join(applied))
    return applied


async def describe_schema(conn: psycopg.AsyncConnection[Any], schema: str) -> list[str]:
    """A normalised description of a schema's tables, columns, constraints, indexes and functions.

    Used to prove that the migrations build exactly the declared ``schema.sql``.
    """
    lines: list[str] = []
    # Type modifiers (varchar length, numeric precision, timestamp precision), identity and
    # generated columns are part of a column's definition too.
    cur = await conn.execute(
        """SELECT table_name, column_name, data_type, udt_name, is_nullable, coalesce(column_default, ''),
                  concat_ws(',', character_maximum_length, numeric_precision, numeric_scale,
                            datetime_precision),
                  concat_ws(' ', nullif(is_identity, 'NO'), identity_generation, generation_expression)
             FROM information_schema.columns
            WHERE table_schema = %s AND table_name <> 'schema_migrations'
            ORDER BY table_name, column_name""",
        (schema,),
    )
    lines += [
        f"column {r[0]}.{r[1]} {r[2]}/{r[3]}({r[6]}) null={r[4]} default={r[5]} {r[7]}".rstrip()
        for r in await cur.fetchall()
    ]
    cur = await conn.execute(
        """SELECT t.typname, string_agg(e.enumlabel, ',' ORDER BY e.enumsortorder)
             FROM pg_type t JOIN pg_enum e ON e.enumtypid = t.oid
             JOIN pg_namespace ns ON ns.oid = t.typnamespace
            WHERE ns.nspname = %s GROUP BY 1 ORDER BY 1""",
        (schema,),
    )
    lines += [f"enum {r[0]} {r[1]}" for r in await cur.fetchall()]
    cur = await conn.execute(
        "SELECT viewname, md5(definition) FROM pg_views WHERE schemaname = %s ORDER BY 1", (schema,)
    )
    lines += [f"view {r[0]} {r[1]}" for r in await cur.fetchall()]
    cur = await conn.execute(
        """SELECT rel.relname, con.conname, pg_get_constraintdef(con.oid)
             FROM pg_constraint con JOIN pg_class rel ON rel.oid = con.conrelid
             JOIN pg_namespace ns ON ns.oid = rel.relnamespace
            WHERE ns.nspname = %s AND rel.relname <> 'schema_migrations'
            ORDER BY 1, 2""",
        (schema,),
    )
    lines += [f"constraint {r[0]}.{r[1]} {r[2]}" for r in await cur.fetchall()]
    cur = await conn.execute(
        """SELECT indexname, indexdef FROM pg_indexes
            WHERE schemaname = %s AND tablename <> 'schema_migrations' ORDER BY 1""",
        (schema,),
    )
    lines += [f"index {r[0]} {r[1]}" for r in await cur.fetchall()]
    cur = await conn.execute(
        """SELECT p.proname, pg_get_function_identity_arguments(p.oid), md5(p.prosrc)
             FROM pg_proc p JOIN pg_namespace ns ON ns.oid = p.pronamespace
            WHERE ns.nspname = %s ORDER BY 1, 2""",
        (schema,),
    )
    lines += [f"function {r[0]}({r[1]}) {r[2]}" for r in await cur.fetchall()]
    cur = await conn.execute(
        """SELECT t.tgname, c.relname, pg_get_triggerdef(t.oid) FROM pg_trigger t
             JOIN pg_class c ON c.oid = t.tgrelid JOIN pg_namespace ns ON ns.oid = c.relnamespace
            WHERE ns.nspname = %s AND NOT t.tgisinternal ORDER BY 1""",
        (schema,),
    )
    lines += [f"trigger {r[0]} {r[1]} {r[2]}" for r in await cur.fetchall()]
    return lines

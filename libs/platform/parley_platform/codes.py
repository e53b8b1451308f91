"""The platform's error codes: what every service can answer, whatever its domain."""

from __future__ import annotations

from .errors import Catalog, Kind

CATALOG = Catalog("platform", "Raised by the shared platform library in every service.")
define = CATALOG.define

# Requests
INVALID_ARGUMENT = define("INVALID_ARGUMENT", Kind.INVALID_ARGUMENT, "A request field is invalid.")
INVALID_PAYLOAD = define(
    "INVALID_PAYLOAD",
    Kind.INVALID_ARGUMENT,
    "The request bytes do not decode as the method's request message.",
    hint="send the protobuf request message the method declares",
)
INVALID_ID = define(
    "INVALID_ID",
    Kind.INVALID_ARGUMENT,
    "An id field is missing, too long, or not in the form the API expects.",
)
INVALID_CONTRACT = define(
    "INVALID_CONTRACT",
    Kind.INVALID_ARGUMENT,
    "A contract document or request breaks the canonical-JSON rules; the message names the field, "
    "never the value.",
)
INVALID_PAGE = define(
    "INVALID_PAGE",
    Kind.INVALID_ARGUMENT,
    "A page request is out of range: limit 1-100, offset 0 or more.",
)
INVALID_DM_POLICY = define(
    "INVALID_DM_POLICY", Kind.INVALID_ARGUMENT, "A DM policy is not one of open, pairing, allowlist, closed."
)
UNAUTHENTICATED = define(
    "UNAUTHENTICATED",
    Kind.UNAUTHENTICATED,
    "The gRPC call carries no operator token, or a wrong one.",
    hint="send 'authorization: Bearer <PARLEY_OPERATOR_TOKEN>'",
)
DEADLINE_EXCEEDED = define(
    "DEADLINE_EXCEEDED", Kind.DEADLINE_EXCEEDED, "The call did not finish within its deadline."
)
INTERNAL = define(
    "INTERNAL", Kind.INTERNAL, "A bug: the handler failed unexpectedly.", hint="see the service log"
)
BAD_REPLY = define("BAD_REPLY", Kind.INTERNAL, "A NATS reply was not in the RPC envelope or did not decode.")

# Start-up
OPERATOR_TOKEN_REQUIRED = define(
    "OPERATOR_TOKEN_REQUIRED",
    Kind.INVALID_ARGUMENT,
    "PARLEY_OPERATOR_TOKEN is not set; the service refuses to start.",
    hint="`parley run` sets one for you; otherwise choose a long random string",
)
OPERATOR_TOKEN_EMPTY = define(
    "OPERATOR_TOKEN_EMPTY",
    Kind.INVALID_ARGUMENT,
    "The operator token is blank, which would admit anyone.",
    hint="set PARLEY_OPERATOR_TOKEN to a long random secret",
)
PORT_IN_USE = define(
    "PORT_IN_USE",
    Kind.FAILED_PRECONDITION,
    "A gRPC or metrics port is taken by another process.",
    hint="set the service's PARLEY_*_GRPC_PORT to a free port",
)

# PostgreSQL
ALREADY_EXISTS = define("ALREADY_EXISTS", Kind.CONFLICT, "A unique constraint refused the row.")
SERIALIZATION_FAILURE = define(
    "SERIALIZATION_FAILURE",
    Kind.CONFLICT,
    "A concurrent transaction won; retrying may succeed.",
    retryable=True,
)
CONSTRAINT_VIOLATION = define(
    "CONSTRAINT_VIOLATION", Kind.INVALID_ARGUMENT, "A database constraint refused a value."
)
VALUE_TOO_LARGE = define("VALUE_TOO_LARGE", Kind.INVALID_ARGUMENT, "A value is too large for its column.")
DB_POOL_EXHAUSTED = define(
    "DB_POOL_EXHAUSTED", Kind.UNAVAILABLE, "No database connection became free in time."
)
DB_UNAVAILABLE = define(
    "DB_UNAVAILABLE",
    Kind.UNAVAILABLE,
    "PostgreSQL cannot be reached.",
    hint="check PARLEY_DATABASE_URL and that PostgreSQL is running",
)
DB_ERROR = define("DB_ERROR", Kind.INTERNAL, "An unexpected database error.", hint="see the service log")
QUERY_DUPLICATE = define(
    "QUERY_DUPLICATE", Kind.FAILED_PRECONDITION, "A named query is defined twice in a service's SQL file."
)
MIGRATION_INVALID = define(
    "MIGRATION_INVALID",
    Kind.FAILED_PRECONDITION,
    "The migrations directory is missing, or a file is not named NNNN_name.sql, or versions repeat.",
)
MIGRATION_CHANGED = define(
    "MIGRATION_CHANGED",
    Kind.FAILED_PRECONDITION,
    "An applied migration's file changed since it was applied.",
    hint="never edit an applied migration; add a new one",
)

# NATS
NATS_UNAVAILABLE = define(
    "NATS_UNAVAILABLE",
    Kind.UNAVAILABLE,
    "The NATS connection is down.",
    hint="start it with `parley infra up` or set PARLEY_NATS_URL",
)
NO_RESPONDERS = define(
    "NO_RESPONDERS",
    Kind.UNAVAILABLE,
    "No replica of the called service is listening on NATS.",
    hint="is the service that serves this subject running?",
)
NATS_PERMISSION_DENIED = define(
    "NATS_PERMISSION_DENIED",
    Kind.PERMISSION_DENIED,
    "The NATS server refused this identity the subject (parley_platform.permissions says who may).",
)
NATS_TIMEOUT = define("NATS_TIMEOUT", Kind.DEADLINE_EXCEEDED, "A NATS request got no reply in time.")
JETSTREAM_UNAVAILABLE = define(
    "JETSTREAM_UNAVAILABLE",
    Kind.UNAVAILABLE,
    "JetStream did not answer (no quorum, or not enabled).",
    hint="is the server started with -js?",
)
NATS_ERROR = define("NATS_ERROR", Kind.INTERNAL, "An unexpected NATS error.", hint="see the service log")
DEAD_LETTER_NOT_FOUND = define(
    "DEAD_LETTER_NOT_FOUND",
    Kind.NOT_FOUND,
    "No dead letter has that sequence (it was replayed and handled, or purged).",
    hint="`parley dead list` shows the dead letters there are",
)
DEPENDENCY_UNAVAILABLE = define(
    "DEPENDENCY_UNAVAILABLE",
    Kind.UNAVAILABLE,
    "A service the handling needs did not answer; the message waits for it (it is not dead-lettered).",
    hint="see parley_dependency_up: the named dependency is down",
)

# Development infrastructure (make run, the tests)
INFRA_UNAVAILABLE = define(
    "INFRA_UNAVAILABLE",
    Kind.UNAVAILABLE,
    "The embedded NATS or PostgreSQL could not be started, found or stopped.",
)

# Scheduled-task workers
WORKER_NAME_INVALID = define(
    "WORKER_NAME_INVALID", Kind.INVALID_ARGUMENT, "A worker name cannot be a NATS subject token."
)
WORKER_DUPLICATE = define("WORKER_DUPLICATE", Kind.INVALID_ARGUMENT, "A worker is registered twice.")
WORKER_UNKNOWN = define("WORKER_UNKNOWN", Kind.INVALID_ARGUMENT, "A task names a worker this service lacks.")

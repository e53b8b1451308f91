"""Every benchmark runs at a tiny size and prints its summary: ``make bench`` cannot rot unnoticed.

Each ``bench/*.py`` runs as its own process with tiny arguments against this session's NATS and
PostgreSQL (its own database and namespace, as in ``make bench``). The sizes say nothing about
performance; what is checked is that the benchmark completes, that its last line is its JSON
summary, and that the figures it exists to report are there and are numbers.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from parley_devinfra import infra

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BENCH = Path(__file__).resolve().parents[2] / "bench"

# script -> (tiny arguments, the summary's keys that must be numbers, the keys that must be present)
RUNS: dict[str, tuple[list[str], set[str], set[str]]] = {
    "authz.py": (
        ["--sequential", "30", "--concurrent", "60", "--clients", "4"],
        {
            "decide_nats_4_ratio_to_sql",
            "authorize_nats_4_ratio_to_sql",
            "decide_grpc_4_ratio_to_sql",
            "authorize_grpc_4_ratio_to_sql",
            "decide_nats_1_ratio_to_sql",
            "floor_nats_4_per_s",
        },
        {"series", "floors"},
    ),
    "autonomy.py": (
        ["--turns", "10", "--ticks", "1"],
        {"ratio_autonomous_to_message_turn", "ratio_tick_to_message_turn"},
        {"message_turn", "autonomous_turn", "tick"},
    ),
    "capabilities.py": (
        ["--runs", "10", "--in-flight", "4", "--racers", "4"],
        {"ratio_to_floor", "floor_authorized_p50_ms", "race_runs_per_approval_max"},
        {"authorized_sequential", "authorized_concurrent"},
    ),
    "chat_connectors.py": (
        ["--turns", "5"],
        {"telegram_p50_ratio_to_kit", "telegram_p50_ms", "kit_p50_ms"},
        {"telegram", "kit"},
    ),
    "cluster.py": (
        ["--sequential", "20", "--concurrent", "50", "--in-flight", "4", "--failovers", "1"],
        {"sequential_p50_ratio_to_floor", "throughput_ratio_to_floor", "failover_publish_gap_s_median"},
        {"floor", "replicated"},
    ),
    "confirmations.py": (
        ["--approvals", "10", "--in-flight", "4"],
        {"ratio_to_floor", "floor_approval_p50_ms"},
        {"approval_sequential", "approval_concurrent"},
    ),
    "connector_kit.py": (
        ["--sequential", "20", "--concurrent", "40", "--in-flight", "4"],
        {"ratio_p50_to_floor", "throughput_ratio_to_floor", "kit_round_trip_p50_ms"},
        {"kit_sequential", "floor_sequential", "kit_concurrent", "floor_concurrent"},
    ),
    "custom_actions.py": (
        ["--http", "10", "--spawn", "2", "--sql", "20"],
        {
            "http_ratio_to_floor",
            "code_ratio_to_floor",
            "shell_ratio_to_floor",
            "revision_check_ratio_to_floor",
        },
        set(),
    ),
    "mcp.py": (
        ["--calls", "10"],
        {"ratio_to_floor", "action_p50_ms", "floor_p50_ms"},
        {"rows"},
    ),
    "documents.py": (
        ["--queries", "3", "--documents", "20"],
        {"operator_p50_ratio_to_floor", "stranger_p50_ratio_to_floor", "member_p50_ratio_to_floor"},
        {"floor", "authorized", "hits"},
    ),
    "evaluators.py": (
        ["--turns", "4", "--window-ms", "300"],
        {"calls_per_turn_unbatched", "calls_per_turn_batched", "ratio_batched_to_floor"},
        {"model_calls_per_turn", "turn_p50_ms"},
    ),
    "faults.py": (
        ["--rate", "2", "--only", "nats_sigkill", "--before", "1", "--after", "1", "--drain-timeout", "60"],
        {"answered_ratio_min", "ratio_to_floor_min", "floor_answered_ratio", "scenarios"},
        {"results", "dead_lettered_total", "duplicated_total"},
    ),
    # SmolLM2 (135M, packaged): the score is not asserted, only that both paths ran and were counted.
    "local_model.py": (
        ["--model", "smollm2", "--questions", "2", "--threads", "1", "--timeout", "90"],
        {"suite_tokens_per_s", "raw_tokens_per_s", "tokens_per_s_ratio_to_raw", "suite_first_reply_s"},
        {"suite_score", "raw_score", "answers"},
    ),
    "model_gateway.py": (
        ["--sequential", "50", "--concurrent", "100", "--in-flight", "8", "--local-prompts", "1"],
        {
            "overhead_ratio_p50_sequential",
            "throughput_ratio_concurrent",
            "envelope_ratio_p50_sequential",
            "gateway_to_envelope_p50_sequential",
        },
        {"packing", "local_model"},
    ),
    "pairing.py": (
        ["--rows", "300", "--pages", "10", "--upserts", "40", "--clients", "4", "--replicas", "1"],
        {"first_page_p99_ms_max", "upsert_ratio_to_raw_upsert_sql", "upserts_per_s"},
        {"pages", "upserts"},
    ),
    "scheduler.py": (
        ["--tasks", "100", "--concurrency", "4", "--lag-tasks", "20", "--lag-rate", "100"],
        {
            "ratio_to_procrastinate_1",
            "ratio_to_pgqueuer_1",
            "ratio_to_procrastinate_2",
            "ratio_to_pgqueuer_2",
            "ratio_to_floor_claim_1",
            "lag_p99_ms",
        },
        {"parley_1_replica", "pgqueuer_1_process", "procrastinate_1_process"},
    ),
    "streaming.py": (
        ["--turns", "3", "--model-latency-ms", "20", "--chunk-delay-ms", "2"],
        {
            "first_chunk_ratio_to_gateway",
            "web_first_chunk_ratio_to_runtime",
            "web_first_chunk_ratio_to_gateway",
        },
        {
            "runtime_first_chunk",
            "gateway_first_text",
            "gateway_first_item",
            "first_chunk_overhead_p50_ms",
            "web_first_chunk",
        },
    ),
    "turn_latency.py": (
        # REFLECTION after every (eight-word) message: each turn's evaluator section is drained.
        [
            *("--sequential", "10", "--concurrent", "20", "--in-flight", "8"),
            *("--words", "8", "--reflection-interval", "1"),
        ],
        {"ratio_to_floor", "throughput_ratio_to_floor"},
        {"turn_sequential", "turn_concurrent", "floor"},
    ),
    "web.py": (
        ["--sequential", "5", "--concurrent", "10", "--in-flight", "2"],
        {
            "reply_p50_ratio_to_nats",
            "reply_p50_ratio_to_nats_durable",
            "reply_throughput_ratio_to_nats",
            "first_chunk_p50_ratio_to_nats",
        },
        {"series", "web_first_chunk_p50_ms"},
    ),
    "turn_throughput.py": (
        ["--turns", "30", "--in-flight", "8", "--census", "10", "--floor-n", "20", "--settle", "0.5"],
        {"turns_per_s", "ratio_3_replicas_to_floor", "ratio_1_replica_to_floor", "sql_statements_per_turn"},
        {"turns_1_replica", "turns_3_replicas", "round_trips_per_turn"},
    ),
}


def test_every_benchmark_has_a_smoke_run() -> None:
    scripts = {path.name for path in BENCH.glob("*.py") if not path.name.startswith("_")}
    assert scripts == set(RUNS), "a benchmark without tiny arguments here is never run by make test"


@pytest.mark.parametrize("script", sorted(RUNS))
def test_benchmark_completes_at_a_tiny_size(script: str, endpoints: infra.Endpoints, tmp_path: Path) -> None:
    arguments, numbers, present = RUNS[script]
    env = {
        **os.environ,
        "PARLEY_TEST_NATS_URL": endpoints.nats_url,
        "PARLEY_TEST_DATABASE_URL": endpoints.database_url,
        # The benchmark's logs and scratch files land in this test's directory.
        "TMPDIR": str(tmp_path),
    }
    done = subprocess.run(
        [sys.executable, str(BENCH / script), *arguments],
        env=env,
        cwd=BENCH.parent,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    output = f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    assert done.returncode == 0, output
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert lines, output
    summary = json.loads(lines[-1])
    assert summary["benchmark"] == script.removesuffix(".py")
    assert not (numbers | present) - summary.keys(), output
    for key in numbers:
        value = summary[key]
        assert isinstance(value, int | float), f"{key} = {value!r}"
        assert math.isfinite(value), f"{key} = {value!r}"
        assert value > 0, f"{key} = {value!r}"

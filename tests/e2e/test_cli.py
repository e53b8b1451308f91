"""The `parley` command as a user runs it: a real process against the real suite."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from parley_cli import config
from parley_devinfra import infra
from parley_devinfra.infra import free_port
from support import ROOT, Suite

PARLEY = str(Path(sys.executable).parent / "parley")


def cli_env(suite: Suite, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARLEY_")}
    env.update(
        PARLEY_NATS_URL=suite.env.nats_url,
        PARLEY_NAMESPACE=suite.namespace,
        PARLEY_OPERATOR_TOKEN=suite.env.token,
        PARLEY_RUNTIME_ADDR=f"127.0.0.1:{suite.runtime.grpc_port}",
    )
    env.update(extra)
    return env


def run(args: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PARLEY, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_send_prints_the_reply(suite: Suite) -> None:
    result = run(["send", "--agent", "default", "hello from the cli"], cli_env(suite))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "You said: hello from the cli"


def test_send_times_out_with_a_clear_message(suite: Suite) -> None:
    result = run(["send", "--timeout", "0.5", "please be slow"], cli_env(suite))
    assert result.returncode == 1
    assert "no reply within 0.5s" in result.stderr


def test_send_says_at_once_when_the_agent_chooses_not_to_reply(suite: Suite) -> None:
    # The scripted model answers IGNORE: the turn ends without a reply, and its stream's final
    # chunk says so; before, `send` waited out its timeout and asked whether the suite was running.
    started = time.monotonic()
    result = run(["send", "--timeout", "30", "please ignore this"], cli_env(suite))
    assert result.returncode == 1
    assert "the turn was ignored" in result.stderr
    assert "chose not to answer" in result.stderr
    assert "is the suite running" not in result.stderr
    assert time.monotonic() - started < 20


def test_send_to_an_unknown_agent_fails_clearly(suite: Suite) -> None:
    result = run(["send", "--agent", "nobody", "hi"], cli_env(suite))
    assert result.returncode == 1
    assert "no agent named 'nobody'" in result.stderr
    assert "parley agents" in result.stderr


def test_agents_lists_the_default_agent(suite: Suite) -> None:
    result = run(["agents"], cli_env(suite))
    assert result.returncode == 0, result.stderr
    assert "default" in result.stdout


def test_autonomy_is_switched_and_shown(suite: Suite) -> None:
    env = cli_env(suite)
    status = run(["autonomy", "status", "default"], env)
    assert status.returncode == 0, status.stderr
    assert "autonomy off (set by the character)" in status.stdout
    assert "every 30000 ms, large model" in status.stdout
    on = run(["autonomy", "on", "default"], env)
    assert on.returncode == 0, on.stderr
    assert "autonomy on (set by the operator)" in on.stdout
    off = run(["autonomy", "off", "default", "--json"], env)
    assert off.returncode == 0, off.stderr
    assert '"enabled": false' in off.stdout
    unknown = run(["autonomy", "on", "nobody"], env)
    assert unknown.returncode == 1
    assert "no agent 'nobody'" in unknown.stderr
    turns = run(["turns", "--agent", "default"], env)
    assert turns.returncode == 0, turns.stderr
    assert "ORIGIN" in turns.stdout.splitlines()[0]


def test_wrong_token_is_refused(suite: Suite) -> None:
    result = run(["agents"], cli_env(suite, PARLEY_OPERATOR_TOKEN="wrong"))
    assert result.returncode == 1
    assert "invalid bearer token" in result.stderr


def test_runtime_not_running_is_reported(suite: Suite) -> None:
    result = run(["agents"], cli_env(suite, PARLEY_RUNTIME_ADDR=f"127.0.0.1:{free_port()}"))
    assert result.returncode == 1
    assert "not reachable" in result.stderr
    assert "make run" in result.stderr


@pytest.mark.slow
def test_parley_run_brings_everything_up_and_ctrl_c_stops_it() -> None:
    """`make run` on a machine with nothing configured: embedded NATS and Postgres, both services,
    a reply to `parley send`, and Ctrl-C stopping all of it, infrastructure included."""
    state = Path(tempfile.mkdtemp(prefix="parley-run-"))
    state.chmod(0o755)  # the embedded Postgres runs as the postgres user when we are root
    # Every service of the suite on free ports, so the test never collides with a running suite.
    ports = {
        env: str(free_port())
        for service in config.SERVICES
        for env in (service.grpc_env, service.metrics_env)
    }
    ports[config.WEB_PORT_ENV] = str(free_port())
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARLEY_")}
    env.update(ports)
    env.update(
        PARLEY_STATE_DIR=str(state),
        PARLEY_RUNTIME_ADDR=f"127.0.0.1:{ports['PARLEY_RUNTIME_GRPC_PORT']}",
        PARLEY_CHARACTERS_DIR=str(ROOT / "characters"),
        PARLEY_MODEL_PROVIDER="scripted",
    )
    supervisor = subprocess.Popen(
        [PARLEY, "run"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output: list[str] = []
    try:
        assert supervisor.stdout is not None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = supervisor.stdout.readline()
            if not line:
                break
            output.append(line)
            if "Parley is running." in line:
                break
        assert any("Parley is running." in line for line in output), "".join(output)
        assert (state / "logs" / "runtime.log").exists()
        # The web connector's chat page, at the address the banner gives.
        web = f"http://127.0.0.1:{ports[config.WEB_PORT_ENV]}/"
        rest_of_banner: list[str] = []
        while not rest_of_banner or "Press Ctrl-C" not in rest_of_banner[-1]:
            rest_of_banner.append(supervisor.stdout.readline())
            assert rest_of_banner[-1], "".join(output + rest_of_banner)
        assert any(web in line for line in rest_of_banner), "".join(output + rest_of_banner)
        with urllib.request.urlopen(web, timeout=10) as page:
            assert "Parley chat" in page.read().decode()

        result = run(["send", "hello, make run"], env)
        assert result.returncode == 0, result.stderr + "".join(output)
        assert result.stdout.strip() == "You said: hello, make run"
        assert infra.status(state)["nats"]["running"] is True  # type: ignore[index]

        started = time.monotonic()
        supervisor.send_signal(signal.SIGINT)
        rest, _ = supervisor.communicate(timeout=30)
        assert supervisor.returncode == 0, rest
        assert time.monotonic() - started < 20
        assert "parley run: stopped." in rest
        status = infra.status(state)
        assert status["nats"]["running"] is False  # type: ignore[index]
        assert status["postgres"]["running"] is False  # type: ignore[index]
        for port in ports.values():
            assert infra.port_free(int(port))
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()
        if supervisor.stdout is not None:
            supervisor.stdout.close()  # not left to the GC, which warns in whichever test it runs in
        infra.down(state)


def test_parley_run_refuses_an_unknown_local_model_before_starting_anything(tmp_path: Path) -> None:
    """The local model is settled first: a wrong PARLEY_LOCAL_MODEL stops `parley run` with the
    choices, before any infrastructure or service is started."""
    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARLEY_")}
    env.update(
        {service.grpc_env: str(free_port()) for service in config.SERVICES},
        **{service.metrics_env: str(free_port()) for service in config.SERVICES},
        PARLEY_STATE_DIR=str(state),
        PARLEY_LOCAL_MODEL="gpt-5",
    )
    result = run(["run"], env)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "unknown local model 'gpt-5' (PARLEY_LOCAL_MODEL)" in result.stdout
    assert "qwen-1.5b, qwen-0.5b, smollm2" in result.stdout
    assert "Parley is running" not in result.stdout
    assert not (state / "logs").exists()
    assert infra.read_endpoints(state) is None

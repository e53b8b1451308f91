"""The deployment files: docker-compose.yml, Dockerfile, .dockerignore, deploy/.

Structural checks that need neither a Docker engine nor the network, and the validators: the
Compose specification's JSON schema (vendored in tests/schemas/) for docker-compose.yml, and
promtool (Debian's prometheus package, installed by `make install`) for the Prometheus files. A
missing validator fails the test: a check that is skipped proves nothing. The Kubernetes manifests
and the Grafana dashboard have modules of their own (test_deploy_k8s.py, test_deploy_grafana.py).
"""

from __future__ import annotations

import copy
import fnmatch
import importlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any

import jsonschema
import pytest
import yaml
from metric_names import Metric, defined_metrics, promql_problems, run_promtool, series_index
from pydantic_settings import BaseSettings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
PROMETHEUS = ROOT / "deploy" / "prometheus.yml"
ALERTS = ROOT / "deploy" / "alerts.yml"
COMPOSE_SCHEMA = ROOT / "tests" / "schemas" / "compose_spec.json"
# Where the metrics are defined; alert expressions may use nothing else.
METRIC_SOURCES = (ROOT / "libs", ROOT / "services")
NATS_NODES = ("nats-1", "nats-2", "nats-3")  # the three nodes of the NATS cluster
INFRASTRUCTURE = (*NATS_NODES, "postgres")
REQUIRED_ALERTS = {"ServiceDown", "DeadLetters", "TurnsFailing", "SlowTurns", "ModelErrors"}
# Files the image build needs from the source folders.
BUILD_INPUT_SUFFIXES = {".py", ".pyi", ".sql", ".proto", ".yaml", ".yml", ".json", ".toml"}
TEST_TOKEN = "deploy-test-token"


# --- loading ---------------------------------------------------------------------------------------


def load_yaml(path: Path) -> Any:
    assert path.is_file(), f"{path.relative_to(ROOT)} is missing"
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc = load_yaml(COMPOSE)
    assert isinstance(doc, dict)
    assert isinstance(doc.get("services"), dict)
    assert doc["services"]
    return doc


@pytest.fixture(scope="module")
def prometheus() -> dict[str, Any]:
    doc = load_yaml(PROMETHEUS)
    assert isinstance(doc, dict)
    return doc


@pytest.fixture(scope="module")
def alert_rules() -> list[dict[str, Any]]:
    doc = load_yaml(ALERTS)
    rules = [rule for group in doc["groups"] for rule in group["rules"]]
    assert rules
    return rules


@pytest.fixture(scope="module")
def source_text() -> str:
    files = [path for root in METRIC_SOURCES for path in sorted(root.rglob("*.py"))]
    assert files
    return "\n".join(path.read_text() for path in files)


def python_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The suite's services built from this repository (the rest use published images; the
    optional chat connectors, under a profile, are checked by ``test_chat_connectors_...``)."""
    found = {
        name: svc for name, svc in compose["services"].items() if "build" in svc and not svc.get("profiles")
    }
    assert {"runtime", "model-gateway"} <= set(found), sorted(found)
    return found


def command_argv(service: dict[str, Any]) -> list[str]:
    command = service.get("command")
    assert command, "a Parley service must say which module it runs"
    return shlex.split(command) if isinstance(command, str) else [str(arg) for arg in command]


def service_module(name: str, service: dict[str, Any]) -> str:
    argv = command_argv(service)
    assert argv[:2] == ["python", "-m"], f"{name}: command {argv} is not `python -m <module>`"
    assert len(argv) >= 3, f"{name}: command {argv} names no module"
    return argv[2]


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(key): "" if value is None else str(value) for key, value in env.items()}


def interpolated_default(value: str) -> str:
    """``${VAR:-default}`` → ``default``: what compose uses when VAR is unset."""
    return re.sub(r"\$\{\w+:?-([^}]*)\}", r"\1", value)


def port_setting(module: str, kind: str) -> tuple[str, int]:
    """(environment variable, default) of the service's ``*_<kind>_port`` setting."""
    config = importlib.import_module(f"{module}.config")
    found: list[tuple[str, int]] = []
    for value in vars(config).values():
        if (
            isinstance(value, type)
            and issubclass(value, BaseSettings)
            and value.__module__ == config.__name__
        ):
            prefix = str(value.model_config.get("env_prefix", ""))
            for field_name, field in value.model_fields.items():
                if field_name.endswith(f"_{kind}_port"):
                    found.append(((prefix + field_name).upper(), int(field.default)))
    assert len(found) == 1, f"{module}.config should define exactly one *_{kind}_port setting: {found}"
    return found[0]


def effective_port(service: dict[str, Any], module: str, kind: str) -> int:
    variable, default = port_setting(module, kind)
    value = environment(service).get(variable)
    return int(interpolated_default(value)) if value else default


def replicas(service: dict[str, Any]) -> int:
    return int((service.get("deploy") or {}).get("replicas", 1))


def fixed_host_port(entry: Any) -> str | None:
    """The fixed host port a `ports` entry publishes, if any (ranges and ephemeral ports are not)."""
    if isinstance(entry, dict):
        published = str(entry.get("published") or "")
    else:
        spec = str(entry).split("/", 1)[0]
        parts = spec.rsplit(":", 2)
        published = parts[-2] if len(parts) >= 2 else ""
    return published if published and "-" not in published else None


def test_fixed_host_port_reads_every_form_of_a_ports_entry() -> None:
    assert fixed_host_port("127.0.0.1::50051") is None
    assert fixed_host_port("50051") is None
    assert fixed_host_port("127.0.0.1:50052:50052") == "50052"
    assert fixed_host_port("9000-9010:9101/tcp") is None
    assert fixed_host_port({"target": 9101}) is None
    assert fixed_host_port({"target": 9101, "published": 9101}) == "9101"


# --- docker-compose.yml ----------------------------------------------------------------------------


def test_python_services_build_from_this_folder_and_run_an_existing_module(compose: dict[str, Any]) -> None:
    for name, service in python_services(compose).items():
        build = service["build"]
        context = build if isinstance(build, str) else build.get("context")
        assert context in (".", "./"), f"{name}: builds from {build!r}, not the one Dockerfile in ."
        if isinstance(build, dict):
            assert build.get("dockerfile", "Dockerfile") == "Dockerfile", name
        module = service_module(name, service)
        assert importlib.util.find_spec(module) is not None, f"{name}: no module {module}"
        assert importlib.util.find_spec(f"{module}.__main__") is not None, f"{name}: {module} has no __main__"
        assert service.get("restart") == "unless-stopped", name


def test_python_services_wait_for_healthy_infrastructure(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, service in python_services(compose).items():
        depends_on = service.get("depends_on")
        assert isinstance(depends_on, dict), f"{name}: depends_on needs conditions, not a list"
        for infra in INFRASTRUCTURE:
            assert infra in services, f"compose has no {infra} service"
            assert depends_on.get(infra, {}).get("condition") == "service_healthy", (
                f"{name} must wait until {infra} is healthy"
            )
    # A `service_healthy` condition on a service without a healthcheck never comes true.
    for name, service in services.items():
        depends_on = service.get("depends_on") or {}
        conditions = depends_on.items() if isinstance(depends_on, dict) else ()
        for dependency, spec in conditions:
            if (spec or {}).get("condition") == "service_healthy":
                assert "healthcheck" in services[dependency], f"{name} waits on {dependency}'s healthcheck"


def test_every_service_has_a_healthcheck_and_python_ones_probe_their_grpc_port(
    compose: dict[str, Any],
) -> None:
    services = compose["services"]
    for name, service in services.items():
        check = service.get("healthcheck") or {}
        test = check.get("test")
        assert test, f"{name} has no healthcheck"
        assert not check.get("disable"), name
        assert isinstance(test, str) or test[0] in ("CMD", "CMD-SHELL"), f"{name}: {test}"
    for name, service in python_services(compose).items():
        test = service["healthcheck"]["test"]
        argv = shlex.split(test) if isinstance(test, str) else [str(arg) for arg in test]
        module = service_module(name, service)
        variable, default = port_setting(module, "grpc")
        port = str(effective_port(service, module, "grpc"))
        assert any(variable in arg or port in arg for arg in argv), (
            f"{name}: healthcheck does not probe its gRPC port ({variable}, {port}): {argv}"
        )
        if argv[:1] == ["CMD"] and argv[1:3] == ["python", "-c"]:
            compile(argv[3], f"<{name} healthcheck>", "exec")  # a typo here keeps a service unhealthy
            if variable in argv[4:]:
                assert argv[argv.index(variable) + 1] == str(default), f"{name}: healthcheck default port"


def test_chat_connectors_are_optional_and_run_with_mounted_credentials(compose: dict[str, Any]) -> None:
    """Telegram and Slack start only with their profile, never need their tokens for other
    commands, and read the credentials file of `parley connectors add` from a mounted folder."""
    for name, module in (("telegram", "parley_telegram"), ("slack", "parley_slack")):
        service = compose["services"][name]
        assert service.get("profiles") == [name], name
        assert service_module(name, service) == module
        assert importlib.util.find_spec(f"{module}.__main__") is not None, module
        env = environment(service)
        assert env["PARLEY_CONNECTOR_CREDENTIALS"] == f"/etc/parley/connectors/{name}.json"
        assert any(str(v).startswith("./deploy/connectors:") for v in service["volumes"]), name
        tokens = {k: v for k, v in env.items() if "TOKEN" in k or "SECRET" in k}
        assert tokens, name
        assert all(v.endswith(":-}") for v in tokens.values()), f"{name}: {tokens}"
        assert "PARLEY_OPERATOR_TOKEN" not in env, f"{name} is a connector, not an operator"


def test_runtime_runs_replicas_and_replicated_services_publish_no_fixed_host_port(
    compose: dict[str, Any],
) -> None:
    services = compose["services"]
    assert replicas(services["runtime"]) == 2
    for name, service in services.items():
        if replicas(service) > 1:
            fixed = [entry for entry in service.get("ports") or [] if fixed_host_port(entry)]
            assert not fixed, f"{name} has {replicas(service)} replicas but fixed host ports {fixed}"


def test_services_share_one_environment_that_needs_a_token(compose: dict[str, Any]) -> None:
    assert isinstance(compose.get("x-parley-env"), dict), "the shared environment anchor is missing"
    for name, service in python_services(compose).items():
        env = environment(service)
        for required in ("PARLEY_OPERATOR_TOKEN", "PARLEY_SECRET_SALT"):
            assert re.fullmatch(rf"\$\{{{required}:\?[^}}]*\}}", env.get(required, "")), (
                f"{name}: {required} must be required, never defaulted"
            )
        assert env.get("PARLEY_NATS_URL", "").split(",") == [f"nats://{node}:4222" for node in NATS_NODES], (
            name
        )
        assert env.get("PARLEY_STREAM_REPLICAS") == str(len(NATS_NODES)), (
            f"{name}: one copy of each stream a node"
        )
        assert re.match(r"postgres(?:ql)?://[^@]+@postgres:", env.get("PARLEY_DATABASE_URL", "")), name
        assert env.get("PARLEY_GRPC_HOST") == "0.0.0.0", name
        assert env.get("PARLEY_METRICS_HOST") == "0.0.0.0", name


def test_named_volumes_are_declared(compose: dict[str, Any]) -> None:
    declared = set(compose.get("volumes") or {})
    for name, service in compose["services"].items():
        for volume in service.get("volumes") or []:
            source = volume.get("source", "") if isinstance(volume, dict) else str(volume).split(":", 1)[0]
            if source and not source.startswith((".", "/", "~", "$")):
                assert source in declared, f"{name} uses undeclared volume {source}"
            elif source.startswith("."):
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"


def compose_schema_errors(doc: dict[str, Any]) -> list[str]:
    """Where ``doc`` breaks the Compose specification (the schema vendored in tests/schemas/)."""
    spec = json.loads(COMPOSE_SCHEMA.read_text())
    # The schema declares draft 2019-09 (and still uses draft-04's `id`, which that draft ignores).
    assert "2019-09" in str(spec.get("$schema", "")), spec.get("$schema")
    validator = jsonschema.Draft201909Validator(spec)
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in validator.iter_errors(doc)
    ]


def test_compose_file_matches_the_compose_specification(compose: dict[str, Any]) -> None:
    allowed = {"version", "name", "services", "volumes", "networks", "configs", "secrets", "include"}
    unknown = {key for key in compose if key not in allowed and not key.startswith("x-")}
    assert not unknown, f"unknown top-level keys {unknown}"
    assert not compose_schema_errors(compose)


def test_the_compose_schema_rejects_what_compose_would_reject(compose: dict[str, Any]) -> None:
    broken = copy.deepcopy(compose)
    broken["services"]["runtime"]["healthcheck"]["retires"] = 3
    broken["services"]["nats-1"]["ports"] = "4222:4222"
    broken["services"]["postgres"]["depends_on"] = {"nats": {"condition": "service_happy"}}
    errors = compose_schema_errors(broken)
    assert any(e.startswith("services/runtime/healthcheck") and "retires" in e for e in errors), errors
    assert any(e.startswith("services/nats-1/ports") for e in errors), errors
    assert any(e.startswith("services/postgres/depends_on") for e in errors), errors


def test_compose_config_renders_with_docker_compose_where_it_is_installed() -> None:
    """The schema above is the check every machine runs; `docker-compose config` also resolves the
    interpolation and the merge keys the way Compose does, so it runs where it is installed."""
    validators: list[list[str]] = []
    if legacy := shutil.which("docker-compose"):
        validators.append([legacy])
    if (docker := shutil.which("docker")) and _runs([docker, "compose", "version"]):
        validators.append([docker, "compose"])
    if not validators:
        pytest.skip("neither docker-compose nor the compose plugin is installed (the schema test ran)")
    env = {
        **os.environ,
        "PARLEY_OPERATOR_TOKEN": TEST_TOKEN,
        "PARLEY_SECRET_SALT": "test-salt-for-validation",
        "GRAFANA_ADMIN_PASSWORD": "test-password-for-validation",
    }
    for validator in validators:
        result = subprocess.run(
            [*validator, "-f", str(COMPOSE), "config", "-q"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert result.returncode == 0, f"{' '.join(validator)} config: {result.stderr}"


def _runs(argv: list[str]) -> bool:
    try:
        return subprocess.run(argv, capture_output=True, timeout=30, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


# --- deploy/prometheus.yml, deploy/alerts.yml ------------------------------------------------------


def scrape_targets(job: dict[str, Any]) -> set[tuple[str, int, str]]:
    """(host, port, how) for every target a scrape job finds."""
    found = set()
    for static in job.get("static_configs") or []:
        for target in static.get("targets") or []:
            host, _, port = str(target).rpartition(":")
            found.add((host, int(port), "static"))
    for dns in job.get("dns_sd_configs") or []:
        for host in dns.get("names") or []:
            found.add((host, int(dns["port"]), str(dns.get("type", "SRV"))))
    return found


def test_prometheus_scrapes_every_replica_of_every_python_service(
    compose: dict[str, Any], prometheus: dict[str, Any]
) -> None:
    jobs = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    assert "prometheus" in jobs
    for name, service in python_services(compose).items():
        port = effective_port(service, service_module(name, service), "metrics")
        assert name in jobs, f"no scrape job for {name}"
        # An A-record lookup of the service name returns one address per replica.
        assert (name, port, "A") in scrape_targets(jobs[name]), (
            f"job {name} should discover {name}:{port} with an A-record dns_sd_config, "
            f"has {scrape_targets(jobs[name])}"
        )


def test_prometheus_loads_the_alerts_that_compose_mounts(
    compose: dict[str, Any], prometheus: dict[str, Any]
) -> None:
    rule_files = prometheus.get("rule_files") or []
    assert ALERTS.name in rule_files
    assert (PROMETHEUS.parent / ALERTS.name).is_file()
    service = compose["services"]["prometheus"]
    args = command_argv(service)
    config = next(
        (arg.split("=", 1)[1] for arg in args if arg.startswith("--config.file=")),
        "/etc/prometheus/prometheus.yml",
    )
    mounts = {}
    for volume in service.get("volumes") or []:
        source, target = str(volume).split(":")[:2]
        mounts[target] = (ROOT / source).resolve()
    assert mounts.get(config) == PROMETHEUS.resolve(), f"{PROMETHEUS.name} is not mounted at {config}"
    for rule_file in rule_files:
        target = str(PurePosixPath(config).parent / rule_file)
        assert mounts.get(target) == (PROMETHEUS.parent / rule_file).resolve(), f"{rule_file} not at {target}"


def test_alerts_are_the_documented_ones_and_complete(alert_rules: list[dict[str, Any]]) -> None:
    names = [rule.get("alert") for rule in alert_rules]
    assert set(names) >= REQUIRED_ALERTS, REQUIRED_ALERTS - set(names)
    assert len(names) == len(set(names)), names
    for rule in alert_rules:
        assert rule.get("expr"), rule
        assert rule.get("labels", {}).get("severity") in ("critical", "warning", "info"), rule["alert"]
        assert rule.get("annotations", {}).get("summary"), rule["alert"]


@pytest.fixture(scope="module")
def metric_series() -> dict[str, list[Metric]]:
    index = series_index(defined_metrics(METRIC_SOURCES))
    assert index
    return index


def test_alerts_use_only_metrics_and_labels_the_services_define(
    alert_rules: list[dict[str, Any]],
    prometheus: dict[str, Any],
    source_text: str,
    metric_series: dict[str, list[Metric]],
) -> None:
    jobs = {job["job_name"] for job in prometheus["scrape_configs"]}
    problems = [
        f"{rule['alert']}: {problem}"
        for rule in alert_rules
        for problem in promql_problems(str(rule["expr"]), metric_series, jobs, source_text)
    ]
    assert not problems, problems


def test_every_parley_job_is_watched_for_having_no_replica(
    alert_rules: list[dict[str, Any]], prometheus: dict[str, Any]
) -> None:
    # Docker's DNS drops a stopped container, so `up == 0` cannot see a service with no replica left.
    watched = {
        job
        for rule in alert_rules
        for job in re.findall(r'absent\(\s*up\{[^}]*\bjob\s*=\s*"([^"]+)"', str(rule["expr"]))
    }
    parley_jobs = {job["job_name"] for job in prometheus["scrape_configs"]} - {"prometheus"}
    assert parley_jobs <= watched, f"no absent(up{{job=...}}) alert for {parley_jobs - watched}"


def test_prometheus_files_pass_promtool(prometheus: dict[str, Any]) -> None:
    assert prometheus.get("scrape_configs"), "prometheus.yml scrapes nothing"
    for argv in (["check", "config", str(PROMETHEUS)], ["check", "rules", str(ALERTS)]):
        result = run_promtool(*argv)
        assert result.returncode == 0, f"promtool {' '.join(argv)}: {result.stdout}{result.stderr}"


def test_promtool_rejects_a_broken_rule(tmp_path: Path) -> None:
    rules = tmp_path / "broken.yml"
    rules.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [{"alert": "A", "expr": "sum(("}]}]}))
    assert run_promtool("check", "rules", str(rules)).returncode != 0


# --- Dockerfile, .dockerignore ---------------------------------------------------------------------


def dockerfile_stages() -> list[list[tuple[str, str]]]:
    """Instructions as (KEYWORD, arguments), grouped by build stage."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    stages: list[list[tuple[str, str]]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, args = line.partition(" ")
        if keyword.upper() == "FROM":
            stages.append([])
        assert stages, "the Dockerfile must start with FROM"
        stages[-1].append((keyword.upper(), args.strip()))
    return stages


def copies(stage: list[tuple[str, str]]) -> list[tuple[list[str], str]]:
    """(sources, destination) of each COPY from the build context."""
    found = []
    for keyword, args in stage:
        if keyword in ("COPY", "ADD"):
            parts = json.loads(args) if args.startswith("[") else shlex.split(args)
            if any(part.startswith("--from") for part in parts):
                continue
            paths = [part for part in parts if not part.startswith("--")]
            found.append((paths[:-1], paths[-1]))
    return found


def env_of(stage: list[tuple[str, str]]) -> dict[str, str]:
    env = {}
    for keyword, args in stage:
        if keyword == "ENV":
            for item in shlex.split(args):
                key, _, value = item.partition("=")
                env[key] = value
    return env


def package_roots() -> set[str]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    where = pyproject["tool"]["setuptools"]["packages"]["find"]["where"]
    return {PurePosixPath(path).parts[0] for path in where}


def test_dockerfile_copies_every_package_root_and_installs_the_project() -> None:
    stages = dockerfile_stages()
    copied = {
        PurePosixPath(source).parts[0]
        for stage in stages
        for sources, _ in copies(stage)
        for source in sources
    }
    needed = package_roots() | {"pyproject.toml", "characters"}
    assert needed <= copied, f"the Dockerfile does not copy {needed - copied}"
    runs = " ".join(args for stage in stages for keyword, args in stage if keyword == "RUN")
    assert re.search(r"pip install --no-cache-dir \.(\s|$)", runs), "the project is not pip-installed"


def test_image_is_slim_python_and_runs_as_a_non_root_user_listening_on_all_interfaces() -> None:
    final = dockerfile_stages()[-1]
    image = final[0][1].split()[0]
    assert image == "python:3.11-slim", image
    users = [args for keyword, args in final if keyword == "USER"]
    assert users, "the image runs as root"
    assert users[-1].split(":")[0] not in ("root", "0"), users[-1]
    env = env_of(final)
    assert env.get("PARLEY_GRPC_HOST") == "0.0.0.0"
    assert env.get("PARLEY_METRICS_HOST") == "0.0.0.0"
    # The runtime finds its agents where the image put them.
    workdir = PurePosixPath("/")
    characters = None
    for keyword, args in final:
        if keyword == "WORKDIR":
            workdir = workdir / args
        elif keyword == "COPY" and "--from" not in args:
            sources, destination = copies([(keyword, args)])[0]
            if any(PurePosixPath(source).parts[0] == "characters" for source in sources):
                characters = workdir / destination
    assert characters is not None, "the final image has no characters/"
    assert PurePosixPath(env.get("PARLEY_CHARACTERS_DIR", str(workdir / "characters"))) == characters


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = PurePosixPath(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for raw in patterns:
        exclude = not raw.startswith("!")
        pattern = raw.removeprefix("!").strip().strip("/")
        candidates = {pattern, pattern.removeprefix("**/")}
        if any(fnmatch.fnmatchcase(prefix, p) for prefix in prefixes for p in candidates):
            ignored = exclude
    return ignored


def test_dockerignore_keeps_what_the_build_needs_and_drops_local_state() -> None:
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
    sources = {source for stage in dockerfile_stages() for paths, _ in copies(stage) for source in paths}
    needed: list[str] = []
    for source in sorted(sources):
        path = ROOT / source
        if path.is_file():
            needed.append(source)
            continue
        for file in sorted(path.rglob("*")):
            relative = file.relative_to(ROOT)
            if (
                file.is_file()
                and "__pycache__" not in relative.parts
                and (file.suffix in BUILD_INPUT_SUFFIXES or file.name == "py.typed")
            ):
                needed.append(relative.as_posix())
    assert needed
    excluded = [path for path in needed if dockerignored(path, patterns)]
    assert not excluded, f".dockerignore drops files the image needs: {excluded[:10]}"
    for local in (".git", ".venv", ".parley", "libs/platform/parley_platform/__pycache__"):
        assert dockerignored(local, patterns), f".dockerignore should exclude {local}"

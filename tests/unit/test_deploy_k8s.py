"""The Kubernetes manifests in deploy/k8s: the base and the example overlay, rendered the way
kustomize renders them (tests/kustomize_lite.py), validated against the Kubernetes schemas of the
`kubernetes-validate` package (offline), and checked for what the schemas cannot see: every
service is there, probed on its gRPC port, with resources, a PodDisruptionBudget, a Service and
scrape annotations, and every credential comes from a Secret, never from the manifests."""

from __future__ import annotations

import copy
import importlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kustomize_lite import Document, kustomization, render
from pydantic_settings import BaseSettings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
BASE = K8S / "base"
OVERLAYS = sorted(path.parent for path in (K8S / "overlays").glob("*/kustomization.yaml"))
COMPOSE = ROOT / "docker-compose.yml"
# The oldest Kubernetes these manifests are written for (native gRPC probes are GA since 1.27)
# and the newest the validator knows.
KUBERNETES_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
# Credentials: each must come from a Secret (secretKeyRef), never from a value or a ConfigMap.
SHARED_SECRETS = ("PARLEY_OPERATOR_TOKEN", "PARLEY_SECRET_SALT", "PARLEY_DATABASE_URL")
SERVICE_SECRETS = ("PARLEY_NATS_USER", "PARLEY_NATS_PASSWORD")
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|SALT|DATABASE_URL|PRIVATE|API_KEY|CREDENTIAL", re.I)
URL_WITH_PASSWORD = re.compile(r"\w+://[^/\s:@]+:[^/\s@]+@")


def compose_services() -> dict[str, str]:
    """Parley service name → the module it runs, from docker-compose.yml (the optional chat
    connectors under a compose profile need a platform's token and are not deployed by the base)."""
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    return {
        name: svc["command"][2]
        for name, svc in services.items()
        if "build" in svc and not svc.get("profiles")
    }


def ports_of(module: str) -> dict[str, tuple[str, int]]:
    """kind (grpc, metrics) → (environment variable, default) of a service's port settings."""
    config = importlib.import_module(f"{module}.config")
    found = {}
    for value in vars(config).values():
        if (
            isinstance(value, type)
            and issubclass(value, BaseSettings)
            and value.__module__ == config.__name__
        ):
            prefix = str(value.model_config.get("env_prefix", ""))
            for field_name, field in value.model_fields.items():
                for kind in ("grpc", "metrics"):
                    if field_name.endswith(f"_{kind}_port"):
                        found[kind] = ((prefix + field_name).upper(), int(field.default))
    assert set(found) == {"grpc", "metrics"}, f"{module}.config: {found}"
    return found


def of_kind(docs: list[Document], kind: str) -> dict[str, Document]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(key) == value for key, value in selector.items())


def strings(node: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """(path, value) of every string in a document."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from strings(value, f"{path}.{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from strings(value, f"{path}[{index}]")
    elif isinstance(node, str):
        yield path, node


def deployment_problems(name: str, module: str, docs: list[Document]) -> list[str]:
    deployments = of_kind(docs, "Deployment")
    if name not in deployments:
        return [f"no Deployment {name}"]
    ports = ports_of(module)
    grpc_variable, grpc_port = ports["grpc"]
    metrics_variable, metrics_port = ports["metrics"]
    problems = []
    deployment = deployments[name]
    template = deployment["spec"]["template"]
    labels = template["metadata"].get("labels") or {}
    if not selects(deployment["spec"]["selector"].get("matchLabels") or {}, labels):
        problems.append(f"{name}: the Deployment's selector does not match its pods")
    [container] = template["spec"]["containers"]
    if container.get("command") != ["python", "-m", module]:
        problems.append(f"{name}: runs {container.get('command')}, not python -m {module}")
    env = {item["name"]: item for item in container.get("env") or []}
    for variable, default in ((grpc_variable, grpc_port), (metrics_variable, metrics_port)):
        if variable in env and env[variable].get("value") != str(default):
            problems.append(
                f"{name}: {variable} is {env[variable].get('value')}; the checks expect {default}"
            )
    container_ports = {port["containerPort"] for port in container.get("ports") or []}
    if not {grpc_port, metrics_port} <= container_ports:
        problems.append(f"{name}: container ports {sorted(container_ports)} lack {grpc_port}/{metrics_port}")
    for probe in ("readinessProbe", "livenessProbe"):
        grpc = (container.get(probe) or {}).get("grpc") or {}
        if grpc.get("port") != grpc_port:
            problems.append(f"{name}: {probe} is not a gRPC health probe on port {grpc_port}: {grpc}")
    resources = container.get("resources") or {}
    for bound in ("requests", "limits"):
        missing = {"cpu", "memory"} - set(resources.get(bound) or {})
        if missing:
            problems.append(f"{name}: no {bound} for {sorted(missing)}")
    annotations = template["metadata"].get("annotations") or {}
    if annotations.get("prometheus.io/scrape") != "true" or annotations.get("prometheus.io/port") != str(
        metrics_port
    ):
        problems.append(f"{name}: pods are not annotated for scraping on {metrics_port}: {annotations}")
    for variable in (*SHARED_SECRETS, *SERVICE_SECRETS):
        ref = ((env.get(variable) or {}).get("valueFrom") or {}).get("secretKeyRef")
        if not ref:
            problems.append(f"{name}: {variable} does not come from a Secret")
        elif variable in SERVICE_SECRETS and ref["name"] != f"parley-nats-{name}":
            problems.append(f"{name}: {variable} comes from {ref['name']}, not its own parley-nats-{name}")
    config_maps = [
        ref["configMapRef"]["name"] for ref in container.get("envFrom") or [] if "configMapRef" in ref
    ]
    if not any(
        "PARLEY_NATS_URL" in (of_kind(docs, "ConfigMap").get(c) or {}).get("data", {}) for c in config_maps
    ):
        problems.append(f"{name}: PARLEY_NATS_URL does not come from a ConfigMap it reads")
    budgets = [pdb for pdb in of_kind(docs, "PodDisruptionBudget").values() if selects(
        pdb["spec"]["selector"].get("matchLabels") or {}, labels)]  # fmt: skip
    if len(budgets) != 1:
        problems.append(f"{name}: {len(budgets)} PodDisruptionBudgets select its pods, not 1")
    services = [
        svc for svc in of_kind(docs, "Service").values() if selects(svc["spec"].get("selector"), labels)
    ]
    served = {port["port"] for svc in services for port in svc["spec"]["ports"]}
    if not {grpc_port, metrics_port} <= served:
        problems.append(f"{name}: no Service port for gRPC {grpc_port} and metrics {metrics_port}: {served}")
    return problems


def secret_problems(docs: list[Document]) -> list[str]:
    """No credential is written in a manifest: no Secret with data, no secret-named value."""
    problems = []
    for doc in docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] == "Secret" and (doc.get("data") or doc.get("stringData")):
            problems.append(f"{where}: a Secret with its values in the manifests")
        if doc["kind"] == "ConfigMap":
            problems += [
                f"{where}: {key} is a credential" for key in doc.get("data") or {} if SECRET_NAME.search(key)
            ]
        pod = ((doc.get("spec") or {}).get("template") or {}).get("spec") or {}
        for container in pod.get("containers") or []:
            for item in container.get("env") or []:
                if SECRET_NAME.search(item["name"]) and "value" in item:
                    problems.append(f"{where}: {item['name']} has a value written in the manifest")
        problems += [f"{where}: {path} holds a URL with a password" for path, value in strings(doc)
                     if URL_WITH_PASSWORD.search(value)]  # fmt: skip
    return problems


def all_problems(docs: list[Document]) -> list[str]:
    services = compose_services()
    problems = [p for name, module in services.items() for p in deployment_problems(name, module, docs)]
    extra = set(of_kind(docs, "Deployment")) - set(services)
    problems += [f"Deployment {name} is no Parley service" for name in sorted(extra)]
    return problems + secret_problems(docs)


@pytest.fixture(scope="module", params=[BASE, *OVERLAYS], ids=lambda p: str(p.relative_to(K8S)))
def rendered(request: pytest.FixtureRequest) -> list[Document]:
    docs = render(request.param)
    assert docs
    return docs


def test_the_base_kustomization_lists_every_manifest_and_nothing_else() -> None:
    listed = kustomization(BASE)["resources"]
    files = sorted(p.name for p in BASE.glob("*.y*ml") if p.name != "kustomization.yaml")
    assert sorted(listed) == files
    assert len(listed) == len(set(listed))
    assert OVERLAYS, "no example overlay"
    for overlay in OVERLAYS:
        assert "../../base" in kustomization(overlay)["resources"], overlay


def schema_problems(docs: list[Document]) -> list[str]:
    problems = []
    for doc in docs:
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = "/".join(map(str, getattr(exc, "path", ())))
                problems.append(f"{doc['kind']}/{doc['metadata']['name']} ({version}) {where}: {exc.message}")
    return problems


def test_every_document_is_valid_kubernetes(rendered: list[Document]) -> None:
    problems = schema_problems(rendered)
    assert not problems, "\n".join(problems)


def test_the_schemas_reject_a_malformed_manifest(rendered: list[Document]) -> None:
    # The validator reports the first error of a document: one mistake per copy.
    runtime = of_kind(rendered, "Deployment")["runtime"]
    named_port, typo = copy.deepcopy(runtime), copy.deepcopy(runtime)
    probe = named_port["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    probe["grpc"]["port"] = "grpc"  # a gRPC probe takes a number, not a port name
    typo["spec"]["replica"] = 2
    problems = schema_problems([named_port, typo])
    assert any("readinessProbe/grpc/port" in p for p in problems), problems
    assert any("'replica' was unexpected" in p for p in problems), problems


def test_every_service_is_deployed_probed_budgeted_and_served_with_secrets_from_secrets(
    rendered: list[Document],
) -> None:
    assert not all_problems(rendered)


def test_the_overlay_sets_namespace_image_and_patches(rendered: list[Document]) -> None:
    namespaced = [doc for doc in rendered if doc["kind"] != "Namespace"]
    namespaces = {doc["metadata"].get("namespace") for doc in namespaced}
    images = {
        container["image"]
        for doc in of_kind(rendered, "Deployment").values()
        for container in doc["spec"]["template"]["spec"]["containers"]
    }
    if namespaces == {None}:  # the base: the namespace and the image are the overlay's to choose
        assert images == {"parley"}
        return
    assert len(namespaces) == 1, namespaces
    [namespace] = namespaces
    assert namespace in of_kind(rendered, "Namespace"), f"namespace {namespace} is not created"
    assert len(images) == 1, images
    assert re.fullmatch(r"[\w.-]+(?::\d+)?/[\w./-]+:[\w.-]+", images.pop()), (
        "the overlay pins a registry image"
    )


def test_the_checks_find_what_is_wrong(rendered: list[Document]) -> None:
    """Each structural check, given manifests with one thing broken, names it."""

    def broken(change: Any) -> list[str]:
        docs = copy.deepcopy(rendered)
        change(docs)
        return all_problems(docs)

    def deployment(docs: list[Document], name: str) -> Any:
        return of_kind(docs, "Deployment")[name]["spec"]["template"]

    def container(docs: list[Document], name: str) -> Any:
        return deployment(docs, name)["spec"]["containers"][0]

    cases = {
        "no Deployment pairing": lambda d: d.remove(of_kind(d, "Deployment")["pairing"]),
        "authz: 0 PodDisruptionBudgets": lambda d: d.remove(of_kind(d, "PodDisruptionBudget")["authz"]),
        "runtime: readinessProbe is not a gRPC health probe": lambda d: container(d, "runtime")[
            "readinessProbe"
        ]["grpc"].update(port=50052),
        "scheduler: livenessProbe is not a gRPC": lambda d: container(d, "scheduler").pop("livenessProbe"),
        "model-gateway: no limits": lambda d: container(d, "model-gateway")["resources"].pop("limits"),
        "authz: pods are not annotated": lambda d: deployment(d, "authz")["metadata"].pop("annotations"),
        "PARLEY_OPERATOR_TOKEN has a value written": lambda d: container(d, "runtime")["env"].append(
            {"name": "PARLEY_OPERATOR_TOKEN", "value": "hunter2"}
        ),
        "a URL with a password": lambda d: of_kind(d, "ConfigMap")["parley-config"]["data"].update(
            PARLEY_NATS_URL="nats://runtime:s3cret@nats:4222"
        ),
        "a Secret with its values": lambda d: d.append(
            {"kind": "Secret", "metadata": {"name": "parley-secrets"}, "stringData": {"x": "y"}}
        ),
        "not its own parley-nats-pairing": lambda d: next(
            e for e in container(d, "pairing")["env"] if e["name"] == "PARLEY_NATS_PASSWORD"
        )["valueFrom"]["secretKeyRef"].update(name="parley-nats-runtime"),
        "no Service port": lambda d: d.remove(of_kind(d, "Service")["scheduler"]),
    }
    for expected, change in cases.items():
        problems = broken(change)
        assert any(expected in problem for problem in problems), (expected, problems)

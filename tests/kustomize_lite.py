"""Renders the kustomizations in deploy/k8s for the tests, where no kustomize binary is installed.

It implements only what those kustomizations use: ``resources`` (files and folders), ``namespace``,
``images`` and ``patches`` that merge maps (strategic-merge patches without lists). Anything else
is refused with the field's name rather than rendered differently from kustomize: a kustomization
that starts using more makes the tests fail until this learns it.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

SUPPORTED = {"apiVersion", "kind", "resources", "namespace", "images", "patches"}
CLUSTER_SCOPED = {
    "Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "PersistentVolume",
    "StorageClass", "PriorityClass", "IngressClass",
}  # fmt: skip

Document = dict[str, Any]


class Unsupported(ValueError):
    """The kustomization uses a feature this renderer does not implement."""


def kustomization(folder: Path) -> dict[str, Any]:
    path = folder / "kustomization.yaml"
    if not path.is_file():
        raise Unsupported(f"{folder} has no kustomization.yaml")
    doc = yaml.safe_load(path.read_text())
    unknown = set(doc) - SUPPORTED
    if unknown:
        raise Unsupported(f"{path}: fields this renderer does not implement: {sorted(unknown)}")
    if doc.get("kind") != "Kustomization":
        raise Unsupported(f"{path}: kind {doc.get('kind')!r}")
    return dict(doc)


def load_documents(path: Path) -> list[Document]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def render(folder: Path) -> list[Document]:
    """The documents ``kustomize build folder`` would print (in resource order)."""
    spec = kustomization(folder)
    docs: list[Document] = []
    for entry in spec.get("resources") or []:
        target = (folder / entry).resolve()
        docs += render(target) if target.is_dir() else load_documents(target)
    for patch in spec.get("patches") or []:
        if set(patch) != {"path"}:
            raise Unsupported(f"{folder}: a patch with {sorted(set(patch) - {'path'})}")
        for body in load_documents(folder / patch["path"]):
            _apply_patch(docs, body, f"{folder}/{patch['path']}")
    for image in spec.get("images") or []:
        _set_image(docs, image)
    if namespace := spec.get("namespace"):
        for doc in docs:
            if doc["kind"] not in CLUSTER_SCOPED:
                doc.setdefault("metadata", {})["namespace"] = namespace
    return docs


def _apply_patch(docs: list[Document], patch: Document, where: str) -> None:
    matches = [
        doc
        for doc in docs
        if doc["kind"] == patch["kind"] and doc["metadata"]["name"] == patch["metadata"]["name"]
    ]
    if len(matches) != 1:
        raise Unsupported(
            f"{where}: patches {patch['kind']}/{patch['metadata']['name']}, found {len(matches)}"
        )
    _merge(matches[0], patch, where)


def _merge(target: dict[str, Any], patch: dict[str, Any], where: str) -> None:
    for key, value in patch.items():
        if isinstance(value, list):
            raise Unsupported(f"{where}: merging the list {key!r} needs strategic-merge keys")
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value, where)
        else:
            target[key] = copy.deepcopy(value)


def _set_image(docs: list[Document], image: dict[str, Any]) -> None:
    unknown = set(image) - {"name", "newName", "newTag"}
    if unknown:
        raise Unsupported(f"images: {sorted(unknown)}")
    for doc in docs:
        pod = ((doc.get("spec") or {}).get("template") or {}).get("spec") or {}
        for container in [*(pod.get("containers") or []), *(pod.get("initContainers") or [])]:
            name, _, tag = str(container["image"]).partition(":")
            if name == image["name"]:
                new_tag = str(image.get("newTag", tag))
                container["image"] = str(image.get("newName", name)) + (f":{new_tag}" if new_tag else "")

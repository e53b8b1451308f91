"""The committed generated code is exactly what the protos generate (run `make gen` after editing proto/)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from support import ROOT


def _generator() -> object:
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "tools" / "gen_proto.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_committed_code_matches_the_protos(tmp_path: Path) -> None:
    generator = _generator()
    generator.generate(tmp_path)  # type: ignore[attr-defined]
    fresh = _files(tmp_path)
    committed = _files(ROOT / "libs" / "proto")
    assert sorted(fresh) == sorted(committed), "generated files differ: run `make gen`"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert stale == [], f"stale generated code, run `make gen`: {stale}"
    assert any(name.endswith("runtime_pb2.pyi") for name in fresh)

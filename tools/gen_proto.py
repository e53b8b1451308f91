"""Generate Python code and type stubs from proto/ into a target directory.

Usage: python tools/gen_proto.py [OUT_DIR]   (default: libs/proto)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import grpc_tools
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"


def generate(out_dir: Path) -> list[Path]:
    """Compile every .proto under proto/ into out_dir; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    # protoc-gen-mypy lives beside the interpreter; protoc finds plugins on PATH.
    env_path = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")
    os.environ["PATH"] = env_path
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for proto in protos:
        package_dir = (out_dir / proto).parent
        while package_dir != out_dir:
            (package_dir / "__init__.py").touch()
            package_dir = package_dir.parent
    return sorted(p for p in out_dir.rglob("*") if p.is_file() and "__pycache__" not in p.parts)


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "libs" / "proto"
    for path in generate(target):
        print(path.relative_to(target))

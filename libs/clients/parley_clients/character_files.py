"""elizaOS ``knowledge`` entries that name files: ``{"path": ..}`` and ``{"directory": ..}``.

Whoever holds the character file reads them (``parley agents add`` on the operator's machine, the
runtime for its characters directory) and sends their text inline as ``{"path", "text"}``; the
runtime never reads a path that arrives over the API. A path must stay inside the file's
directory: a character file cannot make its reader send ``/etc/passwd`` or ``../../secrets``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TEXT_SUFFIXES = frozenset({".txt", ".text", ".md", ".markdown"})
MAX_FILE_BYTES = 512_000
MAX_FILES = 200


def _inside(base: Path, relative: str) -> Path | None:
    candidate = (base / relative).resolve()
    try:
        candidate.relative_to(base)
    except ValueError:
        return None
    return candidate


def _read(path: Path, shown: str, warnings: list[str]) -> dict[str, Any] | None:
    if path.suffix.lower() not in TEXT_SUFFIXES:
        warnings.append(f"knowledge {shown}: only {', '.join(sorted(TEXT_SUFFIXES))} files are read; skipped")
        return None
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            warnings.append(f"knowledge {shown}: over {MAX_FILE_BYTES} bytes; skipped")
            return None
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        warnings.append(f"knowledge {shown}: cannot read it ({type(exc).__name__}); skipped")
        return None
    return {"path": shown, "text": text} if text.strip() else None


def inline_knowledge(document: dict[str, Any], base_dir: Path) -> list[str]:
    """Replace the file entries of ``document["knowledge"]`` by their text; the warnings, if any."""
    items = document.get("knowledge")
    if not isinstance(items, list):
        return []
    base = base_dir.resolve()
    warnings: list[str] = []
    inlined: list[Any] = []
    for item in items:
        if not isinstance(item, dict) or "text" in item or not ({"path", "directory"} & item.keys()):
            inlined.append(item)
            continue
        key = "path" if "path" in item else "directory"
        shown = str(item[key])
        found = _inside(base, shown)
        if found is None:
            warnings.append(f"knowledge {key} {shown!r} is outside the character file's directory; skipped")
            continue
        if key == "path":
            entry = _read(found, shown, warnings) if found.is_file() else None
            if not found.is_file():
                warnings.append(f"knowledge path {shown!r} is not a file; skipped")
            if entry is not None:
                inlined.append({**item, **entry})
            continue
        if not found.is_dir():
            warnings.append(f"knowledge directory {shown!r} is not a directory; skipped")
            continue
        files = sorted(p for p in found.rglob("*") if p.is_file())[:MAX_FILES]
        for file in files:
            name = str(Path(shown) / file.relative_to(found))
            if not file.resolve().is_relative_to(base):  # a link to somewhere else
                warnings.append(f"knowledge {name!r} is outside the character file's directory; skipped")
                continue
            entry = _read(file, name, warnings)
            if entry is not None:
                inlined.append({k: v for k, v in item.items() if k != "directory"} | entry)
    document["knowledge"] = inlined
    return warnings

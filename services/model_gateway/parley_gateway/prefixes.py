"""Evaluated prompt prefixes of the local model, kept on disk so a restart does not evaluate them again.

On two CPU cores a 1.5B model evaluates the prompt at tens of tokens a second, so the
few hundred tokens of an agent's stable segments (who it is, its actions, the output
format) cost seconds to tens of seconds before the first token of a reply. llama.cpp
already keeps the previous prompt in its KV cache; this keeps the stable prefix across
restarts: the first request with a new prefix evaluates the prefix alone, saves the
context's state for exactly those tokens (``llama_state_save_file``: the KV cells and the
tokens, a few MB), then continues with the rest of its prompt. At start-up the gateway
loads the prefix used last, so the first reply after a restart only evaluates the
message's own tokens. Files are named by the SHA-256 of the model file's name, size and
the tokens, so a prefix is never loaded into another model; the oldest beyond
``keep`` are removed.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SUFFIX = ".kv"


class PrefixStore:
    def __init__(self, folder: Path, model_path: Path, *, keep: int = 8) -> None:
        self.folder = folder
        stat = model_path.stat()
        self.model_id = f"{model_path.name}:{stat.st_size}"
        self.keep = keep

    def _path(self, tokens: Sequence[int]) -> Path:
        digest = hashlib.sha256(self.model_id.encode())
        digest.update(",".join(map(str, tokens)).encode())
        return self.folder / (digest.hexdigest()[:32] + SUFFIX)

    def _saved(self) -> list[Path]:
        if not self.folder.is_dir():
            return []
        return sorted(self.folder.glob("*" + SUFFIX), key=lambda p: p.stat().st_mtime_ns, reverse=True)

    def prepare(self, llm: Any, prefix: Sequence[int]) -> int:
        """Leave ``prefix`` evaluated at the start of ``llm``'s KV cache: already there, loaded from
        disk, or evaluated now and saved. How many of its tokens were not evaluated now."""
        if len(prefix) < 2:
            return 0
        current = llm.input_ids[: llm.n_tokens].tolist()
        if current[: len(prefix)] == list(prefix):
            return len(prefix)
        path = self._path(prefix)
        if path.is_file() and self._load(llm, path, len(prefix)) == len(prefix):
            with contextlib.suppress(OSError):
                os.utime(path)
            return len(prefix)
        shared = 0
        for old, new in zip(current, prefix, strict=False):
            if old != new:
                break
            shared += 1
        llm._ctx.kv_cache_seq_rm(-1, shared, -1)
        llm.n_tokens = shared
        llm.eval(list(prefix[shared:]))
        self._save(llm, path, prefix)
        return shared

    def warm(self, llm: Any) -> int:
        """Load the prefix used last (at start-up); the number of tokens it holds, 0 if none."""
        for path in self._saved()[:1]:
            return self._load(llm, path, llm.n_ctx())
        return 0

    def _save(self, llm: Any, path: Path, tokens: Sequence[int]) -> None:
        import llama_cpp

        self.folder.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        array = (llama_cpp.llama_token * len(tokens))(*tokens)
        if llama_cpp.llama_state_save_file(llm._ctx.ctx, str(partial).encode(), array, len(tokens)):
            os.replace(partial, path)
        partial.unlink(missing_ok=True)
        for old in self._saved()[self.keep :]:
            old.unlink(missing_ok=True)

    def _load(self, llm: Any, path: Path, capacity: int) -> int:
        import llama_cpp

        array = (llama_cpp.llama_token * capacity)()
        count = ctypes.c_size_t(0)
        llm._ctx.kv_cache_clear()
        llm.n_tokens = 0
        if not llama_cpp.llama_state_load_file(
            llm._ctx.ctx, str(path).encode(), array, capacity, ctypes.byref(count)
        ):
            path.unlink(missing_ok=True)  # unreadable, or from another build of llama.cpp
            llm._ctx.kv_cache_clear()
            return 0
        loaded = int(count.value)
        llm.input_ids[:loaded] = array[:loaded]
        llm.n_tokens = loaded
        # The restored logits are not a live decode's: the next generate evaluates a token again.
        llm._requires_eval = True
        return loaded

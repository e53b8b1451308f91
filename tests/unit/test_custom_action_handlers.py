"""Custom action definitions, the shell and code handlers (real child processes), and a definition
as an ordinary action of the catalog."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from http_server import local_http_server

from parley_platform.errors import InvalidArgument
from parley_runtime.agents.custom_actions import to_action, try_definition
from parley_runtime.character import parse_character
from parley_runtime.custom.definitions import parse_definition, parse_definitions
from parley_runtime.custom.executor import CustomActionSettings, Executor
from parley_runtime.plugins.arguments import coerce_params, missing_required, schema_errors
from parley_runtime.plugins.catalog import Catalog, describe
from parley_runtime.sdk import Plugin

SECRET = "sk-live-abcdef123456"


def definition(handler: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "id": "t1",
        "name": "DO_IT",
        "description": "does it",
        "parameters": [{"name": "name", "description": "a name", "required": True}],
        "handler": handler,
        **extra,
    }


ENABLED = Executor(CustomActionSettings(shell_enabled=True, code_enabled=True))
DISABLED = Executor(CustomActionSettings())


# -- definitions -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (
            definition({"type": "http", "url": "ftp://x.example/", "headers": {"Authorization": SECRET}}),
            "handler.url",
        ),
        (definition({"type": "http", "url": "https://x.example/{{nope}}"}), "handler.url: {{nope}}"),
        (definition({"type": "http", "url": "https://x.example/"}, name="doIt"), "name"),
        (definition({"type": "smtp", "url": "https://x.example/"}), "handler"),
        (definition({"type": "http", "url": "https://x.example/", "headers": {"X": f"{SECRET}\r\n"}}), "X"),
        (
            definition({"type": "http", "url": "https://x.example/", "bodyTemplate": "{{ghost}}"}),
            "bodyTemplate",
        ),
        (definition({"type": "shell", "command": 'echo "{{name}}" | cat'}), "handler.command"),
        (definition({"type": "shell", "command": "echo \\{{name}} | cat"}), "a word of its own"),
        (definition({"type": "shell", "command": "echo ${{name}} | cat"}), "a word of its own"),
        (definition({"type": "shell", "command": "echo a{{name}}b | cat"}), "a word of its own"),
        # a value must not choose the program: not first, not after an operator, a keyword or assignments
        (definition({"type": "shell", "command": "{{name}} --version"}), "must not be the program"),
        (definition({"type": "shell", "command": "'{{name}}' x"}), "must not be the program"),
        (definition({"type": "shell", "command": "echo a | {{name}}"}), "must not be the program"),
        (definition({"type": "shell", "command": "true && {{name}} | cat"}), "must not be the program"),
        (
            definition({"type": "shell", "command": "echo a; X=1 {{name}} > /dev/null"}),
            "must not be the program",
        ),
        (definition({"type": "shell", "command": "if {{name}}; then :; fi"}), "must not be the program"),
        (definition({"type": "shell", "command": "echo $({{name}})"}), "must not be the program"),
        (definition({"type": "shell", "command": "> out {{name}}; cat out"}), "must not be the program"),
        (definition({"type": "shell", "command": "2>&1 {{name}} | cat"}), "must not be the program"),
        (definition({"type": "shell", "command": "X=1 >out {{name}} | cat"}), "must not be the program"),
        (definition({"type": "shell", "command": "cat <<EOF\n$({{name}})\nEOF"}), "must not share a line"),
        (definition({"type": "shell", "command": "cat <<EOF\n`{{name}}`\nEOF"}), "must not share a line"),
        (definition({"type": "shell", "command": "cat <<EOF\n$(( {{name}} + 1 ))\nEOF"}), "arithmetic"),
        # shell arithmetic evaluates a value as an expression (bash runs $(...) in array subscripts)
        (definition({"type": "shell", "command": "echo $(( {{name}} + 1 ))"}), "arithmetic"),
        (definition({"type": "shell", "command": "cat <<'EOF'\n{{name}}\nEOF"}), "quoted here-document"),
        # {{ name }} is refused in every handler, naming the field
        (definition({"type": "shell", "command": "echo {{ name }}"}), "handler.command: write placeholders"),
        (
            definition({"type": "shell", "command": "echo {{name }} | cat"}),
            "handler.command: write placeholders",
        ),
        (
            definition({"type": "http", "url": "https://x.example/{{ name}}"}),
            "handler.url: write placeholders",
        ),
        (
            definition({"type": "http", "url": "https://x.example/", "headers": {"X-N": "{{ name }}"}}),
            "handler.headers.X-N: write placeholders",
        ),
        (
            definition({"type": "http", "url": "https://x.example/", "bodyTemplate": '{"n": "{{ name }}"}'}),
            "handler.bodyTemplate: write placeholders",
        ),
        # header values are ASCII (httpx cannot send anything else)
        (
            definition({"type": "http", "url": "https://x.example/", "headers": {"X-City": "Troms\u00f8"}}),
            "handler.headers: the value of header X-City must be ASCII",
        ),
        # body templates: no placeholder after an escaping backslash, and JSON once the values are empty
        (
            definition({"type": "http", "url": "https://x.example/", "bodyTemplate": '{"a": "\\{{name}}"}'}),
            "handler.bodyTemplate: a {{placeholder}} must not follow a backslash",
        ),
        (
            definition(
                {"type": "http", "url": "https://x.example/", "bodyTemplate": '{"a": "\\\\\\{{name}}"}'}
            ),
            "must not follow a backslash",
        ),
        (
            definition({"type": "http", "url": "https://x.example/", "bodyTemplate": '{"a": "{{name}}"'}),
            "handler.bodyTemplate: must be a JSON document",
        ),
        (
            definition({"type": "http", "url": "https://x.example/", "bodyTemplate": "name={{name}}&x=1"}),
            "handler.bodyTemplate: must be a JSON document",
        ),
        (definition({"type": "code", "code": "print(1)", "timeoutSeconds": 600}), "handler.timeoutSeconds"),
        ({**definition({"type": "code", "code": "1"}), "parameters": [{"name": "a b"}]}, "parameters.0.name"),
        (
            {
                **definition({"type": "code", "code": "1"}),
                "parameters": [{"name": "a", "schema": {"type": 5}}],
            },
            "schema",
        ),
        ({**definition({"type": "code", "code": "1"}), "surprise": SECRET}, "surprise"),
        ({k: v for k, v in definition({"type": "code", "code": "1"}).items() if k != "id"}, "id"),
    ],
)
def test_invalid_definitions_name_the_field_and_never_echo_values(data: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        parse_definition(data)
    assert field in caught.value.message
    assert SECRET not in str(caught.value)
    assert caught.value.code == "CUSTOM_ACTION_INVALID"


@pytest.mark.parametrize(
    "handler",
    [
        {
            "type": "http",
            "url": "https://x.example/",
            "method": "POST",
            "bodyTemplate": '{"a": "\\\\{{name}}"}',
        },
        {
            "type": "http",
            "url": "https://x.example/",
            "method": "POST",
            "bodyTemplate": '[{{name}}, "{{name}}"]',
        },
        {"type": "shell", "command": 'X={{name}} && printf %s "$X" | cat'},
        {"type": "shell", "command": "printf %s {{name}}"},
        {"type": "shell", "command": "echo -- {{name}} | cat"},
        {"type": "shell", "command": "cat <<EOF\n{{name}}\nEOF"},
        {"type": "shell", "command": "echo a 2>&1 {{name}} | cat"},
        {"type": "shell", "command": "echo a > out {{name}}; cat out"},
        {"type": "shell", "command": "cat <<EOF 2>&1 {{name}}\n{{name}}\nEOF"},
    ],
)
def test_safe_definitions_are_accepted(handler: dict[str, Any]) -> None:
    assert parse_definition(definition(handler)).handler.type == handler["type"]


def test_a_character_carries_custom_actions_and_reports_their_fields() -> None:
    good = definition(
        {"type": "http", "url": "https://wttr.in/{{name}}?format=3"}, createdAt="2025-01-01T00:00:00Z"
    )
    character = parse_character({"name": "c", "customActions": [good]})
    assert [d.name for d in character.custom_actions] == ["DO_IT"]
    assert character.document()["customActions"][0]["handler"]["url"] == "https://wttr.in/{{name}}?format=3"
    with pytest.raises(InvalidArgument) as caught:
        parse_character({"name": "c", "customActions": [{**good, "name": "lower"}]})
    assert "customActions.0.name" in caught.value.message


def test_config_file_definitions_must_be_unique() -> None:
    one = definition({"type": "code", "code": "1"})
    assert len(parse_definitions({"customActions": [one]}, "f.yaml")) == 1
    with pytest.raises(InvalidArgument, match="share the name DO_IT"):
        parse_definitions([one, {**one, "id": "t2"}], "f.yaml")


def test_list_documents_mask_credential_headers() -> None:
    d = parse_definition(
        definition(
            {
                "type": "http",
                "url": "https://x.example/",
                "headers": {"Authorization": SECRET, "Accept": "a/b"},
            }
        )
    )
    assert d.public_document()["handler"]["headers"] == {"Authorization": "[REDACTED]", "Accept": "a/b"}
    assert d.header_secrets() == [SECRET]


# -- an ordinary action ------------------------------------------------------------------------


def test_a_definition_becomes_an_action_with_validated_parameters() -> None:
    d = parse_definition(
        {
            **definition({"type": "code", "code": "print(params)"}, similes=["DO", "RUN_IT"]),
            "parameters": [
                {"name": "name", "required": True},
                {"name": "count", "schema": {"type": "integer", "minimum": 1}},
            ],
        }
    )
    action = to_action(d, ENABLED)
    catalog = Catalog([Plugin("custom_actions", actions=(action,))])
    assert catalog.find("run_it") is action
    assert "DO_IT: does it (also: DO, RUN_IT) params: name: string, count?: integer" in describe([action])
    assert missing_required(action, coerce_params(action, {})) == ["name"]
    assert schema_errors(action, coerce_params(action, {"name": "x", "count": "0"})) == [
        "count: 0 is less than the minimum of 1"
    ]
    assert "code" in action.capabilities
    assert not action.idempotent


async def test_test_checks_parameters_before_running() -> None:
    d = parse_definition(definition({"type": "code", "code": "print('ran')"}))
    assert (await try_definition(ENABLED, d, {})).output == "missing: [name]"
    result = await try_definition(ENABLED, d, {"name": "x"})
    assert (result.ok, result.output) == (True, "ran\n")


# -- shell -------------------------------------------------------------------------------------


async def test_shell_is_off_unless_enabled() -> None:
    d = parse_definition(definition({"type": "shell", "command": "echo {{name}}"}))
    result = await try_definition(DISABLED, d, {"name": "x"})
    assert not result.ok
    assert "shell actions are disabled" in result.output
    assert "PARLEY_CUSTOM_ACTIONS_SHELL=true" in result.output


async def test_shell_without_shell_syntax_passes_values_as_one_argument() -> None:
    d = parse_definition(definition({"type": "shell", "command": "printf '%s|' {{name}} 'x {{name}}'"}))
    value = "a b; touch /tmp/pwned $(id) `id` '\""
    result = await try_definition(ENABLED, d, {"name": value})
    assert (result.ok, result.output) == (True, f"{value}|x {value}|")


async def test_shell_syntax_runs_under_sh_with_quoted_values() -> None:
    d = parse_definition(definition({"type": "shell", "command": "printf %s {{name}} | tr a-z A-Z"}))
    result = await try_definition(ENABLED, d, {"name": "x; echo pwned $(id)"})
    assert (result.ok, result.output) == (True, "X; ECHO PWNED $(ID)")
    glued = parse_definition(definition({"type": "shell", "command": 'X={{name}} && printf %s "$X" | cat'}))
    value = "'; id; echo '\\"
    result = await try_definition(ENABLED, glued, {"name": value})
    assert (result.ok, result.output) == (True, value)


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ("cat <<EOF\n{{name}}\nEOF", "{v}\n"),
        ("cat <<-EOF\n\t[{{name}}]\n\tEOF", "[{v}]\n"),
        ("printf '%s|' {{name}} {{name}} | cat", "{v}|{v}|"),
        ('X={{name}}; printf %s "$X" | cat', "{v}"),
        ("printf %s {{name}} > out; cat out", "{v}"),
    ],
)
async def test_shell_values_are_positional_parameters_never_script(command: str, expected: str) -> None:
    """The script holds "${1}", the value is an argument of sh: in a here-document, a pipeline or an
    assignment it is expanded once, as data."""
    d = parse_definition(definition({"type": "shell", "command": command}))
    for value in ("$(echo INJECTED)", "`echo INJECTED`", "'; echo INJECTED; '", "${HOME:-INJECTED}", "-n *"):
        result = await try_definition(ENABLED, d, {"name": value})
        assert (result.ok, result.output) == (True, expected.format(v=value)), value


async def test_shell_argv_puts_values_after_the_script() -> None:
    from parley_runtime.custom.shell import shell_argv

    argv = shell_argv("printf %s {{name}} | cat", {"name": "$(echo INJECTED)"})
    assert argv == ["/bin/sh", "-c", 'printf %s "${1}" | cat', "sh", "$(echo INJECTED)"]


async def test_shell_values_that_cannot_be_arguments_are_a_clear_failure() -> None:
    d = parse_definition(definition({"type": "shell", "command": "printf %s {{name}}"}))
    result = await try_definition(ENABLED, d, {"name": "a\ud800b"})
    assert (result.ok, result.output) == (
        False,
        "a value cannot be passed to the command: it is not valid text",
    )


async def test_shell_environment_is_empty() -> None:
    os.environ["PARLEY_TEST_MARKER"] = SECRET
    try:
        d = parse_definition(definition({"type": "shell", "command": "env"}, parameters=[]))
        result = await try_definition(ENABLED, d, {})
    finally:
        del os.environ["PARLEY_TEST_MARKER"]
    assert (result.ok, result.output) == (True, "")


async def test_shell_timeout_and_output_cap() -> None:
    slow = parse_definition(
        definition({"type": "shell", "command": "sleep 10", "timeoutSeconds": 0.5}, parameters=[])
    )
    result = await try_definition(ENABLED, slow, {})
    assert not result.ok
    assert result.output.startswith("timed out after 0.5s")
    loud = parse_definition(definition({"type": "shell", "command": "yes x | head -c 100000"}, parameters=[]))
    result = await try_definition(ENABLED, loud, {})
    assert result.ok
    assert result.output == "x\n" * 2000


async def test_shell_runs_under_limits() -> None:
    d = parse_definition(
        definition({"type": "shell", "command": "sh -c 'ulimit -v; ulimit -c; ulimit -t'"}, parameters=[])
    )
    result = await try_definition(ENABLED, d, {})
    assert (result.ok, result.output.split()) == (True, [str(1024 * 1024), "0", "11"])


async def test_shell_unknown_program_and_failure_exit() -> None:
    missing = parse_definition(definition({"type": "shell", "command": "no-such-program-xyz"}, parameters=[]))
    assert "not a program" in (await try_definition(ENABLED, missing, {})).output
    failing = parse_definition(
        definition({"type": "shell", "command": "sh -c 'echo oops; exit 3'"}, parameters=[])
    )
    assert (await try_definition(ENABLED, failing, {})).output == "exit status 3: oops\n"


# -- code --------------------------------------------------------------------------------------


async def test_code_is_off_unless_enabled() -> None:
    d = parse_definition(definition({"type": "code", "code": "print(1)"}))
    result = await try_definition(DISABLED, d, {"name": "x"})
    assert not result.ok
    assert "PARLEY_CUSTOM_ACTIONS_CODE=true" in result.output


async def test_code_gets_params_as_data() -> None:
    value = '"); import os; os.system("touch /tmp/pwned"); print("'
    d = parse_definition(definition({"type": "code", "code": "print(params['name'][::-1])"}))
    result = await try_definition(ENABLED, d, {"name": value})
    assert (result.ok, result.output) == (True, value[::-1] + "\n")
    typed = parse_definition(
        {
            **definition({"type": "code", "code": "result = {'sum': params['a'] + params['b']}"}),
            "parameters": [{"name": n, "required": True, "schema": {"type": "integer"}} for n in "ab"],
        }
    )
    result = await try_definition(ENABLED, typed, {"a": "2", "b": 40})
    assert (result.ok, json.loads(result.output)) == (True, {"sum": 42})


async def test_code_environment_is_empty() -> None:
    os.environ["PARLEY_TEST_MARKER"] = SECRET
    try:
        d = parse_definition(definition({"type": "code", "code": "import os; print(sorted(os.environ))"}))
        result = await try_definition(ENABLED, d, {"name": "x"})
    finally:
        del os.environ["PARLEY_TEST_MARKER"]
    assert result.ok, result.output
    # Python's own locale coercion (PEP 538) may add LC_CTYPE; nothing comes from the parent.
    assert set(json.loads(result.output.replace("'", '"'))) <= {"LC_CTYPE"}


@pytest.mark.parametrize(
    "code",
    [
        "import socket; socket.socket()",
        "import socket; socket.getaddrinfo('example.com', 80)",
        "import socket; socket.create_connection(('127.0.0.1', 9))",
        "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9/')",
        "import subprocess; subprocess.run(['true'])",
        "import os; os.system('true')",
        "import ctypes",
        "import resource; resource.setrlimit(resource.RLIMIT_CPU, (1000, 1000))",
        # process creation without an audit event on 3.11, and signals to the runtime
        "import _posixsubprocess",
        "import sys; sys.meta_path.pop(0); sys.modules.pop('_posixsubprocess'); import _posixsubprocess",
        "import _imp, importlib.machinery as m; _imp.create_builtin(m.ModuleSpec('posix', None)).kill",
        "import _imp, importlib.machinery as m; _imp.create_dynamic(m.ModuleSpec('_posixsubprocess', None))",
        "import os; os.kill(os.getppid(), 9)",
        "import os; os.killpg(os.getpgid(os.getppid()), 9)",
        "import posix; posix.kill(posix.getppid(), 9)",
        "import signal, threading; signal.pthread_kill(threading.get_ident(), 0)",
        "import os; os.fork()",
        "import os; os.forkpty()",
        "import os; os.execv('/bin/echo', ['echo', 'ESCAPED'])",
        "import os; os.posix_spawn('/bin/echo', ['echo', 'ESCAPED'], {})",
        "import os; os.spawnv(os.P_WAIT, '/bin/echo', ['echo', 'ESCAPED'])",
        "import os; os.popen('echo ESCAPED').read()",
        "import pty",
        "import multiprocessing",
        "import asyncio",
    ],
)
async def test_code_has_no_network_and_no_processes(code: str) -> None:
    d = parse_definition(definition({"type": "code", "code": code}))
    result = await try_definition(ENABLED, d, {"name": "x"})
    assert not result.ok
    assert "is not allowed in a code action" in result.output
    assert "ESCAPED" not in result.output.replace("'ESCAPED'", "")


async def test_code_cannot_run_a_program_through_fork_exec() -> None:
    """_posixsubprocess.fork_exec raises no audit event on 3.11; the module cannot be had at all."""
    code = (
        "import _posixsubprocess, os\n"
        "r, w = os.pipe()\n"
        "_posixsubprocess.fork_exec([b'/bin/echo', b'ESCAPED'], [b'/bin/echo'], True, (w,), None, None,"
        " -1, -1, -1, w, -1, -1, r, w, False, False, -1, None, None, None, -1, None)\n"
    )
    d = parse_definition(definition({"type": "code", "code": code}))
    result = await try_definition(ENABLED, d, {"name": "x"})
    assert not result.ok
    assert "import of _posixsubprocess is not allowed in a code action" in result.output
    assert "ESCAPED\n" not in result.output


async def test_code_cannot_signal_the_runtime_which_stays_alive() -> None:
    parent = os.getpid()
    d = parse_definition(
        definition({"type": "code", "code": "import os, signal; os.kill(os.getppid(), signal.SIGTERM)"})
    )
    result = await try_definition(ENABLED, d, {"name": "x"})
    assert not result.ok
    assert "os.kill is not allowed in a code action" in result.output
    os.kill(parent, 0)  # still here
    ok = await try_definition(
        ENABLED, parse_definition(definition({"type": "code", "code": "print(6 * 7)"})), {"name": "x"}
    )
    assert (ok.ok, ok.output) == (True, "42\n")


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to nobody needs root")
async def test_code_run_by_root_drops_to_an_unprivileged_user() -> None:
    """Where the runtime is root and ``nobody`` can run this Python, the child becomes ``nobody``
    (the kernel then refuses signals to the runtime and enforces RLIMIT_NPROC). Exercised here with
    the bootstrap directly: this machine's Python may live where ``nobody`` cannot read it."""
    import pwd
    import sys

    from parley_runtime.custom.code import BOOTSTRAP
    from parley_runtime.custom.process import run_process

    nobody = pwd.getpwnam("nobody")
    code = "import os; print(os.getuid(), os.getgid(), os.getgroups())"
    document = {"code": code, "params": {}, "limits": {"RLIMIT_NPROC": 0},
                "user": {"uid": nobody.pw_uid, "gid": nobody.pw_gid}}  # fmt: skip
    outcome = await run_process(
        [sys.executable, "-I", "-S", "-c", BOOTSTRAP], stdin=json.dumps(document).encode(), timeout=10
    )
    assert (outcome.returncode, outcome.output) == (0, f"{nobody.pw_uid} {nobody.pw_gid} []\n")


async def test_code_limits_time_memory_and_output() -> None:
    spin = parse_definition(definition({"type": "code", "code": "while True: pass", "timeoutSeconds": 1}))
    result = await try_definition(ENABLED, spin, {"name": "x"})
    assert not result.ok
    assert result.output.startswith("timed out after 1s")
    hungry = parse_definition(definition({"type": "code", "code": "x = bytearray(1024 * 1024 * 1024)"}))
    result = await try_definition(ENABLED, hungry, {"name": "x"})
    assert not result.ok
    assert "MemoryError" in result.output
    loud = parse_definition(definition({"type": "code", "code": "print('y' * 100000)"}))
    result = await try_definition(ENABLED, loud, {"name": "x"})
    assert (result.ok, result.output) == (True, "y" * 4000)


async def test_test_of_an_http_action_with_an_unsendable_value_is_a_failed_result() -> None:
    allowed = Executor(CustomActionSettings(allow_hosts=("127.0.0.1",)))
    async with local_http_server() as server:
        d = parse_definition(definition({"type": "http", "url": f"{server.base}/echo/{{{{name}}}}"}))
        result = await try_definition(allowed, d, {"name": "\udc00\ud800"})
    assert not result.ok
    assert result.output.startswith("the request cannot be sent")
    assert server.requests == []


async def test_outputs_never_show_the_definitions_credentials() -> None:
    """The local server echoes the request, Authorization header included; the output masks it."""
    allowed = Executor(CustomActionSettings(allow_hosts=("127.0.0.1",)))
    async with local_http_server() as server:
        d = parse_definition(
            definition(
                {
                    "type": "http",
                    "url": f"{server.base}/echo",
                    "headers": {"Authorization": f"Bearer {SECRET}"},
                },
                parameters=[],
            )
        )
        result = await try_definition(allowed, d, {})
    assert result.ok, result.output
    assert server.requests[0].headers["authorization"] == f"Bearer {SECRET}"
    assert SECRET not in result.output
    assert json.loads(result.output)["headers"]["authorization"] == "[REDACTED]"


async def test_secret_references_are_read_from_the_agent_and_never_shown() -> None:
    allowed = Executor(CustomActionSettings(allow_hosts=("127.0.0.1",)))
    settings = {"API_KEY": SECRET}
    async with local_http_server() as server:
        d = parse_definition(
            definition(
                {
                    "type": "http",
                    "url": f"{server.base}/echo?k={{{{secret:API_KEY}}}}",
                    "headers": {"X-Api-Key": "{{secret:API_KEY}}"},
                },
                parameters=[],
            )
        )
        assert d.secret_refs() == ["API_KEY"]
        assert SECRET not in json.dumps(d.document())
        result = await try_definition(allowed, d, {"secret:API_KEY": "from-the-model"}, settings.get)
        missing = await try_definition(allowed, d, {}, {}.get)
    assert result.ok, result.output
    assert server.requests[0].headers["x-api-key"] == SECRET
    assert server.requests[0].target == f"/echo?k={SECRET}"
    assert SECRET not in result.output
    assert not missing.ok
    assert "the secret API_KEY is not set" in missing.output
    with pytest.raises(InvalidArgument, match="for http handlers only"):
        parse_definition(definition({"type": "shell", "command": "echo {{secret:API_KEY}}"}, parameters=[]))

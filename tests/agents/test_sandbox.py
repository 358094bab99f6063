"""The tool sandbox and the calculator: each forbidden or runaway program is stopped and reported
(and the next run works), the limits hold, runs do not block the event loop and are bounded in
number; the calculator refuses everything but bounded arithmetic. What the sandbox's isolation
holds against code that defeats its in-process check is test_sandbox_isolation.py's."""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
import re
import socket
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lightning_fasync.agents.sandbox import Sandbox, SandboxLimits
from lightning_fasync.agents.tools import (
    MAX_BITS, MAX_CALLS_PER_TURN, CalculatorError, ToolBox, ToolCall, _parse_one, calculate, format_tool_call,
    has_tool_call, parse_tool_calls,
)

LIMITS = SandboxLimits(cpu_s=1.0, wall_s=3.0, memory_mb=256, file_mb=1, disk_mb=2, max_output=200, max_concurrent=2)


@pytest.fixture(scope="module")
def sandbox():
    box = Sandbox(LIMITS)
    yield box
    box.close()
    box.close()  # idempotent


def assert_next_run_works(box: Sandbox) -> None:
    result = box.run_sync("print(6 * 7)")
    assert (result.outcome, result.text) == ("ok", "42")


def test_a_normal_run_prints_in_a_fresh_directory_as_an_unprivileged_user_with_a_minimal_environment(sandbox):
    result = sandbox.run_sync("import os, json\nprint(os.getcwd(), os.getuid(), os.getgid())\n"
                              "print(json.dumps(sorted(os.environ)))\n"
                              "open('notes.txt', 'w').write('kept inside')\nprint(open('notes.txt').read())")
    assert result.outcome == "ok", result
    who, env, notes = result.output.splitlines()
    assert who == "/tmp 65534 65534"
    assert env == '["HOME", "LANG", "PATH", "PWD", "TMPDIR"]'
    assert notes == "kept inside"
    assert result.network_isolated is True
    second = sandbox.run_sync("import os; print(os.listdir('.'))")
    assert second.output.strip() == "[]"  # a fresh directory per run


def test_the_code_s_wall_clock_starts_once_the_sandbox_is_set_up(monkeypatch):
    """A setup slower than ``wall_s`` (a loaded host) is not charged to the code, which has not run;
    the code's own time still is."""
    import time

    import lightning_fasync.agents.sandbox as sandbox_module

    real = sandbox_module._read_child_pid

    def slow_setup(info_r, deadline):
        time.sleep(1.5)  # longer than the wall_s below, nothing of the code running
        return real(info_r, deadline)

    monkeypatch.setattr(sandbox_module, "_read_child_pid", slow_setup)
    box = Sandbox(dataclasses.replace(LIMITS, wall_s=1.0))
    try:
        result = box.run_sync("print(6 * 7)")
        assert (result.outcome, result.text) == ("ok", "42")
        slept = box.run_sync("import time\ntime.sleep(5)")
        assert slept.outcome != "ok" and "time limit" in slept.text, slept  # wall_s still bounds the code
    finally:
        box.close()


def test_the_codes_own_error_is_its_result(sandbox):
    result = sandbox.run_sync("print('before')\n1 / 0")
    assert result.outcome == "error"
    assert result.text == "before\nerror: ZeroDivisionError: division by zero"
    exited = sandbox.run_sync("import sys; sys.exit(3)")
    assert (exited.outcome, exited.text) == ("error", "error: exit status 3")


@pytest.mark.parametrize(
    "code, message",
    [
        ("while True:\n    pass", "time limit exceeded"),  # CPU: RLIMIT_CPU
        ("import time\ntime.sleep(60)", "time limit exceeded"),  # no CPU: the wall clock kills the group
        ("x = bytearray(2 * 1024 ** 3)", "memory limit exceeded"),
        ("chunks = []\nwhile True:\n    chunks.append(bytearray(64 * 1024 ** 2))", "memory limit exceeded"),
        ("open('big.bin', 'wb').write(b'x' * (2 * 1024 ** 2))", "file size limit exceeded"),
        ("for i in range(5):\n    open(f'{i}.bin', 'wb').write(b'x' * (900 * 1024))", "disk limit exceeded"),
        ("while True:\n    print('spam' * 100)", "output limit exceeded"),
    ],
    ids=["cpu-loop", "sleep", "one-big-allocation", "growing-allocation", "big-file", "many-files", "endless-output"],
)
def test_limits_stop_the_run_and_the_next_run_works(sandbox, code, message):
    result = sandbox.run_sync(code)
    assert (result.outcome, result.message) == ("limit", message), result
    assert result.text.endswith(f"error: {message}")
    assert len(result.output.encode()) <= LIMITS.max_output
    assert sandbox.running == 0  # the run's processes are gone
    assert_next_run_works(sandbox)


OUTSIDE = "writing outside the working directory is not allowed"


@pytest.mark.parametrize("mode", ["bwrap", "process"])
def test_writing_outside_the_working_directory_is_stopped(mode, tmp_path):
    # Under bubblewrap the host's directories are not there (and its /tmp is the run's own): a
    # directory outside the run's /tmp stands for them; test_sandbox_isolation.py writes to the host's.
    outside = tmp_path if mode == "process" else pathlib.Path("/srv/fasync")
    target, link_target = outside / "escaped.txt", outside / "via_link.txt"
    box = Sandbox(dataclasses.replace(LIMITS, mode=mode))
    try:
        for code in (
            f"open({str(target)!r}, 'w').write('x')",
            f"import os\nfd = os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)",
            f"import os\nos.symlink({str(link_target)!r}, 'link')",
            "import os\nos.chdir('..')\nopen('escaped.txt', 'w')",
            f"import shutil\nshutil.rmtree({str(outside)!r})",
        ):
            result = box.run_sync(code)
            assert (result.outcome, result.message) == ("violation", OUTSIDE), code
            assert not target.exists() and not link_target.exists() and tmp_path.exists()
        assert_next_run_works(box)
    finally:
        box.close()


@pytest.mark.parametrize("mode", ["bwrap", "process"])
def test_network_access_is_stopped_and_no_connection_reaches_a_local_listener(mode):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    box = Sandbox(dataclasses.replace(LIMITS, mode=mode))
    try:
        for code in (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'leak')",
            # Catching the error does not help: the run ends at the first socket call.
            f"import socket\ntry:\n    socket.socket().connect(('127.0.0.1', {port}))\n"
            "except Exception:\n    pass\nprint('went on')",
            "import urllib.request\nurllib.request.urlopen('http://127.0.0.1:1/', timeout=2)",
        ):
            result = box.run_sync(code)
            assert (result.outcome, result.text) == ("violation", "error: network access is not allowed"), code
            assert isinstance(result.network_isolated, bool) and (result.network_isolated or mode == "process")
        with pytest.raises(socket.timeout):
            listener.accept()  # nothing ever connected
        assert_next_run_works(box)
    finally:
        box.close()
        listener.close()


@pytest.mark.parametrize(
    "code, message",
    [
        ("import subprocess\nsubprocess.run(['true'])", "starting processes is not allowed"),
        ("import os\nos.system('true')", "starting processes is not allowed"),
        ("import os\nif os.fork() == 0:\n    os._exit(0)", "starting processes is not allowed"),
        ("import os\nos.execv('/bin/true', ['true'])", "starting processes is not allowed"),
        ("import ctypes", "native code (ctypes) is not allowed"),
        ("import os\nos.kill(os.getppid(), 0)", "sending signals is not allowed"),
        ("import gc\ngc.get_objects()", "inspecting the interpreter's objects is not allowed"),
    ],
    ids=["subprocess", "os.system", "fork", "exec", "ctypes", "kill", "gc"],
)
def test_processes_signals_native_code_and_introspection_are_stopped(sandbox, code, message):
    result = sandbox.run_sync(code)
    assert (result.outcome, result.message) == ("violation", message), result
    assert_next_run_works(sandbox)


def test_runs_leave_the_event_loop_free_and_at_most_max_concurrent_run_at_once(sandbox):
    peak = 0
    done = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, sandbox.running)
            done.wait(0.005)

    async def main():
        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            runs = [asyncio.ensure_future(sandbox.run("import time\ntime.sleep(0.6)\nprint('slept')")) for _ in range(5)]
            await asyncio.sleep(0.05)
            assert not any(r.done() for r in runs)  # the loop runs while the sandboxes do
            return await asyncio.gather(*runs)
        finally:
            done.set()
            watcher.join()

    results = asyncio.run(main())
    assert [r.text for r in results] == ["slept"] * 5
    assert 1 <= peak <= LIMITS.max_concurrent


def test_limits_are_validated():
    with pytest.raises(ValueError, match=r"`agentflow.sandbox.wall_s` is 0; it must be > 0"):
        Sandbox(SandboxLimits(wall_s=0))
    with pytest.raises(ValueError, match=r"`agentflow.sandbox.mode` is 'nsjail'; it must be one of bwrap, process"):
        Sandbox(SandboxLimits(mode="nsjail"))


# ----------------------------------------------------------------------------- calculator and calls


@pytest.mark.parametrize(
    "expression, answer",
    [
        ("37*48", "1776"), ("2+3*4", "14"), ("(2+3)*4", "20"), ("-5--3", "-2"), ("+7", "7"), ("7/2", "3.5"),
        ("6/3", "2"), ("7//2", "3"), ("-7%3", "2"), ("2**10", "1024"), ("2**-1", "0.5"), ("1.5*4", "6"),
        ("0.1+0.2", "0.30000000000000004"), (" 12 - 30 ", "-18"), ("2**4095", str(2**4095)),
    ],
)
def test_calculator_evaluates_arithmetic(expression, answer):
    assert calculate(expression) == answer


@pytest.mark.parametrize(
    "expression, error",
    [
        ("1/0", "division by zero"), ("5%0", "division by zero"), ("0**-1", "division by zero"),
        ("9**9**9", f"more than {MAX_BITS} bits"), ("10**10**10", f"more than {MAX_BITS} bits"),
        ("2**4096", f"more than {MAX_BITS} bits"), ("2**4000*2**4000", f"more than {MAX_BITS} bits"),
        ("2.0**5000", "too large"), ("1e308*10", "not finite"), ("(-8)**0.5", "not a real number"),
        ("2^10", "unsupported operator ^ (use ** for powers)"), ("x+1", "unsupported syntax (Name)"),
        ("__import__('os').system('true')", "unsupported syntax (Call)"), ("(1).real", "unsupported syntax (Attribute)"),
        ("'a'*3", "only numbers"), ("True+1", "only numbers"), ("1 if 1 else 2", "unsupported syntax (IfExp)"),
        ("[1, 2]", "unsupported syntax (List)"), ("1+", "not valid arithmetic"), ("1" * 300, "longer than"),
        ("((1)", "not valid arithmetic"), ("(" * 130 + "1" + ")" * 130, "longer than"),
    ],
)
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression, error):
    with pytest.raises(CalculatorError, match=re.escape(error)):
        calculate(expression)


def test_tool_calls_parse_in_qwens_format():
    text = "thinking " + format_tool_call("calculator", {"expression": "1+2"}) + "\n" + \
        '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "1+2"}, None), ("python", {"code": "print(1)"}, None)]
    assert has_tool_call(text) and not has_tool_call("42")
    bad = parse_tool_calls('<tool_call>{"name": 1}</tool_call><tool_call>not json</tool_call>'
                           '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call><tool_call>{"name"')
    assert [c.error for c in bad] == [
        'the tool call needs a "name" string', "the tool call is not valid JSON (Expecting value)",
        'the tool call needs an "arguments" object', "the <tool_call> block is not closed with </tool_call>"]


@given(st.lists(st.sampled_from(["<tool_call>", "</tool_call>", '{"name": "calculator"}', "x", "<tool", "\n"]),
                max_size=30))
def test_tool_calls_parse_as_the_lazy_regex_reads_them(parts):
    text = "".join(parts)
    bodies = re.findall(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL)
    calls = parse_tool_calls(text)
    unclosed = "<tool_call>" in text.rsplit("</tool_call>", 1)[-1]
    want = [_parse_one(b) for b in bodies][:MAX_CALLS_PER_TURN]
    assert calls[: len(want)] == want
    assert len(calls) == len(want) + (unclosed or len(bodies) > MAX_CALLS_PER_TURN)


def test_many_tool_calls_and_unclosed_openers_are_bounded():
    calls = parse_tool_calls(format_tool_call("calculator", {"expression": "1"}) * 40)
    assert len(calls) == MAX_CALLS_PER_TURN + 1 and all(c.error is None for c in calls[:-1])
    assert calls[-1].error == f"more than {MAX_CALLS_PER_TURN} tool calls in one turn; the rest were not run"
    # 20,000 unclosed openers (220 KB): one pass, one error (the lazy regex took seconds on a fifth of it).
    assert [c.error for c in parse_tool_calls("<tool_call>" * 20_000)] == [
        "the <tool_call> block is not closed with </tool_call>"]


def test_the_toolbox_answers_bad_calls_with_errors(sandbox):
    box = ToolBox(["calculator", "python"], sandbox)

    async def answers():
        return [await box.call(c) for c in (
            ToolCall("calculator", {"expression": "6*7"}), ToolCall("calculator", {"expr": "6*7"}),
            ToolCall("shell", {"cmd": "ls"}), ToolCall("", error="the tool call is not valid JSON (x)"),
            ToolCall("python", {"code": "print(6*7)"}), ToolCall("python", {"code": "import socket; socket.socket()"}),
        )]

    results = asyncio.run(answers())
    assert [(r.outcome, r.content) for r in results] == [
        ("ok", "42"),
        ("error", 'error: calculator needs {"expression": "<arithmetic>"}'),
        ("error", "error: unknown tool 'shell'; the tools are calculator, python"),
        ("error", "error: malformed tool call: the tool call is not valid JSON (x)"),
        ("ok", "42"),
        ("violation", "error: network access is not allowed"),
    ]
    with pytest.raises(ValueError, match="`agentflow.tools` lists 'shell'"):
        ToolBox(["shell"])

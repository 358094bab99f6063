"""Parse tool calls with SGLang's own Qwen 2.5/3 detector: ``python tests/helpers/sglang_tool_call_driver.py``.

Reads a JSON list of texts on stdin and prints, for each, the calls SGLang's ``Qwen25Detector``
finds (name and arguments). Run in its own process by ``tests/agents/test_tool_agent_flow.py``: it installs the
Triton stand-ins of ``sglang_driver.py``, which must not leak into the test process.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sglang_driver import install_sglang_triton_stubs  # noqa: E402


def main() -> None:
    install_sglang_triton_stubs()
    from sglang.srt.entrypoints.openai.protocol import Function, Tool
    from sglang.srt.function_call.qwen25_detector import Qwen25Detector

    tools = [Tool(type="function", function=Function(name=name, parameters={"type": "object"}))
             for name in ("calculator", "python")]
    out = []
    for text in json.load(sys.stdin):
        result = Qwen25Detector().detect_and_parse(text, tools)
        out.append([{"name": c.name, "arguments": json.loads(c.parameters)} for c in result.calls])
    print(json.dumps(out))


if __name__ == "__main__":
    main()

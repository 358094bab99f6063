"""FAKE ``python -m sglang.launch_server`` (see the package docstring): not SGLang.

It appends one JSON line to ``$FASYNC_FAKE_SGLANG_RECORD`` (its pid, argv and the
``CUDA_VISIBLE_DEVICES`` it was given), then serves the model through the embedded engine
(``lightning_fasync.engine.server``) on the host and port it was given. SGLang's flags the embedded
engine has no use for (``--tp-size``, ``--mem-fraction-static``, passthrough args, ...) are recorded
and ignored. With ``FASYNC_FAKE_SGLANG_HANG=1`` it never serves: a server that never becomes healthy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> int:
    argv = sys.argv[1:]
    record = os.environ.get("FASYNC_FAKE_SGLANG_RECORD")
    if record:
        line = {"pid": os.getpid(), "argv": argv, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
        with open(record, "a") as f:
            f.write(json.dumps(line) + "\n")
    print(f"FAKE sglang.launch_server (pid {os.getpid()}): {' '.join(argv)}", flush=True)
    if os.environ.get("FASYNC_FAKE_SGLANG_HANG") == "1":
        print("FAKE sglang.launch_server: told to hang, never serving", flush=True)
        while True:
            time.sleep(1)
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--model-path", "--model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--context-length", default=None)
    parser.add_argument("--max-running-requests", default=None)
    parser.add_argument("--weight-version", default=None)
    parser.add_argument("--api-key", default=None)
    args, _ = parser.parse_known_args(argv)
    served = ["--model", args.model_path, "--host", args.host, "--port", str(args.port), "--threads", "1"]
    if args.api_key:
        served += ["--api-key", args.api_key]
    for flag in ("context_length", "max_running_requests", "weight_version"):
        if getattr(args, flag) is not None:
            served += ["--" + flag.replace("_", "-"), getattr(args, flag)]
    from lightning_fasync.engine.server import main as serve

    return serve(served)


if __name__ == "__main__":
    sys.exit(main())

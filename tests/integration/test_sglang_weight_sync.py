"""Weight sync against SGLang's own code (``tests/helpers/sglang_weight_driver.py``, in a child process):
payloads made by SGLang's ``FlattenedTensorBucket`` and ``MultiprocessingSerializer`` load into our
engine, and a group created by SGLang's ``init_custom_process_group`` (as slime's trainer creates
it) feeds our engine's ``/update_weights_from_distributed``; the other way round, our trainer side
(:mod:`lightning_fasync.weights.sync`) forms its group with SGLang's
``init_custom_process_group`` on the engine side and its payloads are read by SGLang's restricted
unpickler and bucket code. What travels is checked tensor by tensor (checksums)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from lightning_fasync.fleet.client import SGLangClient
from lightning_fasync.fleet.launch import launch_server
from lightning_fasync.weights.checksum import checksums, compare
from lightning_fasync.weights.sync import make_weight_sync
from tests.helpers.paths import HELPERS
from tests.helpers.required import SGLANG, require

DRIVER = os.path.join(HELPERS, "sglang_weight_driver.py")

require(*SGLANG, module_level=True)

pytestmark = pytest.mark.slow


def test_sglangs_payloads_and_group_update_our_engine(tmp_path):
    from safetensors.torch import save_file

    from lightning_fasync.policy import build_policy

    model, _ = build_policy("tiny")
    (tmp_path / "model").mkdir()
    save_file({"lm_head.weight": model.lm_head.weight.detach().clone()}, str(tmp_path / "model" / "model.safetensors"))
    engine = launch_server("tiny", max_running_requests=2, context_length=64, timeout=120)
    # Output to files, not pipes: torch's shared-memory manager (which the driver starts) inherits
    # them and lives as long as the engine maps its memory, so a pipe would not end with the driver.
    stdout, stderr = open(tmp_path / "out", "w+"), open(tmp_path / "err", "w+")
    try:
        proc = subprocess.run([sys.executable, DRIVER, "send", engine.url, str(tmp_path / "model")], stdout=stdout,
                              stderr=stderr, timeout=300)
    finally:
        engine.stop()
    stdout.seek(0), stderr.seek(0)
    assert proc.returncode == 0, stderr.read()[-4000:]
    out = json.loads(stdout.read().strip().splitlines()[-1])
    # Every field of SGLang's request classes is read (none refused as unknown); what needs a
    # bracket, a group or a valid rank is refused for that reason, naming it.
    fields = out["fields"]
    assert {"rid", "http_worker_ipc", "names", "dtypes", "shapes", "weight_version", "load_format"} <= set(
        fields["/update_weights_from_distributed"]["fields"])
    for path, seen in fields.items():
        assert "Unknown field" not in str(seen["answer"]), (path, seen)
    assert "begin_weight_update" in str(fields["/update_weights_from_tensor"]["answer"])
    assert "begin_weight_update" in str(fields["/update_weights_from_distributed"]["answer"])
    assert "rank_offset" in str(fields["/init_weights_update_group"]["answer"])
    assert "does not exist" in str(fields["/destroy_weights_update_group"]["answer"])
    assert fields["/update_weights_from_disk"]["answer"][0] == 200
    assert [fields[p]["answer"][0] for p in ("/begin_weight_update", "/end_weight_update")] == [200, 200]
    assert (out["begin"], out["end"], out["begin2"], out["end2"]) == (200, 200, 200, 200)
    for key in ("tensor_bucket", "tensor_pairs", "init", "bucket", "single", "destroy"):
        status, body = out[key]
        assert status == 200 and body["success"] is True, (key, body)
    assert out["tensor_diffs"] == [] and out["distributed_diffs"] == []
    assert out["weight_version"] == "6"


def test_our_trainer_side_against_sglangs_receiving_code(tmp_path):
    from lightning_fasync.policy import build_policy

    proc = subprocess.Popen([sys.executable, DRIVER, "serve"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()[-4000:]
        url = json.loads(line)["url"]
        model, _ = build_policy("tiny")
        pushed = {}

        async def main():
            import torch

            client = SGLangClient([url], admin_timeout_s=120)
            for version, kind in ((3, "distributed"), (4, "tensor")):
                g = torch.Generator().manual_seed(version)
                pushed[kind] = {k: v + torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
                sync = make_weight_sync(kind, client, bucket_bytes=256 * 1024, timeout_s=120)
                try:
                    await sync.push(pushed[kind], version, step=version - 1)
                    got = await client._request("GET", url + "/received")
                finally:
                    await sync.close()
                client = SGLangClient([url], admin_timeout_s=120)
                assert compare(checksums(pushed[kind]), got["checksums"]) == [], kind
                assert set(got["versions"][-1:]) == {str(version)}
            await client.close()

        asyncio.run(asyncio.wait_for(main(), 240))
    finally:
        proc.kill()
        proc.wait()

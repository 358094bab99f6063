"""The embedded engine's LoRA endpoints under stress: concurrent loads merge the adapter once, a
refused weight update leaves the adapter's base intact, links inside an adapter directory are
refused, and the client sends a load or unload once (neither is idempotent)."""

import asyncio
import os
import time

import pytest
import torch

from lightning_fasync.fleet.client import SGLangClient
from lightning_fasync.lora import merged_weights, read_adapter_dir, write_adapter_dir
from lightning_fasync.pipeline.engine_client import EngineError, EngineFault
from lightning_fasync.policy import build_policy
from lightning_fasync.weights.sync import WeightSyncError
from tests.helpers.engine import call, serve
from tests.lora.test_sync import trained


def _adapter():
    """The adapter of a trained module, its base (copies) and the weights base + adapter (the engine's merge)."""
    weights = trained("adapter").engine_state_dict()
    base = {k: v.detach().clone() for k, v in weights.base.items()}
    return weights, base, merged_weights(base, weights.config, dict(weights))


def _assert_served(engine, want, what):
    served = dict(engine.model.named_parameters(remove_duplicate=False))
    for name, tensor in want.items():
        assert torch.equal(served[name], tensor), f"{what}: {name}"


def test_concurrent_loads_merge_the_adapter_once_and_unload_restores_the_base_bit_exactly(monkeypatch):
    from lightning_fasync.engine import lora as engine_lora

    weights, base, expected = _adapter()
    read = engine_lora._read

    def slow_read(engine, path):  # every load reads before any merges, were they not serialised
        time.sleep(0.3)
        return read(engine, path)

    monkeypatch.setattr(engine_lora, "_read", slow_read)

    async def body(session, url, engine):
        _, info = await call(session, "GET", url + "/server_info")
        d = write_adapter_dir(dict(weights), weights.config, os.path.join(info["lora_dir"], "a"))
        for names in (["p", "p", "p"], ["p", "q"]):  # the same name, then two names
            answers = await asyncio.gather(*(call(session, "POST", url + "/load_lora_adapter",
                                                  {"lora_name": n, "lora_path": d}) for n in names))
            assert sorted(s for s, _ in answers) == [200] + [400] * (len(names) - 1), answers
            winner = next(names[i] for i, (s, _) in enumerate(answers) if s == 200)
            for status, answer in answers:
                assert answer["loaded_adapters"] == {winner: d}, answer
                if status == 400:
                    assert answer["error_message"].startswith("Failed to load LoRA adapter"), answer
            _assert_served(engine, expected, "after concurrent loads")
            unloads = await asyncio.gather(*(call(session, "POST", url + "/unload_lora_adapter", {"lora_name": winner})
                                             for _ in range(2)))
            assert sorted(s for s, _ in unloads) == [200, 400], unloads
            _assert_served(engine, base, "after the unload")

    serve(build_policy("tiny"), body, own_model=True)


def test_a_refused_weight_update_leaves_the_adapters_base_and_load_unload_working():
    weights, base, expected = _adapter()
    adapted = next(n for n in weights.base if "q_proj" in n)

    async def body(session, url, engine):
        _, info = await call(session, "GET", url + "/server_info")
        d = write_adapter_dir(dict(weights), weights.config, os.path.join(info["lora_dir"], "a"))
        client = SGLangClient([url])
        try:
            status, answer = await call(session, "POST", url + "/load_lora_adapter", {"lora_name": "p", "lora_path": d})
            assert status == 200, answer
            refused = [
                {adapted: torch.zeros(3, 3)},  # an adapted weight of the wrong shape
                {adapted: base[adapted] * 2, "model.no_such.weight": torch.zeros(1)},  # the right shape, refused as a whole
            ]
            for update in refused:
                with pytest.raises(WeightSyncError, match="update_weights_from_tensor"):
                    await client.update_weights_from_tensor(update, weight_version=2)
                _assert_served(engine, expected, "after a refused update")
            status, answer = await call(session, "POST", url + "/unload_lora_adapter", {"lora_name": "p"})
            assert status == 200 and answer["success"] is True, answer
            _assert_served(engine, base, "unloaded after refused updates")
            status, answer = await call(session, "POST", url + "/load_lora_adapter", {"lora_name": "p", "lora_path": d})
            assert status == 200, answer
            _assert_served(engine, expected, "loaded again")
            status, answer = await call(session, "POST", url + "/unload_lora_adapter", {"lora_name": "p"})
            assert status == 200, answer
            _assert_served(engine, base, "unloaded again")
        finally:
            await client.close()

    serve(build_policy("tiny"), body, own_model=True)


@pytest.mark.parametrize("linked", ["adapter_config.json", "adapter_model.safetensors"])
def test_an_adapter_file_linked_out_of_the_lora_dir_is_refused_naming_it(tmp_path, linked):
    weights, base, _ = _adapter()
    outside = write_adapter_dir(dict(weights), weights.config, str(tmp_path / "outside"))

    async def body(session, url, engine):
        _, info = await call(session, "GET", url + "/server_info")
        d = write_adapter_dir(dict(weights), weights.config, os.path.join(info["lora_dir"], "a"))
        os.remove(os.path.join(d, linked))
        os.symlink(os.path.join(outside, linked), os.path.join(d, linked))
        status, answer = await call(session, "POST", url + "/load_lora_adapter", {"lora_name": "p", "lora_path": d})
        assert status == 400 and answer["success"] is False, answer
        message = answer["error_message"]
        assert message.startswith("Failed to load LoRA adapter p:") and "is a symbolic link" in message, message
        assert repr(os.path.join(d, linked)) in message, message
        assert answer["loaded_adapters"] == {}
        _assert_served(engine, base, "after the refused load")

    serve(build_policy("tiny"), body, own_model=True)


def test_oversized_or_special_adapter_files_are_refused_naming_them(tmp_path, monkeypatch):
    from lightning_fasync import lora

    weights = trained("adapter").engine_state_dict()
    d = write_adapter_dir(dict(weights), weights.config, str(tmp_path / "a"))
    config, tensors = read_adapter_dir(d)
    assert config == weights.config and set(tensors) == set(weights)
    monkeypatch.setattr(lora, "ADAPTER_CONFIG_MAX_BYTES", 16)
    with pytest.raises(ValueError, match=r"adapter_config\.json' is \d+ bytes, more than the 16 bytes"):
        read_adapter_dir(d)
    monkeypatch.undo()
    monkeypatch.setattr(lora, "ADAPTER_WEIGHTS_MAX_BYTES", 16)
    with pytest.raises(ValueError, match=r"adapter_model\.safetensors' is \d+ bytes, more than the 16 bytes"):
        read_adapter_dir(d)
    monkeypatch.undo()
    os.remove(os.path.join(d, "adapter_config.json"))
    os.mkfifo(os.path.join(d, "adapter_config.json"))  # opening it must not wait for a writer
    with pytest.raises(ValueError, match=r"adapter_config\.json' is not a regular file"):
        read_adapter_dir(d)


def _counting_server(handler_delay: float, status: int):
    """An aiohttp app answering every LoRA call with ``status`` after ``handler_delay`` s, and its call count."""
    from aiohttp import web

    calls = []

    async def handle(request):
        calls.append(request.path)
        await asyncio.sleep(handler_delay)
        return web.json_response({"success": status == 200, "error_message": "busy", "loaded_adapters": {}},
                                 status=status)

    app = web.Application()
    app.router.add_post("/load_lora_adapter", handle)
    app.router.add_post("/unload_lora_adapter", handle)
    return app, calls


@pytest.mark.parametrize("case", ["503", "timeout"])
def test_the_client_sends_a_lora_load_or_unload_once(case):
    from aiohttp.test_utils import TestServer

    async def main():
        app, calls = _counting_server(2.0 if case == "timeout" else 0.0, 503)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        client = SGLangClient([str(server.make_url("")).rstrip("/")], retries=3, retry_backoff_s=0.01,
                              admin_timeout_s=0.5)
        try:
            with pytest.raises(EngineFault if case == "timeout" else EngineError) as err:
                await client.load_lora_adapter("p", "/x")
            assert "not sent again" in str(err.value) if case == "timeout" else "answered 503" in str(err.value)
            with pytest.raises(EngineError):
                await client.unload_lora_adapter("p")
            assert calls == ["/load_lora_adapter", "/unload_lora_adapter"]
        finally:
            await client.close()
            await server.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_the_lora_fingerprint_key_is_one_constant():
    from lightning_fasync.export import hf
    from lightning_fasync.lightning import module
    from lightning_fasync.lora import LORA_FINGERPRINT_KEY

    assert hf._LORA_FINGERPRINT is LORA_FINGERPRINT_KEY
    assert module.LORA_FINGERPRINT_KEY == LORA_FINGERPRINT_KEY


def test_the_adapter_sync_reports_a_refused_load_naming_the_engine_and_call():
    from lightning_fasync.weights.lora_sync import AdapterWeightSync

    weights = trained("adapter").engine_state_dict()

    async def body(session, url, engine):
        sync = AdapterWeightSync(SGLangClient([url]), pause_mode=None)
        try:
            with pytest.raises(WeightSyncError) as err:
                await sync.push(weights, 3)
        finally:
            await sync.close()
        assert str(err.value).startswith(f"The weight sync of weight version 3 failed: {url} refused "
                                         "/load_lora_adapter: LoRA is not enabled."), str(err.value)

    serve(build_policy("tiny"), body, app_kwargs={"enable_lora": False}, own_model=True)

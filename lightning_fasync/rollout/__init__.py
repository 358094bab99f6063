"""Rollout engines: the embedded SGLang-compatible engine, its server, the client, and launchers.

Import the submodules you need (``rollout.client``, ``rollout.launch``, ``rollout.pool``,
``rollout.engine``, ``rollout.weight_sync``); this package imports nothing heavy itself. See
``docs/engine.md`` and ``docs/weight_sync.md``.
"""

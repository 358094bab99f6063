"""Rollout engines: the embedded SGLang-compatible engine, its server, the client, and launchers.

Import the submodules you need (``rollout.client``, ``rollout.launch``, ``rollout.pool``,
``rollout.engine``); this package imports nothing heavy itself. See
``docs/engine.md``.
"""

"""The embedded rollout engine: an SGLang-compatible HTTP server over a Hugging Face policy.

``model_runner`` (the forward pass and the paged KV cache), ``engine`` (continuous batching),
``sampling``, ``protocol`` (SGLang's request and response shapes), ``server`` (the HTTP routes
and the process entry point, ``python -m lightning_fasync.engine.server``), ``openai_api`` and
``weight_endpoints`` (route groups), ``http_common`` (what the route modules share). It runs in
its own process; the trainer reaches it only over HTTP (:mod:`lightning_fasync.fleet`). See
``docs/engine.md``. This package imports nothing heavy itself.
"""

"""A FAKE ``sglang`` package for the tests of ``rollout.backend: sglang`` on CPU.

SGLang's GPU runtime cannot run here, so ``tests/helpers/fake_sglang`` is put first on the ``PYTHONPATH``
of the server processes the plugin launches (``FASYNC_FAKE_SGLANG_PATH``, read by
``lightning_fasync.fleet.backends`` only), never of the test or trainer process. Its
``launch_server`` records what it was started with and serves through the embedded engine.
"""

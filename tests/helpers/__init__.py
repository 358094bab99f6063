"""What several tests share: builders and references (imported as ``tests.helpers.<module>``), the
scripts tests run in child processes (``*_driver.py``, ``megatron_fit.py``; they import their
siblings by bare name, their folder being the script's), modules a child process imports by name
(``flaky_rewards``, ``megatron_cpu``, on its ``PYTHONPATH``) and the FAKE ``sglang`` package
(``fake_sglang/``). No test file imports another test file.
"""

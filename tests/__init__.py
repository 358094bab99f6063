"""The test suite, a package: its folders mirror ``lightning_fasync/`` (``tests/engine/`` tests
``lightning_fasync/engine/``, ...), ``tests/integration/`` runs the whole thing end to end, and
``tests/helpers/`` holds what several tests share. Every folder is a package, so test files may
share a basename across folders and import helpers as ``tests.helpers.<module>``.
"""

"""The engine fleet the trainer drives: the HTTP client, launchers, the router, the pool of
replicas and its supervisor, the watchdog, the registered engine backends (``backends``) and the
split of the machine between trainer and engines (``resources``). See ``docs/backends.md``.
Import the submodules you need; this package imports nothing heavy itself.
"""

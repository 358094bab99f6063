"""lightning-fasync: fully-asynchronous RL training of LLM policies for PyTorch Lightning and Fabric.

Docstrings say "the spec" for the contract this package implements, written down in
``docs/contract.md`` (parameter names, capacity and window formulas, the step protocol, metric
names and their aggregation); "§N" cites its section N.

Layout: ``pipeline/`` (the scheduler and the step protocol; no Lightning, HTTP or model imports),
``rollout/`` (the embedded engine, its server and client), ``algorithms/`` (losses and off-policy
corrections), ``data/`` (tasks), ``lightning/`` (the callback, module contract, strategy, Fabric
loop), ``components.py`` (the loader of ``package.module:Name`` config entries), ``config.py``
(the typed config and the one parser), ``simulate.py`` (the live controller on a virtual clock).
"""

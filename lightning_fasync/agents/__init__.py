"""Tool-using agents: the multi-turn :class:`~lightning_fasync.agents.flow.ToolAgentFlow`, its tools
(``calculator``, a sandboxed ``python``) and the sandbox they run in (docs/agents.md).

Nothing is imported here eagerly: ``config.py`` reads :class:`~lightning_fasync.agents.sandbox.SandboxLimits`
without pulling in the flow.
"""

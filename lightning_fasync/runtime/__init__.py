"""What both drivers (the Lightning callback and the Fabric loop) share beyond the pipeline: the
composition root :class:`~lightning_fasync.runtime.rollout_runtime.RolloutRuntime`, the other
ranks' half of the step protocol (``follower``), rank helpers (``ranks``), checkpoint files
(``checkpoints``), colocate offload (``offload``) and SIGTERM handling (``preemption``).
Nothing here imports Lightning.
"""

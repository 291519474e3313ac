"""Training on a Tinker-API service (``Serving(backend="tinker")``): the room of the service client.

- :mod:`agl.tinker.service`: :class:`~agl.tinker.service.TinkerService`, one run's connection (the
  SDK's service client, a LoRA training client per adapter, the sampler serving each version), bounded
  in time, recovering a managed server that died;
- :mod:`agl.tinker.policy`: :class:`~agl.tinker.policy.TinkerPolicy`, the LightningRL update sent to the
  service (one datum per sequence, ``ppo``, ``optim_step``) in place of the local one;
- :mod:`agl.tinker.server`: :class:`~agl.tinker.server.SkyRLServer`, SkyRL's Tinker server that agl
  starts in its own venv (self-hosted, and the tests' real server).

The gateway's side is thin: :mod:`agl.gateway.backends.tinker` samples through the service with
agl's rendering. The ``tinker`` SDK is imported only when a service is used.
"""

"""Training on a Tinker-API service (``Serving(backend="tinker")``): the room of the service client.

- :mod:`agl.tinker.service`: :class:`~agl.tinker.service.TinkerService`, one run's connection (the
  SDK's service client, a LoRA training client per adapter, the sampler serving each version), bounded
  in time, recovering a managed server that died;
- :mod:`agl.tinker.server`: :class:`~agl.tinker.server.SkyRLServer`, SkyRL's Tinker server that agl
  starts in its own venv (self-hosted, and the tests' real server).

The update sent to the service is the algorithms' room's
(:class:`agl.algorithms.tinker_update.TinkerPolicy`, beside the local update); the gateway's side is thin: :mod:`agl.gateway.backends.tinker` samples through the service with
agl's rendering. The ``tinker`` SDK is imported only when a service is used.
"""

"""The running pieces of an APO run: the agent's run environment
(:class:`agl.run.environment.Environment`: store, gateway, runners) and the optimiser's own gateway and
store.

Both models sit behind an agl gateway, so every call is a recorded span: the agent's in the agent's
store (``run_dir/store.db`` by default), the optimiser's in a store of its own
(``run_dir/optimizer.db``). The optimiser's store must differ from the agent's, or the agent's
runners would claim the optimiser's rollouts.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from agl.algorithms.apo.settings import RunSettings
from agl.errors import UsageError
from agl.gateway.serve import ServedGateway
from agl.run.environment import Environment as RunEnvironment
from agl.run.environment import open_store

if TYPE_CHECKING:
    from agl.algorithms.apo.algorithm import APO
    from agl.store.base import Store

__all__ = ["Environment", "open_store"]

#: the agent's and the optimiser's gateways may load a model in their lifespan
STARTUP_TIMEOUT_S = 900.0


class Environment:
    """Starts the agent's run environment and the optimiser's gateway; :meth:`close` stops them all.

    ``store``/``agent_url``/``model_name``: where the agent's rollouts go and which model they call;
    ``opt_store``/``opt_url``/``opt_model``: the same for the optimiser.
    """

    def __init__(self, apo: APO, settings: RunSettings, agent: Any) -> None:
        self.apo = apo
        self.settings = settings
        self.run = RunEnvironment(settings.serving)
        self._stack = contextlib.ExitStack()
        try:
            self._start(agent)
        except BaseException:
            self.close()
            raise

    def _start(self, agent: Any) -> None:
        s = self.settings.serving
        if s.backend == "openai" and s.gateway_url is None and (not s.base_url or not s.model_name):
            raise UsageError(
                "the openai backend needs base_url (an OpenAI-compatible endpoint) and the model's "
                "name (Trainer model_name=, agl apo --model)"
            )
        self.run.start(agent, worker_id="agl-apo")
        self.store: Store = self.run.store  # type: ignore[assignment]
        self.agent_url: str = self.run.url or ""
        self.model_name: str = self.run.model_name or "model"
        self.api_key = s.gateway_api_key
        self._start_optimizer()

    def _start_optimizer(self) -> None:
        """The optimiser: its own backend, or any OpenAI-compatible URL, or (by default) the agent's
        own model through the agent's gateway — always behind a gateway that records its calls."""
        apo = self.apo
        self.opt_store = open_store(apo.optimizer_store, self.settings.run_dir / "optimizer.db")
        if self.opt_store is self.store:
            raise UsageError(
                "optimizer_store must not be the agent's store: runners would claim the optimiser's rollouts"
            )
        if apo.optimizer_backend is not None:
            opt_backend = apo.optimizer_backend
        else:
            from agl.gateway.backends import from_spec

            own_url = apo.optimizer_base_url is not None
            opt_backend = from_spec(
                "openai",
                url=apo.optimizer_base_url or self.agent_url,
                # through the agent's gateway: its key, if it has one
                api_key=apo.optimizer_api_key or (None if own_url else (self.api_key or "agl")),
                models=[apo.optimizer_model] if apo.optimizer_model else [],
                timeout_s=apo.optimizer_timeout_s,
            )
        served = ServedGateway.for_backend(opt_backend, self.opt_store, startup_timeout_s=STARTUP_TIMEOUT_S)
        self._stack.callback(served.close)
        self.opt_url = served.url
        opt_models = opt_backend.models() if hasattr(opt_backend, "models") else []
        self.opt_model = apo.optimizer_model or (opt_models[0] if opt_models else self.model_name)

    def close(self) -> None:
        self.run.close()
        self._stack.close()

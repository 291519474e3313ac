"""The run environment every algorithm shares (DESIGN §9): what serves the policy and where rollouts go.

- :mod:`agl.run.settings`: ``Serving``, the serving and deployment settings of a run (backend, model,
  store, runners, run directory, gateway);
- :mod:`agl.run.environment`: ``Environment(serving)`` opens the store, serves the backend behind an
  in-process gateway (or uses one started elsewhere), runs in-process runners, pushes new weights;
- :mod:`agl.run.metrics`: ``MetricsLog``, a run's ``metrics.jsonl`` and TensorBoard scalars.

LightningRL's loop (``agl.Trainer``), APO and SFT all run on these; nothing here imports ``agl.trainer.trainer``.
"""

"""The run environment every algorithm shares (DESIGN §9): what serves the policy and where rollouts go.

- :mod:`agl.run.settings`: ``Serving``, the serving and deployment settings of a run (backend, model,
  store, runners, run directory, gateway);
- :mod:`agl.run.environment`: ``Environment(serving)`` opens the store, serves the backend behind an
  in-process gateway (or uses one started elsewhere), runs in-process runners, pushes new weights;
- :mod:`agl.run.served`: proving which weights served each call (``prove_calls``);
- :mod:`agl.run.metrics`: ``MetricsLog``, a run's ``metrics.jsonl`` and TensorBoard scalars;
- :mod:`agl.run.plot`: reward curves drawn from ``metrics.jsonl`` (``agl plot``).

LightningRL's loop (:mod:`agl.trainer`), APO and SFT all run on these; nothing here imports
:mod:`agl.trainer`, whose own modules (the schedules, the pipeline, sampling, the checks) live there.
"""

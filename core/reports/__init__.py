"""Reports read off a store or a run directory (any process; the CLI and the dashboard use them).

- :mod:`~agl.reports.export`: transitions and merged sequences as JSONL/Parquet (``agl transitions``);
- :mod:`~agl.reports.inspect`: one rollout's tree, calls and rewards (``agl inspect``);
- :mod:`~agl.reports.exactness`: whether every call's ids are exact (``agl exactness``);
- :mod:`~agl.reports.doctor`: what is installed and instrumented (``agl doctor``).

Reward curves (``agl plot``) are :mod:`agl.run.plot`, beside the metrics they draw: the Trainer and APO
write them, and both sit below this package.
"""

"""What the benchmark scripts and tools share: ``base`` (grid, dtypes, tolerances, providers' names),
``traffic`` (bytes per op), ``timing`` (profiler and CUDA-event timers), ``providers`` (ours and the peers),
``records`` (JSON), ``report`` (tables, plots), ``cli_args`` (the scripts' common flags) and ``session``
(one run)."""

"""CPU tests of the benchmarks and tools (``pytest bench``)."""

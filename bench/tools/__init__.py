"""Maintainer tools, each run as ``python -m bench.tools.NAME`` from the repository root (``--help`` lists its
flags): ``tune_table`` (write a tuning table), ``tune_cutile`` (sweep the heuristics), ``kernel_resources``
(registers, spills and shared memory, no GPU), ``sanitize`` (compute-sanitizer driver), ``host_profile``
(where a call's host time goes), ``ncu_compare`` (one checked call per provider for Nsight Compute),
``make_results`` (writes RESULTS.md) and ``dtensor_train`` (FSDP2 and tensor parallel, under torchrun)."""

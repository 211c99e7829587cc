"""Benchmarks of tilegym_rms beside its peers. Run them from the repository root, as modules:

    python -m bench.bench_rmsnorm            # forward, backward, full, fused add, QK-norm, latency, held-out
    python -m bench.bench_rmsnorm_backward   # the backward alone, called directly and through autograd
    python -m bench.bench_model              # a training step of small Llama and Qwen3 models (transformers)
    python -m bench.heldout_report           # the held-out measure's results against their targets

``--help`` lists each one's flags; ``tilegym-rms bench`` and ``tilegym-rms bench-backward`` run the first two.
``python -m`` puts the current directory first on the path, so the scripts measure this checkout's
tilegym_rms. ``common/`` is the library they share, ``tools/`` the maintainers' tools (tuning, the
compute-sanitizer driver, compiler resources, profiling, the results page, the sharded-training check) and
``tests/`` their CPU tests (``pytest bench``).
"""

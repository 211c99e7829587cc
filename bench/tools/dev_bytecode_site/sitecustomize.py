"""Loaded at interpreter start in the processes ``bench.tools.dev_bytecode`` runs (its folder is first on their
``PYTHONPATH``): with ``TILEGYM_RMS_DEV_BYTECODE=1``, cuTile may write its development-only bytecode versions and
takes the tileiras on ``PATH``. Nothing happens without the variable or without cuTile."""

import os

if os.environ.get("TILEGYM_RMS_DEV_BYTECODE") == "1":
    try:
        import cuda.tile._compile as _compile
    except ImportError:
        pass
    else:
        _compile.dev_features_enabled = lambda: True  # the bytecode version probe then tries 13.5 too
        _compile._find_pip_tileiras = lambda: None  # the release on PATH, not a pip package of another one

"""Run a Python command with cuTile's development-only bytecode versions allowed: an experiment tool, never the
product's path.

cuTile 1.7.0 writes at most bytecode 13.4 unless its development features are on, and hints that need 13.5
(``num_worker_warps`` other than 4 and 8) are refused until then, whatever tileiras is installed. This tool runs
its arguments as ``python ARGS`` with ``bench/tools/dev_bytecode_site`` first on ``PYTHONPATH``, whose
``sitecustomize`` turns those features on in that process and in every process it starts (compile workers
included), and takes the tileiras on ``PATH`` rather than a pip-installed one: put tileiras 13.5 there first (the
13.5 bundle's ``env.sh`` does, ``../shared/gpu/README.md``). PERFORMANCE.md ("What tileiras 13.5 changes") records
what such builds hold and how they time::

    python -m bench.tools.dev_bytecode -m bench.tools.kernel_resources --shapes 4096x8192 \\
        --entry "gather 1x8192 b0 o4 w0,gather 1x8192 b0 o4 w16"
    python -m bench.tools.dev_bytecode -m bench.tools.tune_cutile --op forward --shapes 4096x8192 \\
        --entry "gather 1x8192 b0 o4 w0,gather 1x8192 b0 o4 w16" --check
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ENV = "TILEGYM_RMS_DEV_BYTECODE"
SITE = Path(__file__).resolve().parent / "dev_bytecode_site"


def environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with the switch set and the site folder first on ``PYTHONPATH``."""
    out = dict(os.environ if env is None else env)
    out[ENV] = "1"
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE), out.get("PYTHONPATH", "")) if p)
    return out


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args else 2
    os.execve(sys.executable, [sys.executable, *args], environment())
    return 0  # not reached: the command replaces this process


if __name__ == "__main__":
    sys.exit(main())

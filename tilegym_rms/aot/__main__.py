"""``python -m tilegym_rms.aot``: the compile check (see the package's docstring)."""

import sys

from . import main

sys.exit(main())

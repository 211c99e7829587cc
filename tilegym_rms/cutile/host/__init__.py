"""Host side of the cuTile kernels, one module per kernel family: :mod:`.forward` (the norm and the fused add),
:mod:`.backward` (with the dw reduction) and :mod:`.qk`; :mod:`.common` holds what they share.
:mod:`tilegym_rms.cutile` exposes them as the backend contract of :mod:`tilegym_rms.dispatch`."""

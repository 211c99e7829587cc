"""Host side of the Triton kernels: :mod:`.forward` (the norm and the fused add) and :mod:`.backward` (with the
dw reduction); :mod:`.common` holds what they share. :mod:`tilegym_rms.triton` exposes them as the backend
contract of :mod:`tilegym_rms.dispatch`."""

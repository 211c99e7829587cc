"""Probe: does loading the next row tile before reducing this one, or loading without TMA, speed up the
persistent kernels? (PERFORMANCE.md, "Toolchain".)

The product's persistent loops issue a row tile's loads only when they reach it, and its loads may use
TMA. This probe runs the same loops (plain forward, llama cast, weight; backward with weight, no tail) with
two switches: ``PREFETCH`` holds the next tile's raw loads while the current tile is reduced and stored, and
``TMA=False`` loads x (and dy) without TMA. Each shape takes the tiles, grid and hints that the device's
tuning table launches, so the first variant is the product's kernel; the others also run with eight warps at
one block per SM. Every variant's output is checked against the product's before it is timed.

On cuda-tile 1.7 / tileiras 13.4 (H100) a prefetching loop whose loads use TMA computes wrong results: the
probe prints WRONG there. The backward's prefetch of rstd keeps TMA, so its TMA-free variant is wrong too.

    python bench/pipeline_probe.py --shapes 8192x2304,32768x3072 --dtype bf16
"""

from __future__ import annotations

import argparse
import sys

import torch

try:
    from . import base, timing, traffic, tune_cutile
except ImportError:
    import base
    import timing
    import traffic
    import tune_cutile

base.ensure_repo_on_path()

import cuda.tile as ct  # noqa: E402

from tilegym_rms.cutile import kernels as K  # noqa: E402

_F32 = ct.float32


def _raw(a, index, shape, TMA):
    return ct.load(a, index, shape, padding_mode=K._ZERO, latency=10, allow_tma=TMA)


def _fwd_tile(cur, w_t, y, rstd, t, n, eps, TILE_M):
    xf = ct.astype(cur, _F32)
    r = K._rstd_from_sum_sq(K._sum_sq(xf), n, eps, K.CAST_LLAMA, y.dtype)
    ct.store(y, (t, 0), K._normalize(xf, r, w_t, K.CAST_LLAMA, y.dtype), allow_tma=False, latency=3)
    ct.store(rstd, (t,), ct.reshape(r, (TILE_M,)), allow_tma=False)


@ct.kernel
def fwd_probe(
    x,
    w,
    y,
    rstd,
    eps,
    TILE_M: ct.Constant[int],
    TILE_N: ct.Constant[int],
    PREFETCH: ct.Constant[bool],
    TMA: ct.Constant[bool],
):
    n = x.shape[1]
    w_t = K._effective_weight(w, 0, 0.0, TILE_N, True, K.CAST_LLAMA, x.dtype)
    tiles = ct.cdiv(x.shape[0], TILE_M)
    nb = ct.num_blocks(0)
    shape = (TILE_M, TILE_N)
    if PREFETCH:
        nxt = _raw(x, (ct.bid(0), 0), shape, TMA)
        for t in range(ct.bid(0), tiles, nb):
            cur = nxt
            nxt = _raw(x, (ct.minimum(t + nb, tiles - 1), 0), shape, TMA)  # a tile past the end is undefined
            _fwd_tile(cur, w_t, y, rstd, t, n, eps, TILE_M)
    else:
        for t in range(ct.bid(0), tiles, nb):
            _fwd_tile(_raw(x, (t, 0), shape, TMA), w_t, y, rstd, t, n, eps, TILE_M)


def _bwd_tile(xr, dyr, r, w_t, dx, t, n, acc, DW_PER_ROW):
    xhat = ct.astype(xr, _F32) * r
    dyf = ct.astype(dyr, _F32)
    g = dyf * w_t
    c = K._row_dot(xhat, g) / n
    # No residual gradient to add: dx stands in for dres, which HAS_DRES=False never reads.
    dx_tile = K._dx(g, xhat, c, r, dx, (t, 0), xhat.shape, False, dx.dtype)
    ct.store(dx, (t, 0), dx_tile, allow_tma=False, latency=3)
    return K._dw_add(acc, dyf, xhat, DW_PER_ROW)


@ct.kernel
def bwd_probe(
    dy,
    x,
    w,
    rstd,
    dx,
    dw_partial,
    TILE_M: ct.Constant[int],
    TILE_N: ct.Constant[int],
    DW_PER_ROW: ct.Constant[bool],
    PREFETCH: ct.Constant[bool],
    TMA: ct.Constant[bool],
):
    n = x.shape[1]
    w_t = K._effective_weight(w, 0, 0.0, TILE_N, True, K.CAST_GEMMA, x.dtype)
    acc = K._dw_zeros(TILE_M, TILE_N, DW_PER_ROW)
    tiles = ct.cdiv(x.shape[0], TILE_M)
    nb = ct.num_blocks(0)
    shape = (TILE_M, TILE_N)
    if PREFETCH:
        b = ct.bid(0)
        nx, ndy, nr = _raw(x, (b, 0), shape, TMA), _raw(dy, (b, 0), shape, TMA), K._load_row_values(rstd, b, TILE_M)
        for t in range(ct.bid(0), tiles, nb):
            cx, cdy, cr = nx, ndy, nr
            following = ct.minimum(t + nb, tiles - 1)
            nx, ndy = _raw(x, (following, 0), shape, TMA), _raw(dy, (following, 0), shape, TMA)
            nr = K._load_row_values(rstd, following, TILE_M)
            acc = _bwd_tile(cx, cdy, cr, w_t, dx, t, n, acc, DW_PER_ROW)
    else:
        for t in range(ct.bid(0), tiles, nb):
            r = K._load_row_values(rstd, t, TILE_M)
            acc = _bwd_tile(
                _raw(x, (t, 0), shape, TMA), _raw(dy, (t, 0), shape, TMA), r, w_t, dx, t, n, acc, DW_PER_ROW
            )
    ct.store(dw_partial, (ct.bid(0), 0), K._dw_total(acc, DW_PER_ROW), allow_tma=False)


# (PREFETCH, TMA, eight warps at one block per SM instead of the table's hints and grid): a prefetching loop
# holds two row tiles, which at the table's two blocks per SM spills (cuobjdump -res-usage).
VARIANTS = (
    (False, True, False),
    (False, False, False),
    (True, True, False),
    (True, False, False),
    (False, True, True),
    (True, True, True),
    (True, False, True),
)
EIGHT_WARPS = (("num_worker_warps", 8), ("occupancy", 1))


def _label(prefetch, tma, eight):
    return (
        f"{'prefetch' if prefetch else 'plain':<8} {'tma' if tma else 'no-tma':<6} {'8 warps' if eight else 'table':<7}"
    )


def _launch_shape(cfg, eight, sms):
    """Hints and grid of one variant: the table's, or eight warps at one block per SM."""
    return (EIGHT_WARPS, min(sms, cfg.grid)) if eight else (cfg.hints, cfg.grid)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", required=True, type=tune_cutile.parse_shapes, help="MxN,MxN,...")
    parser.add_argument("--dtype", default="bf16", choices=sorted(base.DTYPES))
    parser.add_argument("--ops", default="forward,backward")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    device = timing.cuda_device(parser.prog)
    if device is None:
        return 2
    import tilegym_rms.cutile as cutile
    from tilegym_rms.cutile import config, launch, tuning

    dtype = base.DTYPES[args.dtype]
    sms = launch.num_sms(device.index)
    table = tuning.table_for(device.index)
    timer = timing.Timer(device, "profiler")
    print(timer.calibrate())
    copy_bw = traffic.summarize(timing.copy_bandwidth(timer, device, base.COPY_BYTES, 5)[0])[0]
    key = tuning.device_key(device.index)
    print(f"{torch.cuda.get_device_name(device)}; copy {copy_bw:.0f} GB/s; {args.dtype}; table {key}")
    stream = launch._current_stream(device.index)
    for m, n in args.shapes:
        for op in args.ops.split(","):
            nbytes = traffic.op_bytes(op, m, n, dtype.itemsize)
            count, _ = traffic.rotation_sets(nbytes, timing.l2_bytes(device))
            w = torch.randn(n, dtype=dtype, device=device)
            sets = [torch.randn(m, n, dtype=dtype, device=device) for _ in range(count)]
            if op == "forward":
                cfg = config.forward_config(m, n, dtype, sms, table=table)
                if cfg.kernel != "persistent" or cfg.tail_n:
                    print(f"  {m} x {n} forward: the table launches {cfg}; the probe covers persistent, no tail")
                    continue
                y, rstd = torch.empty_like(sets[0]), torch.empty(m, device=device)
                ref = cutile.forward(sets[0], w, 1e-6, 0.0, "llama")[0]

                def call(s, pf, tma, eight, cfg=cfg, y=y, rstd=rstd, w=w):
                    hints, grid = _launch_shape(cfg, eight, sms)
                    kern = launch.with_hints(fwd_probe, hints)
                    ct.launch(stream, (grid,), kern, (s, w, y, rstd, 1e-6, cfg.tile_m, cfg.tile_n, pf, tma))
                    return y

            else:
                cfg = config.backward_config(m, n, dtype, sms, table=table)
                if cfg.plan != "persistent" or cfg.tail_n:
                    print(f"  {m} x {n} backward: the table launches {cfg}; the probe covers persistent, no tail")
                    continue
                dys = [torch.randn_like(s) for s in sets]
                rstd = torch.rand(m, device=device) + 0.5
                dx, part = torch.empty_like(sets[0]), torch.empty(cfg.grid, n, device=device)  # eight warps: fewer rows
                ref = cutile.backward(sets[0], dys[0], w, rstd, 0.0, "llama")[0]
                index = {id(s): i for i, s in enumerate(sets)}

                def call(s, pf, tma, eight, cfg=cfg, dx=dx, part=part, w=w, dys=dys, rstd=rstd, index=index):
                    hints, grid = _launch_shape(cfg, eight, sms)
                    kern = launch.with_hints(bwd_probe, hints)
                    args_ = (dys[index[id(s)]], s, w, rstd, dx, part, cfg.tile_m, cfg.tile_n, cfg.dw_per_row, pf, tma)
                    ct.launch(stream, (grid,), kern, args_)
                    return dx

            print(f"  {m} x {n} {op}: {cfg}")
            for pf, tma, eight in VARIANTS:
                try:
                    out = call(sets[0], pf, tma, eight)
                    torch.cuda.synchronize()
                    err = (out.float() - ref.float()).abs().max().item()
                    if err > 0.05:
                        print(f"    {_label(pf, tma, eight)} WRONG: max |diff| against the product {err:.3g}")
                        continue

                    def run_pass(pf=pf, tma=tma, eight=eight, sets=sets):
                        for s in sets:
                            call(s, pf, tma, eight)

                    us = traffic.summarize(timer.time_reps(run_pass, args.reps, len(sets)).us)[0]
                    gb = traffic.gbps(nbytes, us)
                    print(
                        f"    {_label(pf, tma, eight)} {us:9.1f} us {gb:6.0f} GB/s ({100 * gb / copy_bw:.1f}% of copy)"
                    )
                except Exception as exc:  # noqa: BLE001 - a variant that does not compile is a result too
                    print(f"    {_label(pf, tma, eight)} failed: {base.short_error(exc, 300)}")
                sys.stdout.flush()
            del sets
    return 0


if __name__ == "__main__":
    sys.exit(main())

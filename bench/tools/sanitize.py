"""Every cuTile kernel variant class on odd shapes, checked against float64: a driver for compute-sanitizer.

    python -m bench.tools.sanitize --list                  # the cases: no GPU needed
    python -m bench.tools.sanitize                         # plain run: compiles every variant, fills the disk cache
    compute-sanitizer --tool memcheck --error-exitcode 1 python -m bench.tools.sanitize
    compute-sanitizer --tool racecheck --error-exitcode 1 python -m bench.tools.sanitize --kernels racecheck --quick

Each case launches one kernel class through the product's host code (``tilegym_rms.cutile.forward`` /
``backward``, or the host's dw reduction launch), checks the outputs against the float64 reference
(``tilegym_rms.reference``) and prints one line; the run ends with ``N passed, N failed`` and exits 1 on any
failure (2 without a usable GPU). A case whose configuration no longer matches its class (after a change to
``tilegym_rms/cutile/config/``) fails its case instead of silently testing another kernel.

Classes (``--kernels`` takes class names, kernel names, ``forward``, ``backward``, ``racecheck`` or ``all``):

* ``fwd_gather``: ``rms_norm_fwd_gather``, one row per block in a single tile (``kernel="gather"``).
* ``fwd_gather_chunked``: the same kernel over column chunks, as the product runs rows wider than the widest
  single tile; forced on narrower rows by lowering ``config.HEURISTICS.fwd_max_single_tile_n``.
* ``fwd_gather_norstd``: the gather kernel without the rstd store (``store_rstd=False``, inference).
* ``fwd_persistent`` / ``fwd_persistent_tail``: ``rms_norm_fwd_persistent`` (``kernel="persistent"``) with one
  padded tile, or a tile plus a narrower tail tile.
* ``fwd_tiles`` / ``fwd_tiles_tail``: the same kernel one tile per block without the walk (``kernel="tiles"``).
* ``bwd_direct``: ``rms_norm_bwd_direct`` (dx blocks, then dw strip blocks, one launch).
* ``bwd_persistent``: ``rms_norm_bwd_persistent`` (with or without a tail tile), then ``rms_norm_dw_reduce``.
* ``bwd_chunked``: ``rms_norm_bwd_row_dot`` + ``rms_norm_bwd_column_chunk``, then ``rms_norm_dw_reduce``.
* ``dw_reduce``: ``rms_norm_dw_reduce`` alone, on fp32 partial buffers of odd row counts (M is their rows).

The backward has no public switch between its strategies, so the script forces one the way
``bench/tools/tune_cutile.py`` sweeps: it overrides the heuristics' thresholds that route between strategies
(``config.override``, the tuning table off) and clears the host caches (``tilegym_rms.cutile.clear_caches``)
around the case; the configuration itself still comes from the product's host
(``tilegym_rms.cutile.host.backward``). No product file is patched. Compile-time constants depend on N, the
dtype and the weight, never on M, and a forced strategy keeps the product's tiles, so forcing a class onto a
shape the product would route elsewhere compiles nothing new. Each line says how its class was reached:
``picked`` (what the product launches for that call), ``kernel=`` (the forward's ``kernel`` argument) or
``forced``.

Shapes: M in {1, 7, 4097}; N in {1, 3, 1000, 5120, 10001, 12288, 20000, 65537}, each class on the widths it
applies to. 10001 is there because the other tail-tile widths fill their tail tile exactly: with it, the
padded columns of a tail tile are exercised too. Cases above ``--max-elements`` are skipped; the default
cap leaves out only 4097 x 65537, so the widest rows run at M = 1 and 7: at M = 4097 they would be slow under
memcheck and add no code path (each row walks the same chunk loop at every M). bf16 runs every shape of a
class with a weight; its narrowest and widest N also run without one (the dummy weight tensor then has one
element, so memcheck would catch any read of it); fp32 runs the widest N of each class, with a weight. Only
the llama casting mode runs: the casting modes change arithmetic, not memory access (tests/ cover them).
``--quick``: M in {7, 4097}, the narrowest and widest N of each class, fp32 at M = 7 only, and a lower cap
that keeps the widest rows at M = 7.

Tolerance (``TOLERANCE``, by dtype): ``max |out - ref| / (|ref| + rms(scale))`` element by element, with
``scale`` the reference itself (y, rstd, dw) or ``rstd * w * dy`` for dx (dx is a difference of terms of that
size). An element a kernel forgot to write is then caught, which a norm-wise error would average away; a
correct bf16 output, rounded at most twice, stays below the bound.

Why the run looks as it does under the sanitizer:

* ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` is set before torch loads: with the caching allocator, tensors are
  slices of larger segments and an out-of-bounds access lands in valid memory, invisible to memcheck.
  Every tensor is then its own allocation of exactly its size.
* eps is large (a run-time scalar, so it compiles nothing): with the usual tiny eps, the N = 1 gradient
  cancels to almost nothing against its terms, and a dx element never written would pass unnoticed.
* Compiles: cuTile compiles each variant (``--list`` counts them) once per shape specialization (M = 1 apart
  from larger M, and the power-of-two factors of N), so a cold run compiles more often than ``--list`` says;
  the compiles are most of a plain run's time. cuTile keeps the cubins in its disk cache
  (``~/.cache/cutile-python``, or ``CUDA_TILE_CACHE_DIR``), so a plain run first leaves the sanitizer runs
  nothing to compile.
* initcheck (not part of the recipe): clean on the forward classes; on the backward ones it reports reads
  of dw and row_dot that the float64 check shows were written. Those are the outputs the kernels store
  without ``allow_tma=False``, which suggests initcheck does not see TMA stores.

Racecheck: it watches shared memory, which a cuTile kernel uses wherever values cross warps. A tile is spread
over all the threads of a block, so a reduction along an axis (``ct.sum``), or broadcasting its ``(rows, 1)``
result back over the tile, exchanges partial values between warps through shared memory, with barriers
between the writes and the reads; a missing or misplaced barrier is a hazard racecheck reports. Every class
reduces inside a block (``--list`` says what each one sums), so every class shares tiles across warps and
``--kernels racecheck`` selects them all. The hazards most worth looking for sit in loops that reuse the same
shared buffer: the grid-stride loop of the persistent kernels (a block takes more than one row tile only when
there are more row tiles than blocks, hence M = 4097 in ``--quick``), the chunk loops of the chunked kernels,
the strip loop of the direct backward and the partial-row loop of the reduction. Races between blocks in
global memory are outside racecheck; the float64 comparison of every output element covers those.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
import zlib
from collections.abc import Callable

# Before torch loads, because its allocator reads the switch only once (see the module docstring); the
# experimental-kernel warnings would only interleave with the case lines.
os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
os.environ.setdefault("TILEGYM_RMS_SILENCE_EXPERIMENTAL", "1")

import torch  # noqa: E402

import tilegym_rms.cutile as cutile  # noqa: E402
from tilegym_rms import reference  # noqa: E402
from tilegym_rms.cutile import config, host, tuning  # noqa: E402
from tilegym_rms.experimental import kernel_name  # noqa: E402

M_VALUES = (1, 7, 4097)
N_VALUES = (1, 3, 1000, 5120, 10001, 12288, 20000, 65537)
QUICK_M_VALUES = (7, 4097)
MAX_ELEMENTS = 1 << 27
QUICK_MAX_ELEMENTS = 1 << 26
ASSUMED_SMS = 132  # --list without a GPU: an H100 SXM
EPS = 0.1
OFFSET = 0.0
CASTING = "llama"
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-4}
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# Large enough that every M qualifies for the direct backward.
UNLIMITED = 1 << 62

GATHER = "rms_norm_fwd_gather"
PERSISTENT = "rms_norm_fwd_persistent"
BWD_DIRECT = "rms_norm_bwd_direct"
BWD_PERSISTENT = "rms_norm_bwd_persistent"
ROW_DOT = "rms_norm_bwd_row_dot"
COLUMN_CHUNK = "rms_norm_bwd_column_chunk"
REDUCE = "rms_norm_dw_reduce"


@dataclasses.dataclass(frozen=True)
class KernelClass:
    name: str
    op: str  # "forward", "backward" or "reduce"
    kernels: tuple[str, ...]  # every kernel the class can launch
    accepts: Callable  # config -> whether the configuration is this class
    sums: str  # what it reduces inside a block (why racecheck covers it)
    kernel: str | None = None  # the forward's kernel argument
    store_rstd: bool = True
    patch: tuple[tuple[str, int], ...] = ()  # heuristics parameters overridden to force the class
    ns: tuple[int, ...] | None = None  # widths it runs on (None: every N it applies to)


CLASSES = (
    KernelClass(
        "fwd_gather",
        "forward",
        (GATHER,),
        lambda c: c.kernel == "gather" and c.single_tile,
        "the row's sum of squares across the warps holding its one tile",
        kernel="gather",
    ),
    KernelClass(
        "fwd_gather_chunked",
        "forward",
        (GATHER,),
        lambda c: c.kernel == "gather" and not c.single_tile,
        "the sum of squares accumulated over column chunks, then across warps",
        kernel="gather",
        patch=(("fwd_max_single_tile_n", 0),),
        # One chunk almost all padding, a partial last chunk, a last chunk of one column.
        ns=(3, 20000, 65537),
    ),
    KernelClass(
        "fwd_gather_norstd",
        "forward",
        (GATHER,),
        lambda c: c.kernel == "gather",
        "as fwd_gather; only the rstd store is left out",
        kernel="gather",
        store_rstd=False,
        # It differs from the gather classes by one store: a tiny row, a padded row, a chunked row.
        ns=(3, 5120, 65537),
    ),
    *(
        KernelClass(
            f"fwd_{kernel}{'_tail' if tail else ''}",
            "forward",
            (PERSISTENT,),
            lambda c, kernel=kernel, tail=tail: c.kernel == kernel and (c.tail_n > 0) == tail,
            f"per-row sums of squares {'over the tile and the tail tile' if tail else 'of a multi-row tile'}, {how}",
            kernel=kernel,
        )
        for kernel, how in (("persistent", "once per grid-stride step"), ("tiles", "one tile per block (no walk)"))
        for tail in (False, True)
    ),
    KernelClass(
        "bwd_direct",
        "backward",
        (BWD_DIRECT,),
        lambda c: c.strategy == "direct",
        "row dots of x^ and g (dx blocks); dw columns over the rows of a strip (strip blocks)",
        patch=(("bwd_direct_max_rows_per_sm", UNLIMITED),),
    ),
    KernelClass(
        "bwd_persistent",
        "backward",
        (BWD_PERSISTENT, REDUCE),
        lambda c: c.strategy == "persistent",
        "row dots (over the rows' columns) each grid-stride step; dw over the tile's rows each step, or once per"
        " block at the end (dw per row)",
        patch=(("bwd_direct_max_tile_n", 0),),
    ),
    KernelClass(
        "bwd_chunked",
        "backward",
        (ROW_DOT, COLUMN_CHUNK, REDUCE),
        lambda c: c.strategy == "chunked",
        "row dots over column chunks (row_dot); dw over the tile's rows each step (column_chunk)",
        patch=(("bwd_direct_max_tile_n", 0), ("bwd_max_single_tile_n", 0)),
        # One chunk almost all padding, then partial last chunks of several sizes down to one column.
        ns=(3, 5120, 20000, 65537),
    ),
    KernelClass(
        "dw_reduce",
        "reduce",
        (REDUCE,),
        lambda c: True,
        "dw columns over the partial rows of each step",
        # A strip mostly padding, the narrow strip width, the wide one, a last strip of one column.
        ns=(3, 1000, 20000, 65537),
    ),
)
CLASS_BY_NAME = {c.name: c for c in CLASSES}


@dataclasses.dataclass(frozen=True)
class Case:
    cls: KernelClass
    m: int  # rows (dw_reduce: rows of the partial buffer)
    n: int
    dtype: torch.dtype
    has_w: bool

    @property
    def label(self) -> str:
        w = "w" if self.has_w else "no-w"
        return f"{self.cls.name:<20} M={self.m:<5} N={self.n:<6} {DTYPE_NAMES[self.dtype]} {w:<4}"

    @property
    def seed(self) -> int:
        return zlib.crc32(self.label.encode())


@dataclasses.dataclass
class Expected:
    """What the host will launch for a case."""

    cfg: object  # ForwardConfig / BackwardConfig / None (dw_reduce)
    red: object  # ReduceConfig when the dw reduction runs, else None
    how: str  # "picked", "kernel=" or "forced"
    kernels: tuple[str, ...]
    variants: tuple[tuple, ...]  # one key per compiled kernel variant
    text: str


@contextlib.contextmanager
def overridden(patch):
    """Heuristics parameters set to force a class, with the host caches cleared on the way in and out. The
    tuning table is off meanwhile: its winner would not see the patch."""
    if not patch:
        yield
        return
    with tuning.use_table(None), config.override(**dict(patch)):
        cutile.clear_caches()
        try:
            yield
        finally:
            cutile.clear_caches()


def _hints_text(hints) -> str:
    short = {"occupancy": "occ", "num_worker_warps": "warps"}
    return ",".join(f"{short.get(k, k)}={v}" for k, v in hints) or "-"


def _config_for(cls: KernelClass, dev: int, m: int, n: int, dtype: torch.dtype, kernel=None):
    if cls.op == "forward":
        return host.forward.cached_config(dev, m, n, dtype, kernel)
    if cls.op == "backward":
        return host.backward.cached_config(dev, m, n, dtype)
    return None


def expected(case: Case, dev: int) -> Expected | None:
    """What the case launches as the host computes it, or None when the class does not apply to the shape."""
    cls, m, n, dtype, has_w = case.cls, case.m, case.n, case.dtype, case.has_w
    with overridden(cls.patch):
        try:
            cfg = _config_for(cls, dev, m, n, dtype, cls.kernel)
        except ValueError:  # e.g. kernel="persistent" on rows wider than its widest tile
            return None
        reduces = cls.op == "reduce" or (cls.op == "backward" and has_w and cfg.strategy != "direct")
        red = config.reduce_config(n, host.common.target(dev).sms) if reduces else None
    if cfg is not None and not cls.accepts(cfg):
        return None
    if cls.op == "reduce":
        how = "picked"
    else:
        default = _config_for(cls, dev, m, n, dtype)
        if cls.accepts(default):
            how = "picked"
        elif cls.op == "forward" and not cls.patch:
            how = "kernel="
        else:
            how = "forced"
    kernels, variants, text = _describe(case, cfg, red)
    return Expected(cfg, red, how, kernels, variants, text)


def _describe(case: Case, cfg, red):
    """Kernels in launch order, one key per compiled variant (its ct.Constant values, hints and dtype) and a
    one-line description of the tiles and grids."""
    dt, w = DTYPE_NAMES[case.dtype], case.has_w
    kernels, variants, parts = [], [], []
    if cfg is None:
        pass
    elif case.cls.op == "forward" and cfg.kernel == "gather":
        kernels.append(GATHER)
        variants.append((GATHER, dt, cfg.tile_n, CASTING, w, cfg.single_tile, case.cls.store_rstd, cfg.hints))
        count = config.cdiv(case.n, cfg.tile_n)
        chunks = "1 tile" if cfg.single_tile else f"{count} chunk{'s' if count > 1 else ''}"
        parts.append(f"gather {cfg.tile_n} ({chunks}) grid={cfg.grid} {_hints_text(cfg.hints)}")
    elif case.cls.op == "forward":
        kernels.append(PERSISTENT)
        variants.append((PERSISTENT, dt, cfg.tile_m, cfg.tile_n, cfg.tail_n, CASTING, w, cfg.hints))
        tail = f"+{cfg.tail_n}" if cfg.tail_n else ""
        parts.append(f"persistent {cfg.tile_m}x{cfg.tile_n}{tail} grid={cfg.grid} {_hints_text(cfg.hints)}")
    elif cfg.strategy == "direct":
        kernels.append(BWD_DIRECT)
        variants.append((BWD_DIRECT, dt, cfg.tile_m, cfg.tile_n, cfg.strip_n, cfg.strip_m, w, cfg.hints))
        strips = f" + {cfg.num_chunks} strips {cfg.strip_m}x{cfg.strip_n}" if w else ""
        parts.append(f"direct {cfg.tile_m}x{cfg.tile_n} grid={cfg.grid}{strips} {_hints_text(cfg.hints)}")
    elif cfg.strategy == "persistent":
        kernels.append(BWD_PERSISTENT)
        variants.append((BWD_PERSISTENT, dt, cfg.tile_m, cfg.tile_n, cfg.tail_n, w, cfg.dw_per_row, cfg.hints))
        tail = f"+{cfg.tail_n}" if cfg.tail_n else ""
        per_row = " dw per row" if cfg.dw_per_row else ""
        parts.append(f"fused {cfg.tile_m}x{cfg.tile_n}{tail}{per_row} grid={cfg.grid} {_hints_text(cfg.hints)}")
    else:
        kernels += [ROW_DOT, COLUMN_CHUNK]
        variants += [(k, dt, cfg.tile_m, cfg.tile_n, w, cfg.hints) for k in (ROW_DOT, COLUMN_CHUNK)]
        row_dot_grid = min(config.cdiv(case.m, cfg.tile_m), cfg.grid * cfg.num_chunks)
        parts.append(
            f"chunked {cfg.tile_m}x{cfg.tile_n} row_dot grid={row_dot_grid}, "
            f"column_chunk grid=({cfg.grid},{cfg.num_chunks}) {_hints_text(cfg.hints)}"
        )
    if red is not None:
        kernels.append(REDUCE)
        variants.append((REDUCE, dt, red.tile_g, red.tile_n))
        partial_rows = case.m if cfg is None else cfg.grid
        parts.append(f"reduce {red.tile_g}x{red.tile_n} over {partial_rows} rows grid={red.grid}")
    return tuple(kernels), tuple(variants), "; ".join(parts)


def cases_for(classes, quick: bool, max_elements: int, dev: int) -> list[tuple[Case, Expected]]:
    ms = QUICK_M_VALUES if quick else M_VALUES
    out = []
    for cls in classes:
        # Widths the class applies to (at any M: only the forced thresholds look at M, and they admit all).
        ns = [n for n in (cls.ns or N_VALUES) if expected(Case(cls, ms[-1], n, torch.bfloat16, True), dev)]
        if not ns:
            continue
        ends = sorted({ns[0], ns[-1]})
        shapes = [(torch.bfloat16, True, n, m) for n in (ends if quick else ns) for m in ms]
        if cls.op != "reduce":
            shapes += [(torch.bfloat16, False, n, m) for n in ends for m in ms]
        shapes += [(torch.float32, True, ns[-1], m) for m in (ms[:1] if quick else ms)]
        for dtype, has_w, n, m in shapes:
            case = Case(cls, m, n, dtype, has_w)
            if m * n > max_elements:
                continue
            p = expected(case, dev)
            if p is not None:
                out.append((case, p))
    return out


def select_classes(names: list[str]) -> list[KernelClass]:
    chosen = set()
    for name in names:
        if name in ("all", "racecheck"):  # every class reduces across warps: see the module docstring
            chosen.update(c.name for c in CLASSES)
        elif name in ("forward", "backward"):
            chosen.update(c.name for c in CLASSES if c.op == name or (name == "backward" and c.op == "reduce"))
        elif name in CLASS_BY_NAME:
            chosen.add(name)
        elif any(name in c.kernels for c in CLASSES):
            chosen.update(c.name for c in CLASSES if name in c.kernels)
        else:
            raise ValueError(f"unknown class or kernel {name!r}; choose from: {', '.join(_choices())}")
    return [c for c in CLASSES if c.name in chosen]


def _choices() -> list[str]:
    kernels = sorted({k for c in CLASSES for k in c.kernels})
    return ["all", "forward", "backward", "racecheck", *CLASS_BY_NAME, *kernels]


# ----------------------------------------------------------------------------------------------------------
# Running a case
# ----------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def recording_launches():
    """The names of the kernels the host launches, in order (through the launch helper's warning hook)."""
    from tilegym_rms.cutile import launch as launch_module

    names: list[str] = []
    original = launch_module.notify_launch

    def record(kernel, device_type=None):
        names.append(kernel_name(kernel))
        return original(kernel, device_type)

    launch_module.notify_launch = record
    try:
        yield names
    finally:
        launch_module.notify_launch = original


def max_rel_err(out: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """``max |out - ref| / (|ref| + rms(scale))`` (scale: ``ref``), NaN when ``out`` is not finite."""
    if out.shape != ref.shape:
        raise AssertionError(f"shape {tuple(out.shape)}, expected {tuple(ref.shape)}")
    ref = ref.double()
    s = ref if scale is None else scale
    floor = s.square().mean().sqrt().clamp_min(1e-300)
    return ((out.double() - ref).abs() / (ref.abs() + floor)).max().item()


def run_case(case: Case, p: Expected, device: torch.device) -> dict[str, float]:
    """Launches the case's kernels through the host code; returns the relative error of each output."""
    m, n, dtype = case.m, case.n, case.dtype
    gen = torch.Generator(device=device).manual_seed(case.seed)
    dev = device.index
    if case.cls.op == "reduce":
        partial = torch.randn(m, n, dtype=torch.float32, device=device, generator=gen)
        dw = torch.empty(n, dtype=dtype, device=device)
        reduce = host.backward.reduce_launch(host.common.target(dev), n)
        host.backward.reduce(reduce, partial, dw, dev, host.common.launcher())
        torch.cuda.synchronize(device)
        return {"dw": max_rel_err(dw, partial.double().sum(0))}

    x = torch.randn(m, n, dtype=dtype, device=device, generator=gen)
    w = (torch.rand(n, device=device, generator=gen) + 0.5).to(dtype) if case.has_w else None
    x64, w64 = x.double(), (w.double() if w is not None else None)
    y_ref, rstd_ref = reference.rms_norm_forward(x64, w64, EPS, OFFSET, CASTING)
    if case.cls.op == "forward":
        y, rstd = cutile.forward(x, w, EPS, OFFSET, CASTING, store_rstd=case.cls.store_rstd, kernel=case.cls.kernel)
        torch.cuda.synchronize(device)
        errs = {"y": max_rel_err(y, y_ref)}
        if case.cls.store_rstd:
            errs["rstd"] = max_rel_err(rstd, rstd_ref)
        elif rstd is not None:
            raise AssertionError("rstd returned with store_rstd=False")
        return errs

    dy = torch.randn(m, n, dtype=dtype, device=device, generator=gen)
    rstd = rstd_ref.float()  # the backward's input, as a forward would store it
    dx, dw = cutile.backward(x, dy, w, rstd, OFFSET, CASTING)
    torch.cuda.synchronize(device)
    dy64, rstd64 = dy.double(), rstd.double()
    dx_ref, dw_ref = reference.rms_norm_backward(x64, dy64, w64, rstd64, OFFSET)
    g = dy64 if w64 is None else dy64 * (w64 + OFFSET)
    errs = {"dx": max_rel_err(dx, dx_ref, rstd64.unsqueeze(-1) * g)}
    if w is None:
        if dw is not None:
            raise AssertionError("dw returned without a weight")
    else:
        if dw.dtype != w.dtype:
            raise AssertionError(f"dw is {dw.dtype}, the weight {w.dtype}")
        errs["dw"] = max_rel_err(dw, dw_ref)
    return errs


def _is_cuda_failure(exc: BaseException) -> bool:
    # After an illegal access (memcheck stops the faulting kernel) the context is gone: later cases would
    # only repeat the error.
    text = f"{type(exc).__name__}: {exc}"
    return any(s in text for s in ("CUDA error", "CUDA_ERROR", "cudaError", "AcceleratorError"))


def execute(selected: list[tuple[Case, Expected]], device: torch.device) -> int:
    passed = failed = 0
    per_class: dict[str, list[int]] = {}
    t_start = time.perf_counter()
    width = len(str(len(selected)))
    for i, (case, p) in enumerate(selected, 1):
        tol = TOLERANCE[case.dtype]
        t0 = time.perf_counter()
        error = None
        errs: dict[str, float] = {}
        launched: list[str] = []
        try:
            with overridden(case.cls.patch), recording_launches() as launched:
                # The configuration the launch will read from the host's cache, under the same overrides.
                live = _config_for(case.cls, device.index, case.m, case.n, case.dtype, case.cls.kernel)
                if live != p.cfg:
                    raise AssertionError(f"configuration {live}, expected {p.cfg}")
                errs = run_case(case, p, device)
            if tuple(launched) != p.kernels:
                raise AssertionError(f"launched {'+'.join(launched) or 'nothing'}, expected {'+'.join(p.kernels)}")
        except Exception as exc:  # noqa: BLE001 - every failure is reported, the run goes on where it can
            error = exc
        ok = error is None and all(e <= tol for e in errs.values())  # NaN compares False: a failure
        passed += ok
        failed += not ok
        per_class.setdefault(case.cls.name, [0, 0])[0 if ok else 1] += 1
        kernels = "+".join(dict.fromkeys(launched or p.kernels))
        detail = " ".join(f"{k}={v:.1e}" for k, v in errs.items())
        if error is not None:
            detail = f"{detail} {type(error).__name__}: {str(error).splitlines()[0][:200]}".strip()
        status = "ok  " if ok else "FAIL"
        secs = time.perf_counter() - t0
        print(
            f"[{i:>{width}}/{len(selected)}] {status} {case.label} {p.how:<6} {kernels:<60} {detail} ({secs:.2f}s)",
            flush=True,
        )
        if error is not None and _is_cuda_failure(error):
            rest = len(selected) - i
            print(f"aborting: the CUDA context is unusable after this error; {rest} cases not run", flush=True)
            failed += rest
            break
    for name, (ok_count, bad) in per_class.items():
        print(f"  {name:<20} {ok_count} passed, {bad} failed")
    print(f"{passed} passed, {failed} failed ({time.perf_counter() - t_start:.0f}s)", flush=True)
    return 1 if failed else 0


# ----------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------


def print_cases(selected: list[tuple[Case, Expected]], classes: list[KernelClass], sms: str) -> None:
    print(f"cases for {sms}")
    for i, (case, p) in enumerate(selected, 1):
        print(f"{i:>4} {case.label} {p.how:<6} {'+'.join(p.kernels):<60} {p.text}")
    print()
    print(f"{'class':<20} {'cases':>5} {'picked':>6} {'kernel=':>7} {'forced':>6} {'variants':>8}  reduces in a block")
    all_variants = set()
    for cls in classes:
        mine = [p for c, p in selected if c.cls is cls]
        variants = {v for p in mine for v in p.variants}
        all_variants |= variants
        counts = [sum(p.how == h for p in mine) for h in ("picked", "kernel=", "forced")]
        print(
            f"{cls.name:<20} {len(mine):>5} {counts[0]:>6} {counts[1]:>7} {counts[2]:>6} {len(variants):>8}  {cls.sums}"
        )
    print(
        f"{len(selected)} cases, {len(all_variants)} distinct kernel variants to compile "
        "(a variant shared by several classes is counted in each row)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.tools.sanitize", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--kernels",
        nargs="+",
        default=["all"],
        metavar="NAME",
        help=f"classes or kernels to run (default all): {', '.join(_choices())}",
    )
    parser.add_argument("--quick", action="store_true", help="fewer shapes (M 7 and 4097, narrowest and widest N)")
    parser.add_argument("--list", action="store_true", help="print the cases and exit (no GPU needed)")
    parser.add_argument(
        "--max-elements",
        type=int,
        help=f"skip cases with more elements, M x N (default {MAX_ELEMENTS}; with --quick {QUICK_MAX_ELEMENTS})",
    )
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        classes = select_classes([name for item in args.kernels for name in item.split(",") if name])
    except ValueError as exc:
        parser.error(str(exc))
    max_elements = args.max_elements or (QUICK_MAX_ELEMENTS if args.quick else MAX_ELEMENTS)
    gpu = torch.cuda.is_available()
    if args.list and not gpu:
        from tilegym_rms.cutile import launch as launch_module

        # The host asks the launch module for the SM count; without a GPU there is none to ask.
        launch_module.num_sms = lambda device_index: ASSUMED_SMS
        tuning.device_key = lambda device_index: f"sm90_{ASSUMED_SMS}sm"  # and its table
        dev, sms = 0, f"{ASSUMED_SMS} SMs (assumed: no GPU)"
    elif not gpu:
        print("sanitize.py needs a CUDA GPU (--list works without one)", file=sys.stderr)
        return 2
    else:
        dev = torch.cuda.current_device()
        ok, why = cutile.available(torch.device("cuda", dev))
        if not ok:
            print(f"cuTile cannot run here: {why}", file=sys.stderr)
            return 2
        sms = f"{torch.cuda.get_device_name(dev)}, {torch.cuda.get_device_properties(dev).multi_processor_count} SMs"
    selected = cases_for(classes, args.quick, max_elements, dev)
    missing = [c.name for c in classes if not any(case.cls is c for case, _ in selected)]
    if args.list:
        print_cases(selected, classes, sms)
        if missing:
            print(f"no case for: {', '.join(missing)}")
        return 1 if missing else 0
    allocator = "uncached" if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") else "caching"
    print(f"{sms}; torch {torch.__version__}; {allocator} allocator; {len(selected)} cases", flush=True)
    if missing:
        print(f"no case for: {', '.join(missing)}", file=sys.stderr)
        return 1
    return execute(selected, torch.device("cuda", dev))


if __name__ == "__main__":
    sys.exit(main())

"""What a run shows: plain-text tables on stdout and PNG plots of the JSON records."""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench.common import base, records


def format_table(headers: list[str], rows: list[list[str]], left: int = 1) -> str:
    """Plain-text table; the first ``left`` columns are left-aligned, the others right-aligned."""
    widths = [len(h) for h in headers]
    for r in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, r, strict=False)]

    def fmt(cells):
        pairs = enumerate(zip(cells, widths, strict=False))
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in pairs)

    lines = [fmt(headers), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in rows]
    return "\n".join(lines)


def cell(p: records.Point | None, copy_bw: float | None, what: str = "gbps") -> str:
    if p is None:
        return "-"
    if p.error:
        return "ERR"
    if not p.us:
        return "-"
    flag = "!" if p.ok is False else ""
    if what == "us" or p.metric == "latency":
        return f"{p.time_stats()[0]:.1f}{flag}"
    bw = p.gbps_stats()[0]
    pct = f" ({100 * bw / copy_bw:.0f}%)" if copy_bw else ""
    return f"{fmt_num(bw)}{pct}{flag}"


def fmt_num(v: float) -> str:
    """Three significant digits for small numbers, integers from 100 up."""
    if not math.isfinite(v):
        return str(v)
    if abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def results_table(points: list[records.Point], providers: list[str], copy_bw: float | None, what: str = "gbps") -> str:
    """Rows = configurations (in first-seen order), columns = providers."""
    rows: dict[tuple, dict[str, records.Point]] = {}
    for p in points:
        rows.setdefault((p.dtype, p.m, p.n), {})[p.provider] = p
    cols = [pr for pr in providers if any(pr in r for r in rows.values())]
    body = []
    for (dtype, m, n), by in rows.items():
        body.append([dtype, str(m), str(n)] + [cell(by.get(pr), copy_bw, what) for pr in cols])
    return format_table(["dtype", "M", "N"] + cols, body, left=1)


def mismatch_lines(points: list[records.Point]) -> list[str]:
    out = []
    for p in points:
        if p.ok is False:
            errs = ", ".join(f"{k}={v:.2e}" for k, v in p.errs.items())
            tols = {k: base.tolerance(k, p.dtype) for k in p.errs}
            one = set(tols.values())
            limit = f"{one.pop():g}" if len(one) == 1 else ", ".join(f"{k} {t:g}" for k, t in tols.items())
            out.append(f"  ! {p.provider} {p.op} {p.dtype} M={p.m} N={p.n}: {errs} (limit {limit})")
        if p.error:
            out.append(f"  ERR {p.provider} {p.op} {p.dtype} M={p.m} N={p.n}: {p.error}")
    return out


def plot_records(recs: list[dict], path: Path, title: str, copy_bw: float | None = None) -> str:
    """One subplot per (op mode, extra config); one line per provider; dashed line at the copy bandwidth for
    GB/s plots. Returns a message (written, or why not)."""
    if not recs:
        return f"plot {path.name}: no data"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001
        return f"plot {path.name} skipped: matplotlib unavailable ({base.short_error(exc)})"

    panels: dict[tuple, list[dict]] = {}
    for rec in recs:
        panels.setdefault((rec["kernel_operation_mode"], rec["extra_benchmark_config_str"]), []).append(rec)
    keys = sorted(panels, key=_panel_sort_key)
    ncols = min(3, len(keys))
    nrows = math.ceil(len(keys) / ncols)
    height = 3.0 * nrows + 0.9
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, height), squeeze=False, dpi=80)
    order = {p: i for i, p in enumerate(base.PROVIDERS_ALL)}
    providers = sorted({r["kernel_provider"] for r in recs}, key=lambda p: (order.get(p, 99), p))
    colors = {p: f"C{i % 10}" for i, p in enumerate(providers)}
    for ax, key in zip(axes.flat, keys, strict=False):
        panel = panels[key]
        xs_all = [x for r in panel for x in r["x_values"]]
        numeric = all(isinstance(x, (int, float)) for x in xs_all)
        cats = sorted({json.dumps(x) for x in xs_all}, key=lambda s: records.x_sort_key(json.loads(s)))
        for rec in sorted(panel, key=lambda r: providers.index(r["kernel_provider"])):
            xs = rec["x_values"] if numeric else [cats.index(json.dumps(x)) for x in rec["x_values"]]
            ax.plot(xs, rec["y_values_50"], marker="o", ms=3, lw=1.2, color=colors[rec["kernel_provider"]])
            ax.fill_between(
                xs, rec["y_values_20"], rec["y_values_80"], alpha=0.15, color=colors[rec["kernel_provider"]]
            )
            bad = [i for i, x in enumerate(rec["x_values"]) if x in rec.get("mismatch_x_values", [])]
            if bad:
                ax.plot([xs[i] for i in bad], [rec["y_values_50"][i] for i in bad], "rx", ms=8, mew=2)
        unit = panel[0]["metric_unit"]
        bw = copy_bw or panel[0].get("copy_bandwidth_GBps")
        if unit == "GB/s" and bw:
            ax.axhline(bw, ls="--", color="k", lw=1)
            ax.text(0.01, bw, f" copy {bw:.0f}", va="bottom", ha="left", fontsize=7, transform=ax.get_yaxis_transform())
            ax.set_ylim(0, max(bw * 1.1, ax.get_ylim()[1]))
        if numeric:
            xv = sorted({float(x) for x in xs_all})
            if len(xv) > 1 and xv[0] > 0 and xv[-1] / xv[0] >= 8:
                ax.set_xscale("log", base=2)
            ax.set_xticks(xv)
            labels = [f"{int(x)}" if float(x).is_integer() else f"{x:g}" for x in xv]
            ax.set_xticklabels(labels, fontsize=7, rotation=45 if len(xv) > 4 else 0)
        else:
            ax.set_xticks(range(len(cats)))
            ax.set_xticklabels([json.loads(c) for c in cats], fontsize=7, rotation=30)
        ax.tick_params(axis="y", labelsize=7)
        ax.set_xlabel(panel[0]["x_label"], fontsize=8)
        ax.set_ylabel(f"{panel[0]['metric_name']} ({unit})", fontsize=8)
        ax.set_title(_panel_title(key), fontsize=9)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    handles = [plt.Line2D([], [], color=colors[p], marker="o", ms=3, label=p) for p in providers]
    if any(r.get("mismatch_x_values") for r in recs):
        handles.append(plt.Line2D([], [], color="r", marker="x", ls="", label="check failed"))
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 4), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.45 / height, 1, 1 - 0.3 / height))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return f"plot written: {path}"


def _panel_sort_key(key: tuple) -> tuple:
    op, extra = key
    cfg = json.loads(extra)
    order = {"bf16": 0, "fp16": 1, "fp32": 2}
    return (op, cfg.get("M", 0), order.get(cfg.get("dtype"), 9), extra)


def _panel_title(key: tuple) -> str:
    op, extra = key
    cfg = json.loads(extra)
    parts = [op] + [f"{k}={v}" for k, v in sorted(cfg.items()) if k != "suite"]
    return " ".join(parts)

"""Training-step benchmark of whole models: HF eager RMSNorm vs tilegym_rms (``apply_to_model``) vs Liger.

Small Llama-style and Qwen3-style causal LMs are built from configs (nothing is downloaded): by default 4 layers,
hidden 2048, intermediate 5632 (Llama) / 6144 (Qwen3), 16 heads (8 KV heads), head_dim 128, vocab 32000,
bf16 weights, SDPA attention, AdamW (fused on CUDA), sequence 2048, batch 2. A step is forward with
``labels=input_ids`` (HF's loss), backward, ``optimizer.step()`` and ``zero_grad``.

Gated norms, each semantics: ``--models qwen3_next`` builds a hybrid Qwen3-Next, three linear-attention layers to
one full-attention layer as the released model, so its norms are gated ones (one per linear-attention layer, over
each value head) beside zero-centred ones; every layer's MLP is dense (intermediate 5632), because HF's mixture of
experts loops over experts in Python and would bury the norms. Its linear attention runs HF's torch implementation
when the hub's kernels cannot be fetched, which is slow but the same for every provider. Liger replaces its plain
norms only. ``--models mamba2`` builds a Mamba2 (state-space mixers, expand 2, heads of ``--head-dim``,
``--kv-heads`` groups: its gated norm gates first and normalizes per group of 512 columns at the defaults); HF's
torch scan runs where mamba_ssm is not installed, and Liger has no Mamba2 patch.

Providers, each on a fresh model built with the same seed (so the same weights; an init checksum is recorded):

* ``hf``: the model as transformers builds it (HF's eager RMSNorm modules).
* ``ours``: ``tilegym_rms.integrations.hf.apply_to_model(model)``.
* ``liger``: ``liger_kernel.transformers.apply_liger_kernel_to_<model>`` with ``rms_norm=True`` and every other
  kernel off (RoPE, SwiGLU, cross entropy, fused linear cross entropy), so only the norms differ.

each without compilation (``--compile none``) and under ``torch.compile(model)`` (``inductor``, default options).
Liger replaces the norm classes at module level in transformers, so every (model, provider) pair runs in its
own subprocess: no patch can leak into another provider's numbers.

Timing: ``--warmup`` steps first (they include the compilation, and their wall time is reported), then
``--steps`` steps, each between two CUDA events; the table gives the median step time and tokens/s, the peak
memory and the losses of the first 3 steps. All providers see the same batch and start from the same
weights, so those losses must agree up to bf16 rounding; the largest relative difference to ``hf`` eager is
printed and flagged above ``--loss-rtol``.

Run from the repository root::

    python -m bench.bench_model                     # 2 models x 3 providers x 2 compile modes
    python -m bench.bench_model --device cpu --layers 1 --hidden 64 --seq 32 --steps 2 --warmup 1 \\
        --providers hf,ours --compile none          # smoke test of the script itself

Expected duration of the default run on one H100: about 4-6 minutes. Six subprocesses start (torch and
transformers imports, CUDA init: ~10 s each); the inductor compilations of the forward and backward graphs
dominate (~30-60 s per model and provider); a step takes tens of milliseconds, so the 3 + 20 steps per
run add only a few seconds in all. Output: a markdown table on stdout and in ``--out``
(default ``bench/results/<gpu-slug>/model_step.md``, ``model_step_<models>.md`` for other ``--models``),
and a JSON with every number next to it.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.metadata
import inspect
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent

MODELS = ("llama", "qwen3", "qwen3_next", "mamba2")
DEFAULT_MODELS = ("llama", "qwen3")
PROVIDERS = ("hf", "ours", "liger")
COMPILE_MODES = ("none", "inductor")
# Intermediate size as a multiple of hidden when --intermediate is not given: 5632 and 6144 at hidden 2048,
# the ratios of TinyLlama-1.1B and Qwen3 (Qwen3-Next's config defaults to Llama's ratio).
INTERMEDIATE_RATIO = {"llama": 2.75, "qwen3": 3.0, "qwen3_next": 2.75}
LOSS_STEPS = 3
SILENCE_ENV = "TILEGYM_RMS_SILENCE_EXPERIMENTAL"


# ----------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------


def _csv(allowed):
    def parse(text: str) -> list[str]:
        items = [s.strip() for s in text.split(",") if s.strip()]
        bad = [s for s in items if s not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {','.join(allowed)} (got {text!r})")
        return list(dict.fromkeys(items))  # de-duplicated, order kept

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.bench_model",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument(
        "--models",
        type=_csv(MODELS),
        default=list(DEFAULT_MODELS),
        help=f"comma list of {','.join(MODELS)}\n(default {','.join(DEFAULT_MODELS)})",
    )
    p.add_argument("--providers", type=_csv(PROVIDERS), default=list(PROVIDERS), help="default hf,ours,liger")
    p.add_argument("--compile", type=_csv(COMPILE_MODES), default=list(COMPILE_MODES), help="default none,inductor")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first, compilation included (default 3)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    p.add_argument("--batch", type=int, default=2, help="batch size (default 2)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size (default 2048)")
    p.add_argument("--intermediate", type=int, default=None, help="MLP size (default 2.75x hidden; Qwen3 3x)")
    p.add_argument("--heads", type=int, default=16, help="attention heads (default 16)")
    p.add_argument("--kv-heads", type=int, default=8, help="key/value heads (default 8)")
    p.add_argument("--head-dim", type=int, default=None, help="default hidden // heads (128 at the defaults)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size (default 32000)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="weight dtype (default bf16)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and of the batch (default 0)")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test: numbers mean nothing)")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="markdown file; the JSON goes next to it with .json\n"
        "(default bench/results/<gpu-slug>/model_step.md; with --device cpu a temporary folder)",
    )
    p.add_argument(
        "--loss-rtol",
        type=float,
        default=1e-2,
        help="flag a run whose first losses differ from hf eager by more than this (relative; default 1e-2)",
    )
    p.add_argument("--worker-timeout", type=int, default=900, help="seconds per subprocess (default 900)")
    # Internal: what the parent passes to the subprocess that runs one (model, provider).
    p.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_worker-out", dest="_worker_out", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("steps", "seq", "batch", "layers", "hidden", "heads", "kv_heads", "vocab"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if args.head_dim is None:
        if args.hidden % args.heads:
            p.error(f"--hidden ({args.hidden}) is not a multiple of --heads ({args.heads}): give --head-dim")
        args.head_dim = args.hidden // args.heads
    if args.head_dim % 2:
        p.error("--head-dim must be even (rotary embeddings rotate pairs)")
    return args


def _gpu_slug(name: str) -> str:
    """The results folder of a card (bench/common/session.py's naming), imported only when a GPU run writes there."""
    from bench.common.session import gpu_slug

    return gpu_slug(name)


def model_config(model: str, args: argparse.Namespace) -> dict:
    """The config fields this benchmark sets (the rest are transformers' defaults)."""
    if model == "mamba2":
        return {
            "vocab_size": args.vocab,
            "hidden_size": args.hidden,
            "num_hidden_layers": args.layers,
            "expand": 2,
            "head_dim": args.head_dim,
            "num_heads": 2 * args.hidden // args.head_dim,
            "n_groups": args.kv_heads,  # the gated norm's groups: 2 * hidden / n_groups columns each
            "state_size": 128,
            "chunk_size": 256,
            "tie_word_embeddings": False,
            "use_cache": False,
        }
    intermediate = args.intermediate or int(round(INTERMEDIATE_RATIO[model] * args.hidden))
    config = {
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "max_position_embeddings": max(args.seq, 2048),
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        # A training step does not need the KV cache; building one every forward only adds work.
        "use_cache": False,
    }
    if model == "qwen3_next":
        config.update(
            # The released model's pattern: every fourth layer full attention, the others linear attention, whose
            # value heads (one gated norm each) take the attention's head counts and head dim.
            layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(args.layers)],
            linear_num_value_heads=args.heads,
            linear_num_key_heads=args.kv_heads,
            linear_key_head_dim=args.head_dim,
            linear_value_head_dim=args.head_dim,
            mlp_only_layers=list(range(args.layers)),  # dense MLPs: the experts' Python loop is not what is timed
        )
    return config


# ----------------------------------------------------------------------------------------------
# Worker: one (model, provider), every compile mode, in its own process
# ----------------------------------------------------------------------------------------------


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return text if len(text) <= 300 else text[:297] + "..."


def _build_model(model_name: str, args: argparse.Namespace, dtype, device):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    if model_name == "qwen3_next":
        from transformers import Qwen3NextConfig  # transformers >= 4.57

        cfg_cls = Qwen3NextConfig
    elif model_name == "mamba2":
        from transformers import Mamba2Config

        cfg_cls = Mamba2Config
    else:
        cfg_cls = {"llama": LlamaConfig, "qwen3": Qwen3Config}[model_name]
    cfg = cfg_cls(**model_config(model_name, args))
    # Built on the CPU from the seed, then moved: the weights depend only on the seed, not on the device or on
    # what ran before in the process.
    torch.manual_seed(args.seed)
    attn = {} if model_name == "mamba2" else {"attn_implementation": "sdpa"}  # Mamba2 has no attention
    try:
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, **attn)
    except TypeError:  # transformers < 4.56 names it torch_dtype
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype, **attn)
    model.to(device)
    model.train()
    return model


def _checksum(model) -> float:
    import torch

    with torch.no_grad():
        return float(sum(p.detach().double().sum().item() for p in model.parameters()))


def _count_norms(model) -> int:
    # Gated norms too (Qwen3-Next's Qwen3NextRMSNormGated).
    return sum(1 for m in model.modules() if "RMSNorm" in type(m).__name__)


def _liger_apply_fn(model_name: str):
    """liger's apply function for the family; raises ImportError (with the reason) when liger cannot load,
    LookupError when it has no patch for the family."""
    module = importlib.import_module("liger_kernel.transformers")
    name = f"apply_liger_kernel_to_{model_name}"
    fn = getattr(module, name, None)
    if fn is None:  # older releases export them from monkey_patch only
        fn = getattr(importlib.import_module("liger_kernel.transformers.monkey_patch"), name, None)
    if fn is None:
        raise LookupError(f"liger_kernel has no {name}: it does not patch this model")
    return fn


def _liger_kwargs(fn, model) -> tuple[dict, bool]:
    """Keyword arguments that turn on rms_norm only: every other boolean option liger's signature has is set to
    False by name, so that options added or renamed in other liger releases stay off too. Returns them and
    whether the function takes ``model`` (then it also patches the instance; else only the classes)."""
    params = inspect.signature(fn).parameters
    if "rms_norm" not in params:
        raise TypeError(f"{fn.__name__} has no rms_norm option (signature {inspect.signature(fn)})")
    kwargs = {}
    for name, param in params.items():
        if name == "rms_norm":
            kwargs[name] = True
        elif isinstance(param.default, bool):
            kwargs[name] = False
    takes_model = "model" in params
    if takes_model:
        kwargs["model"] = model
    return kwargs, takes_model


def _liger_count(model) -> int:
    # liger patches instances by binding LigerRMSNorm.forward and a _get_name that answers "LigerRMSNorm"; modules
    # built after a class-level patch are LigerRMSNorm instances. Both answer _get_name() so.
    return sum(1 for m in model.modules() if m._get_name() == "LigerRMSNorm")


def _make_provider_model(model_name: str, provider: str, args, dtype, device) -> tuple[object, int, int, str]:
    """A fresh model with the provider applied: (model, norms in HF's model, norms replaced, note)."""
    note = ""
    fn = _liger_apply_fn(model_name) if provider == "liger" else None
    if fn is not None:
        kwargs, takes_model = _liger_kwargs(fn, None)
        if not takes_model:
            # Only class-level patching: it must happen before the model is built.
            fn(**kwargs)
            note = "liger: class patch before build (no model= argument)"
    model = _build_model(model_name, args, dtype, device)
    total = _count_norms(model)
    if provider == "hf":
        replaced = 0
    elif provider == "ours":
        from tilegym_rms.integrations.hf import apply_to_model

        replaced = apply_to_model(model)
    else:
        kwargs, takes_model = _liger_kwargs(fn, model)
        if takes_model:
            fn(**kwargs)
        replaced = _liger_count(model)
        off = sorted(k for k, v in kwargs.items() if v is False)
        note = "; ".join(filter(None, [note, f"liger options off: {','.join(off)}"]))
    if provider != "hf" and replaced == 0:
        raise RuntimeError(f"{provider} replaced none of the {total} RMSNorm modules")
    return model, total, replaced, note


def _dynamo_counters(clear: bool = False) -> dict:
    """Graph breaks and graphs compiled so far, from dynamo's counters (internal API: empty when it moves)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return {}
    if clear:
        counters.clear()
        return {}
    return {
        "graph_breaks": sum(counters["graph_break"].values()),
        "graphs": counters["stats"].get("unique_graphs", None),
    }


def _run_mode(model_name: str, provider: str, mode: str, args, device) -> dict:
    import torch

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    cuda = device.type == "cuda"
    rec: dict = {"model": model_name, "provider": provider, "compile": mode}
    model, total, replaced, note = _make_provider_model(model_name, provider, args, dtype, device)
    rec.update(norms_total=total, norms_replaced=replaced, init_checksum=_checksum(model), note=note)
    # One fixed batch for every step: the model then fits it and the loss falls step after step, so the
    # losses of steps 2-3 depend on the gradients of steps 1-2 (the backward pass), not only on the forward.
    gen = torch.Generator().manual_seed(args.seed + 1)
    batch = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device)
    # lr 1e-3 moves bf16 weights of the init scale (std 0.02) by several ulps per step, so the updates show in the
    # loss; the norm weights (1.0) move by less than half an ulp at this lr and keep their value in bf16.
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=cuda or None)
    if mode == "inductor":
        torch._dynamo.reset()  # nothing of an earlier mode's compilation may be reused
        _dynamo_counters(clear=True)
        run = torch.compile(model)
    else:
        run = model

    def step():
        loss = run(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    losses = []
    sync()
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        losses.append(step())
    sync()
    rec["warmup_s"] = time.perf_counter() - t0
    if mode == "inductor":
        # A provider whose op breaks the graph compiles into several pieces and loses fusions across them: the
        # counts tell whether a compiled number compares whole graphs.
        rec.update(_dynamo_counters())
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps)]
    times_ms = []
    t0 = time.perf_counter()
    for i in range(args.steps):
        if cuda:
            # No synchronisation inside the loop: the host queues steps ahead as a training loop does, and the
            # events time each step on the GPU (host-bound gaps included, as they cost real training time).
            starts[i].record()
            losses.append(step())
            ends[i].record()
        else:
            s = time.perf_counter()
            losses.append(step())
            times_ms.append((time.perf_counter() - s) * 1e3)
    sync()
    wall = time.perf_counter() - t0
    if cuda:
        times_ms = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
        rec["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    median = statistics.median(times_ms)
    rec.update(
        step_ms=times_ms,
        median_ms=median,
        min_ms=min(times_ms),
        max_ms=max(times_ms),
        wall_ms_per_step=wall * 1e3 / args.steps,
        tokens_per_s=args.batch * args.seq / (median / 1e3),
        losses=[float(v) for v in losses[:LOSS_STEPS]],
        status="ok",
    )
    if not all(math.isfinite(v) for v in rec["losses"]):
        rec["status"] = "error"
        rec["message"] = f"non-finite loss {rec['losses']}"
    return rec  # model, optimizer and compiled graphs go with this frame; the caller collects them


def _versions() -> dict:
    import torch
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    out["cuda"] = torch.version.cuda
    for dist in ("liger-kernel", "triton"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    try:  # from the module: on the GPU machine it runs from the checkout (PYTHONPATH), without package metadata
        import tilegym_rms

        out["tilegym_rms"] = getattr(tilegym_rms, "__version__", "unknown")
    except Exception as exc:  # noqa: BLE001 - reported; the ours provider then fails with the same error
        out["tilegym_rms"] = f"unavailable ({_short(exc)})"
    return out


def worker_main(args: argparse.Namespace) -> int:
    model_name, provider = args._worker.split(":")
    os.environ.setdefault(SILENCE_ENV, "1")
    import torch

    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    out: dict = {"versions": _versions(), "device": str(device)}
    out["device_name"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    records = []
    skip = None
    if provider == "liger":
        try:
            _liger_apply_fn(model_name)
        except LookupError as exc:
            skip = str(exc)
        except Exception as exc:  # noqa: BLE001 - any import failure means: not available here
            skip = f"liger_kernel not importable ({_short(exc)}); pip install liger-kernel"
        else:
            if device.type != "cuda":
                skip = f"liger's kernels are Triton kernels for CUDA devices; skipped on {device.type}"
    for mode in args.compile:
        tag = f"[{model_name}/{provider}/{mode}]"
        if skip:
            records.append({"model": model_name, "provider": provider, "compile": mode, "status": "skipped"})
            records[-1]["message"] = skip
            print(f"{tag} skipped: {skip}", flush=True)
            continue
        try:
            rec = _run_mode(model_name, provider, mode, args, device)
        except Exception as exc:  # noqa: BLE001 - one failing mode must not hide the others' numbers
            rec = {"model": model_name, "provider": provider, "compile": mode, "status": "error"}
            rec["message"] = _short(exc)
            import traceback

            traceback.print_exc()
        if rec["status"] == "ok":
            losses = " ".join(f"{v:.4f}" for v in rec["losses"])
            print(
                f"{tag} norms {rec['norms_replaced']}/{rec['norms_total']}, warm-up {rec['warmup_s']:.1f} s, "
                f"median {rec['median_ms']:.2f} ms/step ({rec['tokens_per_s']:,.0f} tok/s), losses {losses}",
                flush=True,
            )
        else:
            print(f"{tag} {rec['status']}: {rec.get('message', '')}", flush=True)
        records.append(rec)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out["results"] = records
    args._worker_out.write_text(json.dumps(out))
    return 0


# ----------------------------------------------------------------------------------------------
# Parent: one subprocess per (model, provider), then the report
# ----------------------------------------------------------------------------------------------


def _run_worker(model_name: str, provider: str, argv: list[str], args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench_model_") as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "bench.bench_model", *argv]
        cmd += ["--_worker", f"{model_name}:{provider}", "--_worker-out", str(result)]
        env = dict(os.environ, **{SILENCE_ENV: "1"})
        # The checkout first on the child's path, however the parent found it: bench and tilegym_rms from here.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
        # A session of its own, so that a timeout also ends the inductor compile workers it started.
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.worker_timeout)
        except (subprocess.TimeoutExpired, KeyboardInterrupt) as exc:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if isinstance(exc, KeyboardInterrupt):
                raise
            why = f"subprocess killed after {args.worker_timeout} s (--worker-timeout)"
            return {"results": [_failed(model_name, provider, m, why) for m in args.compile]}
        if rc != 0 or not result.exists():
            why = f"subprocess exited with code {rc} (its output is above)"
            return {"results": [_failed(model_name, provider, m, why) for m in args.compile]}
        return json.loads(result.read_text())


def _failed(model_name, provider, mode, why) -> dict:
    return {"model": model_name, "provider": provider, "compile": mode, "status": "error", "message": why}


def _add_comparisons(results: list[dict], rtol: float) -> None:
    """Loss difference to hf eager and speed-up over hf in the same compile mode, for every ok record."""
    ok = {(r["model"], r["provider"], r["compile"]): r for r in results if r["status"] == "ok"}
    for r in ok.values():
        ref = ok.get((r["model"], "hf", "none"))
        if ref is not None:
            n = min(len(ref["losses"]), len(r["losses"]))
            diffs = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["losses"][:n], ref["losses"][:n], strict=True)]
            r["loss_max_rel_diff"] = max(diffs) if diffs else None
            r["loss_ok"] = None if not diffs else r["loss_max_rel_diff"] <= rtol
            r["same_init_as_hf"] = r["init_checksum"] == ref["init_checksum"]
        base = ok.get((r["model"], "hf", r["compile"]))
        if base is not None:
            r["speedup_vs_hf"] = base["median_ms"] / r["median_ms"]


def _describe(c: dict) -> str:
    """A model's config in one line of the report."""
    if "n_groups" in c:  # Mamba2
        width = c["expand"] * c["hidden_size"]
        return (
            f"{c['num_hidden_layers']} layers, hidden {c['hidden_size']}, SSM heads {c['num_heads']} x "
            f"{c['head_dim']}, state {c['state_size']}, gated norm over {width} columns in {c['n_groups']} groups, "
            f"vocab {c['vocab_size']}"
        )
    text = (
        f"{c['num_hidden_layers']} layers, hidden {c['hidden_size']}, intermediate {c['intermediate_size']}, "
        f"heads {c['num_attention_heads']} (kv {c['num_key_value_heads']}), head_dim {c['head_dim']}, "
        f"vocab {c['vocab_size']}"
    )
    if "layer_types" in c:  # Qwen3-Next
        text += f"; layers {'/'.join(t.split('_')[0] for t in c['layer_types'])} attention, dense MLPs"
    return text


def render_markdown(meta: dict, results: list[dict], args: argparse.Namespace) -> str:
    v = meta["versions"]
    lines = [
        "# Training step: whole model, RMSNorm providers",
        "",
        f"Device: {meta['device_name']} ({meta['device']}); torch {v.get('torch')}, transformers "
        f"{v.get('transformers')}, liger-kernel {v.get('liger-kernel') or 'not installed'}, tilegym_rms "
        f"{v.get('tilegym_rms') or 'from checkout'}; {meta['timestamp']}.",
        "",
        f"Step = forward (HF loss on labels = input_ids) + backward + AdamW{' (fused)' if meta['cuda'] else ''}; "
        f"batch {args.batch} x seq {args.seq} = {args.batch * args.seq} tokens, {args.dtype} weights, SDPA "
        f"attention, lr {args.lr:g}, seed {args.seed}; {args.warmup} warm-up steps (compilation included), then "
        f"median of {args.steps} steps ({'CUDA events' if meta['cuda'] else 'wall clock'}).",
        "",
    ]
    lines += [f"- {m}: {_describe(meta['configs'][m])}" for m in args.models]
    lines += [
        "",
        "| model | provider | compile | norms | median ms/step | tokens/s | vs hf | peak GiB | warm-up s "
        "| loss steps 1-3 | max rel Δloss vs hf eager |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    notes = []
    for r in results:
        head = f"| {r['model']} | {r['provider']} | {r['compile']} "
        if r["status"] != "ok":
            lines.append(head + f"| {r['status']} | | | | | | | |")
            notes.append(f"- {r['model']}/{r['provider']}/{r['compile']}: {r['status']}: {r.get('message', '')}")
            continue
        d = r.get("loss_max_rel_diff")
        dtext = "n/a (no hf eager run)" if d is None else f"{d:.1e}" + ("" if r.get("loss_ok") else " **!**")
        speed = f"{r['speedup_vs_hf']:.3f}x" if "speedup_vs_hf" in r else ""
        peak = f"{r['peak_mem_gib']:.2f}" if "peak_mem_gib" in r else ""
        lines.append(
            head + f"| {r['norms_replaced']}/{r['norms_total']} | {r['median_ms']:.2f} | {r['tokens_per_s']:,.0f} "
            f"| {speed} | {peak} | {r['warmup_s']:.1f} | {' '.join(f'{x:.4f}' for x in r['losses'])} | {dtext} |"
        )
        if r.get("graph_breaks"):
            notes.append(
                f"- {r['model']}/{r['provider']}/{r['compile']}: {r['graph_breaks']} graph break(s), "
                f"{r.get('graphs')} graph(s) compiled"
            )
        if r.get("same_init_as_hf") is False:
            notes.append(f"- {r['model']}/{r['provider']}/{r['compile']}: init checksum differs from hf's!")
        if r.get("loss_ok") is False:
            notes.append(
                f"- {r['model']}/{r['provider']}/{r['compile']}: losses differ from hf eager by more than "
                f"--loss-rtol {args.loss_rtol:g}"
            )
    lines += [
        "",
        "norms: RMSNorm modules replaced / present (hf: 0, it runs HF's own). vs hf: hf's median over this one's, "
        "same compile mode. warm-up s: wall time of the warm-up steps, compilation included (the eager run of a "
        "provider goes first in its process, so the compiled run finds kernels it already built).",
    ]
    if notes:
        lines += ["", "Notes:", "", *notes]
    lines.append(f"\nTotal time {meta['total_s']:.0f} s.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args._worker:
        return worker_main(args)
    t0 = time.perf_counter()
    results: list[dict] = []
    meta: dict = {"versions": {}, "device": args.device, "device_name": None}
    jobs = [(m, p) for m in args.models for p in args.providers]
    for i, (m, p) in enumerate(jobs, 1):
        elapsed = time.perf_counter() - t0
        print(f"== {m}/{p} ({i}/{len(jobs)}), compile {','.join(args.compile)}; {elapsed:.0f} s so far", flush=True)
        out = _run_worker(m, p, argv, args)
        results += out["results"]
        if meta["device_name"] is None and "device_name" in out:
            meta.update(versions=out["versions"], device=out["device"], device_name=out["device_name"])
    _add_comparisons(results, args.loss_rtol)
    meta["device_name"] = meta["device_name"] or "unknown"
    meta["cuda"] = str(meta["device"]).startswith("cuda")
    meta["configs"] = {m: model_config(m, args) for m in args.models}
    meta["timestamp"] = time.strftime("%Y-%m-%d %H:%M:%S")
    meta["total_s"] = time.perf_counter() - t0
    text = render_markdown(meta, results, args)
    print()
    print(text, end="")
    # Another set of models gets a file of its own, so that it does not overwrite the default run's.
    name = "model_step" if sorted(args.models) == sorted(DEFAULT_MODELS) else "_".join(["model_step", *args.models])
    if args.out is not None:
        md = args.out
    elif meta["cuda"]:
        md = BENCH_DIR / "results" / _gpu_slug(meta["device_name"]) / f"{name}.md"
    else:
        # A CPU run only tests the script: keep it out of bench/results/.
        md = Path(tempfile.gettempdir()) / "tilegym_rms_bench_model" / f"{name}.md"
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(text)
    settings = {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "out"}
    payload = {
        "benchmark": "model_step",
        "gpu": meta["device_name"],
        "device": meta["device"],
        "versions": meta["versions"],
        "timestamp": meta["timestamp"],
        "total_s": meta["total_s"],
        "settings": settings,
        "configs": meta["configs"],
        "results": results,
    }
    md.with_suffix(".json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    print(f"wrote {md} and {md.with_suffix('.json').name} next to it")
    failed = [r for r in results if r["status"] == "error" or r.get("loss_ok") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

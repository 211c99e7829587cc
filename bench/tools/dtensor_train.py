"""Sharded training with tilegym_rms norms: FSDP2 and tensor/sequence parallel against one device.

A tiny Llama-style model (embedding, 2 blocks of causal attention and SwiGLU MLP, each behind a
``tilegym_rms.RMSNorm``, a final norm and an LM head) trains a few steps under each layout below,
and every step's loss and the first step's gradients are compared with the same model trained
unsharded on this rank's device on the same global batch:

* ``tp``: a 1-D mesh of all ranks, ``parallelize_module`` as torchtitan does it: ColwiseParallel /
  RowwiseParallel on the linears, SequenceParallel on the norms (they get DTensor activations sharded
  on the sequence dim and replicated weights: tilegym_rms's DTensor sharding rules at work).
* ``fsdp``: ``fully_shard`` on a 1-D data-parallel mesh (the norms see plain local tensors).
* ``fsdp+tp``: a 2-D (dp, tp) mesh, tensor parallel inside, FSDP2 across (dp = world / tp).

Prints the losses, the max relative difference and PASS/FAIL per layout; exits non-zero on a fail.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
        torchrun --nproc_per_node 2 -m bench.tools.dtensor_train --device cuda
    torchrun --nproc_per_node 2 -m bench.tools.dtensor_train --device cpu     # gloo smoke test
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import tilegym_rms
from tilegym_rms.testing import rel_err

LAYOUTS = ("tp", "fsdp", "fsdp+tp")

# ------------------------------------------------------------------------------------------------
# The model
# ------------------------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        # -1 heads: under tensor parallel the column-sharded projections hold this rank's heads only.
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = rope(q), rope(k)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


def rope(t):
    """Rotary position embedding over (batch, heads, seq, head_dim)."""
    s, d = t.shape[-2], t.shape[-1]
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, device=t.device, dtype=torch.float32) / d))
    ang = torch.outer(torch.arange(s, device=t.device, dtype=torch.float32), inv)
    cos, sin = ang.cos().to(t.dtype), ang.sin().to(t.dtype)
    t1, t2 = t[..., 0::2], t[..., 1::2]
    return torch.stack((t1 * cos - t2 * sin, t1 * sin + t2 * cos), dim=-1).flatten(-2)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim, n_heads, hidden, eps):
        super().__init__()
        self.attention_norm = tilegym_rms.RMSNorm(dim, eps=eps)
        self.attention = Attention(dim, n_heads)
        self.ffn_norm = tilegym_rms.RMSNorm(dim, eps=eps)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class TinyLlama(nn.Module):
    def __init__(self, vocab=128, dim=64, n_heads=4, hidden=128, n_layers=2, eps=1e-6):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, hidden, eps) for _ in range(n_layers))
        self.norm = tilegym_rms.RMSNorm(dim, eps=eps)
        self.output = nn.Linear(dim, vocab, bias=False)
        with torch.no_grad():  # norm weights away from 1, so that a wrong dw shows in the loss
            for m in self.modules():
                if isinstance(m, tilegym_rms.RMSNorm):
                    m.weight.uniform_(0.5, 1.5)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


# ------------------------------------------------------------------------------------------------
# Parallel layouts
# ------------------------------------------------------------------------------------------------


def apply_tp(model, tp_mesh):
    """torchtitan's Llama plan: activations between blocks stay sharded on the sequence dim."""
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for block in model.layers:
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            },
        )


def apply_fsdp(model, dp_mesh):
    from torch.distributed.fsdp import fully_shard

    for block in model.layers:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def build(layout, reference, device_type, compile_backend):
    """A copy of ``reference`` laid out by ``layout``; returns (model, dp rank, dp size)."""
    world = dist.get_world_size()
    model = copy.deepcopy(reference)
    if layout == "tp":
        mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("tp",))
        apply_tp(model, mesh["tp"])
        dp_rank, dp_size = 0, 1
    elif layout == "fsdp":
        mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("dp",))
        apply_fsdp(model, mesh["dp"])
        dp_rank, dp_size = mesh["dp"].get_local_rank(), world
    else:
        tp = 2 if world % 2 == 0 else 1
        mesh = init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
        apply_tp(model, mesh["tp"])
        apply_fsdp(model, mesh["dp"])
        dp_rank, dp_size = mesh["dp"].get_local_rank(), world // tp
    if compile_backend != "none":
        # The norms alone: compiling a whole tensor-parallel block fails in torch 2.13's DTensor
        # backward ("'Tensor' object has no attribute '_local_tensor'") with torch.nn.RMSNorm too.
        for m in model.modules():
            if isinstance(m, tilegym_rms.RMSNorm):
                m.forward = torch.compile(m.forward, backend=compile_backend, fullgraph=True)
    return model, dp_rank, dp_size


# ------------------------------------------------------------------------------------------------
# Training and comparison
# ------------------------------------------------------------------------------------------------


def full(t):
    """The whole tensor behind a parameter or gradient (DTensor shards gathered, partial sums reduced)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def train(model, batches, lr, on_first_grads=None):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for step, (tokens, targets) in enumerate(batches):
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        if step == 0 and on_first_grads is not None:
            on_first_grads()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses


def record_norm_inputs(model):
    """Which kinds of tensor the norms were given (a DTensor and its placements, or a plain tensor)."""
    seen = set()

    def hook(_module, args):
        x = args[0]
        seen.add(f"DTensor{tuple(x.placements)}" if isinstance(x, DTensor) else "Tensor")

    for m in model.modules():
        if isinstance(m, tilegym_rms.RMSNorm):
            m.register_forward_pre_hook(hook)
    return seen


def run_layout(layout, reference, ref, batches, args, device):
    """Trains a copy of ``reference`` laid out by ``layout``; compares it with the unsharded run ``ref``."""
    rank = dist.get_rank()
    model, dp_rank, dp_size = build(layout, reference, device.type, args.compile)
    seen = record_norm_inputs(model)
    batch = batches[0][0].shape[0]
    if batch % dp_size:
        raise SystemExit(f"global batch {batch} does not split over {dp_size} data-parallel ranks")
    per = batch // dp_size
    local = [(t[dp_rank * per : (dp_rank + 1) * per], y[dp_rank * per : (dp_rank + 1) * per]) for t, y in batches]

    grads = {}

    def keep_grads():
        for name, p in model.named_parameters():
            grads[name] = full(p.grad)

    losses = train(model, local, args.lr, keep_grads)
    # Each data-parallel rank saw its part of the batch: the global loss is their mean.
    losses = torch.stack(losses)
    dist.all_reduce(losses, op=dist.ReduceOp.SUM)
    losses /= dist.get_world_size()  # tensor-parallel ranks hold equal copies, so this is the dp mean

    ref_losses = torch.stack(ref.losses)
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses.tolist(), ref_losses.tolist(), strict=True))
    grad_diff = max(rel_err(grads[name], ref.grads[name]) for name in ref.grads)
    params_after = {name: full(p.detach()) for name, p in model.named_parameters()}
    param_diff = max(rel_err(params_after[n], ref.params[n]) for n in ref.params)
    ok = loss_diff <= args.tol and grad_diff <= args.tol and param_diff <= args.tol
    if rank == 0:
        print(f"[{layout}] norm inputs: {', '.join(sorted(seen))}")
        print(f"[{layout}] losses:     {' '.join(f'{v:.6f}' for v in losses.tolist())}")
        print(f"[{layout}] reference:  {' '.join(f'{v:.6f}' for v in ref_losses.tolist())}")
        print(
            f"[{layout}] max rel diff: loss {loss_diff:.2e}, step-1 grads {grad_diff:.2e}, "
            f"params after {len(batches)} steps {param_diff:.2e} (tol {args.tol:.0e}): {'PASS' if ok else 'FAIL'}"
        )
    return ok


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, from {', '.join(LAYOUTS)}")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4, help="global batch (split over data-parallel ranks)")
    parser.add_argument("--seq", type=int, default=32, help="sequence length (split over tensor-parallel ranks)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--tol", type=float, default=None, help="max rel diff (default 1e-3 fp32, 5e-2 bf16)")
    parser.add_argument(
        "--compile", choices=("none", "aot_eager", "inductor"), default="none", help="torch.compile the norms"
    )
    args = parser.parse_args()
    args.tol = args.tol if args.tol is not None else (1e-3 if args.dtype == "float32" else 5e-2)
    layouts = [s for s in args.layouts.split(",") if s]
    unknown = set(layouts) - set(LAYOUTS)
    if unknown:
        parser.error(f"unknown layouts {sorted(unknown)}; choose from {', '.join(LAYOUTS)}")

    if args.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        # Exact fp32 matmuls: TF32 would swamp the differences this compares.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)

    torch.manual_seed(0)
    reference = TinyLlama().to(device=device, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    vocab = reference.output.out_features
    batches = []
    for _ in range(args.steps):
        tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g).to(device)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    if rank == 0:
        backend = tilegym_rms.dispatch.resolve_backend(device)
        print(
            f"world {world} on {args.device} ({dist.get_backend()}), tilegym_rms backend {backend!r}, "
            f"{args.dtype}, {args.steps} steps, batch {args.batch} x seq {args.seq}, torch {torch.__version__}"
        )

    # The unsharded run on this rank's device: losses, first-step grads and final params by name.
    ref_model = copy.deepcopy(reference)
    ref = argparse.Namespace()

    def keep_ref_grads():
        ref.grads = {n: p.grad.detach().clone() for n, p in ref_model.named_parameters()}

    ref.losses = train(ref_model, batches, args.lr, keep_ref_grads)
    ref.params = {n: p.detach().clone() for n, p in ref_model.named_parameters()}

    results = {layout: run_layout(layout, reference, ref, batches, args, device) for layout in layouts}
    ok = all(results.values())
    if rank == 0:
        summary = ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in results.items())
        print(f"{'PASS' if ok else 'FAIL'}: {summary}")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

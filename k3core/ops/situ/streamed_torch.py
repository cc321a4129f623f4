"""SiTU-GLU in plain torch, streamed over row chunks (CPU, or CUDA without triton).

Owns: the forward and backward on x2d ``[R, 2H]`` through one fixed-size fp32 workspace, so no
full-size fp32 temporary ever exists, and the workspace budget. Does not own: autograd wiring and
backend choice (`api.py`), the reference (`naive.py`).
"""

from __future__ import annotations

import torch

__all__ = [
    "WORKSPACE_BYTES",
    "CUDA_WORKSPACE_BYTES",
    "FWD_BUFFERS",
    "BWD_BUFFERS",
    "rows_per_chunk",
    "situ_glu_fwd_torch",
    "situ_glu_bwd_torch",
]

# Upper bound on the fp32 workspace of the streamed torch path (all chunk temporaries together).
# A few MiB keeps a chunk in the CPU's caches; larger on CUDA, where each chunk costs ~15 kernel
# launches and small chunks would be launch-bound. One row is always processed, so a row wider
# than the budget (H > budget / (buffers * 4 bytes)) uses one row's worth instead.
WORKSPACE_BYTES = 4 * 2**20
CUDA_WORKSPACE_BYTES = 64 * 2**20
# Number of [rows, H] fp32 buffers in the workspace of forward and backward.
FWD_BUFFERS = 3
BWD_BUFFERS = 5


def rows_per_chunk(hidden: int, workspace_bytes: int, buffers: int, itemsize: int = 4) -> int:
    """Rows of a chunk such that `buffers` [rows, hidden] temporaries fit in `workspace_bytes`."""
    return max(1, workspace_bytes // (buffers * hidden * itemsize))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _workspace(rows: int, hidden: int, buffers: int, x: torch.Tensor, workspace_bytes: int) -> torch.Tensor:
    dtype = _compute_dtype(x.dtype)
    rows = min(rows, rows_per_chunk(hidden, workspace_bytes, buffers, dtype.itemsize))
    return torch.empty(buffers, rows, hidden, dtype=dtype, device=x.device)


def situ_glu_fwd_torch(x2d: torch.Tensor, beta: float, linear_beta: float, workspace_bytes: int) -> torch.Tensor:
    """Streamed forward. x2d: [R, 2H] contiguous -> out: [R, H] in x2d.dtype.

    Every op below writes into the workspace (out= or in place), so the only allocations are `out`
    and the workspace. The op order matches `situ_glu_reference`, so fp32 results agree with it
    to the last bit or so (only vectorised vs scalar loops may differ).
    """
    R, H = x2d.shape[0], x2d.shape[1] // 2
    out = torch.empty(R, H, dtype=x2d.dtype, device=x2d.device)
    if out.numel() == 0:
        return out
    ws = _workspace(R, H, FWD_BUFFERS, x2d, workspace_bytes)
    step = ws.shape[1]
    for r0 in range(0, R, step):
        r1 = min(r0 + step, R)
        g, u, t = ws[0, : r1 - r0], ws[1, : r1 - r0], ws[2, : r1 - r0]
        g.copy_(x2d[r0:r1, :H])
        u.copy_(x2d[r0:r1, H:])
        torch.div(g, beta, out=t).tanh_().mul_(beta)  # beta * tanh(g / beta)
        t.mul_(g.sigmoid_())  # a
        u.div_(linear_beta).tanh_().mul_(linear_beta)  # b
        # (not mul(out=out[r0:r1]): on CPU a dtype-casting out= allocates a temporary)
        out[r0:r1].copy_(t.mul_(u))
    return out


def situ_glu_bwd_torch(
    x2d: torch.Tensor, grad2d: torch.Tensor, beta: float, linear_beta: float, workspace_bytes: int
) -> torch.Tensor:
    """Streamed backward. x2d: [R, 2H] contiguous, grad2d: [R, H] any strides -> d_x [R, 2H].

    With tg = tanh(g/beta), s = sigmoid(g), tu = tanh(u/lb), a = beta*tg*s, b = lb*tu:
        d_up   = grad * a * (1 - tu^2)
        d_gate = grad * b * s * ((1 - tg^2) + beta * tg * (1 - s))
    Every factor is bounded (|tg|, |tu|, s, 1 - s in [0, 1]), so saturated inputs give exact
    zeros or finite values, never inf/NaN.
    """
    R, H = x2d.shape[0], x2d.shape[1] // 2
    dx = torch.empty_like(x2d)
    if dx.numel() == 0:
        return dx
    ws = _workspace(R, H, BWD_BUFFERS, x2d, workspace_bytes)
    step = ws.shape[1]
    for r0 in range(0, R, step):
        r1 = min(r0 + step, R)
        tg, s, tu, go, w = (ws[i, : r1 - r0] for i in range(BWD_BUFFERS))
        s.copy_(x2d[r0:r1, :H])
        torch.div(s, beta, out=tg).tanh_()
        s.sigmoid_()
        tu.copy_(x2d[r0:r1, H:]).div_(linear_beta).tanh_()
        go.copy_(grad2d[r0:r1]).mul_(s)  # grad * s, a factor of both halves
        # d_up = beta * tg * (grad * s) * (1 - tu^2)
        torch.mul(tu, tu, out=w)
        torch.addcmul(go, go, w, value=-1.0, out=w).mul_(tg)
        dx[r0:r1, H:].copy_(w.mul_(beta))
        # d_gate = lb * tu * (grad * s) * (1 - tg^2 + beta * tg * (1 - s)), with the bracket
        # computed as -(tg * (tg + beta * s - beta) - 1) and its sign folded into -lb
        torch.add(tg, s, alpha=beta, out=w).sub_(beta).mul_(tg).sub_(1.0)
        w.mul_(tu).mul_(go)
        dx[r0:r1, :H].copy_(w.mul_(-linear_beta))
    return dx

"""Input validation and backend choice for ``kda`` and ``kda_step`` (validated once, at the edge).

Errors name the argument, its shape and the expected shape, e.g.
``kda: argument `beta` has shape (2, 64, 4, 1); expected [B, T, H] = (2, 64, 4)``.
Only shapes, dtypes and devices are checked, never values of device tensors (that would force a
host sync); ``cu_seqlens`` values are checked on the host: ``cu_seqlens`` itself when it lives
there, else its host copy ``cu_seqlens_cpu`` when given.
"""

from __future__ import annotations

import torch

from k3core.ops.kda._fla import require as require_fla

BACKENDS = ("auto", "torch", "naive", "fla")


def _is_tensor(fn: str, name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: argument `{name}` must be a torch.Tensor, got {type(x).__name__}")


def _expect(fn: str, name: str, x: torch.Tensor, desc: str, expected: tuple) -> None:
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{fn}: argument `{name}` has shape {tuple(x.shape)}; expected {desc} = {tuple(expected)}")


def _expect_rank(fn: str, name: str, x: torch.Tensor, desc: str) -> None:
    rank = desc.count(",") + 1
    if x.dim() != rank:
        raise ValueError(f"{fn}: argument `{name}` has shape {tuple(x.shape)}; expected {rank}-D {desc}")


def _floating(fn: str, name: str, x: torch.Tensor) -> None:
    if not x.is_floating_point():
        raise ValueError(f"{fn}: argument `{name}` must be floating point, got {x.dtype}")


def _check_common(fn, q, k, v, g, beta, desc):
    """q, k, g ``[B, T, H, K]``, v ``[B, T, H, V]``, beta ``[B, T, H]`` (desc: the 4-D names)."""
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _is_tensor(fn, name, x)
        _floating(fn, name, x)
    _expect_rank(fn, "q", q, desc["q"])
    _expect(fn, "k", k, desc["q"], q.shape)
    _expect_rank(fn, "v", v, desc["v"])
    _expect(fn, "v", v, desc["v"], (*q.shape[:-1], v.shape[-1]))
    _expect(fn, "g", g, desc["q"], q.shape)
    _expect(fn, "beta", beta, desc["beta"], q.shape[:-1])
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{fn}: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        if x.device != q.device:
            raise ValueError(f"{fn}: argument `{name}` is on {x.device}, q is on {q.device}")


_DENSE = {"q": "[B, T, H, K]", "v": "[B, T, H, V]", "beta": "[B, T, H]"}


def check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, lower_bound,
                     cu_seqlens_cpu=None) -> None:
    fn = "kda"
    _check_common(fn, q, k, v, g, beta, _DENSE)
    B, T, H, K = q.shape
    V = v.shape[-1]
    N = B
    if cu_seqlens is None and cu_seqlens_cpu is not None:
        raise ValueError(f"{fn}: argument `cu_seqlens_cpu` is the host copy of `cu_seqlens`; pass both")
    if cu_seqlens is not None:
        _is_tensor(fn, "cu_seqlens", cu_seqlens)
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
            raise ValueError(f"{fn}: argument `cu_seqlens` must be a 1-D integer tensor [N + 1], "
                             f"got shape {tuple(cu_seqlens.shape)} dtype {cu_seqlens.dtype}")
        if B != 1:
            raise ValueError(f"{fn}: with `cu_seqlens` the sequences are packed along T, so q must have "
                             f"B == 1; q has shape {tuple(q.shape)}")
        N = cu_seqlens.numel() - 1
        host = cu_seqlens if cu_seqlens.device.type == "cpu" else cu_seqlens_cpu
        if cu_seqlens_cpu is not None:
            _is_tensor(fn, "cu_seqlens_cpu", cu_seqlens_cpu)
            if (cu_seqlens_cpu.device.type != "cpu" or cu_seqlens_cpu.shape != cu_seqlens.shape
                    or cu_seqlens_cpu.is_floating_point()):
                raise ValueError(f"{fn}: argument `cu_seqlens_cpu` must be `cu_seqlens` on the host, got "
                                 f"{cu_seqlens_cpu.dtype} {tuple(cu_seqlens_cpu.shape)} on {cu_seqlens_cpu.device}"
                                 f" for `cu_seqlens` {tuple(cu_seqlens.shape)}")
            host = cu_seqlens_cpu
        if host is not None:
            cu = host.tolist()
            if cu[0] != 0 or cu[-1] != T or any(a > b for a, b in zip(cu[:-1], cu[1:])):
                raise ValueError(f"{fn}: `cu_seqlens` must rise from 0 to T = {T} without decreasing, got {cu}")
    if initial_state is not None:
        _is_tensor(fn, "initial_state", initial_state)
        _floating(fn, "initial_state", initial_state)
        desc = "[N, H, K, V] (N = number of sequences)" if cu_seqlens is not None else "[B, H, K, V]"
        _expect(fn, "initial_state", initial_state, desc, (N, H, K, V))
        if initial_state.device != q.device:
            raise ValueError(f"{fn}: argument `initial_state` is on {initial_state.device}, q is on {q.device}")
    if (A_log is None) != (dt_bias is None):
        raise ValueError(f"{fn}: pass `A_log` and `dt_bias` together (the raw-gate mode), or neither")
    if A_log is not None:
        if lower_bound is None:
            raise ValueError(f"{fn}: the raw-gate mode (`A_log`, `dt_bias`) needs `lower_bound`")
        _is_tensor(fn, "A_log", A_log)
        _is_tensor(fn, "dt_bias", dt_bias)
        _expect(fn, "A_log", A_log, "[H]", (H,))
        _expect(fn, "dt_bias", dt_bias, "[H * K]", (H * K,))
    if lower_bound is not None and not float(lower_bound) < 0:
        raise ValueError(f"{fn}: `lower_bound` must be < 0, got {lower_bound}")


def check_step_inputs(q, k, v, g, beta, state, single: bool) -> None:
    """Single token: q ``[B, H, K]``...; few tokens: q ``[B, T, H, K]``... (``single`` says which)."""
    fn = "kda_step"
    desc = ({"q": "[B, H, K]", "v": "[B, H, V]", "beta": "[B, H]"} if single else _DENSE)
    _check_common(fn, q, k, v, g, beta, desc)
    if state is not None:
        _is_tensor(fn, "state", state)
        _floating(fn, "state", state)
        B, H, K, V = q.shape[0], q.shape[-2], q.shape[-1], v.shape[-1]
        _expect(fn, "state", state, "[B, H, K, V]", (B, H, K, V))
        if state.device != q.device:
            raise ValueError(f"{fn}: argument `state` is on {state.device}, q is on {q.device}")


def resolve_backend(fn: str, backend: str, q: torch.Tensor, *, allow_naive: bool,
                    prefer_torch: bool = False) -> str:
    """"auto" -> "fla" for CUDA tensors (needs fla; "torch" when ``prefer_torch``), else "torch"."""
    allowed = BACKENDS if allow_naive else tuple(b for b in BACKENDS if b != "naive")
    if backend not in allowed:
        raise ValueError(f"{fn}: backend must be one of {allowed}, got {backend!r}")
    if backend == "auto":
        if not q.is_cuda or prefer_torch:
            return "torch"
        backend = "fla"
    if backend == "fla":
        if not q.is_cuda:
            raise ValueError(f"{fn}: backend='fla' needs CUDA tensors, q is on {q.device}")
        if q.dtype == torch.float64:
            raise ValueError(f"{fn}: fla's kernels do not take float64; pass backend='torch' for fp64 on CUDA")
        require_fla(fn)
    return backend

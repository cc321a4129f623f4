"""Chunked KDA in plain torch (CPU, or CUDA without fla): exact, differentiable by autograd.

The sequence is cut into chunks of C = 64 tokens. Within a chunk, with Gamma_r = sum_{s<=r} g_s
(the cumulative log decay from the chunk start, per key dimension) and the state S_0 at the chunk
start, the delta rule unrolls to (WY / UT representation, as in the Gated DeltaNet and KDA papers
and fla's ``naive_chunk_kda``):

    A[r, j]  = beta_r * sum_d k_r[d] k_j[d] exp(Gamma_r[d] - Gamma_j[d])        for j <  r
    P[r, j]  =          sum_d q_r[d] k_j[d] exp(Gamma_r[d] - Gamma_j[d])        for j <= r
    (I + A) [W | U] = diag(beta) [k * exp(Gamma) | v]        (unit lower-triangular system)
    E        = U - W S_0                                       (the per-token corrections)
    O        = (q * exp(Gamma)) S_0 + P E
    S_C      = exp(Gamma_C) * S_0 + (k * exp(Gamma_C - Gamma))^T E

Everything except the (short) loop over chunks is batched over all chunks at once.

Numerics: the decayed Gram matrices need exp(Gamma_r - Gamma_j), and Gamma can reach -5 * 64 =
-320 within a chunk, so the factored form ``(x * exp(Gamma)) @ (y * exp(-Gamma))^T`` would overflow
(and pairwise [C, C, K] decays are slow). ``_decayed_grams`` factors through reference points
instead: in 16-token blocks when every block decays by at most e^-80 in fp32 (always true for
K3's safe gate, g >= -5; factors <= e^40), else by recursive halving with every factor <= 1, which
is exact for any g <= 0. Reference points cancel in the products and carry no gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3core.ops.kda._common import compute_dtype, l2norm

CHUNK_SIZE = 64


def chunk_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA, same contract as ``naive_kda`` (shapes ``[B, T, H, K]``, state ``[N, H, K, V]``).

    Inputs are assumed validated (``kda`` does that). ``cu_seqlens`` sequences are scattered into a
    zero-padded batch ``[N, T_max, H, *]``; a padded token has g = 0, beta = 0, k = 0, which leaves
    the state unchanged, so final states are exact.
    """
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if cu_seqlens is not None:
        return _chunk_varlen(q, k, v, g, beta, scale, initial_state, output_final_state,
                             use_qk_l2norm, cu_seqlens, chunk_size)
    o, s = _chunk_dense(q, k, v, g, beta, scale, initial_state, use_qk_l2norm, chunk_size)
    return o, (s if output_final_state else None)


def _chunk_dense(q, k, v, g, beta, scale, initial_state, use_qk_l2norm, C):
    out_dtype, dt = q.dtype, compute_dtype(q)
    B, T, H, K = q.shape
    V = v.shape[-1]
    S = q.new_zeros(B, H, K, V, dtype=dt) if initial_state is None else initial_state.to(dt)
    if T == 0:
        return v.new_zeros(B, 0, H, V, dtype=out_dtype), S
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q, scale=scale), l2norm(k)
    else:
        q = q * scale

    pad = (-T) % C
    if pad:  # padded tokens: k = 0, beta = 0, g = 0 -> the state passes through unchanged
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    N = (T + pad) // C

    def chunks(x):  # [B, T, H, D] -> [B, H, N, C, D], contiguous for the batched matmuls
        return x.reshape(B, N, C, H, -1).permute(0, 3, 1, 2, 4).contiguous()

    q, k, v, g = (chunks(x) for x in (q, k, v, g))
    beta = beta.reshape(B, N, C, H).permute(0, 3, 1, 2)              # [B, H, N, C]
    gc = g.cumsum(dim=-2)                                             # Gamma, [B, H, N, C, K]

    P, A = _decayed_grams(q, k, gc)                                   # [B, H, N, C, C] each
    Tmat = _unit_lower_inverse(A * beta[..., :, None]) * beta[..., None, :]  # (I + A)^-1 diag(beta)
    eg = gc.exp()
    W = Tmat @ (k * eg)                                               # [B, H, N, C, K]
    U = Tmat @ v                                                      # [B, H, N, C, V]
    q_dec = q * eg                                                    # q_r * exp(Gamma_r)
    g_last = gc[..., -1:, :]                                          # [B, H, N, 1, K]
    k_dec = (k * (g_last - gc).exp()).transpose(-1, -2)               # [B, H, N, K, C]
    state_dec = g_last.exp().transpose(-1, -2)                        # [B, H, N, K, 1]

    starts, corrections = [], []
    # unbind (not x[:, :, n]): its backward is one stack, where N selects would each allocate and
    # add a full-size zero gradient
    for U_n, W_n, d_n, k_n in zip(*(x.unbind(dim=2) for x in (U, W, state_dec, k_dec))):
        E = U_n - W_n @ S                                             # the only sequential part
        starts.append(S)
        corrections.append(E)
        S = d_n * S + k_n @ E
    # outputs of all chunks at once, from each chunk's start state and corrections
    o = q_dec @ torch.stack(starts, dim=2) + P @ torch.stack(corrections, dim=2)  # [B, H, N, C, V]
    o = o.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, :T]
    return o.to(out_dtype), S


# Largest in-block log-decay span (Gamma_first - Gamma_last of a 16-token block) for which the
# blocked Gram factors, up to exp(span / 2), stay far from overflow (fp32 max ~ e^88).
_SAFE_SPAN = {torch.float32: 80.0, torch.float64: 600.0}
_BLOCK = 16


def _decayed_grams(q, k, gc):
    """P (inclusive) and A (strict, without beta) lower-triangular decayed Gram matrices.

    q, k, gc: ``[..., C, K]``. Returns ``[..., C, C]`` each, with
    ``X[r, j] = sum_d x_r[d] k_j[d] exp(gc_r[d] - gc_j[d])`` for x in (q, k).
    Uses the fast blocked form when every 16-token block decays by at most ``_SAFE_SPAN`` (always
    true for K3's safe gate, g >= -5), else the recursive-halving form, exact for any g <= 0.
    """
    C = q.shape[-2]
    if C % _BLOCK == 0:
        gb = gc.unflatten(-2, (C // _BLOCK, _BLOCK))
        span = (gb[..., 0, :] - gb[..., -1, :]).detach().max() if gc.numel() else gc.new_zeros(())
        if float(span) <= _SAFE_SPAN[gc.dtype]:
            return _decayed_grams_blocked(q, k, gc, _BLOCK)
    return _decayed_grams_halving(q, k, gc)


def _decayed_grams_blocked(q, k, gc, s):
    """Blocks of s tokens; ``exp(gc_r - gc_j) = exp(gc_r - mid_a) exp(mid_a - last_b) exp(last_b - gc_j)``
    for row block a, column block b <= a, with mid_a the midpoint of block a's log decay and last_b
    block b's last Gamma. The column factor is <= 1, the block factor <= 1 for b < a; the row and
    diagonal-block factors are bounded by exp(span / 2). One matmul per row block yields full rows.
    """
    C = q.shape[-2]
    ns = C // s
    gb = gc.unflatten(-2, (ns, s))                                    # [..., ns, s, K]
    # reference points cancel in the product: detached, so no gradient has to cancel through them
    last = gb[..., -1, :].detach()                                    # [..., ns, K]
    mid = 0.5 * (gb[..., 0, :].detach() + last)
    row_f = (gb - mid[..., :, None, :]).exp()                         # [..., ns, s, K]
    cols = k.unflatten(-2, (ns, s)) * (last[..., :, None, :] - gb).exp()
    tri = torch.ones(ns, ns, dtype=torch.bool, device=q.device).tril()
    blk = (mid[..., :, None, :] - last[..., None, :, :]).masked_fill(~tri[..., None], float("-inf"))
    # cols seen by row block a: [..., ns(a), ns(b) * s = C, K], zero for b > a
    cols_a = (cols[..., None, :, :, :] * blk.exp()[..., None, :]).flatten(-3, -2)
    cols_t = cols_a.transpose(-1, -2)
    P = ((q.unflatten(-2, (ns, s)) * row_f) @ cols_t).reshape(*q.shape[:-2], C, C)
    A = ((k.unflatten(-2, (ns, s)) * row_f) @ cols_t).reshape(*q.shape[:-2], C, C)
    incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = incl.tril(-1)
    # masked_fill also clears the (finite or inf) products above the diagonal of diagonal blocks
    return P.masked_fill(~incl, 0.0), A.masked_fill(~strict, 0.0)


def _decayed_grams_halving(q, k, gc):
    """``_decayed_grams`` for any g <= 0; C a power of two.

    q, k, gc: ``[..., C, K]``. Returns ``[..., C, C]`` each, with
    ``X[r, j] = sum_d x_r[d] k_j[d] exp(gc_r[d] - gc_j[d])`` for x in (q, k).

    Recursive halving: at each level every diagonal block of size 2h is split in two, and its
    lower-left h x h block is one matmul of factors taken relative to ``ref``, the Gamma at the end
    of the first half (rows exp(gc_r - ref) <= 1, columns exp(ref - gc_j) <= 1, for any g <= 0).
    The levels tile the strict lower triangle exactly; the diagonal is ``x_r . k_r`` (decay 1).
    """
    C = q.shape[-2]
    P_parts, A_parts = [], []
    h = C // 2
    while h >= 1:
        nb = C // (2 * h)
        gb, qb, kb = (x.unflatten(-2, (nb, 2 * h)) for x in (gc, q, k))   # [..., nb, 2h, K]
        ref = gb[..., h - 1 : h, :].detach()  # a reference point: cancels in the product
        row_dec = (gb[..., h:, :] - ref).exp()
        rows = torch.cat([qb[..., h:, :] * row_dec, kb[..., h:, :] * row_dec], dim=-2)
        cols = kb[..., :h, :] * (ref - gb[..., :h, :]).exp()
        blk = rows @ cols.transpose(-1, -2)                                 # [..., nb, 2h, h]
        P_parts.append(blk[..., :h, :].flatten(-3))
        A_parts.append(blk[..., h:, :].flatten(-3))
        h //= 2
    P_parts.append((q * k).sum(dim=-1))
    idx_P, idx_A = _gram_positions(C, q.device)
    lead = q.shape[:-2]
    P = q.new_zeros(*lead, C * C).index_copy(-1, idx_P, torch.cat(P_parts, dim=-1))
    A = q.new_zeros(*lead, C * C).index_copy(-1, idx_A, torch.cat(A_parts, dim=-1))
    return P.view(*lead, C, C), A.view(*lead, C, C)


def _unit_lower_inverse(A: torch.Tensor) -> torch.Tensor:
    """``(I + A)^-1`` for strictly lower-triangular A ``[..., C, C]`` (C a power of two).

    Block recursion from 1 x 1 diagonal blocks upwards: the inverse of [[M11, 0], [M21, M22]] is
    [[X11, 0], [-X22 M21 X11, X22]]: log2(C) levels of batched matmuls, no per-row loop. Chosen
    over ``torch.linalg.solve_triangular`` on the benchmark's timings (docs/results/kda_cpu.md).
    """
    C = A.shape[-1]
    lead = A.shape[:-2]
    X = torch.ones(*lead, C, 1, 1, dtype=A.dtype, device=A.device)  # diagonal blocks of size h
    h = 1
    while h < C:
        nb = C // (2 * h)
        blocks = A.unflatten(-2, (nb, 2 * h)).unflatten(-1, (nb, 2 * h)).diagonal(dim1=-4, dim2=-2)
        M21 = blocks.movedim(-1, -3)[..., h:, :h]                     # [..., nb, h, h]
        X11, X22 = X[..., 0::2, :, :], X[..., 1::2, :, :]
        X21 = -(X22 @ M21 @ X11)
        top = torch.cat([X11, torch.zeros_like(X11)], dim=-1)
        X = torch.cat([top, torch.cat([X21, X22], dim=-1)], dim=-2)   # [..., nb, 2h, 2h]
        h *= 2
    return X.squeeze(-3)


def _gram_positions(C: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat positions (row * C + col) of the values ``_decayed_grams`` produces, in its order."""
    parts = []
    h = C // 2
    while h >= 1:
        b = torch.arange(C // (2 * h))[:, None, None] * 2 * h
        r = torch.arange(h)[None, :, None]
        c = torch.arange(h)[None, None, :]
        parts.append(((b + h + r) * C + (b + c)).flatten())
        h //= 2
    strict = torch.cat(parts)
    diag = torch.arange(C) * (C + 1)
    return torch.cat([strict, diag]).to(device), strict.to(device)


def _chunk_varlen(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm,
                  cu_seqlens, C):
    """Packed sequences (B == 1) -> a zero-padded batch [N, T_max, ...] -> back to packed order."""
    bounds = cu_seqlens.tolist()
    lens = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    Nseq, T_max = len(lens), max(lens, default=0)
    # destination row (in the flattened [N * T_max] padded batch) of every packed token
    dest = torch.cat([n * T_max + torch.arange(L) for n, L in enumerate(lens)]).to(q.device)

    def scatter(x):  # [1, T, ...] -> [N, T_max, ...]
        out = x.new_zeros(Nseq * T_max, *x.shape[2:])
        return out.index_copy(0, dest, x[0]).reshape(Nseq, T_max, *x.shape[2:])

    o, s = _chunk_dense(scatter(q), scatter(k), scatter(v), scatter(g), scatter(beta), scale,
                        initial_state, use_qk_l2norm, C)
    o = o.reshape(Nseq * T_max, *o.shape[2:])[dest].unsqueeze(0)
    return o, (s if output_final_state else None)

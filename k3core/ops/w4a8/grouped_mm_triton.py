"""Triton kernel for the W4A8 expert matmul (the contract and the torch path: ``api.py``).

Imported lazily by ``api.py``: importing this module needs triton. One program computes a
``[BLOCK_N rows of one expert, BLOCK_M outputs]`` tile: along K it loads FP8 activation bytes (and their
E8M0 block scales in block32 mode), the packed MXFP4 bytes and E8M0 scales of that expert's
weight, decodes the weight tile in registers (E2M1 code -> fp32 bits, times 2^(b-127) built from
bits) and accumulates ``tl.dot`` in fp32; the per-token activation scale multiplies the finished
tile. Nothing decoded is written to memory: the weight traffic is the packed 4.25 bits per weight.

The dot runs in bf16 (``DOT_BF16``, the default on GPU: every decoded value is exact in bf16, so
tensor cores lose nothing but accumulation order) or fp32 ("ieee"; used under
``TRITON_INTERPRET=1``, whose bf16 dot is not usable, so the kernel's logic can be checked on a CPU).
Hopper has FP8 tensor cores, but MXFP4's scales change every 32 inputs along K, which an FP8 MMA
cannot apply inside the reduction; bf16 MMAs with the weight decoded on the fly keep the
result exact and the memory traffic at 4 bits. Offsets are int64 (an expert stack passes 2^31).
K is a compile-time constant (a model has two: the latent width and the expert width), which also
keeps the kernel runnable under the interpreter.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Tile sizes: 64 x 128 outputs, 64 inputs per step (two MXFP4 scale blocks); a decode step with
# few rows per expert uses 16-row tiles (the smallest tl.dot accepts) to waste less MMA work.
BLOCK_N, BLOCK_N_SMALL, BLOCK_M, BLOCK_K, NUM_WARPS = 64, 16, 128, 64, 4


@triton.jit
def _e8m0(b):
    """int32 E8M0 bytes -> fp32 2^(b-127) (b = 0 is the subnormal 2^-127, b = 255 NaN)."""
    bits = tl.where(b == 0, 0x400000, tl.where(b == 255, 0x7FC00000, b << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e2m1(code):
    """int32 FP4 codes (sign << 3 | magnitude) -> fp32 values {0, 0.5, 1, 1.5, 2, 3, 4, 6} with sign."""
    mag = code & 7
    ex = mag >> 1
    m = mag & 1
    bits = tl.where(ex == 0, tl.where(m == 1, 126 << 23, 0), ((ex + 126) << 23) | (m << 22))
    bits = bits | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e4m3(byte):
    """int32 FP8 E4M3 (fn) bytes -> fp32: (1 + m/8) * 2^(e-7), subnormals m * 2^-9, 0x7F/0xFF NaN.
    Built as fp32 bits with integer arithmetic only (a subnormal m = 2^p * (1 + f) becomes the normal
    fp32 (1 + f) * 2^(p-9)), so it behaves the same on every triton version and under the interpreter."""
    e = (byte >> 3) & 0xF
    m = byte & 7
    normal = ((e + 120) << 23) | (m << 20)
    p = (m >= 2).to(tl.int32) + (m >= 4).to(tl.int32)
    subnormal = tl.where(m == 0, 0, ((118 + p) << 23) | ((m << (23 - p)) & 0x7FFFFF))
    bits = tl.where(e == 0, subnormal, normal)
    bits = tl.where((byte & 0x7F) == 0x7F, 0x7FC00000, bits)
    bits = bits | ((byte & 0x80) << 24)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _w4a8_grouped_kernel(q_ptr, s_ptr, w_ptr, ws_ptr, out_ptr, tile_ptr, M, K: tl.constexpr,
                         stride_qn, stride_sn, stride_we, stride_wm, stride_wse, stride_wsm, stride_on,
                         ACT_BLOCK32: tl.constexpr, DOT_BF16: tl.constexpr,
                         BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
    t = tl.program_id(0)
    pm = tl.program_id(1)
    e = tl.load(tile_ptr + t * 3).to(tl.int64)
    r0 = tl.load(tile_ptr + t * 3 + 1)
    r1 = tl.load(tile_ptr + t * 3 + 2)
    if r0 >= r1:  # a spare tile of the fixed-size table (``device_tiles``): nothing to compute
        return
    rows = r0 + tl.arange(0, BN)
    rmask = rows < r1
    rows64 = rows.to(tl.int64)
    cols = pm * BM + tl.arange(0, BM)
    cmask = cols < M
    cols64 = cols.to(tl.int64)
    kk = tl.arange(0, BK)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + kk
        kmask = ks < K
        amask = rmask[:, None] & kmask[None, :]
        a = _e4m3(tl.load(q_ptr + rows64[:, None] * stride_qn + ks[None, :], mask=amask, other=0).to(tl.int32))
        if ACT_BLOCK32:
            sb = tl.load(s_ptr + rows64[:, None] * stride_sn + (ks // 32)[None, :], mask=amask, other=127)
            a = a * _e8m0(sb.to(tl.int32))
        wmask = kmask[:, None] & cmask[None, :]
        byte = tl.load(w_ptr + e * stride_we + cols64[None, :] * stride_wm + (ks // 2)[:, None], mask=wmask, other=0)
        code = (byte.to(tl.int32) >> ((ks % 2) * 4)[:, None]) & 0xF  # lower index in the low nibble
        wsb = tl.load(ws_ptr + e * stride_wse + cols64[None, :] * stride_wsm + (ks // 32)[:, None], mask=wmask, other=127)
        w = _e2m1(code) * _e8m0(wsb.to(tl.int32))  # [BK, BM]: W^T tile, exact in fp32 and bf16
        if DOT_BF16:
            acc += tl.dot(a.to(tl.bfloat16), w.to(tl.bfloat16))
        else:
            acc += tl.dot(a, w, input_precision="ieee")
    if not ACT_BLOCK32:
        sc = tl.load(s_ptr + rows64 * stride_sn, mask=rmask, other=1.0)
        acc = acc * sc[:, None]
    omask = rmask[:, None] & cmask[None, :]
    tl.store(out_ptr + rows64[:, None] * stride_on + cols64[None, :], acc.to(out_ptr.dtype.element_ty), mask=omask)


def _tiles(counts: list[int], bn: int, device) -> torch.Tensor:
    """[T, 3] int32 (expert, first row, end row) of every BN-row tile of the sorted rows, built on
    the host from the counts: the reference ``device_tiles`` is held to."""
    tiles, start = [], 0
    for e, c in enumerate(counts):
        for r in range(start, start + c, bn):
            tiles.append((e, r, start + c))
        start += c
    return torch.tensor(tiles, dtype=torch.int32).reshape(-1, 3).to(device)


def max_tiles(n: int, experts: int, bn: int) -> int:
    """An upper bound on the BN-row tiles of ``n`` rows over ``experts`` experts, from shapes alone:
    sum_e ceil(c_e / bn) <= sum_e (c_e / bn + 1) rounded, at most ceil(n / bn) + experts."""
    return -(-n // bn) + experts


def device_tiles(counts: torch.Tensor, n: int, bn: int) -> torch.Tensor:
    """``_tiles`` computed where ``counts`` lives, with no read back to the host: ``[max_tiles, 3]``
    int32, the real tiles first in ``_tiles``' order, then spare tiles ``(E - 1, 0, 0)`` (empty: the
    kernel returns at once). Its shape depends on ``n`` and ``E`` only, so a CUDA graph can capture
    the matmul and replay it on other counts."""
    E = counts.numel()
    c = counts.to(torch.int64)
    per = (c + bn - 1) // bn  # tiles of each expert
    last = torch.cumsum(per, 0)  # one past each expert's last tile
    starts = torch.cumsum(c, 0) - c  # each expert's first row
    t = torch.arange(max_tiles(n, E, bn), device=counts.device)
    e = torch.searchsorted(last, t, right=True)  # the expert whose tiles hold t; E past the last tile
    real = e < E
    e = e.clamp(max=E - 1)
    r0 = starts[e] + (t - (last[e] - per[e])) * bn
    r1 = starts[e] + c[e]
    zero = torch.zeros_like(r0)
    return torch.stack((e, torch.where(real, r0, zero), torch.where(real, r1, zero)), 1).to(torch.int32)


def tile_rows(n: int, experts: int) -> int:
    """Rows per tile from shapes alone: 16-row tiles (the smallest ``tl.dot`` takes) while experts
    average at most 16 rows (decode steps), else 64."""
    return BLOCK_N_SMALL if n <= BLOCK_N_SMALL * experts else BLOCK_N


def w4a8_grouped_mm_triton(q: torch.Tensor, s: torch.Tensor, counts: torch.Tensor, packed: torch.Tensor,
                           wscale: torch.Tensor, out_dtype: torch.dtype, dot_bf16: bool | None = None) -> torch.Tensor:
    """q fp8 ``[n, K]`` with its scale (fp32 ``[n, 1]`` per token or uint8 ``[n, K/32]``), rows sorted by
    expert (``counts [E]``, summing to n), packed ``[E, M, K/2]``, wscale ``[E, M, K/32]`` -> ``[n, M]``
    ``out_dtype``. Nothing reads ``counts`` on the host: the tile table is built on the device, sized
    by ``n`` and ``E`` (``device_tiles``), so the call is capturable in a CUDA graph."""
    n, K = q.shape
    M = packed.shape[1]
    if K % 32:
        raise ValueError(f"w4a8: K={K} is not a multiple of 32")
    q, s, packed, wscale = q.contiguous().view(torch.uint8), s.contiguous(), packed.contiguous(), wscale.contiguous()
    out = torch.empty(n, M, dtype=out_dtype, device=q.device)
    if n == 0:
        return out
    bn = tile_rows(n, counts.numel())
    tiles = device_tiles(counts.to(q.device), n, bn)  # no host read: a CUDA graph can capture this call
    if dot_bf16 is None:
        dot_bf16 = os.environ.get("TRITON_INTERPRET", "0") != "1"
    block32 = s.dtype == torch.uint8
    grid = (tiles.shape[0], triton.cdiv(M, BLOCK_M))
    _w4a8_grouped_kernel[grid](
        q, s, packed, wscale, out, tiles, M, K,
        q.stride(0), s.stride(0), packed.stride(0), packed.stride(1), wscale.stride(0), wscale.stride(1), out.stride(0),
        ACT_BLOCK32=block32, DOT_BF16=dot_bf16, BN=bn, BM=BLOCK_M, BK=BLOCK_K, num_warps=NUM_WARPS)
    return out

"""Triton kernel for the W4A8 expert matmul (the contract and the torch path: ``api.py``).

Imported lazily by ``api.py``: importing this module needs triton. One program computes a
``[BN rows of one expert, BM outputs]`` tile. Along K it reads, per step of BK inputs:
  - the weight tile as it lies in memory, ``[BM rows, BK/2 bytes]`` of packed MXFP4 (each row's bytes
    contiguous, so a warp's loads are coalesced and vectorised), with the E8M0 scale of each byte's
    32-input block. The low nibble of byte j holds input 2j, the high nibble input 2j + 1, so the two
    nibbles decode (E2M1 code -> fp32 bits, times 2^(b-127) built from bits) to the weights of the even
    and of the odd inputs, ``[BM, BK/2]`` each, without interleaving anything;
  - the FP8 activations as 16-bit words ``[BN, BK/2]``: the low byte of word j is input 2j, the high
    byte input 2j + 1, the same split (with their E8M0 block scales in block32 mode);
and accumulates ``dot(a_even, w_even^T) + dot(a_odd, w_odd^T)`` in fp32. The per-token activation
scale multiplies the finished tile. Nothing decoded is written to memory: the weight traffic is the
packed 4.25 bits per weight, read once per row tile.

The dot runs in bf16 (``DOT_BF16``, the default on GPU: every decoded value is exact in bf16, so
tensor cores lose nothing but accumulation order) or fp32 ("ieee"; used under
``TRITON_INTERPRET=1``, whose bf16 dot is not usable, so the kernel's logic can be checked on a CPU).
A decode step is bound by the bytes of its active experts, not by tensor-core work (a few to a few
tens of rows per expert), so an FP8 MMA would not shorten it. Offsets are int64 (an expert stack
passes 2^31). K is a compile-time constant (a model has two: the latent width and the expert width),
which also keeps the kernel runnable under the interpreter.

Tile shapes come from the call's shapes alone (``kernel_config``), never from the counts, so a CUDA
graph captured at one routing replays at any other.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

# Rows per tile: 16 (the smallest tl.dot accepts) while experts average at most 16 rows (decode
# steps), else 64.
BLOCK_N, BLOCK_N_SMALL = 64, 16


# the decode ``KernelConfig`` and ``kernel_config`` default to (benchmarks set these to compare): both
# on, the same products bit for bit and 1.08-2.01x faster than neither on an H100 at every medium and
# full decode shape measured (docs/results/w4a8_grouped.md)
HW_CVT, SCALE_ONCE = True, True


class KernelConfig(NamedTuple):
    """One launch's tile shape: ``bm`` outputs per program, ``bk`` inputs per K step, warps, and
    software-pipeline stages; and how codes are decoded on a GPU: ``hw_cvt`` builds E4M3 bytes (the
    activations as they are, each E2M1 weight re-spelled exactly as E4M3) and converts them with the
    hardware FP8 conversion instead of integer bit arithmetic; ``scale_once`` loads each 32-input
    block's E8M0 weight scale once and broadcasts it to the block's 16 bytes instead of gathering it
    per byte. ``hw_cvt`` is ignored under ``TRITON_INTERPRET=1`` (no FP8 types there)."""

    bm: int = 128
    bk: int = 64
    num_warps: int = 4
    num_stages: int = 3
    hw_cvt: bool = HW_CVT
    scale_once: bool = SCALE_ONCE


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
def _e2m1_as_e4m3(code):
    """int32 FP4 codes -> the int32 E4M3 byte of the same value (every E2M1 value is one): 0.5 is
    exponent field 6, 1-6 are fields 7-9 with the mantissa bit moved to the top of three."""
    mag = code & 7
    ex = mag >> 1
    m = mag & 1
    byte = tl.where(ex == 0, tl.where(m == 1, 6 << 3, 0), ((ex + 6) << 3) | (m << 2))
    return byte | ((code & 8) << 4)


@triton.jit
def _fp8_hw(byte):
    """int32 E4M3 bytes -> fp32 through the hardware conversion."""
    return byte.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _w4a8_grouped_kernel(q_ptr, s_ptr, w_ptr, ws_ptr, out_ptr, tile_ptr, M, K: tl.constexpr,
                         stride_qn, stride_sn, stride_we, stride_wm, stride_wse, stride_wsm, stride_on,
                         ACT_BLOCK32: tl.constexpr, DOT_BF16: tl.constexpr, HW_CVT: tl.constexpr,
                         SCALE_ONCE: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
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
    jj = tl.arange(0, BK // 2)  # byte j of a step holds inputs 2j (low nibble) and 2j + 1 (high)
    w_rows = w_ptr + e * stride_we + cols64[:, None] * stride_wm  # [BM, 1]: each output's packed row
    ws_rows = ws_ptr + e * stride_wse + cols64[:, None] * stride_wsm
    q_rows = q_ptr + rows64[:, None] * stride_qn  # 16-bit words: (input 2j, input 2j + 1)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for j0 in range(0, K // 2, BK // 2):
        j = j0 + jj
        jmask = j < K // 2
        wmask = cmask[:, None] & jmask[None, :]
        byte = tl.load(w_rows + j[None, :], mask=wmask, other=0).to(tl.int32)  # [BM, BK/2]
        if SCALE_ONCE:  # one load per 32-input block, broadcast over its 16 bytes
            jb = j0 // 16 + tl.arange(0, BK // 32)
            blk = tl.load(ws_rows + jb[None, :], mask=cmask[:, None] & (jb < K // 32)[None, :], other=127)
            wsc = _e8m0(tl.reshape(tl.broadcast_to(blk[:, :, None], (BM, BK // 32, 16)), (BM, BK // 2)).to(tl.int32))
        else:
            wsc = _e8m0(tl.load(ws_rows + (j // 16)[None, :], mask=wmask, other=127).to(tl.int32))
        amask = rmask[:, None] & jmask[None, :]
        word = tl.load(q_rows + j[None, :], mask=amask, other=0).to(tl.int32)  # [BN, BK/2]
        if HW_CVT:
            w_even = _fp8_hw(_e2m1_as_e4m3(byte & 0xF)) * wsc  # exact in fp32 and bf16
            w_odd = _fp8_hw(_e2m1_as_e4m3((byte >> 4) & 0xF)) * wsc
            a_even = _fp8_hw(word & 0xFF)
            a_odd = _fp8_hw((word >> 8) & 0xFF)
        else:
            w_even = _e2m1(byte & 0xF) * wsc  # exact in fp32 and bf16
            w_odd = _e2m1((byte >> 4) & 0xF) * wsc
            a_even = _e4m3(word & 0xFF)
            a_odd = _e4m3((word >> 8) & 0xFF)
        if ACT_BLOCK32:
            sa = _e8m0(tl.load(s_ptr + rows64[:, None] * stride_sn + (j // 16)[None, :], mask=amask, other=127).to(tl.int32))
            a_even = a_even * sa
            a_odd = a_odd * sa
        if DOT_BF16:
            acc += tl.dot(a_even.to(tl.bfloat16), tl.trans(w_even.to(tl.bfloat16)))
            acc += tl.dot(a_odd.to(tl.bfloat16), tl.trans(w_odd.to(tl.bfloat16)))
        else:
            acc += tl.dot(a_even, tl.trans(w_even), input_precision="ieee")
            acc += tl.dot(a_odd, tl.trans(w_odd), input_precision="ieee")
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
    sum_e ceil(c_e / bn) <= sum over the experts in use of (c_e / bn + 1), and at most min(n, E)
    experts are in use, so it is at most ceil(n / bn) + min(n, E)."""
    return -(-n // bn) + min(n, experts)


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


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def kernel_config(n: int, experts: int, M: int, K: int, device: torch.device) -> KernelConfig:
    """The tile shape for a call, from shapes alone (so a CUDA graph replays it at any routing): the
    widest output block (128, 64 or 32) that still gives every multiprocessor four programs of real
    tiles, since few rows (decode at small batch) leave few tiles and the weight bytes must then be
    read by many programs at once; 64 inputs per K step (on an H100, 64 beat 128 at every decode
    shape of medium and full, by 1.04-1.45x: docs/results/w4a8_grouped.md)."""
    sms = _multiprocessors(device.index or 0) if device.type == "cuda" else 132
    real = -(-n // tile_rows(n, experts)) + min(n, experts)  # ``max_tiles``: an upper bound on real tiles
    bm = 128
    while bm > 32 and real * -(-M // bm) < 4 * sms:
        bm //= 2
    return KernelConfig(bm=bm, bk=64, hw_cvt=HW_CVT, scale_once=SCALE_ONCE)


def w4a8_grouped_mm_triton(q: torch.Tensor, s: torch.Tensor, counts: torch.Tensor, packed: torch.Tensor,
                           wscale: torch.Tensor, out_dtype: torch.dtype, dot_bf16: bool | None = None,
                           config: KernelConfig | None = None) -> torch.Tensor:
    """q fp8 ``[n, K]`` with its scale (fp32 ``[n, 1]`` per token or uint8 ``[n, K/32]``), rows sorted by
    expert (``counts [E]``, summing to n), packed ``[E, M, K/2]``, wscale ``[E, M, K/32]`` -> ``[n, M]``
    ``out_dtype``. Nothing reads ``counts`` on the host: the tile table is built on the device, sized
    by ``n`` and ``E`` (``device_tiles``), so the call is capturable in a CUDA graph. ``config``
    overrides the tile shape (``kernel_config``; benchmarks sweep it)."""
    n, K = q.shape
    M = packed.shape[1]
    if K % 32:
        raise ValueError(f"w4a8: K={K} is not a multiple of 32")
    words = q.contiguous().view(torch.uint8).view(torch.int16)  # [n, K/2]: two FP8 inputs per word
    s, packed, wscale = s.contiguous(), packed.contiguous(), wscale.contiguous()
    out = torch.empty(n, M, dtype=out_dtype, device=q.device)
    if n == 0:
        return out
    bn = tile_rows(n, counts.numel())
    tiles = device_tiles(counts.to(q.device), n, bn)  # no host read: a CUDA graph can capture this call
    interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if dot_bf16 is None:
        dot_bf16 = not interpreted
    cfg = config or kernel_config(n, counts.numel(), M, K, q.device)
    block32 = s.dtype == torch.uint8
    grid = (tiles.shape[0], triton.cdiv(M, cfg.bm))
    _w4a8_grouped_kernel[grid](
        words, s, packed, wscale, out, tiles, M, K,
        words.stride(0), s.stride(0), packed.stride(0), packed.stride(1), wscale.stride(0), wscale.stride(1), out.stride(0),
        ACT_BLOCK32=block32, DOT_BF16=dot_bf16, HW_CVT=cfg.hw_cvt and not interpreted,
        SCALE_ONCE=cfg.scale_once, BN=bn, BM=cfg.bm, BK=cfg.bk,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out

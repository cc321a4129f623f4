"""Static SASS instruction counts of the MXFP4 bf16 quantize kernels, compiled for sm_90 (H100/H200)
on any machine, GPU or not (Triton's bundled ptxas and nvdisasm). Not a timing: a count of the
instructions a thread issues per element, the budget that decides whether a kernel can stay
memory-bound, and a check of the other limit: what the instructions do to data layout (shared
memory round trips, barriers).

    python3 benchmarks/mxfp4_sass.py [--groups 128] [--warps 4]

Rows: the "words" kernel (the previous bf16 default, 33-40% of copy bandwidth measured on an H200),
the generic kernel (25-28% measured; same tile here, it was timed at 128 blocks x 8 warps), the
bf16x2 kernel's fast branch (what runs for every block of real weights) and its whole kernel (both
branches; one runs per program; 55-64% measured, the default), and a floor kernel that only loads
the input words and stores one word per row (80-93% measured). Columns: SASS instructions per
element, of which integer/logic, floating point, and memory; the most frequent opcodes.

What the counts taught (docs/results/mxfp4.md): an issue model (an int32 warp instruction holds a
sub-partition for two cycles) predicted the words kernel (27.7 int instructions per element, ~37%)
but not the candidates that only cut instructions on the words layout (fp32 fma rounding, 14.7 int:
39-45%; bf16x2 codes, 13.5: 40-47%). Moving to a layout where each thread owns whole blocks (no
shared-memory layout change; the one program-wide reduction left picks the branch) took the bf16x2
codes from 42% to 60%. The fast-branch row compiles that branch alone (0/0/0 shared-memory ops);
"both branches" is the launched kernel, whose shared-memory ops are that reduction's and the exact
branch's.
Needs triton (pip install triton); compiles with the launch-time assumptions of the JIT (16-byte
aligned pointers, n_groups divisible by 16).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from k3core.ops.mxfp4 import codec_triton as kt
from k3core.ops.mxfp4 import spec

FLOAT_OPS = {"FFMA", "FADD", "FMUL", "FSETP", "FMNMX", "FSEL", "FSET", "HFMA2", "HMNMX2", "HADD2", "HMUL2"}
MEMORY_OPS = {"LDG", "STG", "LDS", "STS", "SHFL", "BAR", "ATOMG", "RED"}
SHARED_OPS = ("LDS", "STS", "BAR")


@triton.jit
def _load_store_floor(words_ptr, packed_ptr, scale_ptr, nonfinite_ptr, n_groups,
                      ROUND_BIAS: tl.constexpr, NEG_ZERO_FIELD: tl.constexpr, GROUPS: tl.constexpr):
    """The quantize kernels' memory pattern with no codec work: 4 input words per output word."""
    W: tl.constexpr = GROUPS * 4
    ow = tl.program_id(0).to(tl.int64) * W + tl.arange(0, W)
    wmask = ow < n_groups * 4
    j = tl.arange(0, 4)
    w = tl.load(words_ptr + ow[:, None] * 4 + j[None, :], mask=wmask[:, None], other=0)
    tl.store(packed_ptr + ow, tl.sum(w, axis=1), mask=wmask)


WORDS_SIGNATURE = {"words_ptr": "*i32", "packed_ptr": "*i32", "scale_ptr": "*u8", "nonfinite_ptr": "*i32",
                   "n_groups": "i32", "ROUND_BIAS": "constexpr", "NEG_ZERO_FIELD": "constexpr", "GROUPS": "constexpr"}
GENERIC_SIGNATURE = {"x_ptr": "*bf16", "packed_ptr": "*u8", "scale_ptr": "*u8", "nonfinite_ptr": "*i32",
                     "n_groups": "i32", "ROUND_BIAS": "constexpr", "NEG_ZERO_FIELD": "constexpr", "GROUPS": "constexpr"}


def sass(fn, groups: int, warps: int, signature=WORDS_SIGNATURE, **constexprs) -> str:
    sig = dict(signature)
    consts = {"ROUND_BIAS": spec.ROUND_BIAS["compressed-tensors"],
              "NEG_ZERO_FIELD": spec.NEG_ZERO_FIELD[torch.bfloat16], "GROUPS": groups}
    for k, v in constexprs.items():
        sig[k] = "constexpr"
        consts[k] = v
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(5)}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        return subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout


def opcodes(text: str) -> collections.Counter:
    ops = collections.Counter()
    for line in text.splitlines():
        m = re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if m:
            ops[m.group(1)] += 1
    return ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=kt.BF16_QUANT_GROUPS, help="blocks of 32 per program")
    parser.add_argument("--warps", type=int, default=kt.BF16_QUANT_WARPS)
    args = parser.parse_args()
    per_thread = args.groups * 32 / (args.warps * 32)  # elements each thread quantizes
    rows = [
        ("words kernel (previous default)", sass(kt._quantize_bf16_kernel, args.groups, args.warps)),
        ("generic kernel (25% measured)", sass(kt._mxfp4_quantize_kernel, args.groups, args.warps,
                                               GENERIC_SIGNATURE, IS_BF16=True)),
        ("bf16x2 kernel, fast branch", sass(kt._quantize_bf16x2_kernel, args.groups, args.warps, ORDINARY_ONLY=True)),
        ("bf16x2 kernel, both branches", sass(kt._quantize_bf16x2_kernel, args.groups, args.warps)),
        ("load/store floor", sass(_load_store_floor, args.groups, args.warps)),
    ]
    print(f"triton {triton.__version__}, sm_90, {args.groups} blocks x {args.warps} warps per program: "
          f"{per_thread:.0f} elements per thread")
    print(f"{'kernel':34s} {'SASS/elem':>9s} {'int':>6s} {'float':>6s} {'memory':>6s} {'LDS/STS/BAR':>11s}  top opcodes")
    base = None
    for label, text in rows:
        ops = opcodes(text)
        total = sum(ops.values())
        fp = sum(n for op, n in ops.items() if op in FLOAT_OPS)
        mem = sum(n for op, n in ops.items() if op in MEMORY_OPS)
        top = ", ".join(f"{op} {n}" for op, n in ops.most_common(6))
        base = base or total
        shared = "/".join(str(ops[op]) for op in SHARED_OPS)  # per thread and program, not per element
        print(f"{label:34s} {total / per_thread:9.1f} {(total - fp - mem) / per_thread:6.1f} {fp / per_thread:6.1f} "
              f"{mem / per_thread:6.1f} {shared:>11s}  {top}  ({total / base:.2f}x words)")


if __name__ == "__main__":
    main()

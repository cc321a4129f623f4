"""Planner calibration: predicted vs measured activation memory of one preset on one device.

Claim (issue 8, "Calibration"): for the medium preset on the H200 the planner's predictions
(``k3core.plan``, eager elementwise ops, full logits: k3core as it is) are within 15% of what the
GPU path really keeps and peaks at.

Rows, each for batch 1 x T tokens, bf16 model on the device:
  layer saved     bytes autograd keeps for backward in one decoder layer (saved-tensor hooks, once per
                  storage, parameters and the layer's inputs excluded) vs ``layer_activation_terms`` x T;
                  one row per layer kind (KDA/MLA x dense/MoE), the first layer of the kind
  layer peak      peak allocated above the start while that layer runs forward + backward, minus its
                  output and input gradients, vs (saved + ``layer_backward_workspace``) x T
  model no-AC     peak allocated above the loaded model during forward + backward of the whole model
                  with the loss (targets, return_logits=False) vs planner: bf16 gradients + context
                  bytes without checkpointing (``stage_memory(ac=False)``, one stage)
  model AC        the same with every decoder layer under torch.utils.checkpoint (non-reentrant) vs
                  gradients + ``stage_memory(ac=True)``

    python benchmarks/plan_calibration.py --device cuda            # medium preset (the claim)
    python benchmarks/plan_calibration.py --device cuda --tokens 4096 --ac-tokens 8192,32768
    python benchmarks/plan_calibration.py --quick                  # CPU smoke run, tiny preset

On CPU the attention kernels differ (SDPA keeps the [T, T] matrix, KDA runs in torch), so CPU ratios
are not the claim: use --quick only to check the script runs. ``--json FILE`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from k3core.config import K3Config  # noqa: E402
from k3core.ops.memory_probe import peak_bytes  # noqa: E402
from k3core.plan import (  # noqa: E402
    Kernels, layer_activation_terms, layer_backward_workspace, param_counts, snapshots_before, stage_memory,
)

TARGET = 0.15


def _saved_bytes(fn, skip: set[int]) -> tuple[object, int]:
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        r = fn()
    return r, sum(seen.values())


def layer_rows(model, c: K3Config, T: int, device) -> list[dict]:
    frozen = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    kernels = Kernels("eager")
    rows, kinds = [], set()
    for i, layer in enumerate(model.model.layers):
        kind = f"{c.layer_type(i)}+{'moe' if c.is_moe_layer(i) else 'dense'}"
        if kind in kinds:
            continue
        kinds.add(kind)
        D = c.hidden_size
        p = torch.randn(1, T, D, dtype=torch.bfloat16, device=device, requires_grad=True)
        blocks = [torch.randn(1, T, D, dtype=torch.bfloat16, device=device) for _ in range(snapshots_before(c, i))]
        skip = frozen | {t.untyped_storage().data_ptr() for t in [p] + blocks}
        out, saved = _saved_bytes(lambda: layer(p, blocks), skip)
        terms = layer_activation_terms(c, i, kernels, True)
        rows.append({"row": f"layer saved ({kind}, layer {i})", "tokens": T, "measured": saved,
                     "predicted": sum(terms.values()) * T})
        del out
        model.zero_grad(set_to_none=True)
        grad = torch.randn(1, T, D, dtype=torch.bfloat16, device=device)

        def fwd_bwd():
            o = layer(p, blocks)[0]
            o.backward(grad)

        _, peak = peak_bytes(fwd_bwd, device)
        # exclude what the step leaves behind that is not activation: parameter grads, p.grad
        param_grads = sum(q.grad.numel() * q.grad.element_size() for q in layer.parameters() if q.grad is not None)
        measured = peak - param_grads - p.numel() * 2
        predicted = (sum(terms.values()) + layer_backward_workspace(c, i, kernels, True)) * T
        rows.append({"row": f"layer peak ({kind}, layer {i})", "tokens": T, "measured": measured, "predicted": predicted})
        p.grad = None
        model.zero_grad(set_to_none=True)
    return rows


def model_row(model, c: K3Config, T: int, device, ac: bool) -> dict:
    from torch.utils.checkpoint import checkpoint

    originals = []
    if ac:
        for layer in model.model.layers:
            f = layer.forward
            originals.append((layer, f))
            layer.forward = (lambda f: lambda *a, **k: checkpoint(f, *a, use_reentrant=False, **k))(f)
    try:
        ids = torch.randint(0, min(c.vocab_size, 30000), (1, T), device=device)
        model.zero_grad(set_to_none=True)

        def step():
            out = model(ids, targets=ids.roll(-1, 1), return_logits=False)
            out.loss.backward()

        _, peak = peak_bytes(step, device)
    finally:
        for layer, f in originals:
            layer.forward = f
    model.zero_grad(set_to_none=True)
    pc = param_counts(c)
    ctx = stage_memory(c, T, range(c.num_hidden_layers), inflight=1, k_in=0, is_last=True,
                       kernels=Kernels("eager"), situ_streaming=True, ac=ac)
    return {"row": f"model {'AC' if ac else 'no-AC'} peak", "tokens": T, "measured": peak,
            "predicted": pc.bytes_bf16 + ctx["total"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--preset", default=None, help="default: medium on cuda, tiny with --quick/cpu")
    ap.add_argument("--tokens", default=None, help="comma-separated T for layer rows and the no-AC model row")
    ap.add_argument("--ac-tokens", default=None, help="comma-separated T for the AC model row")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    preset = a.preset or ("medium" if cuda and not a.quick else "tiny")
    tokens = [int(x) for x in (a.tokens or ("4096,8192" if cuda and not a.quick else "256")).split(",")]
    ac_tokens = [int(x) for x in (a.ac_tokens or ("8192,32768" if cuda and not a.quick else "256")).split(",")]
    c = K3Config.preset(preset)
    from k3core.model.k3 import K3ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = K3ForCausalLM(c, init_weights=False)
    model.reset_parameters(0)
    model = model.cast(torch.bfloat16)
    model.train()
    print(f"planner calibration: preset {preset}, device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if cuda else "") + f", torch {torch.__version__}")
    rows = []
    for T in tokens:
        rows += layer_rows(model, c, T, device)
        rows.append(model_row(model, c, T, device, ac=False))
    for T in ac_tokens:
        rows.append(model_row(model, c, T, device, ac=True))
    print(f"{'row':42s} {'T':>7s} {'measured MB':>12s} {'predicted MB':>13s} {'pred/meas':>10s}  within {TARGET:.0%}")
    for r in rows:
        r["ratio"] = r["predicted"] / r["measured"] if r["measured"] else float("nan")
        r["within_target"] = abs(r["ratio"] - 1) <= TARGET
        print(f"{r['row']:42s} {r['tokens']:7d} {r['measured'] / 1e6:12.1f} {r['predicted'] / 1e6:13.1f} "
              f"{r['ratio']:10.3f}  {'yes' if r['within_target'] else 'NO'}")
    if a.json:
        Path(a.json).write_text(json.dumps({"preset": preset, "device": str(device), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``k3rl plan`` on a layout that does not fit: why (which memory term exceeds which limit, by how
much) and what would fit, held against the planner's own arithmetic: every hint fits when planned
again, a token count it suggests is the largest that fits, and what it says cannot help does not."""

import io
import re

import pytest

from k3core.config import K3Config
from k3core.plan import GB, TOKEN_STEP, Kernels, Layout, fit_advice, load_hardware, plan

FULL = K3Config.preset("full")
MEDIUM = K3Config.preset("medium")


def _fits(config, hw, tokens, layout: dict, kernels: dict | None = None) -> bool:
    lay = Layout(**{k: (tuple(v) if k == "pp_layout" and v else v) for k, v in layout.items()})
    p = plan(config, hw, tokens, lay, kernels=Kernels(**(kernels or {})), advise=False)
    return p["layout"]["fits"]


def _check_hints(config, hw, tokens, layout, advice):
    assert advice["hints"], advice
    for h in advice["hints"]:
        assert _fits(config, hw, h["tokens_per_gpu"], h["layout"], h["kernels"]), h
        flags = " ".join(h["flags"])
        assert f"--tokens-per-gpu {int(h['tokens_per_gpu'])}" in flags and f"--dp {h['layout']['dp']}" in flags
        if h["tokens_per_gpu"] < tokens:  # the largest count (in TOKEN_STEP steps) those GPUs hold
            assert not _fits(config, hw, h["tokens_per_gpu"] + TOKEN_STEP, h["layout"], h["kernels"]), h


def test_readme_example_says_why_and_what_fits():
    """``k3rl plan --preset full --hardware b300 --tokens-per-gpu 100000``: one GPU holds neither the
    weights nor the optimizer state, and at 100k tokens no number of GPUs holds the activations."""
    hw = load_hardware("b300")
    p = plan(FULL, hw, 100000)
    adv = p["advice"]
    assert not p["layout"]["fits"] and adv is not None
    st = p["layout"]["stages"][0]
    hbm, host = adv["why"]
    over = st["gpu_total"] - hw.hbm_usable
    assert hbm.startswith("HBM: stage 0 needs") and f"{over / GB:,.1f} GB over the {hw.hbm_usable / GB:,.1f} GB usable" in hbm
    assert "weights and gradients" in hbm and "activations" in hbm
    assert host.startswith("host RAM:") and f"{(st['host_per_node'] - hw.host_usable) / GB:,.1f} GB over" in host
    _check_hints(FULL, hw, 100000, Layout(), adv)
    assert any("more GPUs at 100,000 tokens per GPU: the activations alone" in n for n in adv["no_hint"])
    # ... which holds: the hint's own GPUs do not fit 100k tokens
    h = next(h for h in adv["hints"] if h["gpus"] > 1)
    assert not _fits(FULL, hw, 100000, h["layout"])


def test_smaller_micro_batch_and_more_gpus_on_a_large_layout():
    hw = load_hardware("b300")
    lay = Layout(tp=8, ep=8, pp=8, dp=16)
    adv = fit_advice(FULL, hw, 100000, lay)
    _check_hints(FULL, hw, 100000, lay, adv)
    same = next(h for h in adv["hints"] if h["change"].startswith("smaller micro-batch"))
    assert same["layout"]["tp"] == 8 and same["gpus"] == lay.world


def test_more_gpus_at_the_same_tokens_is_the_fewest_that_fit():
    hw = load_hardware("h200")
    adv = fit_advice(FULL, hw, 8000, Layout())
    _check_hints(FULL, hw, 8000, Layout(), adv)
    more = next(h for h in adv["hints"] if h["change"].startswith("more GPUs"))
    assert more["tokens_per_gpu"] == 8000
    # no layout of the same search with half the GPUs fits (the search's own space, smaller worlds)
    smaller = [Layout(tp=tp, ep=_ep(tp * dp), pp=pp, dp=dp, fsdp=f) for tp in (1, 2, 4, 8) for pp in range(1, 9)
               for dp in (1, 2, 4, 8, 16, 32, 64) for f in (False, True) if tp * pp * dp <= more["gpus"] // 2]
    assert smaller and not any(plan(FULL, hw, 8000, s, advise=False)["layout"]["fits"] for s in smaller)


def _ep(gpus: int) -> int:
    return max(e for e in range(1, gpus + 1) if gpus % e == 0 and FULL.num_experts % e == 0)


def test_medium_names_the_logits_and_fused_kernels_fit():
    hw = load_hardware("h200")
    adv = fit_advice(MEDIUM, hw, 100000, Layout(dp=8))
    assert "largest: the output head's logits" in adv["why"][0]
    _check_hints(MEDIUM, hw, 100000, Layout(dp=8), adv)
    assert any(h["kernels"]["elementwise"] == "fused" for h in adv["hints"])


def test_a_fitting_layout_gets_no_advice():
    p = plan(K3Config.preset("tiny"), "h200", 4096)
    assert p["layout"]["fits"] and p["advice"] is None


def test_cli_prints_why_and_the_flags_that_fit():
    import argparse

    from flows.cli_plan import run_plan

    args = argparse.Namespace(config=None, preset="full", hardware="b300", tokens_per_gpu=100000, tp=1, ep=1, pp=1,
                              cp=1, dp=1, fsdp=False, pp_layout=None, elementwise="eager", logits_chunk=0,
                              no_activation_checkpointing=False, fs_gbps=None, engine_sequences=128,
                              engine_context=32768, sweep_tokens=[], json=False)
    out = io.StringIO()
    assert run_plan(args, out=out) == 0
    text = out.getvalue()
    assert "Why it does not fit" in text and "What would fit" in text
    m = re.search(r"--tokens-per-gpu (\d+) --tp (\d+) --ep (\d+) --pp (\d+) --cp 1 --dp (\d+)( --fsdp)?", text)
    assert m, text[-3000:]
    t, tp, ep, pp, dp = map(int, m.groups()[:5])
    assert _fits(FULL, "b300", t, dict(tp=tp, ep=ep, pp=pp, dp=dp, fsdp=bool(m.group(6))))


@pytest.mark.parametrize("tokens", [100000])
def test_advice_does_not_change_the_plan(tokens):
    with_advice = plan(FULL, "b300", tokens)
    without = plan(FULL, "b300", tokens, advise=False)
    assert without["advice"] is None
    assert {k: v for k, v in with_advice.items() if k != "advice"} == {k: v for k, v in without.items() if k != "advice"}

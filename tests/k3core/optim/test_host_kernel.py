"""The C host update (k3core/optim/host_adamw.c) against StreamedAdamW's torch path, and its build.

The torch path (tile by tile through torch's fused CPU AdamW kernel and the bit-trick rounding) is
the reference: the C loop writes out the float operations of torch's vectorised loop in the same
order, so the two agree bit for bit there. torch runs the last (n mod vector width) elements of
each tensor it is given through a scalar loop that its compiler contracts differently; there an
update may differ by an fp32 ulp (so a moment by a bf16 ulp), which the comparison allows for at
most 1 element in 1,000. The C kernel's own result depends on neither thread count nor chunking. The rest of test_streamed_adam.py holds either path to torch.optim.AdamW and to the plain
reference; it runs with the default ("auto": the C kernel where it builds).
"""

import os
import stat

import pytest
import torch

from k3core.optim import host_kernel
from k3core.optim.stochastic_rounding import NOISE_TABLE_NUMEL
from k3core.optim.streamed_adam import StreamedAdamW

pytestmark = pytest.mark.skipif(not host_kernel.available(), reason=f"no host kernel: {host_kernel.why_not()}")

# One parameter longer than the noise table, so every run of it wraps; sizes that divide nothing.
SHAPES = [(NOISE_TABLE_NUMEL + 4099,), (37, 11), (5,), (3, 4, 5), (40_000,)]
DTYPES = [torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16, torch.float32]


def make_params():
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(d)) for s, d in zip(SHAPES, DTYPES)]


def run(kernel, steps=3, threads=1, **kw):
    params = make_params()
    fp32_grad = hasattr(params[1], "grad_dtype")  # torch < 2.12 refuses a gradient of another dtype
    if fp32_grad:
        params[1].grad_dtype = None
    opt = StreamedAdamW(params, host_kernel=kernel, host_threads=threads, **kw)
    gen = torch.Generator().manual_seed(1)
    for t in range(steps):
        for i, p in enumerate(params):
            # fp32 gradients for one bf16 parameter (FSDP2 with an fp32 reduce dtype): that loop too
            dtype = torch.float32 if i == 1 and fp32_grad else p.dtype
            p.grad = None if (t, i) == (1, 3) else (torch.randn(p.shape, generator=gen) * 0.1).to(dtype)
        opt.step()
    return params, opt


def assert_same(a, b):
    (pa, oa), (pb, ob) = a, b
    for p, q in zip(pa, pb):
        assert torch.equal(p.detach(), q.detach())
        for k in ("master", "exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(oa.state[p][k], ob.state[q][k]), k


def assert_same_but_torch_tails(a, b):
    (pa, oa), (pb, ob) = a, b
    for p, q in zip(pa, pb):
        for k, ulp in (("master", 2**-23), ("exp_avg", 2**-8), ("exp_avg_sq", 2**-8)):
            x, y = oa.state[p][k].float(), ob.state[q][k].float()
            differ = x != y
            assert differ.sum() <= max(1, x.numel() // 1000), (k, int(differ.sum()))
            torch.testing.assert_close(x, y, rtol=ulp, atol=0)
        assert torch.equal(p.detach().float(), oa.state[p]["master"].to(p.dtype).float())


@pytest.fixture(autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("weight_decay,max_grad_norm", [(0.1, 0.5), (0.0, None)])
def test_c_kernel_equals_the_torch_path_bit_for_bit(rounding, weight_decay, max_grad_norm):
    kw = dict(lr=1e-2, weight_decay=weight_decay, max_grad_norm=max_grad_norm, moment_rounding=rounding,
              chunk_numel=300_001, tile_numel=65_537)
    c = run("c", **kw)
    assert c[1].host_kernel == "c"
    assert_same_but_torch_tails(c, run("torch", **kw))


def test_c_kernel_result_does_not_depend_on_threads_or_chunking():
    """Clipping is off across chunk sizes: the CPU norm sums pieces of the tile size, which follows
    the chunk size, so the clip scale itself would move by an ulp (on either path)."""
    kw = dict(lr=1e-2, weight_decay=0.1, max_grad_norm=1.0, chunk_numel=70_001)
    assert_same(run("c", threads=1, **kw), run("c", threads=3, **kw))
    kw = dict(lr=1e-2, weight_decay=0.1)
    assert_same(run("c", chunk_numel=1 << 22, **kw), run("c", threads=3, chunk_numel=70_001, **kw))


def test_the_clip_actually_scales_in_these_runs():
    """The equality tests above exercise the kernel's clip division only if the norm exceeds it."""
    _, opt = run("c", steps=1, lr=1e-2, max_grad_norm=0.5)
    assert opt.last_grad_norm > 0.5


def test_bad_host_kernel_settings_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="host_kernel must be"):
        StreamedAdamW(make_params()[1:2], host_kernel="fast")
    with pytest.raises(ValueError, match="bf16 moments only"):
        StreamedAdamW(make_params()[1:2], host_kernel="c", moment_dtype=torch.float32)
    assert StreamedAdamW(make_params()[1:2], moment_dtype=torch.float32).host_kernel == "torch"


@pytest.fixture
def fresh_kernel_module(monkeypatch):
    """host_kernel caches one build per process: give a test its own, and restore the real one."""
    monkeypatch.setattr(host_kernel, "_lib", None)
    monkeypatch.setattr(host_kernel, "_why_not", None)
    yield host_kernel


def test_without_a_compiler_auto_keeps_the_torch_path_and_c_names_the_fix(fresh_kernel_module, monkeypatch):
    monkeypatch.setattr(host_kernel, "_compiler", lambda: None)
    assert not host_kernel.available()
    assert "no C compiler" in host_kernel.why_not()
    assert StreamedAdamW(make_params()[1:2]).host_kernel == "torch"
    with pytest.raises(ValueError, match="no C compiler found .install gcc, or set CC.*host_kernel='torch'"):
        StreamedAdamW(make_params()[1:2], host_kernel="c")


def test_a_failed_build_leaves_nothing_under_the_cache(fresh_kernel_module, monkeypatch, tmp_path):
    bad = tmp_path / "cc"
    bad.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo fake 1.0; exit 0; fi\necho broken >&2; exit 1\n")
    bad.chmod(bad.stat().st_mode | stat.S_IXUSR)
    cache = tmp_path / "cache"
    monkeypatch.setenv("CC", str(bad))
    monkeypatch.setenv("K3RL_KERNEL_CACHE", str(cache))
    assert not host_kernel.available()
    assert "failed to build host_adamw.c: broken" in host_kernel.why_not()
    assert list(cache.iterdir()) == []  # no object, no temporary


def test_a_build_is_cached_by_source_and_reused(fresh_kernel_module, monkeypatch, tmp_path):
    monkeypatch.setenv("K3RL_KERNEL_CACHE", str(tmp_path))
    assert host_kernel.available()
    objects = list(tmp_path.iterdir())
    assert len(objects) == 1 and objects[0].name.startswith("host_adamw-") and objects[0].suffix == ".so"
    mtime = os.stat(objects[0]).st_mtime_ns
    monkeypatch.setattr(host_kernel, "_lib", None)
    assert host_kernel.available()
    assert list(tmp_path.iterdir()) == objects and os.stat(objects[0]).st_mtime_ns == mtime


def test_the_updater_refuses_runs_it_cannot_take():
    updater = host_kernel.HostUpdater(threads=1)
    coef = host_kernel.coefficients(1e-3, 0.9, 0.999, 1e-8, 0.0, 1, None)
    bf = lambda n: torch.zeros(n, dtype=torch.bfloat16)  # noqa: E731
    good = (torch.zeros(8), bf(8), bf(8), bf(8), bf(8), coef, None, 0, 0)
    cases = [
        ((torch.zeros(8), bf(8), bf(7), bf(8), bf(8)), "different lengths"),
        ((torch.zeros(8).bfloat16(), bf(8), bf(8), bf(8), bf(8)), "master must be fp32"),
        ((torch.zeros(8), bf(8), bf(8), torch.zeros(8, dtype=torch.float16), bf(8)), "bf16 or fp32"),
        ((torch.zeros(16)[::2], bf(8), bf(8), bf(8), bf(8)), "contiguous host tensors"),
    ]
    for tensors, message in cases:
        with pytest.raises(ValueError, match=message):
            updater.run([(*tensors, coef, None, 0, 0)])
    updater.run([good])  # and the well-formed run goes through

"""How often the GRPO train step makes the host wait for the GPU, counted on the CPU.

The model lives on the ``meta`` device (shapes, no values), standing for the GPU: the batch is built
on the host as in a real run, and every place where the step reads a device value back (``item``,
``tolist``, ``float``, ``int``, ``bool``, ``cpu``, ``.to("cpu")``) or copies a host tensor to the
device with a blocking copy (torch's ``non_blocking=False`` host -> CUDA copy ends with a stream
synchronise) is counted. A hidden data-dependent op (a boolean-mask index on the device) has no meta
kernel and fails the test outright.

Two CUDA kernels stand in for themselves because their CPU paths read on the host by design: fla's
``chunk_kda`` (a fake module that records the ``cu_seqlens`` it gets; the torch chunked path reads the
offsets per chunk) and the grouped expert GEMM (``torch._grouped_mm``: one expert's matmul here; the
CPU padded path reads the largest expert count).
"""

import types
from collections import Counter

import pytest
import torch

import k3core.model.moe as moe
import k3core.ops.kda._fla as fla
import k3core.ops.kda.api as kda_api
from k3core.config import K3Config
from k3core.model import K3ForCausalLM
from k3core.ops.situ import situ_glu
from k3core.rl import train as tr
from k3core.settings import GRPOSettings

pytestmark = pytest.mark.usefixtures("single_thread")

TINY = K3Config.preset("tiny")
N_MOE, K, E = len(TINY.moe_layers), TINY.num_experts_per_token, TINY.num_experts
READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy")


class Reads:
    """Counts reads of meta ("device") tensor values and blocking host -> device copies; a read
    returns zeros of the tensor's shape, so the code goes on."""

    def __init__(self, monkeypatch):
        self.counts: Counter = Counter()
        self.fla_cu_seqlens: list[torch.Tensor] = []
        orig = {n: getattr(torch.Tensor, n) for n in (*READS, "to")}

        def reader(name):
            def read(t, *a, **k):
                if t.device.type != "meta":
                    return orig[name](t, *a, **k)
                self.counts[name] += 1
                z = torch.zeros(t.shape, dtype=t.dtype)
                return orig[name](z, *a, **k) if name != "cpu" else z
            return read

        def to(t, *a, **k):
            dev, dtype, non_blocking, _ = torch._C._nn._parse_to(*a, **k)
            if t.device.type == "meta" and dev is not None and dev.type == "cpu":
                self.counts["to(cpu)"] += 1
                return torch.zeros(t.shape, dtype=dtype or t.dtype)
            if t.device.type == "cpu" and dev is not None and dev.type != "cpu" and not non_blocking:
                self.counts["blocking copy"] += 1
            return orig["to"](t, *a, **k)

        for n in READS:
            monkeypatch.setattr(torch.Tensor, n, reader(n))
        monkeypatch.setattr(torch.Tensor, "to", to)

        def chunk_kda(q, k, v, g, beta, cu_seqlens=None, **kw):  # fla's kernel: shapes only, no reads
            self.fla_cu_seqlens.append(cu_seqlens)
            return (q + k + g) * beta.unsqueeze(-1) + v, None

        monkeypatch.setattr(kda_api, "resolve_backend", lambda fn, backend, q, **kw: "fla")
        monkeypatch.setattr(fla, "require", lambda fn: types.SimpleNamespace(chunk_kda=chunk_kda))

        def grouped_forward(experts, x_sorted, counts, max_rows=None):  # torch._grouped_mm: no reads
            w13, w2 = experts.effective_weights()
            return situ_glu(x_sorted @ w13[0].t(), experts.beta, experts.linear_beta) @ w2[0].t()

        monkeypatch.setattr(moe.RoutedExperts, "grouped_forward", grouped_forward)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _seqs(n=6):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        p, o = [256, 3 + i, 7], [4, 5, 6, 7, 8][: 2 + i % 4]
        routing = torch.stack([torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N_MOE)])
                               for _ in range(len(p) + len(o) - 1)])
        out.append(tr.RLSequence(p, o, [-1.0] * len(o), 0.5 - i / 4, routing, ref_logprobs=[-1.2] * len(o)))
    return out


def _step(reads, *, micro: int, packing: bool, epochs: int = 1, agg: str = "token-mean", kl_coef: float = 0.0):
    """Reads of one ``grpo_train_step`` on the meta model: ``micro`` 1 (one micro-batch) or 6 (one
    sequence each: budget 1)."""
    with torch.device("meta"):
        model = K3ForCausalLM(TINY)
    cfg = GRPOSettings(routing_replay=True, packing=packing, ppo_epochs=epochs, loss_aggregation=agg,
                       kl_coef=kl_coef, micro_batch_tokens=0 if micro == 1 else 1)
    reads.counts.clear()
    m = tr.grpo_train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), _seqs(), cfg, TINY.pad_token_id,
                           seq_sum_norm=5.0)
    assert m["micro_batches"] == micro * epochs
    return Counter(reads.counts)


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("agg,kl_coef", [("token-mean", 0.0), ("seq-mean-token-mean", 0.1), ("seq-sum", 0.0)])
def test_one_host_read_per_micro_batch(monkeypatch, packing, agg, kl_coef):
    """Each micro-batch of the forward, loss, entropy and backward reads the device once (the loss
    statistics, one ``tolist``) and copies host tensors without waiting; per update the gradient norm
    is read once, per step the entropy statistic once."""
    reads = Reads(monkeypatch)
    one = _step(reads, micro=1, packing=packing, agg=agg, kl_coef=kl_coef)
    six = _step(reads, micro=6, packing=packing, agg=agg, kl_coef=kl_coef)
    per_micro = {k: (six[k] - one[k]) / 5 for k in six | one if six[k] != one[k]}
    assert per_micro == {"tolist": 1.0}, per_micro
    assert one == Counter(tolist=1, __float__=2), one  # + the update's gradient norm, the step's entropy


def test_old_logprobs_read_once_per_micro_batch(monkeypatch):
    """Two PPO epochs: ``logp_old`` comes from one no-grad pass, one read per micro-batch (its
    sequences' log-probabilities are picked on the host), and is handed back to the device without a
    wait (filled on the host, not by a boolean-mask assignment on the device)."""
    reads = Reads(monkeypatch)
    got = _step(reads, micro=6, packing=True, epochs=2)
    assert got == Counter(cpu=6, tolist=12, __float__=2 + 1), got


def test_kda_layers_share_one_device_copy_of_the_offsets(monkeypatch):
    """Every KDA layer of one packed forward gets the same int64 device tensor of ``cu_seqlens``
    (made once per forward by ``VarlenLayout``), so fla's wrapper copies nothing per layer."""
    reads = Reads(monkeypatch)
    _step(reads, micro=1, packing=True)
    n_kda = sum(TINY.layer_type(i) == "kda" for i in range(TINY.num_hidden_layers))
    got = reads.fla_cu_seqlens
    assert len(got) == n_kda > 1
    assert all(c is got[0] for c in got) and got[0].device.type == "meta" and got[0].dtype == torch.long


def test_bad_ids_still_fail_with_the_model_message():
    """The train step checks token and expert ids on the host, with the model's own messages."""
    from tests.k3core.rl.test_train_step import _model

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    cfg = GRPOSettings(routing_replay=True, packing=True, micro_batch_tokens=0)  # one row per sequence
    bad_token = _seqs(2)
    bad_token[1].output_ids[0] = TINY.vocab_size
    with pytest.raises(ValueError, match=r"token id 260 at position \(0, 7\) is outside the vocabulary"):
        tr.grpo_train_step(model, opt, bad_token, cfg, TINY.pad_token_id)
    bad_expert = _seqs(2)
    bad_expert[0].routing[1, 0, 0] = E
    with pytest.raises(ValueError, match=rf"forced expert ids must lie in \[0, {E}\)"):
        tr.grpo_train_step(model, opt, bad_expert, cfg, TINY.pad_token_id)

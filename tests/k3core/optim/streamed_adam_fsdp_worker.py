"""One rank of the 2-process FSDP2 check for StreamedAdamW (gloo, CPU); run by test_streamed_adam.py.

Each rank owns a Shard(0) piece of every parameter (FSDP2 fully_shard) and streams only that shard.
Both ranks see the same batch, so the averaged gradients equal the unsharded ones, and the sharded
run must equal an unsharded StreamedAdamW run of the same model (fp32 moments: no rounding noise,
whose draw depends on the local element index). Clipping exercises the norm all-reduce; the state
dict round-trips through torch.distributed.checkpoint with both ranks writing their shards.

Usage: RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python streamed_adam_fsdp_worker.py CKPT_DIR
"""

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from k3core.optim.streamed_adam import StreamedAdamW


class Net(torch.nn.Module):
    """A bf16 layer and an fp32 layer (the way KDA keeps A_log/dt_bias fp32)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.l1 = torch.nn.Linear(16, 21).to(torch.bfloat16)
        self.l2 = torch.nn.Linear(21, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(x)).float())


def make_opt(model: torch.nn.Module) -> StreamedAdamW:
    return StreamedAdamW(
        model.named_parameters(), lr=1e-2, weight_decay=0.1, chunk_numel=13, max_grad_norm=0.05, moment_dtype=torch.float32
    )


def train(model: torch.nn.Module, opt: StreamedAdamW, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen).to(torch.bfloat16)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def main() -> None:
    ckpt = sys.argv[1]
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))

    sharded = Net(0)
    fully_shard(sharded.l1, mesh=mesh)
    fully_shard(sharded.l2, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    plain = Net(0)
    opt_sharded, opt_plain = make_opt(sharded), make_opt(plain)
    train(sharded, opt_sharded, 3, seed=1)
    train(plain, opt_plain, 3, seed=1)

    assert abs(opt_sharded.last_grad_norm - opt_plain.last_grad_norm) < 1e-5 * opt_plain.last_grad_norm, (
        opt_sharded.last_grad_norm, opt_plain.last_grad_norm)  # fmt: skip
    assert opt_plain.last_grad_norm > 0.05, "clipping must be active for this check"
    for i, ((name, ps), pp) in enumerate(zip(sharded.named_parameters(), plain.parameters())):
        assert ps.dtype == pp.dtype, name
        torch.testing.assert_close(ps.full_tensor(), pp.detach(), rtol=1e-6, atol=1e-6, msg=name)
        master = opt_sharded.state_dict()["state"][i]["master"]
        torch.testing.assert_close(master.full_tensor(), opt_plain.state[pp]["master"], rtol=1e-6, atol=1e-6, msg=name)

    # DCP round trip: both ranks save their shards; a fresh model (other init) loads them.
    dcp.save(opt_sharded.state_dict(), checkpoint_id=ckpt)
    fresh = Net(7)
    fully_shard(fresh.l1, mesh=mesh)
    fully_shard(fresh.l2, mesh=mesh)
    fully_shard(fresh, mesh=mesh)
    opt_fresh = make_opt(fresh)
    sd = opt_fresh.state_dict()
    dcp.load(sd, checkpoint_id=ckpt)
    opt_fresh.load_state_dict(sd)
    train(fresh, opt_fresh, 2, seed=2)
    train(sharded, opt_sharded, 2, seed=2)
    for (name, a), b in zip(fresh.named_parameters(), sharded.parameters()):
        assert torch.equal(a.to_local(), b.to_local()), name
    dist.barrier()
    if dist.get_rank() == 0:
        print("FSDP2 OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

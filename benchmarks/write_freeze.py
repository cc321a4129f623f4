"""The update beside a trainer-state write: how long its first optimizer step waits, when the write is
joined (the baseline: the step waits for the disk) and when it is frozen (the writer copies what it
has not read yet and goes on; the step waits for that copy).

Claim (issue 33): with the freeze, an update that starts while the state is still being written
waits for a memory copy of the unwritten part, not for the disk, and the state written is the one
from before the update, bit for bit.

Setup: a ``StreamedAdamW`` over ``--params`` fp32 parameters in tensors of ``--tensor-numel``
(its host state: fp32 masters and two bf16 moments, 8 B per parameter, as a trainer state stores
it), one step taken so the moments are not zero, gradients set. Each trial starts
``dcp.save`` of the optimizer state in a thread through ``ODirectFileSystemWriter`` (the pipeline's
writer settings for this machine's cores, ``tasks.save.writer_options``), waits ``--start`` of the
write's measured time, then takes an optimizer step after joining the write (``join``) or after
``writer.freeze()``, copying into fresh memory (``freeze, fresh memory``) or into a
``SnapshotArena`` kept from one write to the next as the pipeline keeps one (``freeze, arena``;
its first touch is paid once, untimed, before the trials). Reported per mode, medians over ``--trials``: the step's wait,
the write's wall time, the bytes the freeze copied (the host memory it added); after each freeze
trial the written state is read back and compared with the state before the step.

Usage (from the repository root):
    python benchmarks/write_freeze.py                       # 200M parameters: a 1.6 GB state
    python benchmarks/write_freeze.py --params 50000000 --trials 3 --dir /mnt/nvme/k3rl_freeze
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k3core.checkpoint.odirect import ODirectFileSystemWriter, SnapshotArena  # noqa: E402
from k3core.optim.streamed_adam import StreamedAdamW  # noqa: E402
from tasks.save import writer_options  # noqa: E402


def host_state(opt: StreamedAdamW) -> dict[str, torch.Tensor]:
    return {f"{i}.{k}": v for i, st in enumerate(opt.state.values()) for k, v in st.items() if k != "step"}


def trial(opt: StreamedAdamW, params: list[torch.Tensor], out: Path, mode: str, start_s: float,
          arena: SnapshotArena) -> dict:
    """One write with a step ``start_s`` after it began; the step's wait and the write's time."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    frozen = mode != "join"
    writer = ODirectFileSystemWriter(out, freezable=frozen, snapshot_arena=arena if mode == "freeze, arena" else None,
                                     **writer_options())
    before = {k: v.clone() for k, v in host_state(opt).items()} if frozen else None
    done = {}

    def save():
        t0 = time.perf_counter()
        dcp.save({"optim": host_state(opt)}, storage_writer=writer)
        done["write_s"] = time.perf_counter() - t0

    thread = threading.Thread(target=save)
    t_start = time.perf_counter()
    thread.start()
    time.sleep(start_s)
    t0 = time.perf_counter()
    if mode == "join":
        thread.join()
    else:
        while not writer.freeze(timeout=0.05):
            pass
    wait = time.perf_counter() - t0
    for p in params:
        p.grad.normal_()
    opt.step()
    thread.join()
    result = {"wait_s": wait, "write_s": done["write_s"], "frozen_bytes": writer.frozen_bytes,
              "step_at_s": t0 - t_start}
    if before is not None:
        saved = {k: torch.empty_like(v) for k, v in before.items()}
        dcp.load({"optim": saved}, checkpoint_id=str(out))
        result["equal"] = all(torch.equal(saved[k], before[k]) for k in before)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=int, default=200_000_000)
    p.add_argument("--tensor-numel", type=int, default=8_000_000)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--start", type=float, default=0.3, help="the step starts at this fraction of the write's time")
    p.add_argument("--dir", type=Path, default=ROOT / "build" / "write_freeze")
    a = p.parse_args()
    sizes = [a.tensor_numel] * (a.params // a.tensor_numel) + ([a.params % a.tensor_numel] if a.params % a.tensor_numel else [])
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    opt = StreamedAdamW(params, lr=1e-3)
    for q in params:
        q.grad = torch.randn_like(q)
    opt.step()
    state_bytes = sum(v.numel() * v.element_size() for v in host_state(opt).values())
    print(f"# {a.params:,} parameters in {len(params)} tensors: state {state_bytes / 1e9:.2f} GB, writer "
          f"{writer_options()}, {torch.get_num_threads()} intra-op threads, dir {a.dir}", flush=True)
    arena = SnapshotArena()
    probe = trial(opt, params, a.dir / "probe", "join", 0.0, arena)  # the write alone: where "start" falls
    start_s = a.start * probe["write_s"]
    trial(opt, params, a.dir / "warm", "freeze, arena", start_s, arena)  # the arena's first touch, not timed
    print(f"# write alone {probe['write_s']:.2f} s ({state_bytes / probe['write_s'] / 2**30:.2f} GiB/s); the step "
          f"starts {start_s:.2f} s into each write", flush=True)
    rows = {"join": [], "freeze, fresh memory": [], "freeze, arena": []}
    for t in range(a.trials):
        for mode in rows:
            r = trial(opt, params, a.dir / mode.replace(", ", "-").replace(" ", "-"), mode, start_s, arena)
            rows[mode].append(r)
            print(f"# trial {t} {mode}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                    for k, v in r.items()), flush=True)
    shutil.rmtree(a.dir, ignore_errors=True)
    med = {m: {k: statistics.median(r[k] for r in rs) for k in ("wait_s", "write_s", "frozen_bytes")}
           for m, rs in rows.items()}
    print()
    print("| mode | step's wait s | write s | copied by the freeze GB |")
    print("|---|---|---|---|")
    for m, v in med.items():
        print(f"| {m} | {v['wait_s']:.3f} | {v['write_s']:.2f} | {v['frozen_bytes'] / 1e9:.2f} |")
    print()
    for m in ("freeze, fresh memory", "freeze, arena"):
        print(f"step's wait, {m} / join = {med[m]['wait_s'] / med['join']['wait_s']:.3f}x; the freeze copied "
              f"{med[m]['frozen_bytes'] / state_bytes:.0%} of the state; the written state equals the one before "
              f"the step in {sum(r['equal'] for r in rows[m])}/{len(rows[m])} trials")


if __name__ == "__main__":
    main()

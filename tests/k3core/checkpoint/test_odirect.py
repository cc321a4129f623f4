"""ODirectFileSystemWriter against the stock DCP FileSystemWriter / FileSystemReader.

Reference: the stock writer. Our files must load through the stock reader bit-exactly, and every
item blob must equal, byte for byte, the blob the stock writer produces for the same item.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import fcntl
import json
import mmap
import os
import re
import signal
import time
import traceback
import uuid
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import WriteItemType

from k3core.checkpoint import odirect
from k3core.checkpoint.odirect import (
    AlignedBufferPool,
    ODirectFallbackWarning,
    ODirectFileSystemWriter,
    dio_alignment,
    is_memory_filesystem,
)

REPO = Path(__file__).resolve().parents[3]
KiB, MiB = 1 << 10, 1 << 20

# dcp.save/load outside torch.distributed warn that they assume a single process
pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.timeout(300),  # a pipeline deadlock fails instead of hanging the suite
]


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def disk_dir(tmp_path: Path) -> Path:
    """A directory on a disk filesystem (O_DIRECT meaningful): tmp_path unless it is tmpfs."""
    if not is_memory_filesystem(tmp_path):
        yield tmp_path
        return
    d = REPO / "build" / "test_odirect" / uuid.uuid4().hex
    d.mkdir(parents=True)
    yield d
    for p in sorted(d.rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    d.rmdir()


def direct_io_works(directory: Path) -> bool:
    """Whether O_DIRECT writes of one aligned block succeed in `directory`."""
    p = directory / f".probe-{uuid.uuid4().hex}"
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    try:
        if dio_alignment(fd) == 0:
            return False
        m = mmap.mmap(-1, 4096)
        try:
            os.pwrite(fd, m, 0)
            return True
        except OSError:
            return False
        finally:
            m.close()
    finally:
        os.close(fd)
        p.unlink()


def resident_bytes(path: Path) -> int:
    """Bytes of `path` present in the page cache (mincore over an untouched private mapping)."""
    size = path.stat().st_size
    if size == 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        anchor = ctypes.c_char.from_buffer(m)
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec)
        assert rc == 0, os.strerror(ctypes.get_errno())
        del anchor
        return sum(v & 1 for v in vec) * mmap.PAGESIZE
    finally:
        m.close()


def make_state(seed: int = 0, scale: int = 1) -> dict:
    """Mixed dtypes, sizes that are not multiples of 4096, empty and 0-d tensors, views of larger
    storages, non-contiguous tensors, NaN payloads and -0.0, plus bytes and Python objects."""
    g = torch.Generator().manual_seed(seed)
    f32 = torch.randn(1_000_003 * scale, generator=g)
    f32[:3] = torch.tensor([-0.0, float("nan"), float("inf")])
    nan_payload = torch.tensor([0x7FC00001, 0x7F800001, -0x00400001], dtype=torch.int32).view(torch.float32)
    big = torch.randn(300, 70, generator=g)
    return {
        "f32": f32,
        "nan_payload": nan_payload,
        "bf16": torch.randn(333, 77, generator=g).to(torch.bfloat16),
        "f16": torch.randn(4097, generator=g).to(torch.float16),
        "f64": torch.randn(513, generator=g, dtype=torch.float64),
        "i64": torch.randint(-(2**62), 2**62, (1025,), generator=g, dtype=torch.int64),
        "i8": torch.randint(-128, 127, (4095,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (12_345,), generator=g, dtype=torch.uint8),
        "bool": torch.rand(999, generator=g) > 0.5,
        "c64": torch.randn(211, generator=g, dtype=torch.complex64),
        "fp8": torch.randn(1000, generator=g).to(torch.float8_e4m3fn),
        "empty": torch.empty(0),
        "empty2d": torch.empty(3, 0, dtype=torch.bfloat16),
        "scalar": torch.tensor(3.25),
        "transposed": big.t(),
        "slice": big[7:9],  # view into a larger storage
        "nested": {"w": torch.randn(17, 5, generator=g), "b": torch.zeros(5)},
        "step": 123 + seed,
        "name": f"run-{seed}",
        "blob": bytes(range(256)) * 17 + b"\x00tail",
        "cfg": {"lr": 1e-3, "betas": (0.9, 0.95), "tags": ["a", "b"]},
    }


def empty_like_state(state: dict) -> dict:
    """A load target with the same structure: tensors zeroed, Python values replaced."""
    out = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            out[k] = torch.zeros(v.shape, dtype=v.dtype)
        elif isinstance(v, dict):
            out[k] = empty_like_state(v)
        else:
            out[k] = None
    return out


def assert_bit_exact(got, want, key="") -> None:
    if isinstance(want, dict):
        assert set(got) == set(want), key
        for k in want:
            assert_bit_exact(got[k], want[k], f"{key}.{k}")
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), key
        assert got.dtype == want.dtype and got.shape == want.shape, key
        a = got.contiguous().reshape(-1).view(torch.uint8)
        b = want.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(a, b), f"{key}: bytes differ"
    else:
        assert got == want and type(got) is type(want), key


def load_stock(path: Path, like: dict) -> dict:
    target = empty_like_state(like)
    dcp.load(target, storage_reader=FileSystemReader(path))
    return target


def item_blobs(path: Path) -> dict:
    """{fqn/index: bytes of the item at its recorded offset}, as the stock reader slices them."""
    md = FileSystemReader(path).read_metadata()
    out = {}
    for index, info in md.storage_data.items():
        with open(path / info.relative_path, "rb") as f:
            f.seek(info.offset)
            out[(index.fqn, tuple(index.offset or ()))] = f.read(info.length)
    return out


def data_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.suffix == ".distcp")


def named_files_complete(path: Path) -> bool:
    md = FileSystemReader(path).read_metadata()
    for info in md.storage_data.values():
        p = path / info.relative_path
        if not p.exists() or p.stat().st_size < info.offset + info.length:
            return False
    return True


def fork_child(fn, *args) -> int:
    """Run `fn(*args)` in a forked child (torch already imported: no interpreter start-up, which
    costs seconds on a loaded 2-core box). Exit status 0 iff `fn` returned."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            # libgomp's thread pool does not survive fork: keep the child's torch ops inline
            torch.set_num_threads(1)
            fn(*args)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def wait_child(pid: int, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"child {pid} timed out")


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize(
    "options",
    [
        dict(buffer_bytes=64 * KiB, num_buffers=2),  # many buffer boundaries inside items
        dict(buffer_bytes=1 * MiB, io_threads=2, thread_count=3),  # several files per rank
        dict(buffer_bytes=256 * KiB, single_file_per_rank=False),  # one file per item
        dict(buffer_bytes=64 * KiB, num_buffers=2, thread_count=3, io_threads=2),  # starved pool
    ],
    ids=["tiny-buffers", "threads", "file-per-item", "fewer-buffers-than-threads"],
)
def test_loads_with_stock_reader_bit_exact(disk_dir: Path, options: dict) -> None:
    state = make_state(seed=1)
    ours, stock = disk_dir / "ours", disk_dir / "stock"
    writer = ODirectFileSystemWriter(ours, **options)
    dcp.save(state, storage_writer=writer)
    dcp.save(
        state,
        storage_writer=FileSystemWriter(
            stock,
            thread_count=options.get("thread_count", 1),
            single_file_per_rank=options.get("single_file_per_rank", True),
        ),
    )

    stats = writer.last_stats
    if direct_io_works(disk_dir):
        assert stats.direct_files == stats.files and stats.buffered_files == 0
        # O_DIRECT kept the checkpoint out of the page cache (the stock files are in it);
        # measured before anything reads the files back
        assert sum(resident_bytes(p) for p in data_files(ours)) <= mmap.PAGESIZE * stats.files
        assert sum(resident_bytes(p) for p in data_files(stock)) > stats.payload_bytes // 2

    assert_bit_exact(load_stock(ours, state), state)
    # every item is the very blob the stock writer produces (offsets may differ, bytes may not)
    assert item_blobs(ours) == item_blobs(stock)
    # only the files the metadata names, each exactly as long as its items
    md = FileSystemReader(ours).read_metadata()
    ends: dict[str, int] = {}
    for info in md.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    assert {p.name for p in data_files(ours)} == set(ends)
    for name, end in ends.items():
        assert (ours / name).stat().st_size == end

    assert stats.files == len(ends) and stats.payload_bytes == sum(ends.values())


@pytest.mark.parametrize(
    "options",
    [
        dict(buffer_bytes=64 * KiB, num_buffers=2),
        dict(buffer_bytes=64 * KiB, num_buffers=3, thread_count=3, io_threads=2, hash_threads=2),
        dict(buffer_bytes=256 * KiB, single_file_per_rank=False, direct=False),
    ],
    ids=["one-lane", "lanes-shared-by-files", "buffered-file-per-item"],
)
def test_digests_hashed_while_writing_equal_sha256_of_the_files(disk_dir: Path, options: dict) -> None:
    """Every file the save wrote (data files and .metadata) has the digest the writer reported,
    computed from the bytes on their way out (many buffers per file, files sharing hash lanes, the
    O_DIRECT tail's padding excluded)."""
    import hashlib

    state = make_state(seed=5)
    writer = ODirectFileSystemWriter(disk_dir, **options)
    dcp.save(state, storage_writer=writer)
    on_disk = {p.name for p in data_files(disk_dir)} | {".metadata"}
    assert set(writer.digests) == on_disk
    for name, (digest, size) in writer.digests.items():
        data = (disk_dir / name).read_bytes()
        assert (hashlib.sha256(data).hexdigest(), len(data)) == (digest, size), name


def test_same_file_bytes_as_stock_on_cpu(disk_dir: Path) -> None:
    """On CPU the stock writer writes items in plan order, as we do: whole files are identical."""
    if torch.cuda.is_available():
        pytest.skip("the stock writer reorders items by size when CUDA is available")
    state = make_state(seed=2)
    dcp.save(state, storage_writer=ODirectFileSystemWriter(disk_dir / "ours", buffer_bytes=128 * KiB))
    dcp.save(state, storage_writer=FileSystemWriter(disk_dir / "stock"))
    (ours,), (stock,) = data_files(disk_dir / "ours"), data_files(disk_dir / "stock")
    assert ours.read_bytes() == stock.read_bytes()


def test_overwrite_publishes_new_and_removes_old_files(disk_dir: Path) -> None:
    a, b = make_state(seed=3), make_state(seed=4)
    dcp.save(a, storage_writer=FileSystemWriter(disk_dir))  # a stock checkpoint first
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Detected an existing checkpoint")
        dcp.save(b, storage_writer=ODirectFileSystemWriter(disk_dir, buffer_bytes=256 * KiB))
    assert_bit_exact(load_stock(disk_dir, b), b)
    named = {i.relative_path for i in FileSystemReader(disk_dir).read_metadata().storage_data.values()}
    assert {p.name for p in data_files(disk_dir)} == named
    assert not [p for p in disk_dir.iterdir() if p.name.endswith(".tmp")]


def test_split_into_files_matches_stock_bucketing() -> None:
    """Same bucketing as the stock writer (reference: its private _split_by_size_and_type)."""
    reference = getattr(dcp_fs, "_split_by_size_and_type", None)
    if reference is None:
        pytest.skip("this torch has no _split_by_size_and_type")
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    planner = DefaultSavePlanner()
    planner.set_up_planner(make_state(seed=5), is_coordinator=True)
    items = planner.create_local_plan().items
    assert any(i.type == WriteItemType.BYTE_IO for i in items)
    for files in (1, 2, 3, 7):
        ours = [[i.index for i in b] for b in odirect._split_into_files(items, files)]
        ref = [[i.index for i in b] for b in reference(files, list(items))]
        assert ours == ref


# --------------------------------------------------------------------------- fallback


def _fallback_warnings(record) -> list:
    return [w for w in record if issubclass(w.category, ODirectFallbackWarning)]


def test_fallback_on_tmpfs_warns_once() -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or not is_memory_filesystem(shm):
        pytest.skip("no tmpfs at /dev/shm")
    d = shm / f"k3-odirect-test-{uuid.uuid4().hex}"
    state = make_state(seed=6)
    try:
        writer = ODirectFileSystemWriter(d, buffer_bytes=256 * KiB, thread_count=2)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            dcp.save(state, storage_writer=writer)
        assert len(_fallback_warnings(record)) == 1
        assert writer.last_stats.files == 2 and writer.last_stats.buffered_files == 2
        assert_bit_exact(load_stock(d, state), state)
    finally:
        for p in d.glob("*"):
            p.unlink()
        d.rmdir() if d.exists() else None


def test_fallback_when_open_refuses_o_direct(disk_dir: Path, monkeypatch) -> None:
    """A filesystem whose open(O_DIRECT) fails with EINVAL (old tmpfs, some FUSE/network fs)."""
    real_open = os.open

    def refusing_open(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    state = make_state(seed=7)
    writer = ODirectFileSystemWriter(disk_dir, buffer_bytes=256 * KiB, thread_count=3)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        dcp.save(state, storage_writer=writer)
    assert len(_fallback_warnings(record)) == 1
    assert writer.last_stats.files == 3 and writer.last_stats.direct_files == 0
    monkeypatch.undo()
    assert_bit_exact(load_stock(disk_dir, state), state)


def test_fallback_when_direct_write_fails(disk_dir: Path, monkeypatch) -> None:
    """A filesystem that accepts open(O_DIRECT) but fails the write with EINVAL: the descriptor
    drops O_DIRECT (fcntl) and the same write is retried buffered."""
    real = odirect._pwrite_all

    def refusing_pwrite(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        real(fd, data, offset)

    monkeypatch.setattr(odirect, "_pwrite_all", refusing_pwrite)
    state = make_state(seed=8)
    writer = ODirectFileSystemWriter(disk_dir, buffer_bytes=64 * KiB, io_threads=2, thread_count=2)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        dcp.save(state, storage_writer=writer)
    assert len(_fallback_warnings(record)) == 1
    assert writer.last_stats.buffered_files == 2
    assert_bit_exact(load_stock(disk_dir, state), state)


def test_write_error_fails_the_save_and_publishes_nothing(disk_dir: Path, monkeypatch) -> None:
    def full_disk(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    fds_before = set(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(odirect, "_pwrite_all", full_disk)
    with pytest.raises(CheckpointException) as failure:  # a BaseException
        dcp.save(make_state(seed=9), storage_writer=ODirectFileSystemWriter(disk_dir, buffer_bytes=64 * KiB))
    # DCP wraps the rank's exception; its report must name the real cause
    assert "No space left on device" in "".join(traceback.format_exception(failure.value))
    assert not (disk_dir / ".metadata").exists()
    assert set(os.listdir("/proc/self/fd")) <= fds_before  # no descriptor leaked


def test_rejects_unsupported_options(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        ODirectFileSystemWriter(tmp_path, num_buffers=1)
    with pytest.raises(ValueError):
        ODirectFileSystemWriter(tmp_path, buffer_bytes=4096 + 512)
    if hasattr(dcp_fs, "SerializationFormat"):
        with pytest.raises(ValueError):
            ODirectFileSystemWriter(tmp_path, serialization_format=dcp_fs.SerializationFormat.SAFETENSORS)


# --------------------------------------------------------------------------- memory footprint


def test_buffer_pool_is_page_aligned_and_bounded() -> None:
    pool = AlignedBufferPool(3, 64 * KiB)
    got = [pool.acquire() for _ in range(3)]
    for i in got:
        anchor = ctypes.c_char.from_buffer(pool.buffers[i])
        assert ctypes.addressof(anchor) % mmap.PAGESIZE == 0
        del anchor
    assert pool.peak_in_use_bytes == pool.capacity_bytes == 3 * 64 * KiB
    pool.release(got[0])
    assert pool.acquire() == got[0]
    pool.close()


def test_pool_accounting_independent_of_checkpoint_size(disk_dir: Path) -> None:
    stats = []
    for scale in (1, 8):  # 4 MB and 32 MB of tensors
        w = ODirectFileSystemWriter(disk_dir / f"s{scale}", buffer_bytes=256 * KiB, num_buffers=3)
        dcp.save(make_state(seed=10, scale=scale), storage_writer=w)
        stats.append(w.last_stats)
    assert stats[1].payload_bytes > 7 * stats[0].payload_bytes
    assert stats[0].pool_bytes == stats[1].pool_bytes == 3 * 256 * KiB
    assert all(s.peak_pool_bytes_in_use <= s.pool_bytes for s in stats)


def _rss_child(root: Path, out: Path) -> None:
    def kib(field: str) -> int:
        status = Path("/proc/self/status").read_text()
        return int(re.search(field + r":\s+(\d+)", status).group(1))

    result = {}
    for mib in (4, 32, 160):  # 4 MiB first: warms up lazy imports and allocator pools
        state = {f"t{i}": torch.randn(mib * MiB // 4 // 8 + 11) for i in range(8)}
        w = ODirectFileSystemWriter(root / f"c{mib}", buffer_bytes=1 * MiB, num_buffers=4)
        rss = kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
        dcp.save(state, storage_writer=w)
        result[mib] = {
            "growth": (kib("VmHWM") - rss) * KiB,
            "pool": w.last_stats.pool_bytes,
            "payload": w.last_stats.payload_bytes,
        }
        del state
    out.write_text(json.dumps(result))


def test_peak_rss_growth_does_not_scale_with_checkpoint(disk_dir: Path) -> None:
    """Peak RSS of a save, measured in a fresh (forked) process: 32 MiB -> 160 MiB of checkpoint
    must not move it by more than a few MiB, and it stays within the pool plus slack."""
    out = disk_dir / "rss.json"
    assert wait_child(fork_child(_rss_child, disk_dir, out)) == 0
    r = {int(k): v for k, v in json.loads(out.read_text()).items()}
    assert r[160]["payload"] > 150 * MiB and r[160]["pool"] == 4 * MiB
    growth = {m: r[m]["growth"] for m in (32, 160)}
    assert growth[160] <= r[160]["pool"] + 24 * MiB, growth
    assert growth[160] - growth[32] <= 8 * MiB, growth


# --------------------------------------------------------------------------- several ranks


def _ranked(world: int, rank: int) -> dict:
    """Rank `rank`'s state: a row-sharded DTensor (uneven shards), a replicated tensor (DCP writes
    it once), a per-rank tensor and a Python int."""
    g = torch.Generator().manual_seed(0)
    full = torch.randn(1001, 3, generator=g)
    shared = torch.randn(4099, generator=g).to(torch.bfloat16)
    return {
        "dt": full,
        "shared": shared,
        f"rank{rank}": torch.full((777 + rank,), float(rank), dtype=torch.float64),
        "step": 5,
    }


def _rank_child(rank: int, world: int, ckpt: Path, store: Path, out: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        state = _ranked(world, rank)
        state["dt"] = distribute_tensor(state["dt"], mesh, [Shard(0)])
        w = ODirectFileSystemWriter(ckpt, buffer_bytes=64 * KiB)
        dcp.save(state, storage_writer=w)
        out.write_text(json.dumps(dataclasses.asdict(w.last_stats)))
    finally:
        dist.destroy_process_group()


def test_two_ranks_gloo(disk_dir: Path) -> None:
    ckpt, store = disk_dir / "ckpt", disk_dir / "store"
    outs = [disk_dir / f"rank{r}.json" for r in range(2)]
    pids = [fork_child(_rank_child, r, 2, ckpt, store, outs[r]) for r in range(2)]
    assert [wait_child(pid) for pid in pids] == [0, 0]
    stats = [json.loads(o.read_text()) for o in outs]
    assert [s["files"] for s in stats] == [1, 1]

    want = {**_ranked(2, 0), **_ranked(2, 1)}
    assert_bit_exact(load_stock(ckpt, want), want)
    names = sorted(p.name for p in data_files(ckpt))
    assert len(names) == 2 and names[0].startswith("__0_") and names[1].startswith("__1_")
    md = FileSystemReader(ckpt).read_metadata()
    dt_files = {i.relative_path for k, i in md.storage_data.items() if k.fqn == "dt"}
    assert len(dt_files) == 2  # each rank wrote its own shard
    assert named_files_complete(ckpt)


# --------------------------------------------------------------------------- crash safety


def _killed_child(ckpt: Path, marker: Path) -> None:
    real, calls = odirect._pwrite_all, [0]

    def slow_disk(fd, data, offset):
        real(fd, data, offset)
        calls[0] += 1
        if calls[0] == 3:  # some data is on disk, the save is far from done: stall until killed
            marker.touch()
            time.sleep(600)

    odirect._pwrite_all = slow_disk
    state = {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(8)}  # 32 MiB
    dcp.save(state, storage_writer=ODirectFileSystemWriter(ckpt, buffer_bytes=1 * MiB))


@pytest.mark.parametrize("previous", [False, True], ids=["fresh-dir", "over-previous-checkpoint"])
def test_killed_writer_never_publishes_missing_data(disk_dir: Path, previous: bool) -> None:
    """SIGKILL in the middle of the data writes (the child's disk stalls after 3 buffers)."""
    ckpt = disk_dir / "ckpt"
    old = make_state(seed=11)
    if previous:
        dcp.save(old, storage_writer=ODirectFileSystemWriter(ckpt, buffer_bytes=256 * KiB))
        old_metadata = (ckpt / ".metadata").read_bytes()
    before = {p.name for p in data_files(ckpt)} if previous else set()

    marker = disk_dir / "stalled"
    pid = fork_child(_killed_child, ckpt, marker)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            done, _ = os.waitpid(pid, os.WNOHANG)
            assert not done, "the child exited before stalling"
            assert time.monotonic() < deadline, "the child never started writing"
            time.sleep(0.02)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)

    if previous:
        # the old checkpoint is still published, complete, and loads bit-exactly
        assert (ckpt / ".metadata").read_bytes() == old_metadata
        assert named_files_complete(ckpt)
        assert_bit_exact(load_stock(ckpt, old), old)
    else:
        assert not (ckpt / ".metadata").exists()
    debris = {p.name for p in data_files(ckpt)} - before
    assert debris, "the killed save left no partial data file: it was not killed mid-save"

    # the next successful save publishes and sweeps the debris
    new = make_state(seed=12)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Detected an existing checkpoint")
        dcp.save(new, storage_writer=ODirectFileSystemWriter(ckpt, buffer_bytes=256 * KiB))
    assert not debris & {p.name for p in data_files(ckpt)}
    assert_bit_exact(load_stock(ckpt, new), new)

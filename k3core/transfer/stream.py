"""The cross-process transfer on one host: a fixed ring of shared-memory buckets with flow control.

Owns both ends of the ``"shm_stream"`` transport: ``send_shm_stream`` (sender) and
``receive_stream`` (receiver; ``receive`` and ``load_payload`` in ``receive.py`` call it for such
payloads, as the server's ``/update_weights_from_tensor`` does). Does not own: the segments
themselves (``segments.py``), the checks shared with CUDA IPC (``verify.py``), the wire items
(``wire.py``).

Why a ring: the sender owns ``ring`` segments of ``bucket_bytes`` each, allocated once per stream;
it fills bucket ``i`` while the receiver copies bucket ``i - 1`` out, and reuses a segment only
after the receiver said it is done with it. A tensor larger than a bucket is split across buckets,
so shared memory peaks at ``ring * bucket_bytes`` whatever the model's size or its largest tensor
(a container's /dev/shm is often small: the default ring fits its default 64 MiB).

Protocol. ``send_shm_stream`` creates the ring and a Unix-domain control socket (Linux abstract
namespace: nothing on disk, gone when the sender dies) and returns at once with a JSON ``payload``;
a background thread streams. The payload travels like any other (HTTP body, queue)::

    {"format": "k3rl.weights/1", "transport": "shm_stream", "weight_version": int, "hash": algo,
     "ring": [segment name, ...], "bucket_bytes": int, "control": socket name, "token": hex,
     "timeout_s": float}

The receiver connects to ``control`` and sends ``{"op": "hello", "token"}``; then, one JSON line each:
- sender: ``{"op": "bucket", "seq": i, "slot": i % ring, "items": [...], "chunks": [...], "digests": {...}}``:
  ``items`` declares the wire items that start in this bucket (``{"idx", "name", "dtype", "shape",
  "codec", "parts": [nbytes, ...]}``; parts: the data, then the MXFP4 scales for ``codec: "mxfp4"``,
  see ``wire.py``); ``chunks`` are ``[idx, part, at, offset, nbytes]``: bytes ``[at, at + nbytes)`` of
  that part lie at ``offset`` in the slot, in order; ``digests`` maps ``idx`` to the part digests of
  every item whose last byte is in this bucket;
- receiver: ``{"op": "consumed", "seq": i}`` once bucket ``i`` is copied out (the slot is free);
- sender: ``{"op": "end", "num_tensors", "content_sha256"}``;
- receiver: ``{"op": "done"}`` after everything is verified (and, from ``load_payload``, loaded), or
  ``{"op": "refused", "error"}`` at the first problem; the sender: ``{"op": "abort", "error"}`` if it
  fails. Either side that stops hearing from the other for ``timeout_s`` gives up with a
  ``TransferError`` naming what it waited for; a peer that dies closes the socket, which the other
  side sees at once. The sender unlinks the ring when the stream ends, whatever the outcome.

Checks (``verify.py``, the same as CUDA IPC's): version newer than the receiver's, every item's
name, dtype and shape against ``expected`` as soon as it is declared, the codec's entry rules,
chunk bounds and order, every part's digest over the receiver's own staged copy, the name set and
the content digest; the first failure refuses the transfer before anything is applied.

Memory. Shared memory: ``ring * bucket_bytes`` (sender-owned; the receiver maps the same pages).
Receiver, at peak: the engine's own weights plus the staged copy of every tensor in host memory,
which ``load_payload`` hands to the engine's checked atomic ``load_weights`` only once all of it is
verified; MXFP4-codec items are staged as their codes and dequantised one at a time. Sender: nothing
beyond the ring but one expert's MXFP4 codes at a time. A ``staging`` dict kept by the receiver
reuses the staged tensors across transfers (one standing host copy), since fresh pages cost more to
fault in than the copy.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Mapping

import torch

from k3core.transfer.digest import bytes_view, check_algo, default_algo, tensor_digest
from k3core.transfer.segments import (SEGMENT_NAME, SHM_PREFIX, check_shm_dir, create_segment, map_segment,
                                      unlink_segments)
from k3core.transfer.verify import (as_int, check_content, check_declared, check_digest, check_expected,
                                    check_header, decode_parts, need, parse_entry, part_nbytes, wire_parts)
from k3core.transfer.wire import (FORMAT, TransferError, TransferReport, align_up, content_sha256, dtype_name,
                                  item_digest, iter_wire)

__all__ = ["TRANSPORT", "StreamedSend", "send_shm_stream", "receive_stream", "DEFAULT_RING",
           "DEFAULT_STREAM_BUCKET_BYTES"]

TRANSPORT = "shm_stream"
DEFAULT_RING = 3
DEFAULT_STREAM_BUCKET_BYTES = 16 << 20  # x DEFAULT_RING = 48 MiB: fits a container's default 64 MiB /dev/shm
DEFAULT_TIMEOUT_S = 60.0
_REFUSED = "the receiver refused the transfer"


# ------------------------------------------------------------------ control channel
class _Channel:
    """JSON lines over a connected Unix-domain socket; every read waits at most ``timeout`` seconds."""

    def __init__(self, sock: socket.socket, timeout: float, peer: str):
        self.sock, self.peer, self._buf = sock, peer, b""
        sock.settimeout(timeout)

    def send(self, msg: dict) -> None:
        try:
            self.sock.sendall(json.dumps(msg, separators=(",", ":")).encode() + b"\n")
        except OSError as e:
            raise TransferError(f"the {self.peer} closed the control connection ({e}): did it die or give up?") from None

    def recv(self, waiting_for: str) -> dict:
        while b"\n" not in self._buf:
            try:
                data = self.sock.recv(1 << 20)
            except TimeoutError:
                raise TransferError(f"no word from the {self.peer} for {self.sock.gettimeout():g} s while waiting "
                                    f"for {waiting_for}: is it stuck? (timeout_s)") from None
            except ConnectionResetError:  # the peer exited with our messages unread
                data = b""
            except OSError as e:
                raise TransferError(f"control connection to the {self.peer} failed while waiting for "
                                    f"{waiting_for}: {e}") from None
            if not data:
                raise TransferError(f"the {self.peer} closed the control connection while this side waited for "
                                    f"{waiting_for}: it died or gave up")
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            msg = json.loads(line)
        except ValueError:
            raise TransferError(f"the {self.peer} sent a malformed control message: {line[:200]!r}") from None
        if not isinstance(msg, dict):
            raise TransferError(f"the {self.peer} sent a malformed control message: {line[:200]!r}")
        return msg

    def last_words(self, op: str, wait: float = 0.5) -> dict | None:
        """After an error: the peer's first ``op`` message still unread, if one comes within ``wait``
        seconds of silence before the connection closes; else None. Reads everything up to it."""
        try:
            self.sock.settimeout(wait)
            while True:
                msg = self.recv("its last words")
                if msg.get("op") == op:
                    return msg
        except (TransferError, OSError):
            return None

    def close(self) -> None:
        self.sock.close()


def _abstract(name: str) -> str:
    return "\0" + name


# ------------------------------------------------------------------ sender
class StreamedSend:
    """The sender's handle on one streamed transfer (``send_shm_stream``): hand ``payload`` to the
    receiver, then ``wait()`` for the outcome. The stream runs in a background thread from
    construction on; ``close()`` stops it and unlinks the ring (idempotent, also run on garbage
    collection)."""

    def __init__(self, named_tensors: Mapping[str, torch.Tensor], version: int, ring: int, bucket_bytes: int,
                 quantize_experts: bool, w4a8: bool, algo: str, timeout: float):
        if ring < 1 or bucket_bytes < 1 or timeout <= 0:
            raise ValueError(f"ring, bucket_bytes and timeout must be positive, got {ring}, {bucket_bytes}, {timeout}")
        check_shm_dir()
        check_algo(algo)
        self._tensors, self._quantize, self._w4a8, self._algo = named_tensors, quantize_experts, w4a8, algo
        self._timeout = timeout
        self.slot_bytes = align_up(bucket_bytes)
        tag = f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        self._handles: list = []
        self._slots: list[torch.Tensor] = []
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._finalizer = weakref.finalize(self, StreamedSend._release, self._listener, self._handles, self._slots)
        try:
            for k in range(ring):
                seg, buf = create_segment(f"{tag}-{k}", self.slot_bytes)
                self._handles.append(seg)
                self._slots.append(buf)
            self._listener.bind(_abstract(f"{tag}-control"))
            self._listener.listen(4)
            self._listener.settimeout(timeout)
        except BaseException:
            self.close()
            raise
        self.payload = {"format": FORMAT, "transport": TRANSPORT, "weight_version": int(version), "hash": algo,
                        "ring": [h.name for h in self._handles], "bucket_bytes": self.slot_bytes,
                        "control": f"{tag}-control", "token": secrets.token_hex(16), "timeout_s": float(timeout)}
        self.peak_shm_bytes = sum(b.numel() for b in self._slots)
        self.report: TransferReport | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="k3-transfer-stream", daemon=True)
        self._thread.start()

    @staticmethod
    def _release(listener: socket.socket, handles: list, slots: list) -> None:
        listener.close()
        slots.clear()
        unlink_segments(handles)

    @property
    def segment_names(self) -> list[str]:
        """The ring's shared-memory segment names (empty once the stream ended)."""
        return [h.name for h in self._handles]

    def wait(self, timeout: float | None = None) -> TransferReport:
        """Block until the receiver verified (and loaded) everything; return the report. Raises
        ``TransferError`` with the receiver's reason when it refused, or the sender's own failure."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the stream is still running after {timeout} s")
        if self._error is not None:
            raise self._error
        return self.report

    def close(self) -> None:
        """Stop the stream (the receiver sees the connection close) and unlink the ring."""
        for sock in (self._listener, getattr(getattr(self, "_channel", None), "sock", None)):
            try:  # wakes the stream thread out of accept / recv
                if sock is not None:
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        thread = getattr(self, "_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(self._timeout)
        self._finalizer()

    def __enter__(self) -> StreamedSend:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -------------------------------------------------------------- the stream (background thread)
    def _accept(self) -> _Channel:
        deadline = time.monotonic() + self._timeout
        while True:
            self._listener.settimeout(max(deadline - time.monotonic(), 1e-3))
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                raise TransferError(f"no receiver connected within {self._timeout:g} s: was the payload handed "
                                    "to it?") from None
            except OSError as e:
                raise TransferError(f"stream closed before a receiver connected ({e})") from None
            ch = _Channel(conn, self._timeout, "receiver")
            try:
                hello = ch.recv("its hello")
            except TransferError:
                ch.close()
                continue
            if hello.get("op") == "hello" and hello.get("token") == self.payload["token"]:
                return ch
            ch.close()  # not the receiver of this payload

    def _run(self) -> None:
        ch = None
        try:
            ch = self._channel = self._accept()
            self._listener.close()  # one receiver per stream
            t0 = time.perf_counter()
            self.report = self._stream(ch)
            msg = ch.recv("its verdict")
            if msg.get("op") == "refused":
                raise TransferError(f"{_REFUSED}: {msg.get('error')}")
            if msg.get("op") != "done":
                raise TransferError(f"the receiver sent {msg.get('op')!r} instead of its verdict")
            self.report.seconds = time.perf_counter() - t0
        except BaseException as e:
            self._error = e if isinstance(e, TransferError) else TransferError(f"streamed send failed: {type(e).__name__}: {e}")
            if ch is not None and not str(self._error).startswith(_REFUSED):
                try:
                    ch.send({"op": "abort", "error": str(self._error)})
                except TransferError:  # the receiver hung up: did it say why before this side read it?
                    words = ch.last_words("refused")
                    if words is not None:
                        self._error = TransferError(f"{_REFUSED}: {words.get('error')}")
        finally:
            if ch is not None:
                ch.close()
            self._finalizer()

    @torch.no_grad()
    def _stream(self, ch: _Channel) -> TransferReport:
        algo, ring, S = self._algo, len(self._slots), self.slot_bytes
        consumed = -1  # highest bucket the receiver has released

        def wait_free(seq: int) -> None:
            nonlocal consumed
            while consumed < seq - ring:
                msg = ch.recv(f"it to release bucket {seq - ring}")
                if msg.get("op") == "refused":
                    raise TransferError(f"{_REFUSED}: {msg.get('error')}")
                if msg.get("op") != "consumed" or msg.get("seq") != consumed + 1:
                    raise TransferError(f"the receiver sent {msg!r}, expected consumed {consumed + 1}")
                consumed += 1

        # each item is hashed from its source tensors in a second thread (on their device: no extra
        # device-to-host copy for CUDA sources) while this one fills the ring (both release the GIL)
        hasher = ThreadPoolExecutor(1, thread_name_prefix="k3-transfer-digest")
        digests: dict[int, object] = {}  # idx -> future of its part digests
        rows = []
        nbytes = 0
        cur: dict | None = None
        seq = 0

        def open_bucket() -> dict:
            wait_free(seq)
            return {"seq": seq, "slot": seq % ring, "fill": 0, "items": [], "chunks": [], "done": []}

        def publish(b: dict) -> None:
            nonlocal seq
            ch.send({"op": "bucket", "seq": b["seq"], "slot": b["slot"], "items": b["items"], "chunks": b["chunks"],
                     "digests": {str(i): digests[i].result() for i in b["done"]}})
            seq += 1

        try:
            for idx, item in enumerate(iter_wire(self._tensors, self._quantize, self._w4a8)):
                parts = [bytes_view(p) for p in item.parts()]
                nbytes += item.nbytes()
                digests[idx] = hasher.submit(lambda ps: [tensor_digest(p, algo) for p in ps], parts)
                rows.append((item.name, dtype_name(item.dtype), list(item.shape), item.codec, idx))
                if cur is None:
                    cur = open_bucket()
                cur["items"].append({"idx": idx, "name": item.name, "dtype": dtype_name(item.dtype),
                                     "shape": list(item.shape), "codec": item.codec, "parts": [p.numel() for p in parts]})
                for pi, src in enumerate(parts):
                    at = 0
                    while at < src.numel():
                        if cur["fill"] >= S:
                            publish(cur)
                            cur = open_bucket()
                        n = min(src.numel() - at, S - cur["fill"])
                        _fill(self._slots[cur["slot"]][cur["fill"]: cur["fill"] + n], src[at: at + n])
                        cur["chunks"].append([idx, pi, at, cur["fill"], n])
                        cur["fill"] = align_up(cur["fill"] + n)
                        at += n
                cur["done"].append(idx)
            if cur is not None:
                publish(cur)
            rows = [(name, dtype, shape, codec, item_digest(digests[idx].result()))
                    for name, dtype, shape, codec, idx in rows]
        finally:
            hasher.shutdown(cancel_futures=True)
        content = content_sha256(rows, algo)
        ch.send({"op": "end", "num_tensors": len(rows), "content_sha256": content})
        wait_free(seq + ring - 1)  # every bucket copied out: the ring is no longer needed
        self._finalizer()
        return TransferReport(TRANSPORT, self.payload["weight_version"], algo, content, len(rows), nbytes, 0.0,
                              seq, extra={"ring": ring, "bucket_bytes": S,
                                                       "peak_shm_bytes": self.peak_shm_bytes})


def _fill(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy one chunk into a ring slot (a function of its own so a test can corrupt a bucket here)."""
    dst.copy_(src)


def send_shm_stream(named_tensors: Mapping[str, torch.Tensor], version: int, *, ring: int = DEFAULT_RING,
                    bucket_bytes: int = DEFAULT_STREAM_BUCKET_BYTES, quantize_experts: bool = False,
                    w4a8: bool = True, algo: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> StreamedSend:
    """Stream ``named_tensors`` (native trainer state, CPU or CUDA) through a ring of ``ring``
    shared-memory buckets of ``bucket_bytes`` (see the module docstring). Returns at once; hand
    ``.payload`` to the receiver (``load_payload`` / ``/update_weights_from_tensor``) and call
    ``.wait()``. The caller must not change the tensors until then. ``quantize_experts``/``w4a8``:
    see ``wire.py``. ``algo``: digest algorithm (default: ``default_algo("cpu")``, since the receiver
    hashes its host copy). ``timeout``: seconds either side waits for the other before giving up
    (also sent to the receiver)."""
    return StreamedSend(named_tensors, version, ring, bucket_bytes, quantize_experts, w4a8,
                        algo or default_algo("cpu"), timeout)


# ------------------------------------------------------------------ receiver
class _Staged:
    """One wire item on the receiving side: its parts copied out of the ring, then verified."""

    def __init__(self, decl: dict, expected, staging: dict | None):
        self.name, self.dtype, self.shape, self.codec = parse_entry(decl)
        specs = wire_parts(self.name, self.dtype, self.shape, self.codec)
        sizes = [part_nbytes(d, s) for d, s in specs]
        parts = decl.get("parts")
        need(isinstance(parts, list) and [as_int(p, f"{self.name} part size") for p in parts] == sizes,
             f"{self.name}: part sizes {parts!r}, but {self.codec} {dtype_name(self.dtype)} {list(self.shape)} "
             f"needs {sizes}")
        check_declared(self.name, self.dtype, self.shape, expected)
        if self.codec == "raw":  # staged straight into the tensor the engine gets
            kept = staging.get(self.name) if staging is not None else None
            if kept is None or tuple(kept.shape) != self.shape or kept.dtype != self.dtype:
                kept = torch.empty(self.shape, dtype=self.dtype)
                if staging is not None:
                    staging[self.name] = kept
            self.tensor = kept
            self.parts = [bytes_view(self.tensor)]
        else:
            self.tensor = None
            self.parts = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        self.got = [0] * len(sizes)
        self.digest: str | None = None

    def verify(self, digests, algo: str) -> None:
        need(self.got == [p.numel() for p in self.parts],
             f"{self.name}: digests sent after {self.got} of {[p.numel() for p in self.parts]} bytes")
        need(isinstance(digests, list) and len(digests) == len(self.parts), f"malformed stream: {self.name} digests")
        for what, p, want in zip(("", " (scale)"), self.parts, digests):
            check_digest(p, want, algo, self.name + what)
        if self.codec != "raw":
            self.tensor = decode_parts(self.parts, self.dtype, self.shape, self.codec)
            self.parts = []
        self.digest = item_digest(digests)


def _ring(payload: dict) -> tuple[list[str], int, float]:
    ring = payload.get("ring")
    need(isinstance(ring, list) and ring and all(isinstance(n, str) and SEGMENT_NAME.match(n) for n in ring),
         f"malformed payload: 'ring' must list k3xfer-* segment names, got {ring!r}")
    slot_bytes = as_int(payload.get("bucket_bytes"), "bucket_bytes", 1)
    timeout = payload.get("timeout_s", DEFAULT_TIMEOUT_S)
    need(isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and 0 < timeout <= 3600,
         f"malformed payload: timeout_s {timeout!r}")
    return ring, slot_bytes, float(timeout)


def _connect(payload) -> _Channel:
    need(isinstance(payload, dict) and isinstance(payload.get("control"), str)
         and payload["control"].startswith(SHM_PREFIX) and isinstance(payload.get("token"), str),
         "malformed payload: 'control' must name the sender's k3xfer-* control socket and 'token' be a string")
    control = payload["control"]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(DEFAULT_TIMEOUT_S)
        sock.connect(_abstract(control))
    except OSError as e:
        sock.close()
        raise TransferError(f"cannot reach the sender's control socket {control} ({e}): the sender is gone or "
                            "the stream already ran") from None
    return _Channel(sock, DEFAULT_TIMEOUT_S, "sender")


def _pull(ch: _Channel, slots: list[torch.Tensor], slot_bytes: int, algo: str, expected,
          staging: dict | None) -> tuple[dict[str, _Staged], dict]:
    """Every bucket copied out of the ring and every item verified; returns (items, the end message)."""
    items: dict[int, _Staged] = {}
    names: set[str] = set()
    seq = 0
    while True:
        msg = ch.recv(f"bucket {seq}")
        op = msg.get("op")
        if op == "abort":
            raise TransferError(f"the sender aborted the transfer: {msg.get('error')}")
        if op == "end":
            return items, msg
        need(op == "bucket" and msg.get("seq") == seq and msg.get("slot") == seq % len(slots),
             f"malformed stream: expected bucket {seq} in slot {seq % len(slots)}, got {str(msg)[:200]}")
        for decl in msg.get("items") or []:
            idx = decl.get("idx") if isinstance(decl, dict) else None
            need(isinstance(idx, int) and idx not in items, f"malformed stream: item {str(decl)[:200]}")
            s = items[idx] = _Staged(decl, expected, staging)
            need(s.name not in names, f"malformed payload: {s.name} sent twice")
            names.add(s.name)
        buf = slots[seq % len(slots)]
        for c in msg.get("chunks") or []:
            need(isinstance(c, list) and len(c) == 5 and all(isinstance(x, int) and x >= 0 for x in c),
                 f"malformed stream: chunk {c!r}")
            idx, part, at, off, n = c
            s = items.get(idx)
            need(s is not None and part < len(s.parts) and at == s.got[part] and at + n <= s.parts[part].numel()
                 and off + n <= slot_bytes, f"malformed stream: chunk {c!r} out of order or out of bounds")
            s.parts[part][at: at + n].copy_(buf[off: off + n])
            s.got[part] += n
        ch.send({"op": "consumed", "seq": seq})  # the slot is free: the sender refills it while we hash
        done = msg.get("digests") or {}
        need(isinstance(done, dict), "malformed stream: 'digests' must be an object")
        for key, ds in done.items():
            s = items.get(int(key)) if key.isdigit() else None
            need(s is not None and s.digest is None, f"malformed stream: digests for item {key}")
            s.verify(ds, algo)
        seq += 1


@torch.no_grad()
def receive_stream(payload: dict, *, current_version: int | None = None,
                   expected: Mapping[str, torch.Tensor | tuple] | None = None,
                   apply: Callable[[dict[str, torch.Tensor], int], None] | None = None,
                   timeout: float | None = None, staging: dict | None = None) -> tuple[dict[str, torch.Tensor], int]:
    """Receive a ``send_shm_stream`` payload: connect to the sender, copy every bucket out of the
    ring into staged host tensors, verify everything; return (state dict, weight version).

    Arguments as ``receive``; the returned tensors are the receiver's own (no views of the ring).
    ``apply(state, version)`` runs after every check and before the sender is told ``done``
    (``load_payload`` passes ``engine.load_weights``), so the sender's ``wait()`` reports its outcome
    too. ``timeout``: seconds to wait for the sender (default: the payload's ``timeout_s``).
    ``staging``: a dict the caller keeps across transfers; raw tensors are staged in its tensors
    (allocated on first use, reused while name, shape and dtype match), so steady-state transfers
    write into pages that already exist, at the price of one standing copy; the returned tensors
    are then overwritten by the next transfer that uses the same dict. Raises ``TransferError``; the
    sender is told why.
    """
    ch = _connect(payload)
    try:
        ch.send({"op": "hello", "token": payload["token"]})  # first: a refusal below reaches the sender
        version, algo = check_header(payload, TRANSPORT, current_version)
        ring, slot_bytes, payload_timeout = _ring(payload)
        ch.sock.settimeout(timeout or payload_timeout)
        slots = [map_segment(name, slot_bytes) for name in ring]
        items, end = _pull(ch, slots, slot_bytes, algo, expected, staging)
        del slots
        out: dict[str, torch.Tensor] = {}
        rows = []
        for s in items.values():
            need(s.digest is not None, f"{s.name}: the stream ended before its digests arrived: refused")
            out[s.name] = s.tensor
            rows.append((s.name, dtype_name(s.dtype), list(s.shape), s.codec, s.digest))
        check_content(rows, algo, end.get("num_tensors"), end.get("content_sha256"))
        if expected is not None:
            check_expected(out, expected)
        if apply is not None:
            try:
                apply(out, version)
            except ValueError as e:  # load_weights refuses before copying anything
                raise e if isinstance(e, TransferError) else TransferError(str(e)) from e
        ch.send({"op": "done"})
        return out, version
    except BaseException as e:
        try:
            ch.send({"op": "refused", "error": f"{type(e).__name__}: {e}"})
            ch.last_words("none")  # linger until the sender hangs up, so it reads why before it writes again
        except TransferError:
            pass
        raise
    finally:
        ch.close()

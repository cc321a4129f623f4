"""Reward sandbox: user reward code and the programs it judges run in worker processes apart from
the pipeline, each call in a fresh confined process.

Owns: the worker processes, the confinement of one reward call, and the verdict on how the call
ended. Does not own: what an environment is or how a reward is checked for range
(``k3core.rl.envs``), which environments go through it (``k3core.rl.rewards``), or the settings
(``k3core.settings.RewardSettings``).

Shape. ``RewardSandbox(spec, limits)`` starts ``limits.workers`` worker processes (fresh
interpreters, ``python -m k3core.rl.sandbox``). Each imports the environment by its spec, runs its
optional ``prepare()`` (imports, caches), confines itself for good (no network, writes only under
its own directory) and, per reward call, forks a child that confines itself further (wall and CPU time, address space, process count, file
size, a private empty directory as cwd, an unprivileged uid) and calls ``env.reward``. The worker
kills the child's process group when the wall timeout passes, sweeps every process left under the
call's uid, and deletes the call's directory. Importing the module and calling the factory happen
before the confinement, in the worker and in the pipeline (which loads ``--env`` to validate it):
the sandbox confines reward calls, which see model output, not the environment's import.

Tools of agentic environments (``k3core.rl.episodes``) run here too: ``RewardSandbox.call_tool``
sends one ``env.call_tool(prompt, name, arguments)`` to a worker, which runs it in a fresh confined
child exactly like a reward call (its own wall timeout: the run's ``--tool-timeout``). Its result is
text (cut to 64 Ki characters in the child, so a flood never crosses the pipe; the episode keeps
``MAX_TOOL_RESULT_CHARS``); a call that
raises, returns non-text, or is stopped by a limit raises ``ToolError`` with the reason, which the
episode shows the model as the tool's result.

How a reward call ends (``RewardOutcome``):
- a number in [0, 1]: that reward, ``reason`` empty (or the environment's own ``judge`` reason);
- the sandbox stopped it (``stopped``): reward 0 and the reason, whose first word is ``timeout``,
  ``cpu``, ``memory``, ``processes``, ``filesystem``, ``file size``, ``network`` or ``refused`` (a
  refused call that names no file: a signal, a Landlock-refused socket): a wall or CPU timeout, or an exception anywhere in
  the raised exception's chain that a limit causes (``MemoryError``; ``OSError`` with EAGAIN,
  EACCES, EPERM, EROFS, EFBIG, ENETUNREACH, EHOSTUNREACH, ECONNREFUSED, EADDRNOTAVAIL, ENETDOWN;
  ``socket.gaierror``). The scoring stage completes;
- the reward function is broken (any other exception, ``SystemExit``, NaN, a value outside [0, 1]
  or not a number, a death by a signal the sandbox did not send): ``broken`` holds the message and
  the caller fails the stage (``RewardError``) naming the prompt.

What is enforced where (``enforcement()`` probes this machine; every mechanism is Linux):
- wall timeout (the worker kills the call's process group), RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE,
  no core files, a fresh 0700 directory as cwd, HOME and TMPDIR: always;
- RLIMIT_NPROC: Linux ignores it for root, so a root pipeline runs each worker's calls under a uid
  of their own (1000000 + the worker's pid) and the limit holds; a non-root pipeline keeps its uid,
  and the limit then counts all of that user's processes, so it is set to their current count plus
  ``max_processes``;
- no network: a new network namespace (only a loopback interface, down) when the kernel lets the
  worker create one (root, or unprivileged user namespaces); without one, Landlock (ABI 4+) refuses
  TCP bind and connect only. Unix-domain sockets on the filesystem are outside both; with the
  dropped uid, file permissions refuse the ones the user's uid owns;
- writes only under the worker's directory: Landlock (Linux 5.13+); its ABI 6 scoping also refuses
  signals to processes outside the sandbox. Without Landlock, only file permissions (and, for root,
  the dropped uid) stand in the way, and ``enforcement()`` says so.
- leftover processes: killed by process group always; by uid (``kill(-1)`` under the call's uid)
  for a root pipeline.
- capabilities: a root pipeline's call runs under a uid of its own with none (its bounding set
  emptied, no ambient ones), so file permissions hold for reads too; only where the interpreter or
  the import path sits in a directory closed to other users (such as /root) does the uid keep
  CAP_DAC_READ_SEARCH, and ``enforcement()`` says so (see ``_drop_to``);
- descriptors and environment: a call holds only its stdin (/dev/null), its stdout and stderr (a
  file of its own, under the file-size limit from offset 0, never the pipeline's log) and its result
  pipe (not inheritable); its environment is HOME, TMPDIR, PATH, the locale, the time zone and the
  variables the environment names in ``passes_environment``;
- verdicts: whatever a call writes, the worker and then the pipeline accept only a verdict
  (``checked_answer``: a reward is a finite number in [0, 1]), matched to its request by id;
  reasons are cut to 500 characters and scrubbed of the pipeline's environment values.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import math
import os
import queue
import resource
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from k3core.rl.landlock import landlock_confine

__all__ = ["RewardOutcome", "RewardSandbox", "SandboxLimits", "enforcement", "limit_reason"]


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one reward call. ``timeout_s``: wall seconds (the CPU limit is its ceiling plus one);
    ``memory_mb``: address space of each process; ``max_processes``: processes the call may have at
    once, itself included; ``file_size_mb``: largest file it may write; ``workers``: calls in
    parallel."""

    timeout_s: float = 5.0
    memory_mb: int = 1024
    max_processes: int = 8
    file_size_mb: int = 16
    workers: int = 2

    @classmethod
    def of(cls, reward) -> SandboxLimits:
        """The limits a run's ``RewardSettings`` ask for."""
        return cls(timeout_s=float(reward.timeout), memory_mb=reward.memory_mb,
                   max_processes=reward.max_processes, workers=reward.workers)


@dataclass(frozen=True)
class RewardOutcome:
    reward: float
    reason: str = ""  # why the reward is what it is, when a reason is known ('' for a plain reward)
    stopped: bool = False  # the sandbox stopped the call (a limit): reward 0, ``reason`` says which
    broken: str = ""  # the reward function itself failed: the stage must fail


# ----------------------------------------------------------------------------------- confinement
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_CLONE_NEWNET, _CLONE_NEWUSER = 0x40000000, 0x10000000
_PR_SET_NO_NEW_PRIVS, _PR_SET_CHILD_SUBREAPER = 38, 36
def _unshare_network() -> str:
    """A new network namespace for this process and its children. -> what it enforced ('' if refused)."""
    if _libc.unshare(_CLONE_NEWNET) == 0:
        return "no network (own network namespace)"
    if os.geteuid() != 0 and _libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) == 0:
        return "no network (own user and network namespaces)"
    return ""


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int32)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


_CAP_DAC_READ_SEARCH, _PR_SET_KEEPCAPS, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_RAISE = 2, 8, 47, 2


_PR_CAPBSET_DROP, _CAP_LAST_FILE = 24, "/proc/sys/kernel/cap_last_cap"


def unreadable_by_others(paths: list[str]) -> str:
    """The first of ``paths`` (or a directory above one) that a user other than its owner cannot
    read and search, or '' when every one is open to them: the interpreter, its standard library and
    the import path must be, for a call under a uid of its own to run with no capability."""
    import stat

    for p in paths:
        p = os.path.realpath(p)
        if not os.path.exists(p):
            continue
        for d in [*reversed(Path(p).parents), Path(p)]:
            mode = os.stat(d).st_mode
            need = stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(mode) or d == Path(p) and os.access(p, os.X_OK) else 0)
            if mode & need != need:
                return str(d)
    return ""


def interpreter_paths() -> list[str]:
    """What a call's lazy imports and the programs it runs read: the interpreter and the import path."""
    return [sys.executable, getattr(sys, "_base_executable", sys.executable), sys.prefix, sys.base_prefix,
            *(p for p in sys.path if p)]


def _drop_to(uid: int, keep_read: bool) -> None:
    """Become ``uid`` (no groups) with no capability: every one is dropped from the bounding set first
    (nothing the call executes can regain one), and the permitted, effective, inheritable and ambient
    sets end empty. ``keep_read``: keep CAP_DAC_READ_SEARCH (also across exec, ambient) for a root
    pipeline whose interpreter or libraries sit where other users cannot read (such as /root): the
    call must still import lazily and run ``python``; writing stays refused, and reads are then not
    confined (``enforcement()`` says so). Linux then enforces RLIMIT_NPROC, which it skips for root."""
    last = int(Path(_CAP_LAST_FILE).read_text()) if os.path.exists(_CAP_LAST_FILE) else 40
    for cap in range(last + 1):
        if not (keep_read and cap == _CAP_DAC_READ_SEARCH):
            _libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)
    _libc.prctl(_PR_SET_KEEPCAPS, 1 if keep_read else 0, 0, 0, 0)
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    keep = (1 << _CAP_DAC_READ_SEARCH) if keep_read else 0
    data = (_CapData * 2)(_CapData(keep, keep, keep), _CapData(0, 0, 0))
    if _libc.capset(ctypes.byref(_CapHeader(0x20080522, 0)), data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")
    if keep_read:
        _libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_RAISE, _CAP_DAC_READ_SEARCH, 0, 0)


def _user_process_count(uid: int) -> int:
    n = 0
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.stat(f"/proc/{d}").st_uid == uid:
                    n += 1
            except OSError:
                pass
    return n


def enforcement() -> dict[str, str]:
    """What the sandbox enforces on this machine, mechanism -> how (or 'NOT enforced: why'). Probed in
    a throwaway child process, which confines itself as a worker would."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the probe child
        os.close(r)
        got = {}
        try:
            tmp = tempfile.mkdtemp(prefix="k3rl-probe-")
            net = _unshare_network()
            ll = landlock_confine(tmp, tcp=not net)
            got["network"] = net or ("TCP only (Landlock); UDP not refused" if any("TCP" in x for x in ll)
                                     else "NOT enforced: no network namespace and no Landlock network rules here")
            got["filesystem"] = ll[0] if ll else ("NOT enforced beyond file permissions: no Landlock in this kernel"
                                                  + ("; the dropped uid protects the user's files" if os.geteuid() == 0
                                                     else ""))
            if os.geteuid() == 0:
                closed = unreadable_by_others(interpreter_paths())
                got["capabilities"] = (f"none but CAP_DAC_READ_SEARCH, so reads are not confined: {closed} is closed to "
                                       "other users and the call must read the interpreter" if closed else
                                       "none (the call's uid holds no capability; its bounding set is empty)")
            got["processes"] = ("RLIMIT_NPROC under a uid of the call's own" if os.geteuid() == 0 else
                                "RLIMIT_NPROC, counted over all of this user's processes")
            got["signals"] = next((x for x in ll if "signals" in x), "other users' processes only (file permissions)")
            got["time"] = "wall timeout (process group killed) and RLIMIT_CPU"
            got["memory"] = "RLIMIT_AS per process"
            got["directory"] = "fresh 0700 directory as cwd, HOME and TMPDIR"
            os.write(w, json.dumps(got).encode())
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(data)


class ToolError(RuntimeError):
    """A tool call that did not return text (raised, returned non-text, stopped by a sandbox limit);
    its message completes "the tool NAME ..."."""


# ------------------------------------------------------------------------------ verdicts
_LIMIT_ERRNOS = {errno.EAGAIN: "processes", errno.EACCES: "filesystem", errno.EPERM: "filesystem",
                 errno.EROFS: "filesystem", errno.EFBIG: "file size", errno.ENETUNREACH: "network",
                 errno.EHOSTUNREACH: "network", errno.ECONNREFUSED: "network", errno.EADDRNOTAVAIL: "network",
                 errno.ENETDOWN: "network"}


def limit_reason(exc: BaseException) -> str:
    """The sandbox limit behind ``exc`` (searched along its cause/context chain), or ''."""
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, MemoryError):
            return f"memory: MemoryError: {e}"
        if isinstance(e, socket.gaierror):
            return f"network: {type(e).__name__}: {e}"
        if isinstance(e, OSError) and e.errno in _LIMIT_ERRNOS:
            kind = _LIMIT_ERRNOS[e.errno]
            if kind == "filesystem" and e.filename is None:
                kind = "refused"  # not a file: a signal to a process outside, or a Landlock-refused TCP call
            return f"{kind}: {type(e).__name__}: {e}"
        e = e.__cause__ or e.__context__
    return ""


def _verdict(env, prompt: str, completion: str) -> dict:
    """Call the reward (in the confined child) and classify how it ended."""
    judge = getattr(env, "judge", None)
    try:
        out = judge(prompt, completion) if callable(judge) else (env.reward(prompt, completion), "")
        value, note = out
    except SystemExit as e:
        return {"broken": f"called sys.exit({e.code!r})"}
    except BaseException as e:  # noqa: BLE001 - every other ending is classified, none escapes
        why = limit_reason(e)
        if why:
            return {"reward": 0.0, "reason": why, "stopped": True}
        return {"broken": f"raised {type(e).__name__}: {e}"}
    try:
        value = float(value)
    except (TypeError, ValueError):
        return {"broken": f"returned a non-numeric reward {value!r}"}
    if math.isnan(value) or not 0.0 <= value <= 1.0:
        return {"broken": f"returned reward {value!r} (rewards must lie in [0, 1])"}
    return {"reward": value, "reason": str(note or "")}


_TOOL_RESULT_CAP = 1 << 16  # characters of a tool result that cross the pipe (the episode keeps 4096)
# bytes of one call's answer line the worker reads: a capped tool result as JSON (escapes at most 6x) and room
# for the rest; a call that writes more (its own code writing to the pipe) is stopped there, never buffered
_ANSWER_CAP = 6 * _TOOL_RESULT_CAP + (64 << 10)


def _tool_verdict(env, prompt: str, name: str, arguments: dict) -> dict:
    """Call the tool (in the confined child) and classify how it ended. Imports nothing: the child
    runs under the memory limit, and the episode code pulls in torch."""
    try:
        out = env.call_tool(prompt, name, arguments)
    except SystemExit as e:
        return {"broken": f"called sys.exit({e.code!r})"}
    except BaseException as e:  # noqa: BLE001 - every ending is classified, none escapes
        why = limit_reason(e)
        return {"stopped": True, "reason": why} if why else {"broken": f"raised {type(e).__name__}: {e}"}
    if not isinstance(out, str):
        return {"broken": f"returned {type(out).__name__}, not text"}
    return {"result": out[:_TOOL_RESULT_CAP]}  # the episode cuts it further, and says so


# ------------------------------------------------------------------------------ the worker
def _call_in_child(env, request: dict, limits: SandboxLimits, root: str, uid: int | None,
                   keep_read: bool = False) -> dict:
    """Fork a confined child for one call (a reward, or a tool where ``request["kind"]`` is "tool");
    wait at most ``timeout_s``; clean up after it."""
    call_dir = tempfile.mkdtemp(prefix="call-", dir=root)
    output = call_dir + ".out"  # the call's stdout and stderr, beside its (empty) directory
    if uid is not None:
        os.chown(call_dir, uid, uid)
    r, w = os.pipe()  # not inheritable: a program the call runs does not get it
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.setsid()
            _own_descriptors(w, output)
            os.chdir(call_dir)
            _call_environment(call_dir, tuple(getattr(env, "passes_environment", ())))
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write raises EFBIG instead
            cpu = int(math.ceil(limits.timeout_s)) + 1
            mem = limits.memory_mb << 20
            nproc = limits.max_processes if uid is not None else _user_process_count(os.getuid()) + limits.max_processes
            for lim, val in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, mem), (resource.RLIMIT_CORE, 0),
                             (resource.RLIMIT_FSIZE, limits.file_size_mb << 20), (resource.RLIMIT_NPROC, nproc)):
                resource.setrlimit(lim, (val, val))
            if uid is not None:
                _drop_to(uid, keep_read)
            _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
            out = (_tool_verdict(env, request["prompt"], request["name"], request["arguments"])
                   if request.get("kind") == "tool" else _verdict(env, request["prompt"], request["completion"]))
            os.write(w, (json.dumps(out) + "\n").encode())
        except BaseException as e:  # noqa: BLE001 - the child must end here, never return into the worker
            try:
                os.write(w, (json.dumps({"broken": f"sandbox setup failed: {type(e).__name__}: {e}"}) + "\n").encode())
            except BaseException:  # noqa: BLE001
                pass
        finally:
            os._exit(0)
    os.close(w)
    deadline = time.monotonic() + limits.timeout_s
    data, timed_out = b"", False
    while b"\n" not in data and len(data) <= _ANSWER_CAP:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        ready, _, _ = select.select([r], [], [], left)
        if not ready:
            continue
        chunk = os.read(r, 65536)
        if not chunk:
            break
        data += chunk
    os.close(r)
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    _, status = os.waitpid(pid, 0)
    _sweep(uid)
    shutil.rmtree(call_dir, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.unlink(output)
    if timed_out:
        what = "tool" if request.get("kind") == "tool" else "reward"
        return {"reward": 0.0, "reason": f"timeout: the {what} call ran past {limits.timeout_s:g} s (wall)",
                "stopped": True}
    if b"\n" not in data and len(data) > _ANSWER_CAP:
        return {"broken": f"wrote more than {_ANSWER_CAP} bytes to its result pipe without ending its answer"}
    if data:
        try:
            answer = json.loads(data.splitlines()[0])
        except ValueError:
            return {"broken": f"wrote an unreadable answer {data[:200]!r}"}
        return checked_answer(answer, tool=request.get("kind") == "tool")
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGXCPU:
        return {"reward": 0.0, "reason": f"cpu: the call used more than {math.ceil(limits.timeout_s) + 1} s "
                                         "of CPU (RLIMIT_CPU)", "stopped": True}
    if os.WIFSIGNALED(status):
        return {"broken": f"died by signal {signal.Signals(os.WTERMSIG(status)).name} without returning a reward"}
    return {"broken": f"exited (status {os.waitstatus_to_exitcode(status)}) without returning a reward"}


_CALL_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ")  # what of the pipeline's environment a call keeps


def _own_descriptors(result: int, output: str) -> None:
    """Leave the call only its own descriptors: stdin from /dev/null, stdout and stderr into
    ``output`` (a file of its own, under its file-size limit from offset 0, so the pipeline's log
    never counts against the call and the call never writes into it), and its result pipe; every
    other descriptor the worker holds (its pipes to the pipeline among them) is closed."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.closerange(3, result)
    os.closerange(result + 1, max(result + 2, os.sysconf("SC_OPEN_MAX")))


def _call_environment(call_dir: str, passes: tuple[str, ...] = ()) -> None:
    """The call's environment variables: its directory as HOME and TMPDIR, and of the pipeline's only
    the locale, the time zone, PATH and the variables the environment names in its
    ``passes_environment`` (no credentials, tokens or settings reach a call, or a program it runs,
    unless the environment asks for them by name)."""
    keep = {k: os.environ[k] for k in (*_CALL_ENV, *passes) if k in os.environ}
    os.environ.clear()
    os.environ.update(keep, HOME=call_dir, TMPDIR=call_dir)


_REASON_CHARS = 500  # of a reason or a broken reward's message, in a published table


def checked_answer(answer, tool: bool) -> dict:
    """``answer`` as the verdict of one call, or a ``broken`` one saying what is wrong with it: a reward
    is a finite number in [0, 1] (``reason`` text, ``stopped`` a bool); a tool answers text, a reason
    it was stopped, or a broken message. Whatever wrote the answer, nothing else passes."""
    def text(v):
        return isinstance(v, str)

    if isinstance(answer, dict) and set(answer) == {"broken"} and text(answer["broken"]):
        return {"broken": answer["broken"][:_REASON_CHARS]}
    if isinstance(answer, dict) and tool:
        if set(answer) == {"result"} and text(answer["result"]):
            return answer
        if set(answer) <= {"stopped", "reason", "reward"} and answer.get("stopped") is True and text(answer.get("reason")):
            return {"stopped": True, "reason": answer["reason"][:_REASON_CHARS]}
    elif isinstance(answer, dict) and set(answer) <= {"reward", "reason", "stopped"} and "reward" in answer:
        value, reason, stopped = answer["reward"], answer.get("reason", ""), answer.get("stopped", False)
        if (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                and 0.0 <= value <= 1.0 and text(reason) and isinstance(stopped, bool)):
            return {"reward": float(value), "reason": reason[:_REASON_CHARS], "stopped": stopped}
    return {"broken": f"answered {json.dumps(answer)[:200]}, which is not a verdict (a reward must be a number in "
                      "[0, 1]; a tool answers text)"}


def kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid``, from a child that takes that uid (``kill(-1)`` reaches exactly
    the processes of the caller's uid); returns once that child is done. Needs root."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setresuid(uid, uid, uid)
            os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def _sweep(uid: int | None) -> None:
    """Kill whatever the call left running and reap it (the worker is their subreaper, so once the
    call's process is gone, anything it left is a child of the worker): with a uid of the call's own
    (root pipelines), every process of that uid, waited for until none is left; otherwise the zombies
    already there. A call that left nothing costs one ``waitpid``."""
    try:
        if os.waitpid(-1, os.WNOHANG) == (0, 0) and uid is None:
            return  # live leftovers, which only a uid of their own would let the worker kill
    except ChildProcessError:
        return  # nothing left
    if uid is not None:
        kill_uid(uid)
    while True:
        try:
            pid, _ = os.waitpid(-1, 0 if uid is not None else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _worker_main(rfd: int, wfd: int) -> None:
    """The worker: load the environment, confine itself, then answer one reward call per line."""
    from k3core.rl.envs import load_env

    for fd in (rfd, wfd):  # passed to this worker only: no call or program it runs inherits them
        os.set_inheritable(fd, False)
    inp, out = os.fdopen(rfd, "r"), os.fdopen(wfd, "w")
    hello = json.loads(inp.readline())
    sys.path[:0] = [p for p in hello["sys_path"] if p not in sys.path]
    limits = SandboxLimits(**hello["limits"])
    root = hello["root"]
    try:
        env = load_env(hello["spec"])
        prepare = getattr(env, "prepare", None)
        if callable(prepare):
            prepare()  # imports and caches before confinement, once, so each call's fork starts warm
    except BaseException as e:  # noqa: BLE001 - reported to the pipeline, which raises
        out.write(json.dumps({"error": f"cannot load environment {hello['spec']!r}: {type(e).__name__}: {e}"}) + "\n")
        out.flush()
        return
    import k3core.tokenizer.tool_calls  # noqa: F401 - final_answer and the tool-call parser, which agentic rewards
    # use: a confined call's memory limit leaves no room to import them (and torch, which would start threads
    # before the call's unshare, stays out of the worker)
    import encodings.idna  # noqa: F401 - socket calls with a host name load it lazily; in an unprivileged user
    import gc  # namespace the interpreter's own files may no longer be readable by then

    gc.freeze()  # what the worker holds now never moves to a collected generation: forks copy fewer pages
    uid = 1_000_000 + os.getpid() if os.geteuid() == 0 else None
    closed = unreadable_by_others(interpreter_paths()) if uid is not None else ""
    _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    net = _unshare_network()
    enforced = [x for x in [net, *landlock_confine(root, tcp=not net)] if x]
    if uid is not None:
        enforced.append(f"no capabilities but CAP_DAC_READ_SEARCH ({closed} is closed to other users)" if closed
                        else "no capabilities (bounding set emptied)")
    out.write(json.dumps({"ready": enforced}) + "\n")
    out.flush()
    try:
        for line in inp:  # ends when the pipeline closes the pipe, or dies
            req = json.loads(line)
            out.write(json.dumps({**_call_in_child(env, req, limits, root, uid, bool(closed)), "id": req.get("id")})
                      + "\n")
            out.flush()
    except BrokenPipeError:
        pass  # the pipeline is gone: nobody to answer
    finally:
        for name in os.listdir(root):  # the pipeline removes the directory itself; this covers its death
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


# ------------------------------------------------------------------------------ the pipeline side
class SandboxError(RuntimeError):
    """The sandbox itself failed (a worker died or stopped answering): an infrastructure fault."""


class _Worker:
    def __init__(self, spec: str, limits: SandboxLimits):
        self.root = tempfile.mkdtemp(prefix="k3rl-sandbox-")
        os.chmod(self.root, 0o711)  # the call's uid must reach its own directory inside
        self.timeout = limits.timeout_s + 60.0
        p2c_r, p2c_w = os.pipe()
        c2p_r, c2p_w = os.pipe()
        pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1",
               "PYTHONPATH": os.pathsep.join([pkg_root, *filter(None, [os.environ.get("PYTHONPATH")])])}
        self.proc = subprocess.Popen([sys.executable, "-m", "k3core.rl.sandbox", str(p2c_r), str(c2p_w)],
                                     pass_fds=(p2c_r, c2p_w), stdin=subprocess.DEVNULL, env=env,
                                     stdout=sys.stderr.fileno() if _has_fileno(sys.stderr) else None,
                                     start_new_session=True)
        os.close(p2c_r)
        os.close(c2p_w)
        self.w, self.r = os.fdopen(p2c_w, "w"), c2p_r
        self.buf = b""
        self.calls = 0
        self.send({"spec": spec, "limits": asdict(limits), "root": self.root, "sys_path": sys.path})
        hello = self.recv(timeout=120.0)
        if "error" in hello:
            self.close()
            raise ValueError(hello["error"])
        self.enforced = hello["ready"]

    def send(self, obj: dict) -> None:
        self.w.write(json.dumps(obj) + "\n")
        self.w.flush()

    def recv(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            ready = select.select([self.r], [], [], max(left, 0))[0] if left > 0 else []
            if not ready:
                raise SandboxError(f"sandbox worker {self.proc.pid} did not answer within {timeout:g} s")
            chunk = os.read(self.r, 65536)
            if not chunk:
                raise SandboxError(f"sandbox worker {self.proc.pid} died (exit status {self.proc.poll()})")
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return json.loads(line)

    def call(self, request: dict) -> dict:
        """The worker's answer to ``request``: matched to it by id, and a verdict (``checked_answer``)."""
        self.calls += 1
        self.send({**request, "id": self.calls})
        answer = self.recv(self.timeout)
        if not isinstance(answer, dict) or answer.pop("id", None) != self.calls:
            raise SandboxError(f"sandbox worker {self.proc.pid} answered out of step (call {self.calls}): "
                               f"{json.dumps(answer)[:200]}")
        return checked_answer(answer, tool=request.get("kind") == "tool")

    def close(self) -> None:
        try:
            self.w.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self.r)
        shutil.rmtree(self.root, ignore_errors=True)


def scrubbed(text: str) -> str:
    """``text`` with every value of the pipeline's environment variables (8 characters or more, beyond
    the few a call keeps) replaced by ``<$NAME>``: what a call reports is published (``scored.parquet``,
    a trajectory), and a call never sees those values, so one in its report came from somewhere else."""
    for name, value in sorted(os.environ.items(), key=lambda kv: -len(kv[1])):
        if len(value) >= 8 and name not in _CALL_ENV and value in text:
            text = text.replace(value, f"<${name}>")
    return text


def _has_fileno(f) -> bool:
    try:
        f.fileno()
        return True
    except (AttributeError, OSError, ValueError):
        return False


class RewardSandbox:
    """``limits.workers`` sandbox workers for the environment ``spec`` (a ``module:factory`` or a
    dataset spec: anything ``load_env`` takes). Use as a context manager; ``score`` is thread-safe."""

    def __init__(self, spec: str, limits: SandboxLimits = SandboxLimits()):
        self.spec, self.limits = spec, limits
        self._workers: list[_Worker] = []
        self._free: queue.Queue[_Worker] = queue.Queue()
        self._lock = threading.Lock()
        try:
            for _ in range(max(1, limits.workers)):
                wk = _Worker(spec, limits)
                self._workers.append(wk)
                self._free.put(wk)
        except BaseException:
            self.close()
            raise

    @property
    def enforced(self) -> list[str]:
        """What the workers enforce beyond the rlimits (network namespace, Landlock rules)."""
        return self._workers[0].enforced if self._workers else []

    def __enter__(self) -> RewardSandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            workers, self._workers = self._workers, []
        for wk in workers:
            wk.close()

    def _request(self, request: dict) -> dict:
        wk = self._free.get()
        try:
            return wk.call(request)
        finally:
            self._free.put(wk)

    def call_tool(self, prompt: str, name: str, arguments: dict) -> str:
        """The text of one tool call, run confined; ``ToolError`` with the reason when it raised,
        returned non-text or was stopped. Thread-safe: ``workers`` calls at a time."""
        res = self._request({"kind": "tool", "prompt": prompt, "name": name, "arguments": arguments})
        if "result" in res:
            return scrubbed(res["result"])
        raise ToolError(scrubbed(f"was stopped ({res['reason']})" if res.get("stopped") else res["broken"]))

    def _one(self, pair: tuple[str, str]) -> RewardOutcome:
        res = self._request({"prompt": pair[0], "completion": pair[1]})
        if "broken" in res:
            return RewardOutcome(0.0, broken=scrubbed(res["broken"]))
        return RewardOutcome(res["reward"], scrubbed(res["reason"]), res["stopped"])

    def score(self, prompts: list[str], completions: list[str]) -> list[RewardOutcome]:
        """One outcome per (prompt, completion), in order, ``workers`` calls at a time."""
        pairs = list(zip(prompts, completions))
        if len(self._workers) == 1:
            return [self._one(p) for p in pairs]
        with ThreadPoolExecutor(len(self._workers)) as pool:
            return list(pool.map(self._one, pairs))


if __name__ == "__main__":
    _worker_main(int(sys.argv[1]), int(sys.argv[2]))

"""The reward sandbox, tried with each escape: a reward that loops, sleeps, allocates 10 GB, forks
without end, leaves a daemon behind, writes outside its directory, connects to a port that is
listening on this machine, resolves a name, or signals the pipeline gets reward 0 with the reason,
the escape does not happen (no file, no connection, no process left), and the next call in the same
worker still works. A reward that is itself broken (raises, NaN, out of range, not a number, exits)
is a ``RewardError`` naming the prompt. Reads run in real worker processes against the real kernel."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from k3core.rl.envs import RewardError
from k3core.rl.rewards import score_completions
from k3core.rl.sandbox import RewardSandbox, SandboxLimits, enforcement, kill_uid, limit_reason

SPEC = "hostile_reward_env:make"
TESTS = str(Path(__file__).resolve().parents[2])
LIMITS = SandboxLimits(timeout_s=2.0, memory_mb=512, max_processes=6, workers=2)


@pytest.fixture(scope="module")
def sandbox():
    sys.path.insert(0, TESTS)
    try:
        with RewardSandbox(SPEC, LIMITS) as sb:
            yield sb
    finally:
        sys.path.remove(TESTS)


def _one(sb, what: str, arg: str = ""):
    (out,) = sb.score([f"rev:abc=|{arg}"], [what])
    return out


def _procs_of(uids: set[int]) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.stat(f"/proc/{d}").st_uid in uids:
                    out.append(int(d))
            except OSError:
                pass
    return out


def _call_uids(sb) -> set[int]:
    return {1_000_000 + w.proc.pid for w in sb._workers}


_ENFORCED = None


def _needs(mechanism: str) -> None:
    """Skip, naming what is missing, where this kernel does not offer ``mechanism`` (the escape tests
    below hold only where it does; K3RL_REQUIRE_SANDBOX=1 turns the skip into a failure)."""
    global _ENFORCED
    if _ENFORCED is None:
        _ENFORCED = enforcement()
    how = _ENFORCED[mechanism]
    if how.startswith("NOT"):
        if os.environ.get("K3RL_REQUIRE_SANDBOX") == "1":
            pytest.fail(f"{mechanism}: {how}")
        pytest.skip(f"{mechanism}: {how}")


def test_this_machine_enforces_every_mechanism():
    """The escapes below hold only where the kernel offers the mechanisms; say which ones this machine
    has (a machine without them skips, naming them, unless K3RL_REQUIRE_SANDBOX=1)."""
    for mechanism in enforcement():
        _needs(mechanism)


@pytest.mark.parametrize("what, kind", [("loop", "timeout"), ("sleep", "timeout"), ("alloc-10g", "memory"),
                                        ("fork-bomb", "processes"), ("resolve", "network")])
def test_a_call_past_a_limit_scores_zero_with_the_reason(sandbox, what, kind):
    if kind == "network":
        _needs(kind)
    out = _one(sandbox, what)
    assert (out.reward, out.stopped, out.broken) == (0.0, True, "")
    assert out.reason.startswith(f"{kind}:"), out.reason
    assert _one(sandbox, "ok").reward == 0.5  # the worker is unharmed
    if os.geteuid() == 0:
        assert _procs_of(_call_uids(sandbox)) == []  # nothing of the call survives it


def test_writes_outside_its_directory_are_refused(sandbox, tmp_path):
    _needs("filesystem")
    targets = [tmp_path / "outside.txt", Path("/tmp") / f"k3rl-escape-{os.getpid()}.txt"]
    for target in targets:
        out = _one(sandbox, "write-outside", str(target))
        assert out.reward == 0.0 and out.reason.startswith("filesystem:") and str(target) in out.reason
        assert not target.exists()
    assert _one(sandbox, "write-here").reward == 1.0  # its own directory: writable, and fresh every call
    assert _one(sandbox, "write-here").reward == 1.0


def test_no_connection_reaches_a_port_listening_on_this_machine(sandbox):
    _needs("network")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.5)
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):  # the host's network works for the pipeline
            server.accept()[0].close()
        out = _one(sandbox, "connect", str(port))
        assert out.reward == 0.0 and out.reason.startswith(("network:", "refused:")), out.reason
        with pytest.raises(TimeoutError):
            server.accept()  # the sandboxed call never connected


def test_the_pipeline_cannot_be_signalled(sandbox):
    out = _one(sandbox, "signal", str(os.getpid()))
    assert out.reward == 0.0 and out.stopped and "PermissionError" in out.reason


def test_a_process_left_behind_is_killed(sandbox):
    assert _one(sandbox, "daemon").reward == 1.0
    if os.geteuid() != 0:
        pytest.skip("the sweep by uid needs a root pipeline; otherwise only the call's process group is killed")
    assert _procs_of(_call_uids(sandbox)) == []


@pytest.mark.parametrize("what, says", [("raise", "raised KeyError"), ("nan", "returned reward nan"),
                                        ("too-big", "returned reward 1.5"), ("not-a-number", "non-numeric reward"),
                                        ("sys-exit", "called sys.exit"), ("os-exit", "without returning a reward")])
def test_a_broken_reward_fails_naming_the_prompt(what, says, monkeypatch):
    monkeypatch.syspath_prepend(TESTS)
    prompts = ["rev:abc=|", "rev:xyz=|"]
    with pytest.raises(RewardError, match=rf"{SPEC}.*{says}.*for prompt 'rev:xyz=\|'"):
        score_completions(None, SPEC, prompts, ["ok", what], SandboxLimits(timeout_s=5.0, workers=1))


def test_outcomes_come_back_in_order_across_workers(sandbox):
    whats = ["ok", "loop", "ok", "alloc-10g", "ok", "write-here"]
    outs = sandbox.score(["rev:abc=|"] * len(whats), whats)
    assert [o.reward for o in outs] == [0.5, 0.0, 0.5, 0.0, 0.5, 1.0]
    assert [o.reason.split(":")[0] for o in outs] == ["", "timeout", "", "memory", "", ""]


def test_limit_reason_follows_the_exception_chain():
    try:
        try:
            raise MemoryError()
        except MemoryError as e:
            raise RuntimeError("wrapped") from e
    except RuntimeError as e:
        assert limit_reason(e).startswith("memory:")
    assert limit_reason(ValueError("plain bug")) == ""
    assert limit_reason(FileNotFoundError(2, "No such file", "x")) == ""  # a missing file is a bug, not a limit


def test_an_environment_that_cannot_load_is_a_clear_error(monkeypatch):
    with pytest.raises(ValueError, match="cannot load environment 'no_such_module_k3rl:make'"):
        RewardSandbox("no_such_module_k3rl:make", SandboxLimits(workers=1))


def test_workers_end_when_the_pipeline_is_killed(tmp_path):
    """kill -9 of the pipeline mid-call: its workers finish the call, find nobody to answer, and exit;
    nothing of theirs survives (no worker, no call process)."""
    import signal
    import subprocess
    import time

    script = (f"import sys, threading; sys.path[:0] = [{TESTS!r}]\n"
              "from k3core.rl.sandbox import RewardSandbox, SandboxLimits\n"
              f"sb = RewardSandbox({SPEC!r}, SandboxLimits(timeout_s=2.0, workers=2))\n"
              "print(' '.join(str(w.proc.pid) for w in sb._workers), flush=True)\n"
              "threading.Thread(target=sb.score, args=(['p|', 'p|'], ['sleep', 'sleep'])).start()\n"
              "threading.Event().wait()\n")
    pipeline = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])})
    workers = [int(p) for p in pipeline.stdout.readline().split()]
    assert len(workers) == 2
    time.sleep(0.5)  # the calls are under way
    pipeline.send_signal(signal.SIGKILL)
    pipeline.wait()
    uids = {1_000_000 + w for w in workers}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{w}") for w in workers):
        time.sleep(0.2)
    assert not [w for w in workers if os.path.exists(f"/proc/{w}") and "Z" not in Path(f"/proc/{w}/stat").read_text().split()[2]]
    assert _procs_of(uids) == []


NON_ROOT_PIPELINE = r'''
import json, sys
sys.path[:0] = [{repo!r}, {tests!r}]
from k3core.rl.sandbox import RewardSandbox, SandboxLimits, enforcement
whats = ["ok", "loop", "alloc-10g", "fork-bomb", "write-outside", "resolve", "connect"]
with RewardSandbox("hostile_reward_env:make", SandboxLimits(timeout_s=2.0, workers=1, max_processes=6)) as sb:
    outs = sb.score(["rev:abc=|{outside}"] * 6 + ["rev:abc=|1"], whats)
print(json.dumps({{"enforced": enforcement(), "outs": {{w: [o.reward, o.reason] for w, o in zip(whats, outs)}}}}))
'''


@pytest.mark.skipif(os.geteuid() != 0, reason="emulating a non-root pipeline needs root to change uid")
def test_a_non_root_pipeline_gets_the_same_verdicts(tmp_path):
    """The pipeline itself runs under an unprivileged uid (the sandbox's own privilege drop, which keeps
    file reads), so the sandbox takes its non-root path: a user and network namespace, Landlock,
    RLIMIT_NPROC over the user's processes, no uid of the call's own."""
    import json
    import subprocess

    from k3core.rl import sandbox

    repo, uid = str(Path(__file__).resolve().parents[3]), 2_000_000 + os.getpid()
    outside = Path("/tmp") / f"k3rl-escape-nonroot-{os.getpid()}"  # world-writable: only Landlock refuses it
    script = NON_ROOT_PIPELINE.format(repo=repo, tests=TESTS, outside=outside)
    try:
        proc = subprocess.run([sys.executable, "-c", script], preexec_fn=lambda: sandbox._drop_to(uid, keep_read=True),
                              capture_output=True, text=True, cwd="/tmp", timeout=300)
    finally:
        kill_uid(uid)  # whatever the run left under that uid
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["enforced"]["network"].startswith("no network (own user and network namespaces)")
    assert got["enforced"]["processes"] == "RLIMIT_NPROC, counted over all of this user's processes"
    assert {w: (r, why.split(":")[0]) for w, (r, why) in got["outs"].items()} == {
        "ok": (0.5, ""), "loop": (0.0, "timeout"), "alloc-10g": (0.0, "memory"), "fork-bomb": (0.0, "processes"),
        "write-outside": (0.0, "filesystem"), "resolve": (0.0, "network"), "connect": (0.0, "network")}
    assert not outside.exists()


# ------------------------------------------------------------------ what a call holds and can forge
def test_a_call_holds_only_its_own_descriptors(sandbox):
    """stdin /dev/null, stdout and stderr a file of its own, its result pipe: no pipe to the pipeline."""
    assert _one(sandbox, "descriptors").reward == 1.0


def test_a_forged_verdict_fails_the_call_and_never_reaches_another_prompt(sandbox):
    """A reward that writes a verdict of its own (out of range; or shaped as the worker's answer to the
    pipeline) on every descriptor it holds: the first line on its result pipe is not a verdict, so the
    call is broken (the stage fails naming the prompt); the worker's pipes are closed to it, so no
    other prompt's answer moves; the worker answers the next calls in step."""
    outs = sandbox.score(["rev:abc=|"] * 3, ["ok", "forge", "ok"])
    assert [o.reward for o in outs] == [0.5, 0.0, 0.5]
    assert "not a verdict" in outs[1].broken and not outs[0].broken and not outs[2].broken
    assert [o.reward for o in sandbox.score(["rev:abc=|"] * 4, ["ok"] * 4)] == [0.5] * 4


def test_an_endless_answer_is_cut_at_the_cap_and_breaks_only_its_call(sandbox):
    """A reward that writes without end to its result pipe (no newline): the worker stops reading at
    its cap (not at the wall timeout, never holding what came), the call is broken, the next is not."""
    from k3core.rl.sandbox import _ANSWER_CAP

    outs = sandbox.score(["rev:abc=|"] * 2, ["pipe-flood", "ok"])
    assert f"more than {_ANSWER_CAP} bytes" in outs[0].broken and outs[1].reward == 0.5


def test_an_answer_that_is_not_a_verdict_is_refused_wherever_it_comes_from():
    from k3core.rl.sandbox import checked_answer

    for bad in ({"reward": 7.5}, {"reward": -3.0}, {"reward": float("nan")}, {"reward": True}, {"reward": "1"},
                {"reward": 0.5, "stopped": "no"}, {"reward": 0.5, "extra": 1}, {"reason": "x"}, [], "1.0",
                {"result": 3}):
        assert "not a verdict" in checked_answer(bad, tool=False)["broken"], bad
    assert checked_answer({"reward": 1, "reason": "r" * 9000}, tool=False) == {"reward": 1.0, "reason": "r" * 500,
                                                                               "stopped": False}
    assert checked_answer({"result": "text"}, tool=True) == {"result": "text"}
    assert "not a verdict" in checked_answer({"result": ["not text"]}, tool=True)["broken"]


def test_a_call_sees_none_of_the_pipelines_environment_and_reasons_are_scrubbed(monkeypatch):
    from k3core.rl import sandbox as sbx

    monkeypatch.setenv("K3RL_TEST_SECRET", "hunter2-very-secret")
    monkeypatch.syspath_prepend(TESTS)
    with RewardSandbox(SPEC, SandboxLimits(timeout_s=5.0, workers=1)) as sb:
        env, secret = sb.score(["rev:abc=|"] * 2, ["environment", "secret"])
    assert env.reward == 1.0
    assert secret.broken.endswith("secret=None")  # the call never had it
    assert sbx.scrubbed("token hunter2-very-secret leaked") == "token <$K3RL_TEST_SECRET> leaked"


def test_the_calls_uid_holds_no_capability_but_the_one_its_interpreter_needs(sandbox):
    """Root pipelines: the call's bounding, permitted, effective and ambient sets are empty, except
    CAP_DAC_READ_SEARCH where the interpreter sits in a directory closed to other users."""
    from k3core.rl.sandbox import interpreter_paths, unreadable_by_others

    if os.geteuid() != 0:
        pytest.skip("a non-root pipeline's calls keep its uid, which holds no capability to drop")
    caps = dict(kv.split(":") for kv in _one(sandbox, "capabilities").broken.split("RuntimeError: ")[1].split())
    read = 1 << 2  # CAP_DAC_READ_SEARCH
    want = read if unreadable_by_others(interpreter_paths()) else 0
    assert {k: int(v, 16) for k, v in caps.items()} == {"CapInh": want, "CapPrm": want, "CapEff": want,
                                                         "CapBnd": want, "CapAmb": want}


def test_drop_to_empties_every_capability_set(tmp_path):
    """The drop itself, where nothing needs the read capability: in a forked child of a root process."""
    from k3core.rl import sandbox as sbx

    if os.geteuid() != 0:
        pytest.skip("needs root")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            sbx._drop_to(1_000_000 + os.getpid(), keep_read=False)
            with open("/proc/self/status") as f:
                caps = {ln.split()[0]: int(ln.split()[1], 16) for ln in f if ln.startswith("Cap")}
            try:
                open("/etc/shadow").close()
                shadow = "read"
            except OSError as e:
                shadow = type(e).__name__
            os.write(w, repr((caps, shadow)).encode())
        finally:
            os._exit(0)
    os.close(w)
    out = b""
    while chunk := os.read(r, 4096):
        out += chunk
    os.waitpid(pid, 0)
    caps, shadow = eval(out)  # noqa: S307 - our own child's repr
    assert set(caps.values()) == {0} and shadow == "PermissionError", (caps, shadow)


def test_a_pipeline_log_past_the_file_size_limit_never_changes_a_score(tmp_path):
    """The call writes into a file of its own from offset 0: a pipeline whose stderr is a 17 MiB log
    (past the call's 16 MiB file-size limit) still gets the reward of a call that prints; a call that
    floods 32 MiB keeps its reward too (its output file holds the first 16 MiB, then is deleted with
    the call), and none of it reaches the pipeline's log."""
    log = tmp_path / "pipeline.log"
    log.write_bytes(b"." * (17 << 20))
    script = (f"import sys; sys.path.insert(0, {TESTS!r})\n"
              "from k3core.rl.sandbox import RewardSandbox, SandboxLimits\n"
              f"with RewardSandbox({SPEC!r}, SandboxLimits(timeout_s=10.0, workers=1)) as sb:\n"
              "    outs = sb.score(['rev:abc=|'] * 2, ['print', 'flood'])\n"
              "print(repr([(o.reward, o.reason.split(':')[0], o.broken) for o in outs]))\n")
    with open(log, "ab") as err:
        done = subprocess.run([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=err, text=True,
                              timeout=120)
    assert done.returncode == 0, log.read_bytes()[17 << 20:][-3000:]
    assert done.stdout.strip() == repr([(0.5, "", ""), (1.0, "", "")])
    written = log.read_bytes()[17 << 20:]
    assert b"reward's own output" not in written and b"xxxx" not in written

"""A user environment whose reward misbehaves on purpose, for the reward-sandbox tests: the completion
names what the reward does, the prompt carries its argument (a path, a port, a pid). At import (before
the sandbox confines the worker) it appends a line to $K3RL_TEST_IMPORT_LOG, so a test can count the
worker starts of a stage."""

import math
import os
import socket
import sys
import time

from k3core.rl.envs import ReverseEnv

if os.environ.get("K3RL_TEST_IMPORT_LOG"):
    with open(os.environ["K3RL_TEST_IMPORT_LOG"], "a") as f:
        f.write(f"{os.getpid()}\n")


class Hostile(ReverseEnv):
    name = "hostile"

    def reward(self, prompt, completion):
        arg = prompt.split("|", 1)[-1]
        what = completion
        if what == "ok":
            return 0.5
        if what == "loop":
            while True:
                pass
        if what == "sleep":
            time.sleep(3600)
        if what == "alloc-10g":
            block = bytearray(10 << 30)
            return 1.0 if block else 0.0
        if what == "fork-bomb":
            while True:
                os.fork()
        if what == "daemon":  # leaves a process behind in a session of its own, then answers
            if os.fork() == 0:
                os.setsid()
                time.sleep(3600)
                os._exit(0)
            return 1.0
        if what == "write-outside":
            with open(arg, "w") as f:
                f.write("escaped")
            return 1.0
        if what == "write-here":  # its own directory: allowed, and empty at the start of every call
            fresh = os.listdir(".") == []
            with open("scratch.txt", "w") as f:
                f.write("x" * 1000)
            return 1.0 if fresh and os.path.exists(os.path.join(os.environ["HOME"], "scratch.txt")) else 0.0
        if what == "connect":
            socket.create_connection(("127.0.0.1", int(arg)), timeout=5).close()
            return 1.0
        if what == "resolve":
            socket.getaddrinfo("example.com", 80)
            return 1.0
        if what == "signal":  # kill(pid, 0): the permission check alone, harmless if it were allowed
            os.kill(int(arg), 0)
            return 1.0
        if what == "descriptors":  # only its stdin (/dev/null), stdout and stderr (its own file) and one more
            links = {}
            for fd in sorted(int(f) for f in os.listdir("/proc/self/fd")):
                try:
                    links[fd] = os.readlink(f"/proc/self/fd/{fd}")
                except OSError:  # listdir's own descriptor, closed by now
                    pass
            own = links[0] == "/dev/null" and links[1] == links[2] and links[1].endswith(".out")
            more = [fd for fd in links if fd > 2]  # the call's result pipe, and nothing else
            return 1.0 if own and len(more) == 1 and links[more[0]].startswith("pipe:") else 0.0
        if what == "forge":  # a forged verdict on every descriptor it holds, then an honest answer
            for fd in range(3, 64):
                try:
                    os.write(fd, b'{"reward": 7.5}\n{"id": 1, "reward": 1.0}\n')
                except OSError:
                    pass
            return 0.25
        if what == "pipe-flood":  # an endless answer on its result pipe, no newline
            chunk = b"7" * (1 << 20)
            for fd in range(3, 64):
                try:
                    while True:
                        os.write(fd, chunk)
                except OSError:
                    pass
            return 0.25
        if what == "environment":  # what of the pipeline's environment it sees
            return 1.0 if set(os.environ) <= {"HOME", "TMPDIR", "PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ"} else 0.0
        if what == "capabilities":  # reported through the broken message
            with open("/proc/self/status") as f:
                raise RuntimeError(" ".join(ln.split()[0] + ln.split()[1] for ln in f if ln.startswith("Cap")))
        if what == "print":
            print("a line of the reward's own output")
            print("and one on stderr", file=sys.stderr)
            return 0.5
        if what == "flood":
            sys.stdout.write("x" * (32 << 20))
            sys.stdout.flush()
            return 1.0
        if what == "secret":  # an exception carrying what the environment holds
            raise RuntimeError(f"secret={os.environ.get('K3RL_TEST_SECRET')}")
        if what == "raise":
            raise KeyError("bug in the reward")
        if what == "nan":
            return math.nan
        if what == "too-big":
            return 1.5
        if what == "not-a-number":
            return "high"
        if what == "sys-exit":
            sys.exit(0)
        if what == "os-exit":
            os._exit(0)
        return 0.0


def make():
    return Hostile()

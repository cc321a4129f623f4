"""A user agentic environment whose one tool, ``act``, misbehaves on purpose, for the tests of tools
in the reward sandbox: the call's ``what`` argument names what it does, ``arg`` its argument (a path,
a port)."""

import os
import socket
import time

from k3core.rl.envs import ToolsCalcEnv


class HostileTools(ToolsCalcEnv):
    name = "hostile-tools"
    tools = [{"type": "function", "function": {"name": "act", "description": "does what it is told",
                                                "parameters": {"type": "object", "properties": {
                                                    "what": {"type": "string"}, "arg": {"type": "string"}}}}}]

    def call_tool(self, prompt, name, arguments):
        what, arg = arguments.get("what"), arguments.get("arg", "")
        if what == "ok":
            return f"done {arg} in {os.getcwd() != '/'}"
        if what == "hang":
            time.sleep(600)
        if what == "raise":
            raise KeyError("no such file")
        if what == "number":
            return 42
        if what == "flood":
            return "x" * (50 << 20)
        if what == "write":
            with open(arg, "w") as f:
                f.write("escaped")
            return "wrote"
        if what == "connect":
            socket.create_connection(("127.0.0.1", int(arg)), timeout=2).close()
            return "connected"
        if what == "exit":
            os._exit(3)
        return f"unknown {what}"


def make():
    return HostileTools()

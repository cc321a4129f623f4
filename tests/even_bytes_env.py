"""An environment a random tiny policy's reward varies on: the fraction of even bytes of the completion
(exact, in [0, 1]), so every step trains and equal metrics mean equal samples, not "every reward is 0".
The scorer raises while the file named by ``K3RL_TEST_CRASH_FILE`` exists (the crash-resume tests).
Tests copy this file into a temporary directory under their own module name (``ENV_SRC``)."""

import os

from k3core.rl.envs import ReverseEnv


class EvenBytes(ReverseEnv):
    name = "even-bytes"
    passes_environment = ("K3RL_TEST_CRASH_FILE",)  # the sandboxed call sees no other variable of the pipeline's

    def reward(self, prompt, completion):
        marker = os.environ.get("K3RL_TEST_CRASH_FILE")
        if marker and os.path.exists(marker):
            raise RuntimeError("injected scorer crash")
        data = completion.encode()
        return sum(b % 2 == 0 for b in data) / len(data) if data else 0.0


def make():
    return EvenBytes()

"""An environment a random tiny policy's reward varies on: the fraction of even bytes of the completion
(exact, in [0, 1]), so every step trains and equal metrics mean equal samples, not "every reward is 0".
Tests copy this file into a temporary directory under their own module name (``ENV_SRC``)."""

from k3core.rl.envs import ReverseEnv


class EvenBytes(ReverseEnv):
    name = "even-bytes"

    def reward(self, prompt, completion):
        data = completion.encode()
        return sum(b % 2 == 0 for b in data) / len(data) if data else 0.0


def make():
    return EvenBytes()

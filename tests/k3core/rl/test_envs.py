import random
import textwrap

import pytest

from k3core.rl.data import heldout_prompts, is_heldout, training_prompts
from k3core.rl.envs import AdditionEnv, ReverseEnv, checked_prompts, checked_reward, load_env


def test_addition_reward_exact():
    env = AdditionEnv()
    assert env.reward("12+30=", "42") == 1.0
    assert env.reward("12+30=", " 42 ") == 1.0
    assert env.reward("12+30=", "43") == 0.0
    assert env.reward("12+30=", "") == 0.0


def test_reverse_reward_partial_credit():
    env = ReverseEnv()
    assert env.reward("rev:abcd=", "dcba") == 1.0
    assert env.reward("rev:abcd=", "dcbx") == 0.75
    assert env.reward("rev:abcd=", "dcbaaa") == pytest.approx(4 / 6)
    assert env.reward("rev:abcd=", "") == 0.0


def test_heldout_split_is_disjoint():
    env = AdditionEnv()
    ho = set(heldout_prompts(env, 0, 64, "add"))
    tr = {p for it in range(20) for p in training_prompts(env, 0, it, 16, "add")}
    assert ho and tr and not (ho & tr)
    assert all(is_heldout(p) for p in ho)


def test_user_environment_from_outside_the_package(tmp_path, monkeypatch):
    (tmp_path / "my_user_env.py").write_text(textwrap.dedent('''
        class Vowels:
            name = "vowels"
            def prompts(self, rng, n):
                return ["count vowels:" + "".join(rng.choice("abcde") for _ in range(5)) + "=" for _ in range(n)]
            def reward(self, prompt, completion):
                word = prompt.split(":")[1][:-1]
                return 1.0 if completion.strip() == str(sum(c in "aeiou" for c in word)) else 0.0
        def make():
            return Vowels()
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    env = load_env("my_user_env:make")
    p = checked_prompts(env, random.Random(0), 4, "my_user_env:make")
    assert len(p) == 4
    assert checked_reward(env, "count vowels:aabcd=", "2") == 1.0


def test_bad_environments():
    with pytest.raises(ValueError, match="unknown environment 'nope'"):
        load_env("nope")
    with pytest.raises(ValueError, match="cannot import module"):
        load_env("no_such_module_xyz:make")

    class NaNEnv:
        def prompts(self, rng, n):
            return []

        def reward(self, p, c):
            return float("nan")

    class Raising(NaNEnv):
        def reward(self, p, c):
            raise KeyError("boom")

    with pytest.raises(ValueError, match="rewards must lie in"):
        checked_reward(NaNEnv(), "p", "c", "nan-env")
    class Exiting(NaNEnv):
        def reward(self, p, c):
            raise SystemExit(0)  # must not end the pipeline "successfully"

    from k3core.rl.envs import RewardError
    from tasks.common import NON_RETRYABLE

    with pytest.raises(RewardError, match="raised KeyError"):
        checked_reward(Raising(), "p", "c", "raising")
    with pytest.raises(RewardError, match="raised SystemExit"):
        checked_reward(Exiting(), "p", "c", "exiting")
    assert issubclass(RewardError, NON_RETRYABLE)  # a broken reward fails the stage once, not after retries
    with pytest.raises(ValueError, match="returned no prompts"):
        checked_prompts(NaNEnv(), random.Random(0), 3, "empty")

"""Harness environments: agent loops written outside k3rl, talking plain OpenAI chat to the rollout
server, whose episodes k3rl trains on.

A harness environment is a single-turn environment (``k3core.rl.envs``: ``prompts``, ``reward``)
that also has
  ``run_agent(endpoint, prompt) -> None``
which runs one episode of the user's own agent loop (its own tools, its own message handling) for
``prompt`` against ``endpoint``, an ``AgentEndpoint``: an OpenAI-compatible ``base_url`` with its
``api_key`` and ``model``, and the ``temperature``, ``max_tokens`` and ``extra_body`` every call
must pass, e.g. with the ``openai`` client::

    client = openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key)
    client.chat.completions.create(model=endpoint.model, messages=..., tools=...,
                                   temperature=endpoint.temperature, max_tokens=endpoint.max_tokens,
                                   extra_body=endpoint.extra_body)

``extra_body`` carries the episode's ``session_id``, so the server records the calls of the episode
as one trajectory (``k3core.rollout.chat_sessions``: the ids the model saw and sampled, a loss mask
of 1 on sampled ids and 0 on what the harness added, the sampling log-probabilities, per-id weight
versions, the last call's routed experts). When ``run_agent`` returns, the rollout reads the
trajectory (``GET /v1/sessions/{id}``), frees it (``DELETE``), and the row trains like any agentic
episode; the reward is ``reward(prompt, completion)`` on the trajectory's text, scored as every
reward is (in the sandbox for a user environment).

Where the calls go: the run's rollout server (``--rollout-url``, a k3rl server), or, for the
embedded engine, that engine served on 127.0.0.1 for the length of the rollout
(``k3core.rollout.local_server``). ``run_agent`` itself runs in the rollout stage's process, on a
thread per episode, ``--prompts-per-iteration x --samples-per-prompt`` at once: it is orchestration
code, like the flow; the tools it runs are its own to confine.

Refused, naming the episode and the fix (a trajectory that would train wrongly is never kept):
``run_agent`` raising; an episode whose session holds no call (its calls did not pass
``extra_body``); a call at a temperature other than the run's (the trainer's log-probabilities
would not be the sampler's); a trajectory without routed experts.
"""

from __future__ import annotations

import base64
import secrets
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass

__all__ = ["AgentEndpoint", "HarnessError", "harness_episodes", "is_harness", "run_harness_episodes"]

MAX_LIVE_HARNESS_EPISODES = 256


class HarnessError(ValueError):
    """A harness episode that cannot train: its ``run_agent`` failed, or its session is not usable."""


@dataclass(frozen=True)
class AgentEndpoint:
    """What one episode's calls must use: ``base_url`` (ends in ``/v1``), ``api_key``, ``model``,
    ``temperature`` and ``max_tokens`` (the run's), and ``extra_body`` (the episode's ``session_id``)."""

    base_url: str
    api_key: str
    model: str
    session_id: str
    temperature: float
    max_tokens: int

    @property
    def extra_body(self) -> dict:
        return {"session_id": self.session_id}


def is_harness(env) -> bool:
    return callable(getattr(env, "run_agent", None))


def harness_episodes(client, tok, env, prompts: list[str], samples: int, *, temperature: float, max_tokens: int,
                     first_index: int = 0, spec: str = "?"):
    """``run_harness_episodes`` on ``client``'s engine (a ``RolloutClient`` or ``RolloutEngine``): a
    k3rl rollout server at its URL, or the embedded engine served on 127.0.0.1 with ``tok``'s chat
    template while the episodes run; each trajectory's turns carry their text (decoded with ``tok``)."""
    from contextlib import nullcontext

    from k3core.rollout.client import RolloutClient
    from k3core.rollout.engine import RolloutEngine
    from k3core.rollout.local_server import served
    from k3core.rollout.sglang_serving import is_sglang

    engine = client if isinstance(client, RolloutEngine) else client.engine if client.is_local else None
    if engine is None and is_sglang(client.server_info()):
        raise HarnessError(f"environment {spec!r} runs an agent harness, whose episodes k3rl records as sessions of "
                           f"its own rollout server; {client.url} is SGLang: use --rollout-url local or a "
                           "k3rl rollout-server")
    with served(engine, tok) if engine is not None else nullcontext(client.url) as url:
        server = RolloutClient(url, config=engine.config if engine is not None else client.config,
                               api_key=None if engine is not None else client.api_key)
        eps = run_harness_episodes(server, env, prompts, samples, temperature=temperature, max_tokens=max_tokens,
                                   first_index=first_index, spec=spec)
    for ep in eps:
        for t in ep.turns:
            t["text"] = tok.decode(ep.output_ids[t["span"][0]:t["span"][1]])
    return eps


def run_harness_episodes(server, env, prompts: list[str], samples: int, *, temperature: float, max_tokens: int,
                         first_index: int = 0, spec: str = "?", model: str = "k3rl"):
    """``samples`` episodes per prompt (ordered prompt, then sample) of ``env.run_agent`` against
    ``server`` (a ``RolloutClient`` of a k3rl server), all at once, each on a thread: their
    trajectories as ``k3core.rl.episodes.Trajectory`` (turns: the harness's additions and the
    model's calls, with their spans, weight versions and temperatures; routing of every position
    but the last). ``HarnessError`` for an episode that cannot train."""
    tag = secrets.token_hex(6)
    jobs = [(p, j, f"harness-{tag}-{first_index + i}-{j}") for i, p in enumerate(prompts) for j in range(samples)]
    base_url = f"{server.url}/v1"

    def one(job):
        prompt, j, sid = job
        endpoint = AgentEndpoint(base_url, server.api_key or "none", model, sid, temperature, max_tokens)
        try:
            env.run_agent(endpoint, prompt)
            raised = None
        except Exception as e:  # noqa: BLE001 - the harness's bug, reported with its episode
            raised = e
        status, session = server._call("GET", f"/v1/sessions/{sid}")
        if raised is not None and not (status == 200 and session.get("ended")):
            raise HarnessError(f"environment {spec!r}: run_agent raised {type(raised).__name__}: {raised} in episode "
                               f"{sid} (prompt {prompt!r}); fix the harness") from raised
        # (a harness that went on after a turn cut by max_tokens was refused by the server: what it had trains)
        if status == 404:
            raise HarnessError(f"environment {spec!r}: episode {sid} (prompt {prompt!r}) made no call with its "
                               "session: pass extra_body=endpoint.extra_body to every chat.completions call")
        if status >= 400:
            raise HarnessError(f"environment {spec!r}: reading episode {sid} answered HTTP {status}: {session}")
        server._call("DELETE", f"/v1/sessions/{sid}")
        return trajectory_of(session, prompt, j, temperature, server, spec)

    with ThreadPoolExecutor(min(len(jobs), MAX_LIVE_HARNESS_EPISODES), thread_name_prefix="k3-harness") as pool:
        futures = [pool.submit(one, job) for job in jobs]
        wait(futures, return_when=FIRST_EXCEPTION)
        return [f.result() for f in futures]


def trajectory_of(session: dict, prompt: str, sample: int, temperature: float, server, spec: str = "?"):
    """The ``Trajectory`` of one session's JSON (``ChatSession.as_dict``), checked: its calls at
    ``temperature``, routed experts present and covering every position but the last."""
    import torch

    from k3core.rl.episodes import Trajectory

    sid, calls = session["session_id"], session["calls"]
    off = [k for k, c in enumerate(calls) if c.get("temperature") is not None
           and abs(float(c["temperature"]) - temperature) > 1e-9]
    if off:
        raise HarnessError(f"environment {spec!r}: episode {sid} call {off[0]} sampled at temperature "
                           f"{calls[off[0]]['temperature']}, the run samples at {temperature} (--temperature): pass "
                           "temperature=endpoint.temperature to every call")
    if not session.get("routed_experts"):
        raise HarnessError(f"environment {spec!r}: episode {sid} carries no routed experts (is the server a k3rl "
                           "rollout server?)")
    n_moe, k = server._routing_shape()
    raw = base64.b64decode(session["routed_experts"])
    routing = torch.frombuffer(bytearray(raw), dtype=torch.int32).view(-1, n_moe, k).to(torch.int16)
    ids = session["prompt_ids"] + session["output_ids"]
    if routing.shape[0] != len(ids) - 1:
        raise HarnessError(f"environment {spec!r}: episode {sid} has routing for {routing.shape[0]} positions, "
                           f"its {len(ids)} ids need {len(ids) - 1}")
    turns = []
    for c in calls:
        lo, hi = c["span"]
        if c.get("added_ids"):
            turns.append({"role": "harness", "span": [lo - c["added_ids"], lo]})
        turns.append({"role": "assistant", "span": [lo, hi], "weight_version": c.get("weight_version"),
                      "finish_reason": c.get("finish_reason"), "temperature": c.get("temperature")})
    versions = {c.get("weight_version") for c in calls}
    ended = "answer" if not session.get("ended") else (calls[-1].get("finish_reason") or "length")
    return Trajectory(prompt, list(session["prompt_ids"]), [], output_ids=list(session["output_ids"]),
                      loss_mask=list(session["loss_mask"]), logprobs=list(session["logprobs"]), turns=turns,
                      routing=routing, finish_reason=ended,
                      weight_version=versions.pop() if len(versions) == 1 else None, sample_index=sample)

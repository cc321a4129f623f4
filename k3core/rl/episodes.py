"""Multi-turn episodes of tool calls: the agentic environment protocol, and running episodes on a
rollout engine into trajectories that train through a loss mask.

An agentic environment is a single-turn environment (``k3core.rl.envs``: ``prompts``, ``reward``,
optionally ``system_prompt`` / ``messages``) that also has
  ``tools``                                   OpenAI-style tool declarations (a list of dicts)
  ``call_tool(prompt, name, arguments) -> str``  one tool call's result text
and optionally ``max_turns`` (assistant turns per episode). An episode starts from the prompt's
messages (``k3core.rl.prompting.env_messages``) with the tools declared; each assistant turn ends
at an end-of-turn id; its tool calls (the K2/K3 section format) are run and their results appended
as ``tool`` messages, and the next turn is sampled after them. A turn without tool calls ends the
episode (its content is the answer). So do the limits: ``max_turns`` assistant turns, and
``max_tokens`` tokens after the prompt. ``reward(prompt, completion)`` receives the whole
trajectory's text after the prompt (``final_answer`` gives the last assistant turn's content), once,
at the end.

Where tools run (``tools_of``): a user environment's in the reward sandbox, each call a confined
process with its own wall timeout (``EpisodeLimits.tool_timeout``), as many at once as the sandbox has
workers; the built-in environments' in this process.

Failures are part of the trajectory, never an exception of the rollout: a tool that raises, returns
non-text, hangs past its timeout, or is stopped by another sandbox limit, and an unknown tool name,
become a ``tool`` message starting with ``error:``; a malformed
tool-call section becomes a ``user`` message saying what was wrong (``k3core.tokenizer.tool_calls``).

Token-in/token-out: a trajectory's ids are the prompt's rendering, then per turn the ids the engine
sampled (loss mask 1, their sampling log-probabilities) and the rendering of what the environment
answered (mask 0, log-probability 0), appended, never re-rendered: the text of the conversation
is re-rendered only to find the new suffix (the template must render turns append-only, which the
K3 template does; another is refused). Each turn is sampled with the whole trajectory so far as its
prompt; every episode runs on its own thread, its turns joining the engine's running batch
(continuous batching), so while one waits for its tools the others decode. Where the client keeps decode state between turns
(``RolloutEngine`` sessions, locally or on k3rl's rollout server), each episode is a session: a
turn prefills only the ids appended since the last one, and the episode's state is freed when it
ends; otherwise every turn re-prefills the whole trajectory (same tokens, more compute).
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace

from k3core.rl.prompting import PromptFormat, env_messages
from k3core.rl.sandbox import ToolError
from k3core.tokenizer.tool_calls import final_answer

__all__ = ["EpisodeLimits", "ToolError", "Trajectory", "final_answer", "is_agentic", "run_episodes", "tools_of"]

MAX_TOOL_RESULT_CHARS = 4096  # a tool that floods its output is cut here (with a note), never the stage


@dataclass(frozen=True)
class EpisodeLimits:
    """``max_turns`` assistant turns and ``max_tokens`` tokens after the prompt per episode;
    ``tool_timeout`` wall seconds per sandboxed tool call, ``tool_workers`` of them at a time."""

    max_turns: int = 8
    max_tokens: int = 512
    tool_timeout: float = 10.0
    tool_workers: int = 2

    @classmethod
    def of(cls, rollout) -> EpisodeLimits:
        """The limits a run's rollout section (``k3core.settings.RolloutSettings``) sets."""
        return cls(rollout.max_turns, rollout.max_episode_tokens, rollout.tool_timeout)


def is_agentic(env) -> bool:
    return isinstance(getattr(env, "tools", None), list) and callable(getattr(env, "call_tool", None))


@dataclass
class Trajectory:
    """One episode: ``prompt_ids`` (the first turn's prompt), then ``output_ids`` with their
    ``loss_mask`` and ``logprobs`` (0 where the environment wrote), the ``messages`` of the
    conversation, per-turn records (``turns``: role, token span in ``output_ids``, tool name,
    arguments, result, latency, error), the last call's ``routing`` (every position of the
    trajectory but the last), and why it ended."""

    prompt: str
    prompt_ids: list[int]
    messages: list[dict]
    output_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)
    routing: object = None
    finish_reason: str = ""
    weight_version: int | None = None
    sample_index: int = 0

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_versions(self) -> list[int | None]:
        """Per output id, the weight version of the turn that sampled it; None where the environment wrote."""
        out: list[int | None] = [None] * len(self.output_ids)
        for t in self.turns:
            if t["role"] == "assistant":
                lo, hi = t["span"]
                each = t.get("token_versions")  # a turn a weight update reached mid-generation
                out[lo:hi] = (each or [t.get("weight_version", self.weight_version)] * (hi - lo))[:max(0, len(out) - lo)]
        return out


def _suffix_ids(fmt: PromptFormat, before: list[dict], after: list[dict], tools) -> list[int]:
    """The ids of what ``after`` renders beyond ``before`` (then the generation prompt)."""
    tok = fmt.tok
    head = tok.render_chat(before, tools=tools, add_generation_prompt=False)
    full = tok.render_chat(after, tools=tools, add_generation_prompt=True)
    if not full.startswith(head):
        raise ValueError("the chat template does not render a conversation append-only (adding a turn changed the "
                         "text of earlier ones): multi-turn trajectories need one that does, like K3's")
    return tok.encode(full[len(head):])


def _append_answers(fmt: PromptFormat, ep: Trajectory, assistant: dict, answers: list[dict], tools) -> list[int]:
    """Append the assistant turn just sampled and the environment's ``answers`` to ``ep``'s messages, and
    the answers' rendering (then the generation prompt) to its ids, untrained; their token span."""
    before = ep.messages + [assistant]
    new = _suffix_ids(fmt, before, before + answers, tools)
    span = [len(ep.output_ids), len(ep.output_ids) + len(new)]
    ep.messages = before + answers
    ep.output_ids += new
    ep.loss_mask += [0] * len(new)
    ep.logprobs += [0.0] * len(new)
    return span


def _run_tool(env, prompt: str, call, tool_runner) -> tuple[str, str]:
    """(result text, error) of one parsed call; the error is also the result's text."""
    names = {t.get("function", {}).get("name") for t in env.tools}
    if call.name not in names:
        err = f"error: unknown tool {call.name!r}; the tools are {sorted(n for n in names if n)}"
        return err, err
    try:
        out = tool_runner(prompt, call.name, call.arguments)
    except ToolError as e:  # the sandbox's account of how the call ended
        err = f"error: the tool {call.name} {e}"
        return err, err
    except Exception as e:  # noqa: BLE001 - a broken tool is the model's observation, not a failed stage
        err = f"error: the tool {call.name} raised {type(e).__name__}: {e}"
        return err, err
    if not isinstance(out, str):
        err = f"error: the tool {call.name} returned {type(out).__name__}, not text"
        return err, err
    if len(out) > MAX_TOOL_RESULT_CHARS:
        out = out[:MAX_TOOL_RESULT_CHARS] + f"\n[... cut at {MAX_TOOL_RESULT_CHARS} characters]"
    return out, ("" if not out.startswith("error:") else out)


def _in_process_tools(env):
    return lambda prompt, name, arguments: env.call_tool(prompt, name, arguments)


@contextmanager
def tools_of(env, spec: str | None, limits: EpisodeLimits):
    """(tool runner, calls at a time) for ``env``'s episodes: the built-in environments' tools (our
    code) in this process, one at a time, as for an environment object no spec loads (``spec`` None);
    every other environment's in the reward sandbox (``k3core.rl.sandbox``: workers loading ``spec``,
    each call confined, ``limits.tool_timeout`` wall seconds)."""
    from k3core.rl.rewards import IN_PROCESS
    from k3core.rl.sandbox import RewardSandbox, SandboxLimits

    if spec is None or spec in IN_PROCESS:
        yield _in_process_tools(env), 1
        return
    with RewardSandbox(spec, SandboxLimits(timeout_s=limits.tool_timeout, workers=limits.tool_workers)) as sandbox:
        yield sandbox.call_tool, limits.tool_workers


def run_episodes(client, fmt: PromptFormat, env, prompts: list[str], params, *, max_turns: int = 8,
                 max_tokens: int = 512, tool_runner=None, tool_workers: int = 1,
                 first_index: int = 0, schedule: str = "continuous") -> list[Trajectory]:
    """``params.n`` episodes per prompt (ordered prompt, then sample) on ``client`` (a
    ``RolloutClient`` or ``RolloutEngine``: ``generate(ids, params)`` callable from many threads, and
    ``release_sessions`` where it keeps decode state between turns), each turn at most
    ``params.max_new_tokens`` tokens. ``tool_runner(prompt, name, arguments) -> str``: where tools run
    (default: ``env.call_tool`` in this process), ``tool_workers`` calls at a time (``tools_of`` gives
    both).

    ``schedule``: ``continuous`` (the default) runs every episode on its own thread, so an episode's
    next turn joins the engine's running batch as soon as its tools return, and an episode waiting for
    a slow tool holds no other; ``rounds`` makes every live episode wait for the slowest of the round
    before any samples its next turn (the baseline of ``benchmarks/episode_schedule.py``). A turn's
    sampling seed derives from ``params.seed``, the episode's prompt position (``first_index`` +
    its index), its sample and the turn, so no episode's samples depend on the schedule or on which
    episodes share a batch (only on rounding where batch shapes differ)."""
    if not fmt.chat:
        raise ValueError("multi-turn episodes need a tokenizer with a chat template (a checkpoint with its own "
                         "tokenizer, e.g. --source init:small:0:bpe) and --prompt-format auto or chat")
    if schedule not in ("continuous", "rounds"):
        raise ValueError(f"schedule {schedule!r}: use 'continuous' or 'rounds'")
    from k3core.rollout.sampling import derive_seed  # here: the module is imported by sandbox workers, before torch

    max_turns = min(max_turns, int(getattr(env, "max_turns", max_turns)))
    eps = []
    for p in prompts:
        messages = env_messages(env, p)
        ids = fmt.tok.apply_chat_template(messages, tools=env.tools, add_generation_prompt=True)
        eps += [Trajectory(p, ids, list(messages), sample_index=j) for j in range(params.n)]
    if not eps:
        return eps
    base = params.seed if params.seed is not None else 0
    keeps_state = callable(getattr(client, "release_sessions", None))
    driver = _EpisodeDriver(client, fmt, env, params, max_turns, max_tokens, tool_runner or _in_process_tools(env),
                            threading.Semaphore(max(1, tool_workers)),
                            _Rounds(len(eps)) if schedule == "rounds" else None)

    def one(e: int) -> None:
        ep = eps[e]
        seed = derive_seed(derive_seed(base, first_index + e // params.n), ep.sample_index)
        session = f"ep-{secrets.token_hex(8)}-{e}" if keeps_state else None
        driver.run(ep, seed, session)

    threads = len(eps) if schedule == "rounds" else min(len(eps), MAX_LIVE_EPISODES)
    driving = getattr(client, "driving", None)  # a local engine steps on one thread while the episodes run
    with driving() if callable(driving) else nullcontext(), \
            ThreadPoolExecutor(threads, thread_name_prefix="k3-episode") as pool:
        futures = [pool.submit(one, e) for e in range(len(eps))]
        wait(futures, return_when=FIRST_EXCEPTION)
        driver.abort.set()  # after a failure, every other episode stops at its next turn (a no-op when all ended)
        for f in futures:
            f.result()
    for ep in eps:  # trailing environment tokens train nothing and the last call's routing does not cover them
        while ep.loss_mask and ep.loss_mask[-1] == 0:
            ep.output_ids.pop()
            ep.loss_mask.pop()
            ep.logprobs.pop()
        for rec in ep.turns:  # the last answers' records stay (the tools ran), their spans now empty
            rec["span"] = [min(x, len(ep.output_ids)) for x in rec["span"]]
    return eps


MAX_LIVE_EPISODES = 512  # episode threads at once under the continuous schedule (more wait for a free one)


class _Rounds:
    """A barrier whose party shrinks as episodes end: ``turn_done(ended=False)`` waits until every
    live episode has finished the same turn; ``turn_done(ended=True)`` leaves for good."""

    def __init__(self, parties: int):
        self._cv = threading.Condition()
        self._live, self._arrived, self._round = parties, 0, 0

    def turn_done(self, ended: bool) -> None:
        with self._cv:
            if ended:
                self._live -= 1
            else:
                self._arrived += 1
            mine = self._round
            if self._arrived >= self._live:
                self._round, self._arrived = self._round + 1, 0
                self._cv.notify_all()
            elif not ended:
                while self._round == mine:
                    self._cv.wait()


@dataclass
class _EpisodeDriver:
    """One episode's turns, shared by the threads of ``run_episodes``."""

    client: object
    fmt: PromptFormat
    env: object
    params: object
    max_turns: int
    max_tokens: int
    run_tool: object
    tool_slots: threading.Semaphore
    rounds: _Rounds | None
    abort: threading.Event = field(default_factory=threading.Event)

    def run(self, ep: Trajectory, seed: int, session: str | None) -> None:
        ended = False
        try:
            for turn in range(self.max_turns):
                ended = not self._turn(ep, turn, seed, session)
                if ended:
                    return
                if self.rounds is not None:
                    self.rounds.turn_done(False)
            ep.finish_reason = ep.finish_reason or "max_turns"
        finally:
            if self.rounds is not None:
                self.rounds.turn_done(True)
            if session is not None:  # the ended episode frees its kept state now
                self.client.release_sessions([session])

    def _turn(self, ep: Trajectory, turn: int, seed: int, session: str | None) -> bool:
        """Sample ``ep``'s next turn and run its tools; False when the episode ended."""
        from k3core.rollout.sampling import derive_seed
        from k3core.tokenizer.tool_calls import parse_assistant_text

        if self.abort.is_set():
            ep.finish_reason = ep.finish_reason or "aborted"
            return False
        budget = self.max_tokens - len(ep.output_ids)
        if budget <= 0:
            ep.finish_reason = ep.finish_reason or "max_tokens"
            return False
        extra = {"sessions": [session]} if session is not None else {}
        (c,) = self.client.generate([ep.ids], replace(self.params, n=1, seed=derive_seed(seed, turn),
                                                      max_new_tokens=min(self.params.max_new_tokens, budget)), **extra)
        start = len(ep.output_ids)
        ep.output_ids += c.output_ids
        ep.loss_mask += [1] * len(c.output_ids)
        ep.logprobs += list(c.logprobs)
        ep.routing, ep.weight_version = c.routing, c.weight_version
        text = self.fmt.completion_text(c.output_ids)
        parsed = parse_assistant_text(text)
        ep.turns.append({"role": "assistant", "span": [start, len(ep.output_ids)], "text": text,
                         "weight_version": c.weight_version,
                         **({"token_versions": list(c.token_versions)}
                            if c.token_versions and len(set(c.token_versions)) > 1 else {})})
        if c.finish_reason != "stop":
            ep.finish_reason = "length" if c.finish_reason == "length" else c.finish_reason
            return False
        assistant = {"role": "assistant", "content": parsed.content,
                     "tool_calls": [call.to_openai() for call in parsed.tool_calls]}
        if not parsed.tool_calls and not parsed.errors:
            ep.messages.append(assistant)
            ep.finish_reason = "answer"
            return False
        answers = []
        for call in parsed.tool_calls:
            t0 = time.perf_counter()
            with self.tool_slots:
                result, error = _run_tool(self.env, ep.prompt, call, self.run_tool)
            answers.append({"role": "tool", "tool_call_id": call.id, "content": result})
            ep.turns.append({"role": "tool", "name": call.name, "arguments": json.dumps(call.arguments),
                             "result": result, "error": error, "seconds": time.perf_counter() - t0})
        if parsed.errors:
            answers.append({"role": "user", "content": "Your tool call could not be read: " + "; ".join(parsed.errors)})
            ep.turns.append({"role": "user", "error": "; ".join(parsed.errors)})
        span = _append_answers(self.fmt, ep, assistant, answers, self.env.tools)
        for rec in ep.turns[-len(answers):]:
            rec["span"] = span
        return True


def reference_trajectory(fmt: PromptFormat, env, prompt: str) -> Trajectory:
    """The trajectory of ``env.reference_turns(prompt)`` (a correct episode's assistant texts, tool
    calls included): each turn as the engine would sample it (its ids, then the end-of-turn id), the
    tools really called in this process between them: what the supervised warm-up teaches."""
    from k3core.tokenizer.tool_calls import parse_assistant_text

    if not fmt.chat:
        raise ValueError("multi-turn episodes need a tokenizer with a chat template")
    messages = env_messages(env, prompt)
    ep = Trajectory(prompt, fmt.tok.apply_chat_template(messages, tools=env.tools, add_generation_prompt=True),
                    list(messages), finish_reason="answer")
    turns = env.reference_turns(prompt)
    for k, text in enumerate(turns):
        ids = fmt.answer_ids(text)
        ep.output_ids += ids
        ep.loss_mask += [1] * len(ids)
        parsed = parse_assistant_text(text)
        assistant = {"role": "assistant", "content": parsed.content,
                     "tool_calls": [call.to_openai() for call in parsed.tool_calls]}
        if k == len(turns) - 1:
            ep.messages.append(assistant)
            break
        answers = [{"role": "tool", "tool_call_id": call.id,
                    "content": _run_tool(env, prompt, call, _in_process_tools(env))[0]} for call in parsed.tool_calls]
        _append_answers(fmt, ep, assistant, answers, env.tools)
    ep.logprobs = [0.0] * len(ep.output_ids)
    return ep


def episode_stats(turns: list[str | None], loss_masks: list, finish_reasons: list[str]) -> dict:
    """Tool-use metrics of a rollout's episodes (its ``turns`` JSON, ``loss_mask`` and
    ``finish_reason`` columns); empty for a single-turn rollout. ``episode_turns``: assistant turns
    per episode; ``tool_calls_per_episode``; ``tool_error_rate``: calls whose result was an error
    (raised, non-text, timed out, unknown tool) over all calls; ``malformed_turns_per_episode``:
    tool-call sections that could not be read; ``episode_tokens``: tokens after the prompt;
    ``trained_token_fraction``: of those, the model's own (mask 1); ``answered_fraction``: episodes
    that ended with an answer (not a limit)."""
    recs = [json.loads(t) for t in turns if t is not None]
    if not recs:
        return {}
    n = len(recs)
    calls = [r for ep in recs for r in ep if r.get("role") == "tool"]
    tokens = sum(len(m) for m in loss_masks if m is not None)
    return {"episode_turns": sum(r.get("role") == "assistant" for ep in recs for r in ep) / n,
            "tool_calls_per_episode": len(calls) / n,
            "tool_error_rate": sum(bool(c.get("error")) for c in calls) / len(calls) if calls else 0.0,
            "malformed_turns_per_episode": sum(r.get("role") == "user" for ep in recs for r in ep) / n,
            "episode_tokens": tokens / n,
            "trained_token_fraction": sum(sum(m) for m in loss_masks if m is not None) / max(tokens, 1),
            "answered_fraction": sum(f == "answer" for f in finish_reasons) / len(finish_reasons)}


def trajectories_markdown(rows: list[dict], title: str, limit: int = 3, cut: int = 600) -> str:
    """A few scored episodes (rows of a scored table: ``prompt``, ``turns``, ``reward``, ...) as
    readable markdown: per turn who spoke, the tool calls with their arguments and results, errors,
    and the reward: the trajectory viewer each iteration publishes. The best, the worst and a middle
    episode by reward, so a reader sees what is rewarded and what is not."""
    def clip(text: str) -> str:
        text = str(text)
        return text if len(text) <= cut else text[:cut] + f" [... {len(text) - cut} more characters]"

    def quoted(text: str) -> str:
        return "\n".join("    " + line for line in clip(text).splitlines() or [""])

    ranked = sorted(rows, key=lambda r: -r["reward"])
    picks = [ranked[0], ranked[len(ranked) // 2], ranked[-1]][:limit] if len(ranked) >= 3 else ranked[:limit]
    md = [f"### {title}", ""]
    for r in picks:
        md += [f"#### prompt {r['prompt_index']} sample {r['sample_index']}: reward {r['reward']:.3f}, "
               f"ended by {r['finish_reason']}, {len(r['output_ids'])} tokens ({sum(r['loss_mask'] or [])} trained)",
               "", f"**user**: {clip(r['prompt'])}", ""]
        for t in json.loads(r["turns"] or "[]"):
            if t["role"] == "assistant":
                md += ["**assistant**:", "", quoted(t.get("text", "")), ""]
            elif t["role"] == "tool":
                head = f"**tool** `{t.get('name')}({clip(t.get('arguments', ''))})`, {t.get('seconds', 0):.3f} s"
                md += [head + (" **error**" if t.get("error") else "") + ":", "", quoted(t.get("result", "")), ""]
            elif t["role"] == "harness":  # what an external agent harness added between calls
                md += ["**harness** (tool results, user turns):", "", quoted(t.get("text", "")), ""]
            else:
                md += [f"**user** (malformed call): {clip(t.get('error', ''))}", ""]
        if r.get("reward_reason"):
            md += [f"reward reason: {clip(r['reward_reason'])}", ""]
    return "\n".join(md)

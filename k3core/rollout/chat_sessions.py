"""Sessions of ``/v1/chat/completions``: the calls of one agent episode recorded as one trajectory.

An agent harness outside k3rl talks plain OpenAI chat and names its episode with ``session_id`` (an
extra body field: ``extra_body={"session_id": ...}`` in the ``openai`` client). Each call sends the
whole conversation so far, as OpenAI clients do. The server keeps, per session, the ids the model
saw and sampled and the text of the conversation they stand for; a call whose conversation renders
as that text plus more (the assistant turn the server returned, then tool results or a user turn)
is sampled from the kept ids plus the ids of what it adds only, so the trajectory's ids are exactly
what the model saw and produced, turn after turn, never the answer's text re-encoded. The engine
keeps the session's decode state too (``RolloutEngine`` sessions), so a turn prefills only the new
ids. A call that edits the conversation (it does not extend the session's text) is refused with a
400 naming the session: start another.

``GET /v1/sessions/{id}`` returns the trajectory: ``prompt_ids`` (the first call's prompt), then
``output_ids`` with ``loss_mask`` (1 on sampled ids, 0 on what the harness added) and ``logprobs``
(0 where the harness wrote), ``weight_versions`` (one per output id, None where the harness wrote),
and per call its token span, weight version and temperature, and the last call's ``routed_experts``
(every position but the last). That is a rollout row of an agentic environment; a harness
environment's rollout reads it so (``k3core.rl.harness``).
``DELETE /v1/sessions/{id}`` frees it and its engine state. The server holds at most ``max_sessions``
(the least recently used is dropped first).
"""

from __future__ import annotations

import base64
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from k3core.rollout.request_fields import BadRequest

__all__ = ["ChatSession", "ChatSessions"]


@dataclass
class ChatSession:
    id: str
    head: str = ""  # the conversation's text so far (its last assistant turn included), no generation prompt
    tools: object = None
    prompt_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list = field(default_factory=list)
    calls: list[dict] = field(default_factory=list)
    ended: str = ""  # why no call may extend it any more
    busy: bool = False
    routing: object = None  # the last call's routed experts: [every position but the last, n_moe, k]

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def as_dict(self) -> dict:
        """The trajectory as JSON; ``routed_experts``: as ``/generate`` encodes them (base64 of
        little-endian int32, [positions, n_moe_layers, k]), for routing replay."""
        routed = None
        if self.routing is not None:
            routed = base64.b64encode(self.routing.numpy().astype("<i4").tobytes()).decode("ascii")
        return {"session_id": self.id, "prompt_ids": self.prompt_ids, "output_ids": self.output_ids,
                "loss_mask": self.loss_mask, "logprobs": self.logprobs, "weight_versions": self.weight_versions,
                "calls": self.calls, "ended": self.ended or None, "routed_experts": routed}


class ChatSessions:
    """The sessions one server holds (thread-safe; a session takes one call at a time)."""

    def __init__(self, max_sessions: int = 4096):
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, ChatSession] = OrderedDict()
        self._lock = threading.Lock()
        self.dropped: list[str] = []  # ids evicted since the server last freed their engine state

    def engine_key(self, sid: str) -> str:
        return f"chat:{sid}"

    def begin(self, sid: str, messages: list[dict], tools, tokenizer, first_prompt) -> tuple[ChatSession, list[int], int]:
        """(the session, the ids to sample from, how many of them the session did not hold yet) for
        a call of ``sid`` with this conversation; ``first_prompt()`` renders a new session's prompt."""
        with self._lock:
            s = self._sessions.get(sid)
            if s is None:
                s = self._sessions[sid] = ChatSession(sid, tools=tools)
                while len(self._sessions) > self.max_sessions:
                    self.dropped.append(self._sessions.popitem(last=False)[0])
            elif s.busy:
                raise BadRequest(f"session {sid!r} has a call in flight: an episode's calls come one after another")
            self._sessions.move_to_end(sid)
            if s.ended:
                raise BadRequest(f"session {sid!r} ended ({s.ended}): start a new session_id")
            s.busy = True
        try:
            if not s.prompt_ids:
                return s, first_prompt(), 0
            if tools != s.tools:
                raise BadRequest(f"session {sid!r} declared other tools in its first call: an episode keeps its tools")
            full = tokenizer.render_chat(messages, tools=tools, add_generation_prompt=True)
            if not full.startswith(s.head):
                raise BadRequest(f"session {sid!r}: these messages do not extend the session's conversation (an earlier "
                                 "turn was edited or dropped, or the assistant turn differs from the one returned); "
                                 "send the conversation so far plus new turns, or start a new session_id")
            new = tokenizer.encode(full[len(s.head):])
            return s, s.ids + new, len(new)
        except Exception:
            s.busy = False
            raise

    def finish(self, s: ChatSession, prompt: list[int], n_new: int, completion, messages, assistant: dict,
               tokenizer, tools, ended_by_id: bool, temperature: float | None = None) -> None:
        """Record one call: the ids the harness added (untrained), then the sampled ones (and the
        sampling ``temperature`` their log-probabilities are at)."""
        with self._lock:
            try:
                if not s.prompt_ids:
                    s.prompt_ids = list(prompt)
                else:
                    s.output_ids += prompt[len(prompt) - n_new:]
                    s.loss_mask += [0] * n_new
                    s.logprobs += [0.0] * n_new
                    s.weight_versions += [None] * n_new
                start = len(s.output_ids)
                out = list(completion.output_ids)
                s.output_ids += out
                s.loss_mask += [1] * len(out)
                s.logprobs += list(completion.logprobs)
                s.weight_versions += [completion.weight_version] * len(out)
                s.calls.append({"span": [start, len(s.output_ids)], "added_ids": n_new, "time": time.time(),
                                "finish_reason": completion.finish_reason, "weight_version": completion.weight_version,
                                "temperature": temperature})
                s.routing = completion.routing
                s.head = tokenizer.render_chat(messages + [assistant], tools=tools, add_generation_prompt=False)
                if not ended_by_id:
                    s.ended = (f"its last turn ended by {completion.finish_reason} before an end-of-turn id, so what "
                               "the model saw next is not defined")
            finally:
                s.busy = False

    def release(self, s: ChatSession) -> None:
        with self._lock:
            s.busy = False

    def get(self, sid: str) -> ChatSession | None:
        with self._lock:
            return self._sessions.get(sid)

    def pop(self, sid: str) -> ChatSession | None:
        with self._lock:
            return self._sessions.pop(sid, None)

    def take_dropped(self) -> list[str]:
        with self._lock:
            out, self.dropped = self.dropped, []
            return out

"""One sampled episode (`Sample`) and what a turn adds to it: the reply's tokens, the env's result, the bridge."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from posttrain.rollout.env_results import DEFAULT_MAX_ABS_REWARD, check_result


@dataclasses.dataclass
class Sample:
    """One sampled episode: `segments` are (tokens int32, logp float32, is_policy) after the prompt.

    `routing`: with routing replay, int32 [tokens, Lm, k] expert selections (-1: none); `versions`: each policy
    segment's per-token policy versions (the rollout engine)."""

    domain: str
    group: int
    prompt_ids: list[int]
    segments: list = dataclasses.field(default_factory=list)
    reward: float = 0.0
    status: str = ""
    done: bool = False
    truncated: bool = False
    texts: list = dataclasses.field(default_factory=list)
    info: dict = dataclasses.field(default_factory=dict)
    routing: Any = None
    versions: list = dataclasses.field(default_factory=list)

    @property
    def oldest_version(self) -> int | None:
        """The policy version of its oldest sampled token (its staleness version); None without versions."""
        return min((int(v.min()) for v in self.versions if len(v)), default=None)

    @property
    def completion_len(self) -> int:
        return sum(len(t) for t, _, _ in self.segments)

    @property
    def counts(self) -> bool:
        """Whether the reward says anything about the policy: False for an infra error (never scored, invariant 6)."""
        return self.status != "infra_error"


SampleFn = Callable[[np.ndarray, np.ndarray, Any, int], Any]  # (prompts_PxLp, lengths_P, key, G) -> SampleOutput


def chat_prompt(tokenizer, observation: str, system_prompt: str = "", info: dict | None = None) -> list[int]:
    """Token ids of the first prompt (`rollout.chat.prompt_text`)."""
    from posttrain.rollout import chat

    return tokenizer.encode(chat.prompt_text(tokenizer, observation, system_prompt, info))


def turn_bridge(tokenizer, reply: str, observation: str, ended_with_stop: bool, info: dict | None = None) -> list[int]:
    """Tokens between a sampled assistant turn and the next one (`rollout.chat.bridge_text`)."""
    from posttrain.rollout import chat

    return tokenizer.encode(chat.bridge_text(tokenizer, chat.observation_messages(tokenizer, observation, info),
                                             ended_with_stop))


def append_reply(s: Sample, tokens, logp, truncated: bool, tokenizer, versions=None, routing=None) -> str:
    """Appends a sampled reply (tokens, logp, versions: [n]) to sample `s` as a policy segment; returns its text."""
    seg = np.asarray(tokens, np.int32)
    s.segments.append((seg, np.asarray(logp, np.float32), True))
    s.truncated = truncated
    if versions is not None:
        s.versions.append(np.asarray(versions, np.int32))
    if routing is not None:
        s.routing = np.asarray(routing, np.int32)
    s.texts.append(tokenizer.decode(seg.tolist(), skip_special_tokens=True))
    return s.texts[-1]


def apply_result(s: Sample, result, reply: str, tokenizer, env_id: str = "",
                 max_abs_reward: float = DEFAULT_MAX_ABS_REWARD) -> None:
    """Applies an env step's result, checked by `check_result`, to sample `s` (and the masked bridge if it goes on)."""
    obs, reward, terminated, truncated, info = check_result(result, env_id, max_abs_reward)
    s.reward, s.status, s.info = reward, info.get("status", ""), info
    s.done = bool(terminated or truncated)
    if not s.done:
        bridge = turn_bridge(tokenizer, reply, obs, not s.truncated, info)
        s.segments.append((np.asarray(bridge, np.int32), np.zeros(len(bridge), np.float32), False))

"""Chat rendering of (multi-turn) episodes with the tokenizer's own template: the first prompt and the bridge between
two sampled turns, tools and tool results included (the env's keys and the extension check: docs/rollout.md)."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

PLACEHOLDER = "posttrainPlaceholderReply"
_PROBE_TOOL = {"type": "function", "function": {"name": "posttrain_probe_tool", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}


def renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders a ``tools=`` argument (cached on the tokenizer)."""
    cached = getattr(tokenizer, "_posttrain_renders_tools", None)
    if cached is None:
        chat = [{"role": "user", "content": "q"}]
        try:
            with_tools = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tools=[_PROBE_TOOL])
        except Exception:  # a template that cannot render tools (jinja errors of any kind): it does not
            with_tools = ""
        cached = "posttrain_probe_tool" in with_tools
        try:
            tokenizer._posttrain_renders_tools = cached
        except AttributeError:
            pass
    return cached


def native_tools(tokenizer, info: Mapping | None) -> list | None:
    """The env's tool schemas when the template renders them (else None: tools stay in the observation text)."""
    tools = (info or {}).get("tools")
    return list(tools) if tools and renders_tools(tokenizer) else None


def prompt_text(tokenizer, observation: str, system_prompt: str = "", info: Mapping | None = None) -> str:
    """The first prompt: [system?, earlier messages?, user: observation] with the generation prompt.

    With ``tools=`` when the template renders them. The env's reset info may give the task's own ``system_prompt``
    (it replaces the run's) and ``prompt_messages`` (user / assistant turns before the observation, e.g. a task
    file's few-shot examples)."""
    info = info or {}
    tools = native_tools(tokenizer, info)
    if tools is not None and info.get("tools_prompt"):
        observation = observation.replace(info["tools_prompt"], "").strip()
    system_prompt = info.get("system_prompt") or system_prompt
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
    messages += [{"role": m["role"], "content": m["content"]} for m in info.get("prompt_messages") or ()]
    messages.append({"role": "user", "content": observation})
    extra = {"tools": tools} if tools is not None else {}
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra)


def observation_messages(tokenizer, observation: str, info: Mapping | None) -> list[dict]:
    """The chat messages of a step's observation; ValueError for a malformed info["messages"] entry."""
    messages = (info or {}).get("messages")
    if not messages or not renders_tools(tokenizer):
        return [{"role": "user", "content": observation}]
    for m in messages:
        if not isinstance(m, Mapping) or m.get("role") not in ("tool", "user") or not isinstance(m.get("content"), str):
            raise ValueError(f"an env's step info 'messages' holds {{'role': 'tool' | 'user', 'content': str}} "
                             f"entries, got {m!r:.200}")
    return [dict(m) for m in messages]


def bridge_text(tokenizer, messages: Sequence[Mapping[str, Any]], ended_with_stop: bool) -> str:
    """The text between a sampled assistant turn and the next one, the reply never re-rendered.

    Raises ValueError when the template fails the extension check (docs/rollout.md)."""
    query = [{"role": "user", "content": "q"}]
    start = tokenizer.apply_chat_template(query, add_generation_prompt=True)
    plain = tokenizer.apply_chat_template(query, add_generation_prompt=False)
    end_text = tokenizer.decode([tokenizer.stop_ids[0]], skip_special_tokens=False)
    full = tokenizer.apply_chat_template(query + [{"role": "assistant", "content": PLACEHOLDER}, *messages],
                                         add_generation_prompt=True)
    head = start + PLACEHOLDER + end_text
    generation_prompt = start[len(plain):] if start.startswith(plain) else ""
    if not full.startswith(head) or not generation_prompt or not full.endswith(generation_prompt):
        raise ValueError(
            "the chat template does not extend a conversation turn by turn: rendered after a user turn it should "
            f"read <generation prompt {generation_prompt!r}> + reply + {end_text!r} + the next messages + the "
            f"generation prompt again; got {full[len(plain):][:300]!r}")
    return ("" if ended_with_stop else end_text) + full[len(head):]

"""The rollout engine as the rollout phase's sampler (`EngineSampler`), and the `sampling` config section.

The engine-vs-dense contract: docs/engine.md. Shapes: the legend in `posttrain.types`."""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable

import jax
import numpy as np

from posttrain.errors import AT_LEAST_ONE, NONNEGATIVE, ConfigError, check_fields
from posttrain.generate.engine.loop import Engine, EngineSettings, Request
from posttrain.generate.sampler import SampleOutput, SamplingParams

_SUMMED = ("prefill_tokens", "decode_tokens", "preemptions", "prefix_cached_tokens", "weight_swaps")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineSamplerSettings:
    """The engine's size when it samples a run's rollouts (`SamplingConfig.engine_settings`); ValueError off range.

    Attributes:
        num_slots: S, sequences decoded together (>= 1).
        num_pages: pages in the pool including the scratch page (0: every slot at its longest; else >= 2).
        page_size: tokens per page (>= 1).
        max_seq_len: longest prompt + reply in tokens (0: sized by the longest request seen; else >= 2).
        prefill_bucket: prefill widths are this times a power of two (>= 1).
        record_routing: return the MoE layers' expert selections (routing replay).
        per_episode: multi-turn episodes run per episode (`posttrain.rollout.per_episode`; needs max_seq_len).
        env_overlap: per episode, decode chunks an env step may overlap (>= 0).
        decode_chunk: decode steps per program (>= 0; 0: the backend's default)."""

    num_slots: int
    num_pages: int = 0
    page_size: int = 16
    max_seq_len: int = 0
    prefill_bucket: int = 16
    record_routing: bool = False
    per_episode: bool = False
    env_overlap: int = 0
    decode_chunk: int = 0

    def __post_init__(self):
        if self.num_slots < 1 or self.num_pages == 1 or self.num_pages < 0 or self.page_size < 1 \
                or self.max_seq_len == 1 or self.max_seq_len < 0 or self.prefill_bucket < 1 \
                or (self.per_episode and not self.max_seq_len) or self.env_overlap < 0 or self.decode_chunk < 0:
            raise ValueError(f"invalid engine sampler settings: num_slots={self.num_slots} (>= 1), num_pages="
                             f"{self.num_pages} (0 or >= 2), page_size={self.page_size} (>= 1), max_seq_len="
                             f"{self.max_seq_len} (0 or >= 2; >= 2 per episode), prefill_bucket="
                             f"{self.prefill_bucket} (>= 1), per_episode={self.per_episode}, env_overlap="
                             f"{self.env_overlap} (>= 0), decode_chunk={self.decode_chunk} (>= 0)")

    def engine_settings(self, longest: int) -> EngineSettings:
        """The `EngineSettings` of an engine whose longest request has `longest` tokens."""
        Z, width = self.page_size, self.max_seq_len
        if not width:
            pages = 1
            while pages * Z < longest:
                pages *= 2
            width = max(pages * Z, 2)
        num_pages = self.num_pages or self.num_slots * -(-width // Z) + 1
        return EngineSettings(num_slots=self.num_slots, num_pages=num_pages, page_size=Z, max_seq_len=width,
                              prefill_bucket=self.prefill_bucket, record_routing=self.record_routing,
                              decode_chunk=self.decode_chunk)


def _same_arrays(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(x is y for x, y in zip(la, lb))


class EngineSampler:
    """One run's engine behind `sample_fn`, on `device`; `chunk_hook(engine, chunk)` runs after every decode chunk."""

    def __init__(self, graphdef, settings: EngineSamplerSettings, device=None):
        self.graphdef, self.settings, self.device = graphdef, settings, device
        self.engine: Engine | None = None
        self.version = -1  # the version of the weights in the engine
        self.chunk_hook = None
        self._policy = None  # the weights in the engine (or pending there)
        self._published: dict[int, Any] = {}  # version -> a rollout queue's policy states (`publish`)
        self._live = False
        self._lock = threading.Lock()  # `publish` runs on the learner's thread
        self._metrics: dict[str, float] = {}

    def publish(self, policy, version: int, *, live: bool, keep: int = 2) -> None:
        """Registers `policy` as `version` (the `keep` newest are kept): `sample_fn` with it samples as that version.

        With `live` (partial rollouts) it goes to the engine at once, and later calls sample with the newest version."""
        with self._lock:
            self._published[int(version)] = policy
            self._published = {v: p for v, p in self._published.items() if v > version - keep}
            self._live = live
            if live:
                self._set(policy, version)

    def _set(self, policy, version: int) -> None:
        # the same arrays under another number (an evaluation sampled them before they were published) are relabelled
        if self._policy is not None and _same_arrays(policy, self._policy) and int(version) == self.version:
            return
        self._policy, self.version = policy, int(version)
        if self.engine is not None:
            self.engine.update_weights(policy, self.version)

    def _use(self, policy) -> None:
        with self._lock:
            known = next((v for v, p in self._published.items() if _same_arrays(policy, p)), None)
            if known is None:
                if self._policy is None or not _same_arrays(policy, self._policy):
                    self._set(policy, max(self._published, default=self.version + 1))
            elif self._live:
                newest = max(self._published)
                self._set(self._published[newest], newest)
            else:
                self._set(policy, known)

    def _engine_for(self, longest: int) -> Engine:
        with self._lock:
            e = self.engine
            if e is None or (not self.settings.max_seq_len and e.settings.max_seq_len < longest):
                e = self.engine = Engine(self.graphdef, self._policy, self.settings.engine_settings(longest),
                                         version=self.version)
            return e

    def sample_fn(self, policy, params: SamplingParams, stop_ids, pad_id: int, stream_chunk: int = 0) -> Callable:
        """An `episodes.SampleFn` over `policy` with `params`; `on_rows` gets done rows every `stream_chunk` chunks."""
        self._use(policy)
        stops = tuple(int(s) for s in stop_ids)

        def request(prompt) -> Request:  # one sample's request with this call's settings
            return Request(prompt=tuple(int(x) for x in prompt), max_new_tokens=params.max_new_tokens,
                           temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, stop_ids=stops)

        def fn(prompts, lengths, key, group_size, on_rows=None) -> SampleOutput:
            prompts, lengths = np.asarray(prompts), np.asarray(lengths)
            G, Lg = int(group_size), params.max_new_tokens
            requests = [request(prompts[p, :int(lengths[p])]) for p in range(len(prompts)) for _ in range(G)]
            out = _Rows(len(requests), Lg, pad_id)
            every = stream_chunk if on_rows is not None else 0

            def on_chunk(engine, chunk):
                if every and (chunk + 1) % every == 0:
                    out.deliver(on_rows)
                if self.chunk_hook is not None:
                    self.chunk_hook(engine, chunk)

            generate(self._engine_for(int(lengths.max()) + Lg), requests, key, out.finish, on_chunk)
            return out.output(prompts.shape[1], G)

        def generate(engine, requests, key, on_finish, on_chunk=None, follow_after=0):
            with jax.default_device(self.device) if self.device is not None else contextlib.nullcontext():
                key = key if self.device is None else jax.device_put(key, self.device)
                done = engine.generate(requests, key, on_chunk=on_chunk or (lambda e, c: self.chunk_hook and
                                                                           self.chunk_hook(e, c)),
                                       on_finish=on_finish, follow_after=follow_after)
            self._add_metrics(engine.metrics)
            return done

        if not self.settings.per_episode:
            return fn
        # per-episode multi-turn (`posttrain.rollout.per_episode`) builds its own requests and engine
        fn.request, fn.engine_for, fn.generate = request, self._engine_for, generate
        fn.env_overlap = self.settings.env_overlap
        return fn

    def _add_metrics(self, m: dict) -> None:
        acc, S = self._metrics, self.engine.settings.num_slots
        for k in _SUMMED:
            acc[k] = acc.get(k, 0.0) + m[f"rollout/{k}"]
        acc["kv_pages_allocated"] = max(acc.get("kv_pages_allocated", 0.0), m["rollout/kv_pages_allocated"])
        acc["kv_pages_used"] = max(acc.get("kv_pages_used", 0.0), m["rollout/kv_pages_used"])
        occupancy = m["rollout/slot_occupancy"]
        steps = m["rollout/decode_tokens"] / (occupancy * S) if occupancy > 0 else 0.0
        acc["steps"] = acc.get("steps", 0.0) + steps

    def pop_metrics(self) -> dict[str, float]:
        """The engine's rollout/* counters (sums, peaks, occupancy) since the last pop ({}: none); resets them."""
        acc, self._metrics = self._metrics, {}
        if not acc:
            return {}
        steps = acc.pop("steps")
        occupancy = acc["decode_tokens"] / (steps * self.engine.settings.num_slots) if steps else 0.0
        return {**{f"rollout/{k}": float(v) for k, v in acc.items()}, "rollout/slot_occupancy": occupancy}


class _Rows:
    def __init__(self, n: int, Lg: int, pad_id: int):
        self.tokens = np.full((n, Lg), pad_id, np.int32)
        self.logp = np.zeros((n, Lg), np.float32)
        self.versions = np.full((n, Lg), -1, np.int32)
        self.lengths = np.zeros((n,), np.int32)
        self.truncated = np.zeros((n,), bool)
        self.done = np.zeros((n,), bool)
        self.routing: list[np.ndarray | None] = [None] * n  # [fed tokens, L, k] per row (record_routing)
        self._delivered = 0

    def finish(self, index: int, c: Any) -> None:
        """`Engine.generate`'s on_finish: request `index` ended with completion `c` (no follow-up request)."""
        k = len(c.tokens)
        self.tokens[index, :k], self.logp[index, :k], self.versions[index, :k] = c.tokens, c.logprobs, c.versions
        self.lengths[index], self.truncated[index], self.done[index] = k, c.truncated, True
        self.routing[index] = c.routing

    def deliver(self, sink) -> None:
        """Hands the rows finished so far to a streaming sink when some finished since the last delivery."""
        if int(self.done.sum()) > self._delivered:
            self._delivered = int(self.done.sum())
            sink(self.done.copy(), self.tokens.copy(), self.lengths.copy())

    def output(self, Lp: int, G: int) -> SampleOutput:
        """The call's SampleOutput; routing in the dense sampler's layout (-1 where nothing was fed)."""
        if self.routing[0] is None:
            return SampleOutput(self.tokens, self.logp, self.lengths, self.truncated, versions_NxLg=self.versions)
        (N, Lg), (L, k) = self.tokens.shape, self.routing[0].shape[1:]
        prompt_e, experts = np.full((N // G, Lp, L, k), -1, np.int32), np.full((N, Lg, L, k), -1, np.int32)
        for i, r in enumerate(self.routing):
            n_prompt = len(r) - (int(self.lengths[i]) - 1)
            if i % G == 0:
                prompt_e[i // G, :n_prompt] = r[:n_prompt]
            experts[i, :len(r) - n_prompt] = r[n_prompt:]
        return SampleOutput(self.tokens, self.logp, self.lengths, self.truncated, prompt_e, experts, self.versions)


SAMPLING_BACKENDS = ("auto", "engine", "dense")  # `sampling.backend`, checked at load


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """The `sampling` section: training rollouts.

    Attributes:
        max_new_tokens: completion tokens per turn.
        temperature: sampling temperature (0: greedy); also the trainer's logprob temperature.
        top_p: nucleus sampling mass (1: off).
        top_k: keep the k most likely tokens (0: off).
        prompt_bucket: prompt widths round up to a multiple of this (fewer compilations).
        system_prompt: a system turn before every prompt ("": none).
        decode_shrink_steps: drop finished rows from the decode batch up to this many times (0: never; dense only).
        backend: "engine", "dense" or "auto" (`backend_for`): both give the same logprobs and tokens (docs/engine.md).
        engine_slots: the engine's sequences decoded together (0: rl.prompts_per_step x rl.group_size).
        engine_pages: KV pages in the pool, scratch page included (0: every slot at its longest, never preempted).
        engine_page_size: tokens per KV page.
        engine_max_seq_len: the longest prompt + reply the engine holds (0: sized by the longest request seen).
        engine_per_episode: queue an episode's next turn once its env step returns; needs engine_max_seq_len.
        engine_env_overlap: decode chunks an env step may overlap (0: it runs in the loop); needs engine_per_episode.
        engine_decode_chunk: decode steps per device program (0: 8 on GPU / TPU, 1 on the CPU); tokens do not change."""

    max_new_tokens: int = 24
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    prompt_bucket: int = 16
    system_prompt: str = ""
    decode_shrink_steps: int = 0
    backend: str = "auto"
    engine_slots: int = 0
    engine_pages: int = 0
    engine_page_size: int = 16
    engine_max_seq_len: int = 0
    engine_per_episode: bool = False
    engine_env_overlap: int = 0
    engine_decode_chunk: int = 0

    def __post_init__(self):
        check_fields(self, choices={"backend": SAMPLING_BACKENDS}, ranges={
            "max_new_tokens": AT_LEAST_ONE, "prompt_bucket": AT_LEAST_ONE,
            "temperature": (">= 0 (0: greedy)", lambda v: v >= 0), "top_p": ("in (0, 1] (1: off)", lambda v: 0 < v <= 1),
            "top_k": (">= 0 (0: off)", lambda v: v >= 0), "decode_shrink_steps": NONNEGATIVE,
            "engine_slots": (">= 0 (0: prompts x group)", lambda v: v >= 0),
            "engine_pages": ("0 (every slot at its longest) or >= 2 (page 0 is scratch)", lambda v: v == 0 or v >= 2),
            "engine_page_size": AT_LEAST_ONE, "engine_env_overlap": NONNEGATIVE, "engine_decode_chunk": NONNEGATIVE,
            "engine_max_seq_len": ("0 (sized by the requests) or >= 2", lambda v: v == 0 or v >= 2)})

    def params(self) -> SamplingParams:
        """The training rollouts' per-call sampling parameters."""
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k)

    def backend_for(self, sampler_devices: int) -> str:
        """"engine" or "dense": `backend` as set; "auto" picks the engine on one device without decode shrinking."""
        if self.backend != "auto":
            return self.backend
        return "engine" if sampler_devices == 1 and not self.decode_shrink_steps else "dense"

    def engine_settings(self, sampler_devices: int, *, default_slots: int, record_routing: bool,
                        partial: bool = False) -> EngineSamplerSettings | None:
        """The engine's size on `sampler_devices` devices, or None when the dense sampler samples (`backend_for`).

        Raises ConfigError for `partial` rollouts without the engine, the engine on more than one device,
        engine_per_episode without engine_max_seq_len, or engine_env_overlap without engine_per_episode."""
        if self.backend_for(sampler_devices) != "engine":
            if partial:
                raise ConfigError(f"rollout.partial=True swaps weights inside a running generation: it needs the "
                                  f"rollout engine (sampling.backend='engine' or 'auto'), which runs on one device; "
                                  f"this run samples with the dense sampler (sampling.backend={self.backend!r}, "
                                  f"{sampler_devices} sampler devices, decode_shrink_steps={self.decode_shrink_steps})")
            return None
        if self.engine_per_episode and not self.engine_max_seq_len:
            raise ConfigError("sampling.engine_per_episode=True needs sampling.engine_max_seq_len > 0: the longest "
                              "context an episode may reach (one engine holds all of its turns)")
        if self.engine_env_overlap and not self.engine_per_episode:
            raise ConfigError(f"sampling.engine_env_overlap={self.engine_env_overlap} overlaps env steps with decode "
                              "in per-episode multi-turn rollouts: it needs sampling.engine_per_episode=True")
        if sampler_devices != 1:
            raise ConfigError(f"sampling.backend='engine' runs on one device (its page pool is not sharded), this "
                              f"run's sampler has {sampler_devices}: use sampling.backend='dense', or mesh.rollout=1 "
                              "(the engine on a device of its own)")
        return EngineSamplerSettings(num_slots=self.engine_slots or default_slots, num_pages=self.engine_pages,
                                     page_size=self.engine_page_size, max_seq_len=self.engine_max_seq_len,
                                     record_routing=record_routing, per_episode=self.engine_per_episode,
                                     env_overlap=self.engine_env_overlap, decode_chunk=self.engine_decode_chunk)

"""The rollout engine as the rollout phase's sampler (issue 25): `sampling.backend = "engine"`, or "auto" on one
device (the default).

Dimension legend: P prompts, G group size, N = P*G sequences, Lg max new tokens, S engine slots.

`Rollouter.sample_fn` returns `EngineSampler.sample_fn(...)` instead of a call of `sampler.sample` when the run plan
sets `RolloutSettings.engine`; everything around it (run_episodes, streaming scoring, batching, the trainer) is the
same code path. A call `fn(prompts_PxLp, lengths_P, key, G, on_rows=None)` queues one `engine.Request` per sample
(row p*G + g is sample g of prompt p, as the dense sampler's rows) and returns the dense sampler's `SampleOutput`:
tokens (pad_id after the stop token), logprobs `log_softmax(logits / T)` over the full vocabulary (invariant 1;
0 after the stop token), lengths (stop token included), truncated, and `versions_NxLg` (the policy version that
produced each token, -1 past the end). With the same key its tokens are the dense sampler's, sampled ones too:
sample r's t-th token takes the dense sampler's uniform of row r at step t (`engine_sampling.token_uniforms`),
so the two differ only where float rounding moves a draw across a token boundary.

One engine lives across the run's calls, so its page pool and prefix cache do too: a group's G samples share the
prompt's pages, and a multi-turn episode's next turn (`episodes.run_episodes` calls again with the context so far)
prefills only the tokens added since its last turn. New weights (a `sample_fn` call with other policy arrays) go
to `Engine.update_weights`, which clears the cache (entries are keyed by version). The engine's size is fixed by
`EngineSamplerSettings`, but for max_seq_len = 0: the first call's longest request (prompt + max_new_tokens) sizes
it, rounded up to page_size times a power of two, and a later, longer request builds a bigger engine (a new
compile). Single device (the run plan refuses more). With routing replay the engine records every fed token's
expert selections (`EngineSamplerSettings.record_routing`) in the dense sampler's layout.
`Rollouter.collect` logs the engine's counters of its step (`pop_metrics`: rollout/{kv_pages_allocated,
kv_pages_used, slot_occupancy, prefill_tokens, decode_tokens, preemptions, prefix_cached_tokens, weight_swaps}).
"""
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
    """The engine's size when it samples a run's rollouts (built by the run plan from `sampling.engine_*`).
    Raises ValueError on values outside the ranges below.

    Attributes:
        num_slots: S, sequences decoded together (>= 1; the run plan's default: a step's P * G first-turn rows).
        num_pages: pages in the pool including the scratch page (0: num_slots * ceil(max_seq_len / page_size) + 1,
            every slot at its longest, so no preemption; else >= 2).
        page_size: tokens per page (>= 1).
        max_seq_len: longest prompt + reply in tokens (0: sized by the longest request seen, module doc; else
            >= 2: a longer request is a ValueError).
        prefill_bucket: prefill widths are this times a power of two (>= 1).
        record_routing: return the MoE layers' expert selections (`SampleOutput.prompt_experts_PxLpxLxk`,
            `experts_NxLgxLxk`: routing replay, `rl.routing_replay="replay"`; `EngineSettings.record_routing`).
        per_episode: multi-turn episodes run per episode (`rollout.per_episode`; needs max_seq_len >= 2).
        env_overlap: per episode, decode chunks an env step may overlap (>= 0; `rollout.per_episode.run`).
        decode_chunk: decode steps per program (>= 0; 0: the backend's default; `EngineSettings.decode_chunk`).
    """

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
        """The `EngineSettings` of an engine whose longest request has `longest` tokens (module doc)."""
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
    """One run's engine behind `sample_fn` (module doc). graphdef: the policy's; device: where the engine runs
    (its page pool and programs), the rollout mesh's one device. `chunk_hook(engine, chunk)`, when set, is called
    after every decode chunk (tests and benchmarks step in there)."""

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
        """A rollout queue's policy `version` (states `policy`; the `keep` newest versions are remembered): a later
        `sample_fn` call with these arrays samples as that version. With `live` (partial rollouts,
        `rollout.partial`) the engine takes them at once, at its next decode chunk (a generation under way
        continues under them, its later tokens tagged `version`), and every later call with a published policy
        samples with the newest one instead."""
        with self._lock:
            self._published[int(version)] = policy
            self._published = {v: p for v, p in self._published.items() if v > version - keep}
            self._live = live
            if live:
                self._set(policy, version)

    def _set(self, policy, version: int) -> None:
        # the same arrays under another number (an evaluation sampled the learner's state before the rollout queue
        # published it) are relabelled: the tokens of a training call carry the version it was published as
        if self._policy is not None and _same_arrays(policy, self._policy) and int(version) == self.version:
            return
        self._policy, self.version = policy, int(version)
        if self.engine is not None:
            self.engine.update_weights(policy, self.version)

    def _use(self, policy) -> None:
        """The weights of a `sample_fn` call: a published version's (live: the newest published), or the call's
        own arrays (an evaluation's, a test's: the newest published version number, else the next number; the
        current arrays again: their current number)."""
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
        """`episodes.SampleFn` over the policy states `policy` (`_use`) with `params`; stream_chunk > 0 with an
        `on_rows` sink: every stream_chunk decode steps the rows finished so far go to it (`generate.streaming`'s
        sink arguments)."""
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
        # per-episode multi-turn (`rollout.per_episode`): requests with this call's settings, an engine for
        # requests of up to `longest` tokens, and `generate` on it
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
        """rollout/{prefill_tokens, decode_tokens, preemptions, prefix_cached_tokens, weight_swaps} (sums),
        kv_pages_allocated, kv_pages_used (the largest peak) and slot_occupancy (live slots / S over every decode
        step) of the calls since the last pop; {} when there was none. Resets them."""
        acc, self._metrics = self._metrics, {}
        if not acc:
            return {}
        steps = acc.pop("steps")
        occupancy = acc["decode_tokens"] / (steps * self.engine.settings.num_slots) if steps else 0.0
        return {**{f"rollout/{k}": float(v) for k, v in acc.items()}, "rollout/slot_occupancy": occupancy}


class _Rows:
    """The host arrays of one call's SampleOutput, filled as the engine's requests finish."""

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
        """The call's SampleOutput (prompts padded to Lp, groups of G rows); with routing records the dense
        sampler's layout: a prompt's selections from its group's first row, -1 where nothing was fed."""
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
        decode_shrink_steps: drop finished rows from the decode batch up to this many times
            (`sampler.shrink_schedule`; 0: never). Pays off when a few completions run much longer than the rest;
            each width compiles its own decode loop. Dense sampler only (the engine refills a finished slot).
        backend: what samples the rollouts and evaluations, one of SAMPLING_BACKENDS: "engine" (`generate.engine.loop`:
            continuous batching over a paged KV cache with prefix reuse, `generate.backend`; one device),
            "dense" (`generate.sampler.sample`: one call per batch, a dense KV cache per row; any sampler mesh) or
            "auto": the engine when the sampler runs on one device and decode_shrink_steps is 0 (a dense-only
            knob), the dense sampler otherwise. Both record the same logprobs and MoE routing, draw the same
            tokens from a key (up to float rounding) and give equal greedy replies.
        engine_slots: the engine's sequences decoded together (0: rl.prompts_per_step x rl.group_size, a step's
            first-turn rows; a call with more requests queues them). Engine only, like the fields below.
        engine_pages: KV pages in the engine's pool, the scratch page included (0: every slot at engine_max_seq_len
            tokens, so nothing is ever preempted; fewer save memory, and a full pool preempts and recomputes).
        engine_page_size: tokens per KV page.
        engine_max_seq_len: the longest prompt + reply the engine holds, in tokens (0: sized by the longest request
            seen, rounded up to engine_page_size x a power of two; a longer one later builds a bigger engine, a
            new compile).
        engine_per_episode: multi-turn episodes run per episode (`rollout.per_episode`): an episode's next turn is
            queued as soon as its env step returns, instead of after every episode's turn. Needs
            engine_max_seq_len > 0, the longest context an episode may reach (one engine holds every turn); a
            turn that would not fit ends its episode as truncated.
        engine_env_overlap: per episode, decode chunks an episode's env step may overlap (0: the env steps
            inside the engine's loop while the other episodes wait; > 0: on a thread of its own, and the next
            turn is queued exactly that many decode chunks after the reply ended, waiting for the env then if it
            is slower, so runs are reproducible whatever the env's timing). Set it near env step seconds /
            decode chunk seconds. Needs engine_per_episode.
        engine_decode_chunk: decode steps per device program, K (0: 8 on GPU / TPU, 1 on the CPU; >= 0). The
            host admits requests, preempts and swaps weights between chunks, so K > 1 saves its per-step work
            (half an H200's decode time at qwen3-0.6b) and costs a finished slot up to K - 1 idle steps.
            Tokens and logprobs do not depend on it.
    """

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

        Args:
            default_slots: the slots when engine_slots is 0 (a step's first-turn rows, prompts x group size).
            record_routing: record MoE expert selections (routing replay).
            partial: partial rollouts are on (`rollout.partial`), which need the engine.

        Raises:
            ConfigError: partial rollouts without the engine, the engine on more than one device (its page pool is
                not sharded), engine_per_episode without engine_max_seq_len, or engine_env_overlap without it.
        """
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

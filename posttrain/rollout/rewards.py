"""Model and judge rewards: a reward model and an LLM judge score each reply after the environment, and a sample's
reward becomes the weighted sum of the sources in use (docs/rollout.md). Shapes: the legend in `posttrain.types`."""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import math
import re
import string
import time
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from posttrain.checkpoints import policy as policy_lib
from posttrain.checkpoints.policy import PolicySource
from posttrain.checkpoints.reward_model import load_reward_model, reward_model_dir
from posttrain.errors import ConfigError
from posttrain.generate.sampler import SamplingParams, pad_prompts, sample
from posttrain.rollout.rollouter import Rollouter

SOURCES = ("env", "model", "judge")  # the rewards `weights` combine


TEMPLATE_FIELDS = ("prompt", "reply", "rubric", "max_score")  # what a judge template may name


CRITERION_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")


DEFAULT_TEMPLATE = (
    "You grade a reply to a task. Score each criterion with a number from 0 to {max_score}.\n\n"
    "Criteria:\n{rubric}\n\nTask:\n{prompt}\n\nReply:\n{reply}\n\n"
    "Answer with exactly one line per criterion, in the order above, formatted as <name>: <score>, and nothing "
    "else.")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclasses.dataclass(frozen=True, kw_only=True)
class JudgeConfig:
    """The `rewards.judge` section: an LLM that grades each reply against a rubric.

    Attributes:
        enabled: score replies with the judge.
        path: the judge model, a .gguf file or an HF model directory ("" with no preset: SmolLM2-135M's GGUF).
        preset: a `posttrain.model.presets` name instead (random init with the byte tokenizer: tests).
        overrides: preset fields replaced (e.g. {"vocab_size": 320}).
        template: the judge's user message (`str.format`: {prompt}, {reply}, optional {rubric} and {max_score}).
        criteria: the rubric: a tuple of {"name": a word, "weight": > 0, "description": str}.
        max_score: > 0, the top of each criterion's scale.
        max_new_tokens: the judge's token budget per judgement (greedy decoding).
        batch_size: judgements per sampler call (the last call is padded to it: one compiled shape).
    """

    enabled: bool = False
    path: str = ""
    preset: str = ""
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    template: str = DEFAULT_TEMPLATE
    criteria: tuple[Mapping[str, Any], ...] = ()
    max_score: float = 10.0
    max_new_tokens: int = 64
    batch_size: int = 8

    def __post_init__(self):
        crit = tuple(dict(c) if isinstance(c, Mapping) else c for c in self.criteria)
        object.__setattr__(self, "criteria", crit)
        for i, c in enumerate(crit):
            if not isinstance(c, dict) or set(c) != {"name", "weight", "description"}:
                raise ValueError(f"judge.criteria[{i}]={c!r}: a criterion is {{'name', 'weight', 'description'}}")
            if not (isinstance(c["name"], str) and CRITERION_NAME.fullmatch(c["name"])):
                raise ValueError(f"judge.criteria[{i}].name={c['name']!r}: a word (letters, digits, _ or -)")
            if not (_finite(c["weight"]) and c["weight"] > 0) or not isinstance(c["description"], str):
                raise ValueError(f"judge.criteria[{i}]={c!r}: weight must be a number > 0, description a string")
        names = [c["name"] for c in crit]
        if len(set(names)) != len(names):
            raise ValueError(f"judge.criteria names {names} repeat one")
        if self.enabled and not crit:
            raise ValueError("judge.enabled needs a rubric: set judge.criteria")
        if self.path and self.preset:
            raise ValueError(f"judge: set at most one of path={self.path!r} and preset={self.preset!r}")
        fields = [f for _, f, _, _ in string.Formatter().parse(self.template) if f is not None]
        bad = sorted(set(fields) - set(TEMPLATE_FIELDS))
        if bad or not {"prompt", "reply"} <= set(fields):
            raise ValueError(f"judge.template names {sorted(set(fields))}: it must name {{prompt}} and {{reply}} and "
                             f"may name only {list(TEMPLATE_FIELDS)} (unknown: {bad})")
        checks = {"max_score (> 0)": _finite(self.max_score) and self.max_score > 0,
                  "max_new_tokens (>= 1)": self.max_new_tokens >= 1, "batch_size (>= 1)": self.batch_size >= 1}
        wrong = [k for k, ok in checks.items() if not ok]
        if wrong:
            raise ValueError(f"invalid judge.{', judge.'.join(wrong)}: max_score={self.max_score!r}, "
                             f"max_new_tokens={self.max_new_tokens!r}, batch_size={self.batch_size!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardsConfig:
    """The `rewards` section: model and judge rewards after the environment's.

    Attributes:
        model: a reward model: a `posttrain rm` run or an exported sequence-classification directory ("": none).
        judge: the LLM judge (`JudgeConfig`; off unless judge.enabled).
        weights: {"env" | "model" | "judge": weight} of the weighted sum of scores (a source left out weighs 1).
        judge_unparsable_score: the judge score of a judgement the strict parser rejects (never an error).
        batch_size: sequences per reward-model call (the last call is padded to it).
        max_len: tokens of prompt + reply the reward model reads (a longer sequence keeps its last max_len).
    """

    model: str = ""
    judge: JudgeConfig = JudgeConfig()
    weights: Mapping[str, float] = dataclasses.field(default_factory=lambda: {s: 1.0 for s in SOURCES})
    judge_unparsable_score: float = 0.0
    batch_size: int = 16
    max_len: int = 512

    def __post_init__(self):
        bad = sorted(set(self.weights) - set(SOURCES))
        if bad or not all(_finite(w) for w in self.weights.values()):
            raise ValueError(f"rewards.weights={dict(self.weights)}: keys among {SOURCES}, finite numbers")
        if not _finite(self.judge_unparsable_score):
            raise ValueError(f"rewards.judge_unparsable_score={self.judge_unparsable_score!r}: a finite number")
        if self.batch_size < 1 or self.max_len < 2:
            raise ValueError(f"rewards.batch_size={self.batch_size!r} (>= 1), rewards.max_len={self.max_len!r} (>= 2)")

    @property
    def enabled(self) -> bool:
        """Whether any reward besides the environment's is configured."""
        return bool(self.model) or self.judge.enabled


SCORE_CACHE = 1 << 16  # cached scores per source
_LINE = re.compile(r"([A-Za-z][A-Za-z0-9_-]*)[ \t]*:[ \t]*([+-]?(?:\d+(?:\.\d*)?|\.\d+))")


@dataclasses.dataclass(frozen=True, kw_only=True)
class JudgeSettings:
    """The LLM judge's settings.

    Attributes:
        source: the judge model (preset or path, at the run's precision).
        template: the judge's user message (`str.format` fields prompt, reply, rubric, max_score).
        criteria: ((name, weight, description), ...): the rubric, in the order the judge must answer.
        max_score: the top of each criterion's scale (> 0).
        max_new_tokens: the judge's token budget per judgement.
        batch_size: judgements per sampler call (the last padded to it).
        unparsable_score: the score of a judgement `parse_judgement` rejects.
        prompt_bucket: judge prompt widths round up to a multiple of it (fewer compiled shapes).
    """

    source: PolicySource
    template: str
    criteria: tuple[tuple[str, float, str], ...]
    max_score: float = 10.0
    max_new_tokens: int = 64
    batch_size: int = 8
    unparsable_score: float = 0.0
    prompt_bucket: int = 64


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardSettings:
    """Model and judge rewards of a run (`RewardSettings.of` the `rewards` section).

    Attributes:
        model_path: a reward model (a `posttrain rm` run or an exported directory; "": none).
        model_fields: ModelConfig fields the run sets (dtype, param_dtype, matmul_precision).
        judge: the judge's settings (None: no judge).
        weights: {"env" | "model" | "judge": weight} (a missing source weighs 1).
        batch_size: sequences per reward-model call.
        max_len: tokens of prompt + reply the reward model reads (the last ones).
    """

    model_path: str = ""
    model_fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    judge: JudgeSettings | None = None
    weights: Mapping[str, float] = dataclasses.field(default_factory=dict)
    batch_size: int = 16
    max_len: int = 512

    @classmethod
    def of(cls, rewards: RewardsConfig, precision, *, seed: int) -> "RewardSettings | None":
        """The settings of the `rewards` section (None: no model or judge); ConfigError for a bad model or judge."""
        if not rewards.enabled:
            return None
        fields = dict(dtype=precision.compute_dtype, param_dtype=precision.param_dtype,
                      matmul_precision=precision.matmul_precision)
        if rewards.model:

            try:
                reward_model_dir(rewards.model)
            except (FileNotFoundError, ValueError) as e:
                raise ConfigError(f"rewards.model={rewards.model!r}: {' '.join(str(e).split())}") from None
        judge = None
        if (j := rewards.judge).enabled:
            source = PolicySource(path=j.path, preset=j.preset, overrides=dict(j.overrides), seed=seed, fields=fields)
            try:
                source.check()
            except ValueError as e:
                message = " ".join(str(e).split()).replace("model.", "rewards.judge.")
                raise ConfigError(f"rewards.judge: {message}") from None
            judge = JudgeSettings(source=source, template=j.template, max_score=float(j.max_score),
                                  criteria=tuple((c["name"], float(c["weight"]), c["description"]) for c in j.criteria),
                                  max_new_tokens=j.max_new_tokens, batch_size=j.batch_size,
                                  unparsable_score=float(rewards.judge_unparsable_score))
        return cls(model_path=rewards.model, model_fields=fields, judge=judge, weights=dict(rewards.weights),
                   batch_size=rewards.batch_size, max_len=rewards.max_len)


def rubric_text(criteria) -> str:
    """One line per criterion: "- <name> (weight <w>): <description>"."""
    return "\n".join(f"- {name} (weight {weight:g}): {description}" for name, weight, description in criteria)


def judge_prompt(settings: JudgeSettings, prompt: str, reply: str, criteria=None) -> str:
    """The judge's user message for one (prompt, reply): the template filled in (braces in the texts kept).

    `criteria`: a task's own rubric ((name, weight, description), ...) instead of the settings'."""
    return settings.template.format(prompt=prompt, reply=reply, rubric=rubric_text(criteria or settings.criteria),
                                    max_score=f"{settings.max_score:g}")


def parse_judgement(text: str, criteria, max_score: float) -> tuple[dict[str, float] | None, str]:
    """Returns ({name: score}, "") of a well-formed judgement, else (None, the reason); never raises.

    Well-formed: one line `<name>: <number in [0, max_score]>` per criterion, in the rubric's order, nothing else."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    names = [c[0] for c in criteria]
    scores = {}
    for ln in lines:
        m = _LINE.fullmatch(ln)
        if m is None:
            return None, f"not a '<name>: <score>' line: {ln[:80]!r}"
        name, value = m.group(1), float(m.group(2))
        if name not in names:
            return None, f"unknown criterion {name!r} (rubric: {names})"
        if name in scores:
            return None, f"criterion {name!r} scored twice"
        if not 0.0 <= value <= max_score:
            return None, f"{name}: {m.group(2)} is outside [0, {max_score:g}]"
        scores[name] = value
    if list(scores) != names:
        missing = [n for n in names if n not in scores]
        return None, f"missing criteria {missing}" if missing else f"criteria out of order: {list(scores)}"
    return scores, ""


def judgement_score(scores: Mapping[str, float], criteria, max_score: float) -> float:
    """sum(weight * score) / (sum(weight) * max_score): the judgement's score in [0, 1]."""
    total = sum(w for _, w, _ in criteria)
    return float(sum(w * scores[n] for n, w, _ in criteria) / (total * max_score))


def cache_key(prompt: str, reply: str, *rest) -> str:
    """sha256 hex of the (prompt, reply) texts and anything else an item holds (a task's rubric)."""
    return hashlib.sha256(json.dumps([prompt, reply, *rest], default=str).encode()).hexdigest()


class _Cache(collections.OrderedDict):
    def put(self, key, value):
        self[key] = value
        if len(self) > SCORE_CACHE:
            self.popitem(last=False)


def _chunks(items: Sequence, size: int):
    for i in range(0, len(items), size):
        yield items[i:i + size]


class ModelScorer:
    """The reward model on the mesh: `__call__([(prompt, reply), ...])` returns float32 [B] scores.

    Raises FileNotFoundError / ValueError for a path without a reward model or a tokenizer."""

    def __init__(self, settings: RewardSettings, mesh, rules):
        from flax import nnx

        _, graphdef, self.state, self.tokenizer = load_reward_model(settings.model_path, mesh=mesh, rules=rules,
                                                                    **dict(settings.model_fields))
        if self.tokenizer is None:
            raise ValueError(f"rewards.model={settings.model_path!r}: the reward model has no tokenizer.json")
        self.mesh, self.settings = mesh, settings
        self._fn = jax.jit(lambda state, tokens_BxT, lengths_B: nnx.merge(graphdef, state).score_sequences(
            tokens_BxT, lengths_B))

    def __call__(self, items: Sequence[tuple[str, str]]) -> np.ndarray:
        tok, st = self.tokenizer, self.settings
        seqs = [(tok.encode(p) + tok.encode(r))[-st.max_len:] or [tok.pad_id] for p, r in items]
        out = []
        for chunk in _chunks(seqs, st.batch_size):
            width = min(-(-max(map(len, chunk)) // 64) * 64, -(-st.max_len // 64) * 64)
            tokens = np.full((st.batch_size, width), tok.pad_id, np.int32)
            lengths = np.ones(st.batch_size, np.int32)
            for i, s in enumerate(chunk):
                tokens[i, :len(s)], lengths[i] = s, len(s)
            with jax.set_mesh(self.mesh):
                out.append(np.asarray(jax.device_get(self._fn(self.state, tokens, lengths)))[:len(chunk)])
        return np.concatenate(out).astype(np.float32) if out else np.zeros(0, np.float32)


class Judge:
    """The LLM judge on the mesh: `__call__([(prompt, reply), ...])` returns one judgement dict each."""

    def __init__(self, settings: JudgeSettings, mesh, graphdef, state, tokenizer):
        self.settings, self.mesh, self.graphdef, self.state, self.tokenizer = settings, mesh, graphdef, state, tokenizer

    @classmethod
    def load(cls, settings: JudgeSettings, mesh, rules) -> "Judge":
        """The judge model of `settings.source` loaded on `mesh`."""
        _, graphdef, state, tokenizer = policy_lib.load_policy(settings.source, mesh, rules)
        return cls(settings, mesh, graphdef, state, tokenizer)

    def generate(self, messages: Sequence[str]) -> list[str]:
        tok, st = self.tokenizer, self.settings
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True))
                   for m in messages]
        params, texts = SamplingParams(max_new_tokens=st.max_new_tokens, temperature=0.0), []
        for chunk in _chunks(prompts, st.batch_size):
            toks, lens = pad_prompts(list(chunk) + [chunk[0]] * (st.batch_size - len(chunk)), tok.pad_id,
                                     st.prompt_bucket)
            with jax.set_mesh(self.mesh):
                out = jax.device_get(sample(self.graphdef, self.state, toks, lens, jax.random.key(0), group_size=1,
                                            params=params, stop_ids=tuple(tok.stop_ids), pad_id=tok.pad_id))
            texts += [tok.decode(np.asarray(out.tokens_NxLg[i, :int(out.lengths_N[i])]).tolist(),
                                 skip_special_tokens=True) for i in range(len(chunk))]
        return texts

    def __call__(self, items: Sequence[tuple]) -> list[dict]:
        """One judgement per (prompt, reply) or (prompt, reply, criteria) item: a task's own rubric, when given."""
        st = self.settings
        rubrics = [tuple(map(tuple, it[2])) if len(it) > 2 and it[2] else st.criteria for it in items]
        out = []
        for text, criteria in zip(self.generate([judge_prompt(st, it[0], it[1], c) for it, c in zip(items, rubrics)]),
                                  rubrics):
            scores, reason = parse_judgement(text, criteria, st.max_score)
            score = st.unparsable_score if scores is None else judgement_score(scores, criteria, st.max_score)
            out.append({"output": text, "scores": scores, "score": float(score), "parsed": scores is not None,
                        "reason": reason})
        return out


class Rewarder:
    """Scores samples with the reward model and / or the judge (`model`, `judge`: any callables alike)."""

    def __init__(self, settings: RewardSettings, tokenizer, *, model=None, judge=None):
        self.settings, self.tokenizer, self.model, self.judge = settings, tokenizer, model, judge
        self.model_cache, self.judge_cache = _Cache(), _Cache()

    @classmethod
    def create(cls, settings: RewardSettings, tokenizer, mesh, rules) -> "Rewarder":
        """The reward model and judge of `settings` loaded on `mesh`; `tokenizer`: the policy's."""
        model = ModelScorer(settings, mesh, rules) if settings.model_path else None
        judge = Judge.load(settings.judge, mesh, rules) if settings.judge is not None else None
        return cls(settings, tokenizer, model=model, judge=judge)

    def _texts(self, s) -> tuple[tuple[str, str], tuple[str, str]]:
        """((prompt, reply) with special tokens for the reward model, (prompt, reply) plain for the judge)."""
        dec = self.tokenizer.decode
        ids = [int(x) for seg, _, _ in s.segments for x in seg]
        return ((dec(list(s.prompt_ids), skip_special_tokens=False), dec(ids, skip_special_tokens=False)),
                (dec(list(s.prompt_ids), skip_special_tokens=True), "\n".join(s.texts)))

    @staticmethod
    def _cached(fn, cache: _Cache, items: list[tuple[str, str]]) -> list:
        """fn's values of `items`, each distinct (prompt, reply) not in `cache` scored once (in one call)."""
        keys = [cache_key(*it) for it in items]
        todo = list(dict.fromkeys(k for k in keys if k not in cache))
        first = {k: it for k, it in zip(keys, items)}
        new = dict(zip(todo, fn([first[k] for k in todo]))) if todo else {}
        for k, v in new.items():
            cache.put(k, v)
        return [new[k] if k in new else cache[k] for k in keys]

    def _model_graded(self, graded) -> None:
        """Finishes the env reward of samples whose task names model-graded verifiers (a task file's `rubric`,
        `reward_model`): the weighted mean of the computed verifiers' reward and each model's score.

        Raises ConfigError when a needed model is not configured (the run plan refuses that earlier)."""
        for s in graded:
            mg, (model_item, judge_item) = s.info["model_graded"], self._texts(s)
            s.info["computed_reward"] = float(s.reward)
            total, weights, parts = s.reward * mg["computed_weight"], mg["computed_weight"], {}
            for part in mg["parts"]:
                if part["name"] == "reward_model":
                    if self.model is None:
                        raise ConfigError("a task's reward_model verifier needs rewards.model")
                    score = float(self._cached(self.model, self.model_cache, [model_item])[0])
                else:
                    if self.judge is None:
                        raise ConfigError("a task's rubric verifier needs rewards.judge.enabled")
                    judged = self._cached(self.judge, self.judge_cache, [(*judge_item, part["criteria"])])[0]
                    score, s.info["judge"] = float(judged["score"]), dict(judged)
                parts[part["name"]] = score
                total, weights = total + part["weight"] * score, weights + part["weight"]
            s.info["parts"] = {**s.info.get("parts", {}), **parts}
            s.reward = total / weights if weights > 0 else 0.0

    def score(self, samples) -> dict[str, float]:
        """Sets each counted sample's reward to the weighted sum and its info's sources; returns perf/*_reward_s.

        A sample whose task names model-graded verifiers gets their scores folded into its env reward first
        (`_model_graded`), and no further model or judge reward."""
        w = {src: float(self.settings.weights.get(src, 1.0)) for src in SOURCES}
        graded = [s for s in samples if s.counts and s.info.get("model_graded")]
        if graded:
            t = time.perf_counter()
            self._model_graded(graded)
            perf = {"perf/model_graded_reward_s": time.perf_counter() - t}
        else:
            perf = {}
        live = [s for s in samples if s.counts and not s.info.get("model_graded")]
        texts = [self._texts(s) for s in live]
        for s in graded:
            s.info = {**s.info, "env_reward": float(s.reward)}
            s.reward = w["env"] * s.reward
        total = [w["env"] * s.reward for s in live]
        for s in live:
            s.info = {**s.info, "env_reward": float(s.reward)}
        if self.model is not None and live:
            t = time.perf_counter()
            scores = [float(x) for x in self._cached(self.model, self.model_cache, [m for m, _ in texts])]
            for i, (s, x) in enumerate(zip(live, scores)):
                s.info["model_reward"], total[i] = x, total[i] + w["model"] * x
            perf["perf/model_reward_s"] = time.perf_counter() - t
        if self.judge is not None and live:
            t = time.perf_counter()
            for i, (s, j) in enumerate(zip(live, self._cached(self.judge, self.judge_cache, [j for _, j in texts]))):
                s.info["judge"], total[i] = dict(j), total[i] + w["judge"] * j["score"]
            perf["perf/judge_reward_s"] = time.perf_counter() - t
        for s, r in zip(live, total):
            s.reward = float(r) if math.isfinite(r) else s.reward
        return perf


def reward_metrics(records: Sequence[Mapping]) -> dict[str, float]:
    """reward/{env,model,judge}_mean and reward/judge_unparsable_rate over the archive rows trained on."""
    details = [json.loads(r["details"]) if isinstance(r["details"], str) else r["details"]
               for r in records if r.get("in_batch")]
    out = {}
    for key, name in (("env_reward", "env"), ("model_reward", "model")):
        vals = [d[key] for d in details if key in d]
        if vals:
            out[f"reward/{name}_mean"] = float(np.mean(vals))
    judged = [d["judge"] for d in details if "judge" in d]
    if judged:
        out["reward/judge_mean"] = float(np.mean([j["score"] for j in judged]))
        out["reward/judge_unparsable_rate"] = float(np.mean([not j["parsed"] for j in judged]))
    return out


@dataclasses.dataclass(frozen=True)
class RewardedRollouter(Rollouter):
    """A `Rollouter` whose draw rounds' samples are scored by `rewarder` before groups are formed."""

    rewarder: Any = None

    def _run_fn(self, step: int, sample_fn, key):
        run = super()._run_fn(step, sample_fn, key)

        def scored(batch, size, call):
            samples, perf = run(batch, size, call)
            if self.rewarder is not None:
                perf = {**perf, **self.rewarder.score(samples)}
            return samples, perf

        return scored

    def collect(self, step: int, policy: tuple, rng, policy_version: int | None = None, gate=None):
        """`Rollouter.collect` with the trained samples' `reward_metrics` added."""
        t = super().collect(step, policy, rng, policy_version, gate)
        return dataclasses.replace(t, metrics={**t.metrics, **reward_metrics(t.records)})



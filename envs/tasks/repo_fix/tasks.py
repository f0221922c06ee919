"""The task source of RepoFix-v0: HumanEval problems with injected defects, per split, lazily validated.

Each problem has `len(SLOTS)` task slots (docs/repo_fix.md), so ``num_tasks`` is known without running
anything; building a task validates its problems (`envs.tasks.repo_fix.validate`, about a second the first time,
then cached). Everything is deterministic in (split, seed, index).
"""
from __future__ import annotations

import hashlib

from envs import base
from envs.tasks.repo_fix import layout, mutate, patch, problems as problems_lib, validate

SLOTS = ("single", "single", "double", "two_files")
SPLITS = ("train", "test")
NO_MUTATION_SITES = frozenset({16, 23, 27})  # `enumerate_mutations` finds nothing in these solutions (a test checks)


def split_of(problem: problems_lib.Problem) -> str:
    """"test" (about a quarter) or "train" for `problem`, by a hash of its task id (the same for every seed)."""
    return "test" if hashlib.sha256(f"repo_fix-split:{problem.task_id}".encode()).digest()[0] < 64 else "train"


class RepoFixTasks:
    """`TaskSource` of RepoFix-v0 tasks for one split.

    `seed` selects each problem's visible/hidden split, its defects and the companions; `isolation` applies to the
    validation runs. Raises ValueError on an unknown split, TypeError on a non-int seed."""

    def __init__(self, split: str = "train", *, seed: int = 0, path: str | None = None,
                 isolation: str = "strict") -> None:
        if split not in SPLITS:
            raise ValueError(f"RepoFixTasks: split must be one of {SPLITS}, got {split!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"RepoFixTasks: seed must be an int, got {seed!r}")
        self.split, self.seed, self.isolation = split, seed, isolation
        self.problems = [p for p in problems_lib.load(path)
                         if p.usable and p.number not in NO_MUTATION_SITES and split_of(p) == split]

    @property
    def num_tasks(self) -> int:
        return len(self.problems) * len(SLOTS)

    def validated(self, i: int) -> validate.Validated:
        """The validation of the split's problem `i` (cached)."""
        return validate.cached(self.problems[i], self.seed, self.isolation)

    def _with_defects(self, i: int, skip_entry: str | None = None) -> int:
        """The first problem index from `i` on (cyclically) with a kept defect and an entry other than `skip_entry`."""
        n = len(self.problems)
        for k in range(n):
            j = (i + k) % n
            if self.problems[j].entry != skip_entry and self.validated(j).variants:
                return j
        raise RuntimeError(f"RepoFix {self.split}: no problem has a defect the tests detect (seed {self.seed})")

    def _primary(self, v: validate.Validated, slot: int) -> tuple[mutate.Mutation, ...]:
        variants, kind = v.variants, SLOTS[slot]
        if kind == "single":
            k = SLOTS[:slot].count("single")
            return (v.singles[k],) if k < len(v.singles) else variants[k % len(variants)]
        if kind == "double":
            return v.doubles[0] if v.doubles else variants[slot % len(variants)]
        return (v.singles[-1],) if v.singles else variants[-1]

    def get_task(self, index: int) -> dict:
        """Task `index` = ``i * len(SLOTS) + slot``, a `build_task` dict.

        Raises IndexError/TypeError on a bad index, RuntimeError when no problem has a defect or validation fails."""
        base.check_index(index, self.num_tasks, f"RepoFix {self.split}")
        i, slot = divmod(index, len(SLOTS))
        i = self._with_defects(i)
        primary = self.validated(i)
        parts = [(primary, self._primary(primary, slot))]
        if SLOTS[slot] == "two_files":
            j = self._with_defects((i + 1 + self.seed) % len(self.problems), skip_entry=primary.problem.entry)
            companion = self.validated(j)
            parts.append((companion, companion.variants[0]))
        task = build_task(parts)
        return {**task, "id": f"RepoFix/{self.split}/{index}", "index": index, "split": self.split,
                "slot": SLOTS[slot], "seed": self.seed}


def build_task(parts: list[tuple[validate.Validated, tuple[mutate.Mutation, ...]]]) -> dict:
    """A task dict from (validated problem, its defects) pairs, laid out as modules `layout.MODULES` in order.

    Keys: problems, difficulty (defects), files_with_defects, defects, files (with the defects), original_files,
    golden_patch (files -> original_files), suites and inputs ({"visible"|"hidden": ...}, suites for `scoring`)."""
    broken, fixed = [], []
    for (v, defects), module in zip(parts, layout.MODULES):
        text = mutate.apply(v.problem.module, list(defects))
        broken.append(layout.Part(v.problem, module, text, v.visible))
        fixed.append(layout.Part(v.problem, module, v.problem.module, v.visible))
    files, original = layout.files(broken), layout.files(fixed)
    defects = [{"file": part.path, "op": m.op, "line": m.line, "description": m.description}
               for part, (_, ms) in zip(broken, parts) for m in ms]
    return {
        "problems": [v.problem.task_id for v, _ in parts],
        "difficulty": len(defects),
        "files_with_defects": len({d["file"] for d in defects}),
        "defects": defects,
        "files": files,
        "original_files": original,
        "golden_patch": patch.make_diff(files, original),
        "suites": {"visible": [layout.suite(p, v.visible) for p, (v, _) in zip(fixed, parts)],
                   "hidden": [layout.suite(p, v.hidden) for p, (v, _) in zip(fixed, parts)]},
        "inputs": {side: sorted({f"{v.problem.task_id}: {k}" for v, _ in parts for c in getattr(v, side)
                                 for k in c.inputs})
                   for side in ("visible", "hidden")},
    }

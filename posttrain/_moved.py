"""Old module paths kept importable after the generate/, scheduling/ and runs/ packages took their modules.

`import posttrain.tasks.archive` (the pre-move path) returns `posttrain.scheduling.archive` itself and warns once
with a DeprecationWarning naming the new path. Nothing in this repository uses an old path (a test checks).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

MOVED = {
    "posttrain.rollout.engine": "posttrain.generate.engine.loop",
    "posttrain.rollout.engine_admission": "posttrain.generate.engine.admission",
    "posttrain.rollout.engine_ops": "posttrain.generate.engine.ops",
    "posttrain.rollout.engine_sampling": "posttrain.generate.engine.sampling",
    "posttrain.rollout.engine_sampler": "posttrain.generate.backend",
    "posttrain.rollout.kv_pages": "posttrain.generate.kv_pages",
    "posttrain.rollout.prefix_cache": "posttrain.generate.prefix_cache",
    "posttrain.rollout.paged_attention": "posttrain.generate.paged_attention",
    "posttrain.rollout.page_writes": "posttrain.generate.page_writes",
    "posttrain.rollout.sampler": "posttrain.generate.sampler",
    "posttrain.rollout.streaming": "posttrain.generate.streaming",
    "posttrain.rollout.floors": "posttrain.rollout.floor_metrics",
    "posttrain.rollout.tickets": "posttrain.rollout.attempts",
    "posttrain.tasks.jobs": "posttrain.scheduling.scheduler",
    "posttrain.tasks.scheduler": "posttrain.scheduling.weighted_draw",
    "posttrain.tasks.retry": "posttrain.scheduling.tickets",
    "posttrain.tasks.policy": "posttrain.scheduling.domain_rules",
    "posttrain.tasks.quota": "posttrain.scheduling.quota",
    "posttrain.tasks.stats": "posttrain.scheduling.stats",
    "posttrain.tasks.curriculum": "posttrain.scheduling.curriculum",
    "posttrain.tasks.archive": "posttrain.scheduling.archive",
    "posttrain.tasks.view": "posttrain.scheduling.status_table",
    "posttrain.recipes.workdir": "posttrain.runs.workdir",
    "posttrain.recipes.read_run": "posttrain.runs.read",
    "posttrain.recipes.resources": "posttrain.runs.resources",
    "posttrain.recipes.run_plan": "posttrain.config.plan",
    "posttrain.recipes.preflight": "posttrain.recipes.plan",
    "posttrain.recipes.offline": "posttrain.learn.offline_loop",
    "posttrain.recipes.eval_gate": "posttrain.eval.gate_hook",
    "posttrain.recipes.dryrun": "posttrain.recipes.plan",
    "posttrain.checkpoints.stored_tree": "posttrain.checkpoints.orbax",
}
# packages that exist only as the parents of old paths
OLD_PACKAGES = {"posttrain.tasks"}


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module now at `target` (the same module object)."""

    def __init__(self, target: str | None):
        self.target = target

    def create_module(self, spec):
        if self.target is None:  # an old package: empty, its submodules resolve through MOVED
            module = types.ModuleType(spec.name, f"moved: see {sorted(v for k, v in MOVED.items() if k.startswith(spec.name + '.'))}")
            module.__path__ = []
            return module
        warnings.warn(f"{spec.name} moved to {self.target}; import it from there", DeprecationWarning, stacklevel=3)
        return importlib.import_module(self.target)

    def exec_module(self, module):
        pass


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED:
            return importlib.util.spec_from_loader(fullname, _Alias(MOVED[fullname]))
        if fullname in OLD_PACKAGES:
            return importlib.util.spec_from_loader(fullname, _Alias(None), is_package=True)
        return None


def install() -> None:
    """Puts the finder first on sys.meta_path (once)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())

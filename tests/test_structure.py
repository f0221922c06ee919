"""The code's structure, checked from the source (no imports of the code under test):

- no import circle inside a package, function-local imports included (import-linter's layers contract checks the
  order between packages);
- outside the loader (`posttrain/config/`), `posttrain/recipes/` and `posttrain/cli/`, no code reads a field of a
  run config's section through the section's name (`cfg.rl.group_size`, annotated or not): a component gets its
  own config;
- the run plan copies no config field into a keyword of the same name (`group_size=cfg.rl.group_size`);
- an alias of a project module keeps the module's name (`mesh as mesh_lib`, never `grpo as loop`).
"""
from __future__ import annotations

import ast
import dataclasses
import pathlib
import typing

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("posttrain", "envs")
CONFIG_READERS = ("posttrain/config/", "posttrain/recipes/", "posttrain/cli/")
# A component's own config may hold another component's config under that section's name; each entry says why.
SECTION_READS_ALLOWED = {
    ("posttrain/model/", "lora"): "ModelConfig carries its LoRAConfig (the model's own config)",
    ("posttrain/checkpoints/", "lora"): "loading and exporting read the LoRAConfig of a checkpoint's ModelConfig",
}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: pathlib.Path, source: str | None = None) -> list[tuple[str, int]]:
    """(module imported, line) for every import statement of a module, function-local ones included; `from p import
    n` yields p.n (a submodule, or an attribute of p: the caller keeps the names that are modules)."""
    source = path.read_text() if source is None else source
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            out += [(base, node.lineno)] + [(f"{base}.{a.name}", node.lineno) for a in node.names]
    return out


def library_modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for root in PACKAGES for p in (ROOT / root).rglob("*.py")
            if "__pycache__" not in p.parts}


def package_graph(modules: dict[str, pathlib.Path], sources: dict[str, str] | None = None) -> dict[str, set[str]]:
    """{module: modules of its own package it imports} (a package's __init__ counts as a member of its parent)."""
    graph = {}
    for name, path in modules.items():
        pkg = name.rpartition(".")[0]
        deps = set()
        for target, _ in imports_of(path, (sources or {}).get(name)):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and target.rpartition(".")[0] == pkg and target != pkg:
                deps.add(target)
        graph[name] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_inside_a_package():
    found = circles(package_graph(library_modules()))
    assert not found, "import circles inside a package (function-local imports included):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_a_planted_circle_is_found(tmp_path):
    modules = library_modules()
    sources = {n: p.read_text() for n, p in modules.items()}
    a, b = "posttrain.rollout.batching", "posttrain.rollout.queue"
    sources[a] += "\n\ndef _planted():\n    from posttrain.rollout import queue  # noqa: F401\n"
    assert any(a in c and b in c for c in circles(package_graph(modules, sources)))


# --- config sections are read by the loader and the entry points only

def section_fields() -> dict[str, set[str]]:
    """{section name: its config type's fields} over every run kind's config (GRPO, SFT, DPO, RM)."""
    from posttrain.config import dpo, rm, schema, sft

    out: dict[str, set[str]] = {}
    for run_cls in (schema.Config, sft.SFTRunConfig, dpo.DPORunConfig, rm.RMRunConfig):
        for name, hint in typing.get_type_hints(run_cls).items():
            out.setdefault(name, set()).update(f.name for f in dataclasses.fields(hint))
    return out


def section_reads(source: str, rel: str, fields: dict[str, set[str]]) -> list[str]:
    """`<anything>.<section>.<field>` loads of a run config's field through its section's name."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            section = node.value.attr
            if node.attr in fields.get(section, ()) and not any(
                    rel.startswith(where) and section == s for where, s in SECTION_READS_ALLOWED):
                out.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_config_sections_are_read_only_by_the_loader_and_the_entry_points():
    fields = section_fields()
    assert {"rl", "sampling", "env", "sft", "dpo", "rm"} <= set(fields) and "group_size" in fields["rl"]
    found = []
    for path in sorted((ROOT / "posttrain").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(CONFIG_READERS):
            found += section_reads(path.read_text(), rel, fields)
    assert not found, "a run config's section read outside config/, recipes/ and cli/:\n" + "\n".join(found)


@pytest.mark.parametrize("planted", [
    "def f(cfg):\n    return cfg.rl.group_size\n",  # no annotation
    "def f(c: 'Config'):\n    return c.sampling.engine_pages + 1\n",
    "class A:\n    def g(self):\n        return self.plan.config.env.max_turns\n",
])
def test_a_planted_section_read_is_found(planted):
    assert section_reads(planted, "posttrain/rollout/x.py", section_fields())


def copies(source: str) -> list[str]:
    """Keyword arguments `x=<...>.<section>.x` (a field copied under its own name) of the calls that make the run
    plan or a component's settings (`RunPlan(...)`, `*Settings(...)`). Seeds are the plan's to decide (the train
    seed, the evaluation seed derived from it), so `seed=` is not a copy."""
    fields = section_fields()
    out = []
    for call in ast.walk(ast.parse(source)):
        if not isinstance(call, ast.Call):
            continue
        name = ast.unparse(call.func).rpartition(".")[2]
        if name != "RunPlan" and not name.endswith("Settings"):
            continue
        for node in call.keywords:
            v = node.value
            if isinstance(v, ast.Attribute) and node.arg == v.attr != "seed" and isinstance(v.value, ast.Attribute) \
                    and v.attr in fields.get(v.value.attr, ()):
                out.append(f"{node.lineno}: {name}({node.arg}={ast.unparse(v)})")
    return out


def test_the_plan_copies_no_config_field():
    assert not copies((ROOT / "posttrain/config/plan.py").read_text())
    assert copies("RunPlan(group_size=cfg.rl.group_size)\n") and copies("X.RolloutSettings(packed=c.rl.packed)\n")


# --- module aliases keep the module's name

def alias_problems(source: str, rel: str, modules: set[str]) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                if a.asname and f"{node.module}.{a.name}" in modules and a.name not in a.asname:
                    out.append(f"{rel}:{node.lineno}: {a.name} as {a.asname}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                leaf = a.name.rpartition(".")[2]
                if a.asname and a.name in modules and leaf not in a.asname:
                    out.append(f"{rel}:{node.lineno}: {a.name} as {a.asname}")
    return out


def test_module_aliases_keep_the_module_name():
    modules = set(library_modules())
    found = []
    for folder in ("posttrain", "envs", "tests", "bench", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            found += alias_problems(path.read_text(), path.relative_to(ROOT).as_posix(), modules)
    assert not found, "aliases that hide a module's name:\n" + "\n".join(found)
    assert alias_problems("from posttrain.recipes import grpo as loop\n", "x.py", modules)
    assert not alias_problems("from posttrain.infra import mesh as mesh_lib\n", "x.py", modules)

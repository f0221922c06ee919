"""CodebaseQA-v0: the package shown in the prompt, executed here from the prompt's text, gives every task's answer;
the generator's `run_modules` resolves imports only inside the package."""
import builtins
import re
import types

import pytest
from long_context_cases import generate

from envs.tasks.long_context import codebase

FILE_RE = re.compile(r"### File: (\S+)\.py\n```python\n(.*?)```", re.DOTALL)


def load_prompt_package(prompt):
    """{dotted path: module} of every file in the prompt, executed in an order that satisfies its imports."""
    sources = {path.replace("/", "."): src for path, src in FILE_RE.findall(prompt)}
    loaded = {}

    def importer(name, globals=None, locals=None, fromlist=(), level=0):
        if name not in loaded:
            raise ImportError(name)
        return loaded[name]

    pending = dict(sources)
    while pending:
        progressed = False
        for name, src in list(pending.items()):
            module = types.ModuleType(name)
            module.__dict__["__builtins__"] = {**vars(builtins), "__import__": importer}
            try:
                exec(src, module.__dict__)  # noqa: S102 - the generated package, trusted
            except ImportError:
                continue
            loaded[name], progressed = module, True
            del pending[name]
        assert progressed, f"unresolvable imports in {sorted(pending)[:3]}"
    return loaded


@pytest.mark.parametrize("target", [1024, 8192])
def test_running_the_prompts_code_gives_the_answer(target):
    for t in generate("codebase", 45, target):
        loaded = load_prompt_package(t["prompt"])
        if t["type"] == "call_value":
            path, arg = re.search(r"`([\w.]+)\((\d+)\)`", t["question"]).groups()
            module, fn = path.rsplit(".", 1)
            assert str(loaded[module].__dict__[fn](int(arg))) == t["answer"], t["id"]
        elif t["type"] == "reexport_value":
            module, name = re.search(r"`([\w.]+)`", t["question"]).group(1).rsplit(".", 1)
            assert str(loaded[module].__dict__[name]) == t["answer"], t["id"]
        else:
            module, fn = re.search(r"`([\w.]+)`", t["question"]).group(1).rsplit(".", 1)
            space = loaded[module].__dict__
            called = [n for n in space[fn].__code__.co_names if isinstance(space.get(n), types.FunctionType)]
            assert len(called) == 1 and space[called[0]].__module__ == t["answer"], t["id"]
            assert t["answer"].replace(".", "/") + ".py" in t["prompt"]


def test_run_modules_sees_only_the_package():
    mod = codebase.Module("pkg.core.a", imports=[("os", "path", "path")])
    with pytest.raises(ImportError, match="no module 'os'"):
        codebase.run_modules([mod])


def test_same_names_recur_across_modules():
    t = generate("codebase", 1, 8192)[0]
    names = re.findall(r"^def (\w+)\(", t["prompt"], re.MULTILINE)
    assert len(names) > len(set(names))  # shadowing and twins: a name alone does not locate a function

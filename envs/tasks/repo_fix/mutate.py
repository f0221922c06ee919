"""Mutation operators: the defects of RepoFix-v0, made by editing the canonical solution's AST (mutation testing,
DeMillo, Lipton & Sayward 1978; families as in mutmut / MutPy, listed in docs/repo_fix.md).

A `Mutation` is a text edit that must parse to exactly the mutated AST, so the rest of the file keeps its
formatting; docstrings, f-strings and annotations are never mutated. The tests decide which are defects.
"""
from __future__ import annotations

import ast
import copy
import dataclasses
import re
from collections.abc import Iterator, Sequence

OPERATORS = ("compare", "arithmetic", "off_by_one", "constant", "drop_branch", "swap_args", "wrong_variable")
_CMP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
        ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}
_ARITH = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Add, ast.Div: ast.Mult, ast.FloorDiv: ast.Div,
          ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult, ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd,
          ast.BitXor: ast.BitAnd, ast.LShift: ast.RShift, ast.RShift: ast.LShift}
_NON_COMMUTATIVE = (ast.Sub, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.LShift, ast.RShift)
_SKIP_FIELDS = {"annotation", "returns", "decorator_list", "type_comment"}
_SCOPES = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.Lambda)


@dataclasses.dataclass(frozen=True)
class Mutation:
    """One defect: replace ``text[start:end]`` (character offsets) by `replacement`; `line` is 1-based."""

    op: str
    function: str
    line: int
    start: int
    end: int
    replacement: str
    description: str

    def overlaps(self, other: Mutation) -> bool:
        return self.start < other.end and other.start < self.end


def apply(text: str, mutations: Sequence[Mutation]) -> str:
    """`text` with every mutation applied. Raises ValueError when two of them overlap."""
    ordered = sorted(mutations, key=lambda m: m.start)
    for a, b in zip(ordered, ordered[1:]):
        if a.overlaps(b):
            raise ValueError(f"mutations overlap: {a.description!r} and {b.description!r}")
    for m in reversed(ordered):
        text = text[:m.start] + m.replacement + text[m.end:]
    return text


class _Source:
    """Character offsets of AST positions (which count UTF-8 bytes within a line)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.lines = text.splitlines(keepends=True)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def offset(self, lineno: int, col_bytes: int) -> int:
        line = self.lines[lineno - 1]
        return self.starts[lineno - 1] + len(line.encode()[:col_bytes].decode(errors="replace"))

    def span(self, node: ast.AST) -> tuple[int, int]:
        return self.offset(node.lineno, node.col_offset), self.offset(node.end_lineno, node.end_col_offset)

    def segment(self, node: ast.AST) -> str:
        start, end = self.span(node)
        return self.text[start:end]


def _walk(node: ast.AST, path: tuple = ()) -> Iterator[tuple[tuple, ast.AST]]:
    """(path, node) of `node` and its descendants, skipping annotations, decorators and f-strings."""
    yield path, node
    if isinstance(node, ast.JoinedStr):
        return
    for field, value in ast.iter_fields(node):
        if field in _SKIP_FIELDS:
            continue
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for i, item in items:
            if isinstance(item, ast.AST):
                yield from _walk(item, path + ((field, i),))


def _at(tree: ast.AST, path: tuple) -> ast.AST:
    for field, i in path:
        tree = getattr(tree, field) if i is None else getattr(tree, field)[i]
    return tree


def _dump_replaced(tree: ast.Module, path: tuple, new: ast.AST | None) -> str:
    """`ast.dump` of `tree` with the node at `path` replaced by `new` (None: deleted from its list, or Pass when
    it was alone there); `tree` itself is restored before returning."""
    parent, (field, i) = _at(tree, path[:-1]), path[-1]
    if i is None:
        old = getattr(parent, field)
        setattr(parent, field, new)
        try:
            return ast.dump(tree)
        finally:
            setattr(parent, field, old)
    items = getattr(parent, field)
    old, delete = items[i], new is None and len(items) > 1
    if delete:
        del items[i]
    else:
        items[i] = new if new is not None else ast.Pass()
    try:
        return ast.dump(tree)
    finally:
        if delete:
            items.insert(i, old)
        else:
            items[i] = old


def _int_node(value: int) -> ast.expr:
    return ast.Constant(value) if value >= 0 else ast.UnaryOp(ast.USub(), ast.Constant(-value))


def _int_value(node: ast.AST) -> int | None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant) \
            and type(node.operand.value) is int:
        return -node.operand.value
    return None


def _nudges(expr: ast.expr) -> list[ast.expr]:
    """`expr` moved by +1 and -1: ``n`` -> ``n + 1``, ``n - 1`` -> ``n - 2`` / ``n``, ``3`` -> ``4`` / ``2``."""
    value = _int_value(expr)
    if value is not None:
        return [_int_node(value + 1), _int_node(value - 1)]
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, (ast.Add, ast.Sub)) and _int_value(expr.right) is not None:
        offset = _int_value(expr.right) * (1 if isinstance(expr.op, ast.Add) else -1)
        out = []
        for k in (offset + 1, offset - 1):
            out.append(expr.left if k == 0 else ast.BinOp(expr.left, ast.Add() if k > 0 else ast.Sub(),
                                                          ast.Constant(abs(k))))
        return out
    return [ast.BinOp(expr, ast.Add(), ast.Constant(1)), ast.BinOp(expr, ast.Sub(), ast.Constant(1))]


def _locals(fn: ast.FunctionDef) -> list[str]:
    """Parameters and names assigned in `fn` outside comprehensions and lambdas, sorted."""
    names = {a.arg for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]}
    stack = list(fn.body)
    while stack:
        node = stack.pop()
        if isinstance(node, _SCOPES):
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        stack.extend(ast.iter_child_nodes(node))
    return sorted(names)


_SYMBOLS = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=", ast.In: "in",
            ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not", ast.Add: "+", ast.Sub: "-", ast.Mult: "*",
            ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**", ast.BitAnd: "&", ast.BitOr: "|",
            ast.BitXor: "^", ast.LShift: "<<", ast.RShift: ">>"}


@dataclasses.dataclass
class _Proposal:
    op: str
    path: tuple            # of the node replaced (or deleted: new is None)
    new: ast.AST | None
    edits: list[tuple[int, int, str]]  # text edits to try, in order; re-rendering the node is tried last


def _op_edit(src: _Source, before: ast.AST, after: ast.AST, old_op: type, new_op: type) -> list[tuple[int, int, str]]:
    """The edit of the operator token between two operands, when the gap holds just that token."""
    start, end = src.span(before)[1], src.span(after)[0]
    gap = src.text[start:end]
    core = re.sub(r"\s+", " ", gap.strip(" \t\n()\\"))
    if core.rstrip("=") != _SYMBOLS[old_op].rstrip("=") and core != _SYMBOLS[old_op] + "=":
        return []
    symbol = _SYMBOLS[new_op] + ("=" if core.endswith("=") and core != _SYMBOLS[old_op] else "")
    return [(start, end, gap.replace(core, symbol, 1))] if gap.count(core) == 1 else []


def _swap_edit(src: _Source, a: ast.AST, b: ast.AST) -> list[tuple[int, int, str]]:
    (s0, e0), (s1, e1) = src.span(a), src.span(b)
    return [(s0, e1, src.text[s1:e1] + src.text[e0:s1] + src.text[s0:e0])]


def _child(src: _Source, path: tuple, child: ast.AST, field: str, i: int | None, op: str,
           new: ast.expr) -> _Proposal:
    start, end = src.span(child)
    text = ast.unparse(new)
    return _Proposal(op, path + ((field, i),), new, [(start, end, text), (start, end, f"({text})")])


def _expression_proposals(src: _Source, path: tuple, node: ast.AST, local_names: list[str]) -> list[_Proposal]:
    out = []
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            if type(op) in _CMP:
                new = copy.deepcopy(node)
                new.ops[i] = _CMP[type(op)]()
                left = node.left if i == 0 else node.comparators[i - 1]
                out.append(_Proposal("compare", path, new, _op_edit(src, left, node.comparators[i], type(op),
                                                                       _CMP[type(op)])))
    if isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in _ARITH:
        new, new_op = copy.deepcopy(node), _ARITH[type(node.op)]
        new.op = new_op()
        left, right = (node.left, node.right) if isinstance(node, ast.BinOp) else (node.target, node.value)
        out.append(_Proposal("arithmetic", path, new, _op_edit(src, left, right, type(node.op), new_op)))
    if isinstance(node, ast.BinOp) and isinstance(node.op, _NON_COMMUTATIVE) \
            and ast.unparse(node.left) != ast.unparse(node.right):
        new = ast.BinOp(node.right, node.op, node.left)
        out.append(_Proposal("swap_args", path, new, _swap_edit(src, node.left, node.right)))
    if isinstance(node, ast.Call):
        positional = [a for a in node.args if not isinstance(a, ast.Starred)]
        if len(positional) == len(node.args) >= 2 and ast.unparse(node.args[0]) != ast.unparse(node.args[1]):
            new = copy.deepcopy(node)
            new.args[0], new.args[1] = new.args[1], new.args[0]
            out.append(_Proposal("swap_args", path, new, _swap_edit(src, node.args[0], node.args[1])))
        if isinstance(node.func, ast.Name) and node.func.id == "range":
            for i, arg in enumerate(node.args):
                out += [_child(src, path, arg, "args", i, "off_by_one", n) for n in _nudges(arg)]
    if isinstance(node, ast.Slice):
        for field in ("lower", "upper"):
            bound = getattr(node, field)
            if bound is not None:
                out += [_child(src, path, bound, field, None, "off_by_one", n) for n in _nudges(bound)]
    if isinstance(node, ast.Subscript) and _int_value(node.slice) is not None:
        out += [_child(src, path, node.slice, "slice", None, "off_by_one", n) for n in _nudges(node.slice)]
    value = _int_value(node)
    if value is not None and not (isinstance(node, ast.Constant) and _int_value(node) < 0):
        for new_value in ([1] if value == 0 else [value + 1, value - 1]):
            out.append(_Proposal("constant", path, _int_node(new_value), []))
    if isinstance(node, ast.Constant) and type(node.value) is bool:
        out.append(_Proposal("constant", path, ast.Constant(not node.value), []))
    if isinstance(node, ast.Constant) and type(node.value) is str and len(node.value) < 40:
        out.append(_Proposal("constant", path, ast.Constant(node.value[:-1] if node.value else " "), []))
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in local_names:
        others = [n for n in local_names if n != node.id]
        k = local_names.index(node.id)
        for name in dict.fromkeys(others[(k + d) % len(others)] for d in (0, -1)) if others else ():
            out.append(_Proposal("wrong_variable", path, ast.Name(name, ast.Load()), []))
    return out


def _branch_proposals(src: _Source, tree: ast.Module, path: tuple, node: ast.If) -> list[_Proposal]:
    if node.orelse:
        new = copy.deepcopy(node)
        new.orelse = []
        return [_Proposal("drop_branch", path, new, [(src.span(node.body[-1])[1], src.span(node)[1], "")])]
    field, i = path[-1]
    if len(getattr(_at(tree, path[:-1]), field)) == 1:
        return [_Proposal("drop_branch", path, None, [(*src.span(node), "pass")])]
    start, end = src.starts[node.lineno - 1], src.starts[node.end_lineno]
    start_node, end_node = src.span(node)
    if src.text[start:start_node].strip() or src.text[end_node:end].strip():
        return []
    return [_Proposal("drop_branch", path, None, [(start, end, "")])]


def _realise(src: _Source, tree: ast.Module, fn: str, proposal: _Proposal) -> Mutation | None:
    """The first edit of `proposal` whose result parses to the mutated AST (re-rendering the node tried last)."""
    expected = _dump_replaced(tree, proposal.path, proposal.new)
    node = _at(tree, proposal.path)
    edits = list(proposal.edits)
    if proposal.new is not None and isinstance(node, ast.expr) == isinstance(proposal.new, ast.expr):
        start, end = src.span(node)
        rendered = ast.unparse(proposal.new).replace("\n", "\n" + " " * node.col_offset)
        edits += [(start, end, rendered)] + ([(start, end, f"({rendered})")] if isinstance(node, ast.expr) else [])
    for start, end, text in edits:
        candidate = src.text[:start] + text + src.text[end:]
        try:
            if ast.dump(ast.parse(candidate)) != expected:
                continue
        except SyntaxError:
            continue
        old = " ".join(src.text[start:end].split()) or "(nothing)"
        line = src.text.count("\n", 0, start) + 1
        return Mutation(proposal.op, fn, line, start, end, text,
                        f"{proposal.op} in {fn}, line {line}: `{old[:60]}` -> `{' '.join(text.split())[:60]}`")
    return None


def enumerate_mutations(text: str, functions: Sequence[str]) -> list[Mutation]:
    """Every verified single mutation of the bodies of `functions` (top-level defs of `text`), in source order.

    One per distinct mutated text. Raises ValueError when a name is not a top-level function of `text`."""
    src, tree = _Source(text), ast.parse(text)
    defs = {node.name: (i, node) for i, node in enumerate(tree.body) if isinstance(node, ast.FunctionDef)}
    missing = [f for f in functions if f not in defs]
    if missing:
        raise ValueError(f"enumerate_mutations: no top-level function(s) {missing}; functions are {sorted(defs)}")
    seen, out = {text}, []
    for name in functions:
        index, fn = defs[name]
        body = fn.body[1:] if ast.get_docstring(fn) is not None else fn.body
        first = len(fn.body) - len(body)
        local_names = _locals(fn)
        for k, stmt in enumerate(body):
            for path, node in _walk(stmt, (("body", index), ("body", first + k))):
                proposals = _expression_proposals(src, path, node, local_names)
                if isinstance(node, ast.If):
                    proposals += _branch_proposals(src, tree, path, node)
                for proposal in proposals:
                    mutation = _realise(src, tree, name, proposal)
                    if mutation is not None and apply(text, [mutation]) not in seen:
                        seen.add(apply(text, [mutation]))
                        out.append(mutation)
    return sorted(out, key=lambda m: (m.start, m.end, m.op))

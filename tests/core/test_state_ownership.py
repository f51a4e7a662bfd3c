"""TierState is the one owner of the tier state: no other module changes it behind its back.

The tier state is mmcache/core/state.py (TierState, its verbs) with the parts it owns:
mmcache/core/room.py (which entries leave for room), mmcache/core/in_flight.py (the
offloads in flight), and the admission filter's sketch,
mmcache/core/admission.py (uses per key, folded from Entry.hits). An AST walk over every
other module of mmcache/ reports:

(a) an assignment (`=`, an augmented one, `del`, `setattr`) to `X.field` where X is not
    `self` and X is an Entry, a TierLedger or the TierState, and field is one of theirs:
    an Entry's dataclass fields, a TierLedger's __slots__, the TierState's public
    attributes (those its own methods assign);
(b) a call `X.method(...)` where X is not `self` and method is an Entry transition
    (begin_offload, land, end_offload, promote, discard, take_block, add_members,
    member_left, drop_members) with X an Entry, or a TierLedger mutator (grant,
    return_grant, take_if_free, insert, promote, release, release_later, released,
    offloading, offloaded, gpu_left, host_entered, host_left) with X a TierLedger;
    and a change of the KeyIndex (`X[...] = `, `del X[...]`, forget, leave, add_group,
    or a dict method that changes it) or of an order of victims (`gpu_order` /
    `host_order`: `X[...] = `, `del X[...]`, pop, evict, clear, ...) with X one of them.

What X is, is worked out without running anything, in this order:
- `self` itself is never reported: a part changes its own fields (Entry in entry.py,
  TierLedger in ledger.py, KeyIndex in index.py, the Grants, the Quarantine, the
  policies, the HostPool).
- an annotation wins: a parameter or variable annotated `Entry`, `TierLedger`,
  `TierState`, `KeyIndex` or `EvictionPolicy` (or `... | None`) is one, an element of a
  `list[Entry]` / `Sequence[Entry]` ... is an Entry, and one annotated with any other
  type is none of them (`state: State`, an IPC `_ledger: LeaseLedger`);
- a binding: `x = TierLedger(...)`, `self._ledger = state.ledger`, `self._entries =
  core.index` (an attribute of the class takes the kind of what its methods assign it);
  `state.ledger`, `.index`, `.gpu_order`, `.host_order` of a TierState are its parts;
- names, in the modules that import mmcache.core (or lie in it) and only there:
  `entry`, `group`, `victim`, `e`, `old` are Entries; `ledger`, `state`, `index` (and
  `_ledger`, `_state`, `_index`) the TierLedger, the TierState, the KeyIndex; an
  attribute `.ledger`, `.state`, `.index`, `.group`, `.gpu_order`, `.host_order` (and
  their `_` forms) of anything but an Entry likewise (an Entry's `.state` is its State);
- of an X whose kind is still unknown, only a field or method no other class in
  mmcache/ has (`copy_fence`, `begin_offload`, `gpu_left`, `on_host_evict`, ...) is
  reported: `grant.nbytes = ` or `device.release(t)` are not the state's.

KNOWN lists what the walk finds today, each with why it is left: the test fails on
anything new, and on a known one that is gone (take it off the list).
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import mmcache
from mmcache.core.entry import Entry
from mmcache.core.ledger import TierLedger

ROOT = Path(mmcache.__file__).parent
OWNER = "core/state.py"
#: the modules of the tier state: the TierState's, its planner's, its admission filter's
OWNERS = frozenset({OWNER, "core/room.py", "core/in_flight.py", "core/admission.py"})

ENTRY, LEDGER, STATE, INDEX, ORDER = "Entry", "TierLedger", "TierState", "KeyIndex", "order"
OWNED_CLASSES = {"Entry": ENTRY, "TierLedger": LEDGER, "TierState": STATE, "KeyIndex": INDEX}
#: annotations that name one of them (EvictionPolicy: an order of victims)
TYPE_KINDS = {**OWNED_CLASSES, "EvictionPolicy": ORDER}

ENTRY_TRANSITIONS = frozenset(
    {
        "begin_offload",
        "land",
        "end_offload",
        "promote",
        "discard",
        "take_block",
        "add_members",
        "member_left",
        "drop_members",
        "keep_copy",
        "move_block",
    }
)
LEDGER_MUTATORS = frozenset(
    {
        "grant",
        "return_grant",
        "take_if_free",
        "insert",
        "promote",
        "release",
        "release_later",
        "released",
        "offloading",
        "offloaded",
        "overdue",
        "gpu_left",
        "host_entered",
        "host_left",
    }
)
DICT_MUTATORS = frozenset(
    {"pop", "popitem", "clear", "update", "setdefault", "__setitem__", "__delitem__"}
)
INDEX_MUTATORS = DICT_MUTATORS | {"forget", "leave", "add_group"}
ORDER_MUTATORS = DICT_MUTATORS | {"evict"}
MUTATORS = {
    ENTRY: ENTRY_TRANSITIONS,
    LEDGER: LEDGER_MUTATORS,
    INDEX: INDEX_MUTATORS,
    ORDER: ORDER_MUTATORS,
}

#: by convention, in the modules that import mmcache.core
NAME_KINDS = {
    **dict.fromkeys(["entry", "group", "victim", "e", "old"], ENTRY),
    **dict.fromkeys(["ledger", "_ledger"], LEDGER),
    **dict.fromkeys(["state", "_state"], STATE),
    **dict.fromkeys(["index", "_index"], INDEX),
}
ATTR_KINDS = {
    **{k: v for k, v in NAME_KINDS.items() if v != ENTRY},
    "group": ENTRY,
    **dict.fromkeys(["gpu_order", "host_order", "_gpu_order", "_host_order"], ORDER),
}
#: the TierState's parts, by attribute
STATE_PARTS = {"ledger": LEDGER, "index": INDEX, "gpu_order": ORDER, "host_order": ORDER}

#: What the walk finds in today's tree, and why each is left for now.
KNOWN = {
    # KeyIndex makes a group's members and forgets them: the member transitions are
    # called from the index, which only TierState calls.
    "core/index.py: calls Entry.add_members on group",
    "core/index.py: calls Entry.member_left on member.group",
    "core/index.py: calls Entry.drop_members on entry",
    # A read counts a use for the admission filter in a field, with no call on its hot
    # path; the state folds the count into its sketch when it compares entries.
    "core/batch_reads.py: assigns Entry.hits of entry",
    "core/reads.py: assigns Entry.hits of entry",
    # A read notes the stream it marked the entry's block used on (record_stream), with
    # no call on its hot path: the allocator's bookkeeping, not the tier state.
    "core/batch_reads.py: assigns Entry.used_on of entry",
    "core/reads.py: assigns Entry.used_on of entry",
    # Entry records a reader stream on a batch's entries in one call: its own field,
    # reader bookkeeping, no transition.
    "core/entry.py: assigns Entry.host_streams of entry",
}


def _targets(node: ast.AST) -> list[ast.expr]:
    """What an assignment or a del writes, tuples unpacked."""
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, ast.AugAssign | ast.AnnAssign):
        found = [node.target]
    elif isinstance(node, ast.Delete):
        found = list(node.targets)
    else:
        return []
    out = []
    while found:
        target = found.pop()
        if isinstance(target, ast.Tuple | ast.List):
            found.extend(target.elts)
        elif isinstance(target, ast.Starred):
            found.append(target.value)
        else:
            out.append(target)
    return out


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _state_fields() -> frozenset[str]:
    """The TierState's public attributes: those its own methods assign to self."""
    tree = ast.parse((ROOT / OWNER).read_text())
    fields = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "TierState":
            for sub in ast.walk(node):
                for target in _targets(sub):
                    if (
                        isinstance(target, ast.Attribute)
                        and _is_self(target.value)
                        and not target.attr.startswith("_")
                    ):
                        fields.add(target.attr)
    assert fields, "TierState assigns no public attribute: has it moved?"
    return frozenset(fields)


FIELDS = {
    ENTRY: frozenset(f.name for f in dataclasses.fields(Entry)),
    LEDGER: frozenset(TierLedger.__slots__),
    STATE: _state_fields(),
}


def _names_in_other_classes(trees: list[ast.Module]) -> frozenset[str]:
    """Every field and method name of a class in mmcache/ other than the owned ones."""
    names: set[str] = set()
    for tree in trees:
        for cls in ast.walk(tree):
            if not isinstance(cls, ast.ClassDef) or cls.name in OWNED_CLASSES.keys() - {STATE}:
                continue
            if cls.name == STATE:  # its verbs are there to be called; its fields are owned
                names.update(n.name for n in cls.body if isinstance(n, ast.FunctionDef))
                continue
            for node in ast.walk(cls):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.add(node.name)
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    names.add(node.target.id)
                for target in _targets(node):
                    if isinstance(target, ast.Attribute) and _is_self(target.value):
                        names.add(target.attr)
                    elif isinstance(target, ast.Name):
                        names.add(target.id)
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    names.add(node.value)  # __slots__ and namedtuple fields
    return frozenset(names)


def _annotation_kind(annotation: ast.expr | None) -> tuple[bool, str | None, str | None]:
    """(annotated, kind of the value, kind of its elements) from an annotation."""
    if annotation is None:
        return False, None, None
    text = ast.unparse(annotation).replace('"', "").replace("'", "")
    parts = [p.strip() for p in text.split("|") if p.strip() != "None"]
    if len(parts) == 1 and parts[0] in TYPE_KINDS:
        return True, TYPE_KINDS[parts[0]], None
    m = re.fullmatch(
        r"(?:list|Sequence|Iterable|Iterator|set|frozenset|tuple)\[(\w+)(?:, \.\.\.)?\]", text
    )
    if m and m.group(1) in TYPE_KINDS:
        return True, None, TYPE_KINDS[m.group(1)]
    return True, None, None


class _Kinds:
    """What a name or attribute is (one of the kinds, or None) in one function of a module."""

    def __init__(self, conventions: bool, attrs: dict[str, str | None]) -> None:
        self.conventions = conventions
        self.attrs = attrs  # self.<attr> -> kind (None: known to be none of them)
        self.names: dict[str, str | None] = {}  # annotated or bound locals
        self.elements: dict[str, str] = {}  # locals holding a collection of that kind

    def bind_function(self, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        args = fn.args
        for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
            annotated, kind, element = _annotation_kind(arg.annotation)
            if annotated:
                self.names[arg.arg] = kind
            if element:
                self.elements[arg.arg] = element
        for node in ast.walk(fn):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                annotated, kind, element = _annotation_kind(node.annotation)
                self.names[node.target.id] = kind
                if element:
                    self.elements[node.target.id] = element
            elif isinstance(node, ast.Assign) and len(node.targets) == 1:
                self._bind(node.targets[0], node.value)
            elif isinstance(node, ast.For | ast.AsyncFor | ast.comprehension):
                source = node.iter
                if isinstance(node.target, ast.Name) and isinstance(source, ast.Name):
                    element = self.elements.get(source.id)
                    if element and node.target.id not in self.names:
                        self.names[node.target.id] = element

    def _bind(self, target: ast.expr, value: ast.expr) -> None:
        if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
            for t, v in zip(target.elts, value.elts, strict=False):
                self._bind(t, v)
        elif isinstance(target, ast.Name) and target.id not in self.names:
            kind = self.of(value)
            if kind is not None:
                self.names[target.id] = kind

    def of(self, node: ast.expr) -> str | None:
        """The kind of node, or None where it is none of them or cannot be told."""
        if isinstance(node, ast.Name):
            if node.id in self.names:
                return self.names[node.id]
            return NAME_KINDS.get(node.id) if self.conventions else None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            return OWNED_CLASSES.get(node.func.id)
        if isinstance(node, ast.Attribute):
            if _is_self(node.value) and node.attr in self.attrs:
                return self.attrs[node.attr]
            owner = self.of(node.value)
            if owner == STATE and node.attr in STATE_PARTS:
                return STATE_PARTS[node.attr]
            if self.conventions and owner != ENTRY:
                return ATTR_KINDS.get(node.attr)
        return None


def _class_attrs(cls: ast.ClassDef, conventions: bool) -> dict[str, str | None]:
    """self.<attr> -> its kind, from the class's annotations and its methods' assignments."""
    attrs: dict[str, str | None] = {}
    for item in cls.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            attrs[item.target.id] = _annotation_kind(item.annotation)[1]
    methods = [n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    methods.sort(key=lambda m: m.name != "__init__")
    for method in methods:
        kinds = _Kinds(conventions, attrs)
        kinds.bind_function(method)
        for node in ast.walk(method):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Attribute):
                if _is_self(node.target.value):
                    attrs[node.target.attr] = _annotation_kind(node.annotation)[1]
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    pairs = (
                        zip(target.elts, node.value.elts, strict=False)
                        if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple)
                        else [(target, node.value)]
                    )
                    for t, v in pairs:
                        if (
                            isinstance(t, ast.Attribute)
                            and _is_self(t.value)
                            and t.attr not in attrs
                        ):
                            kind = kinds.of(v)
                            if kind is not None:
                                attrs[t.attr] = kind
    return attrs


def _imports_core(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mmcache.core"):
            return True
        if isinstance(node, ast.Import) and any(
            a.name.startswith("mmcache.core") for a in node.names
        ):
            return True
    return False


def violations(source: str, path: str, distinct: frozenset[str]) -> dict[str, list[int]]:
    """What module path (relative to mmcache/) changes of the tier state outside its owner,
    each with the lines it does so on."""
    if path in OWNERS:
        return {}
    tree = ast.parse(source)
    conventions = path.startswith("core/") or _imports_core(tree)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    class_attrs = {
        cls: _class_attrs(cls, conventions)
        for cls in ast.walk(tree)
        if isinstance(cls, ast.ClassDef)
    }
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    # Innermost first (a nested function is smaller than its outer one): a node is
    # reported once, with the names of the innermost function around it.
    functions.sort(key=lambda fn: len(list(ast.walk(fn))))
    found: dict[str, list[int]] = {}
    seen: set[ast.AST] = set()
    for scope in [*functions, tree]:
        outer: list[ast.FunctionDef | ast.AsyncFunctionDef] = []
        attrs: dict[str, str | None] = {}
        node: ast.AST = scope
        while node in parents:
            node = parents[node]
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                outer.append(node)
            elif isinstance(node, ast.ClassDef):
                attrs = class_attrs[node]
                break
        kinds = _Kinds(conventions, attrs)
        for fn in [*reversed(outer), scope]:
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                kinds.bind_function(fn)
        for sub in ast.walk(scope):
            if sub in seen:
                continue
            seen.add(sub)
            report = _check(sub, kinds, distinct)
            if report is not None:
                found.setdefault(f"{path}: {report}", []).append(getattr(sub, "lineno", 0))
    return found


def _check(node: ast.AST, kinds: _Kinds, distinct: frozenset[str]) -> str | None:
    """What node changes of the tier state, if anything."""
    writes: list[tuple[ast.expr, str]] = []
    for target in _targets(node):
        if isinstance(target, ast.Attribute):
            writes.append((target.value, target.attr))
        elif isinstance(target, ast.Subscript):
            kind = kinds.of(target.value)
            if kind in (INDEX, ORDER):
                return f"changes the {kind} {ast.unparse(target.value)}[...]"
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "setattr"
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ):
        writes.append((node.args[0], node.args[1].value))
    for receiver, attr in writes:
        if _is_self(receiver):
            continue
        kind = kinds.of(receiver)
        if kind in FIELDS and attr in FIELDS[kind]:
            return f"assigns {kind}.{attr} of {ast.unparse(receiver)}"
        if kind is None and attr in distinct:
            return f"assigns .{attr} of {ast.unparse(receiver)}"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        receiver, method = node.func.value, node.func.attr
        if _is_self(receiver):
            return None
        kind = kinds.of(receiver)
        if kind in MUTATORS and method in MUTATORS[kind]:
            name = kind if kind != ORDER else "the order"
            return f"calls {name}.{method} on {ast.unparse(receiver)}"
        if kind is None and method in distinct:
            return f"calls .{method} on {ast.unparse(receiver)}"
    return None


def _modules() -> list[tuple[str, str]]:
    return [
        (path.relative_to(ROOT).as_posix(), path.read_text()) for path in sorted(ROOT.rglob("*.py"))
    ]


def _distinct(modules: list[tuple[str, str]]) -> frozenset[str]:
    """The owned fields and mutators no other class in mmcache/ has a name for."""
    others = _names_in_other_classes([ast.parse(source) for _, source in modules])
    owned = set().union(*FIELDS.values(), ENTRY_TRANSITIONS, LEDGER_MUTATORS, {"forget", "leave"})
    owned |= {"add_group", "gpu_order", "host_order"}
    return frozenset(owned - others)


MODULES = _modules()
DISTINCT = _distinct(MODULES)


def test_only_the_tier_state_changes_the_tier_state() -> None:
    found: dict[str, list[int]] = {}
    for path, source in MODULES:
        found.update(violations(source, path, DISTINCT))
    new = [f"{what} (lines {found[what]})" for what in sorted(found.keys() - KNOWN)]
    assert new == [], "a module changes the tier state behind TierState"
    assert sorted(KNOWN - found.keys()) == [], "fixed: take these off KNOWN"


def test_the_walk_sees_the_modules_and_the_names_it_needs() -> None:
    assert len(MODULES) > 50 and any(path == OWNER for path, _ in MODULES)
    assert {"state", "copy_fence", "count"} <= FIELDS[ENTRY]
    assert {"used", "releasing"} <= FIELDS[LEDGER]
    assert {"ledger", "index", "gpu_order", "on_host_evict"} <= FIELDS[STATE]
    # Distinct names are those no other class has: nbytes is a Grant's too, release a
    # Device's, discard FeatureCache's, grant a FifoBudget's and a TierState verb.
    assert {"copy_fence", "begin_offload", "gpu_left", "on_host_evict"} <= DISTINCT
    assert not {"nbytes", "release", "discard", "grant", "count", "state"} & DISTINCT


BROKEN = """
from mmcache.core.entry import Entry
from mmcache.core.state import TierState


class Part:
    def __init__(self, state: TierState) -> None:
        self._state = state
        self._ledger = state.ledger
        self._index = state.index
        self._order = state.gpu_order

    def go(self, entry: Entry, key: object, victims: list[Entry]) -> None:
        entry.state = None
        entry.count -= 1
        self._ledger.used += 8
        self._state.pool = None
        self._ledger.gpu_left(1)
        entry.discard()
        self._index[key] = entry
        del self._index[key]
        self._index.forget(entry)
        self._order.pop(key)
        self._state.host_order[key] = entry
        setattr(entry, "tensor", None)
        for victim in victims:
            victim.land(None)


def elsewhere(thing: object, other) -> None:
    thing.copy_fence = None
    other.begin_offload(None, None)
"""

FINE = """
from mmcache.core.entry import Entry, State
from mmcache.core.state import TierState


class Part:
    def __init__(self, state: TierState, device: object) -> None:
        self._state = state
        self._device = device
        self.ledger = None
        self.count = 0

    def go(self, entry: Entry, grant: object, state: State, calls: set[object]) -> None:
        self.count += 1
        grant.nbytes = 8
        self._device.release(entry.tensor)
        self._state.grant(grant, 8)
        self._state.released(8)
        self._state.gpu_order.touch(entry.key)
        entry.add_host_reader(None)
        calls.discard(entry)
        state.value
"""


def test_the_walk_reports_each_kind_of_change_and_nothing_else() -> None:
    got = violations(BROKEN, "core/part.py", DISTINCT)
    assert got["core/part.py: changes the KeyIndex self._index[...]"] == [20, 21]
    assert sorted(got) == sorted(
        f"core/part.py: {v}"
        for v in [
            "assigns Entry.state of entry",
            "assigns Entry.count of entry",
            "assigns TierLedger.used of self._ledger",
            "assigns TierState.pool of self._state",
            "calls TierLedger.gpu_left on self._ledger",
            "calls Entry.discard on entry",
            "changes the KeyIndex self._index[...]",
            "calls KeyIndex.forget on self._index",
            "calls the order.pop on self._order",
            "changes the order self._state.host_order[...]",
            "assigns Entry.tensor of entry",
            "calls Entry.land on victim",
            "assigns .copy_fence of thing",
            "calls .begin_offload on other",
        ]
    )
    assert violations(FINE, "core/part.py", DISTINCT) == {}
    assert violations(BROKEN, OWNER, DISTINCT) == {}  # the owner itself

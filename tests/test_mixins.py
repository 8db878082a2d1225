"""Every mixin's declarations of its host class hold: the relay's cores, store and shells and the
diloco role are built from mixins (relay/failures.py, relay/role_store.py, ...,
trainer/diloco_catchup.py) that declare what they use of the class they are mixed into, methods
under `if TYPE_CHECKING:` and attributes as bare annotations. mypy checks a declaration against
its uses and a re-typed method against the host's, but not that the host still has the name: a
method or attribute the host renames keeps its old name in the mixin's declaration, and mypy is
content (tests/test_typing.py). Here each declared method must be a real attribute of every class
the mixin is mixed into, and each declared attribute must be assigned (`self.name = ...`) or
defined somewhere in that class's own code or its other bases'. What only uses the name does not
count: `self.name += 1`, `self.name[k] = v` or `self.name.x = v` needs it to be there already, and a
mixin that declares the name as its host's is not where it is set, even if it reassigns it.

The mixins and their hosts are found by reading the packages' source (a class whose body holds
`if TYPE_CHECKING:` with methods in it; a class naming it as a base), so a new mixin is covered
without a line here; the hosts are then imported and checked as they are at run time."""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# the project's packages, as installed (`[tool.setuptools.packages.find]`): one added there is read here too
PACKAGES = tuple(name.rstrip("*") for name in tomllib.loads((REPO / "pyproject.toml").read_text())
                 ["tool"]["setuptools"]["packages"]["find"]["include"])


def _is_type_checking(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _mixins() -> list[tuple[str, str, list[str], list[str], list[tuple[str, str]]]]:
    """(module, class, declared methods, declared attributes, hosts as (module, class)) for every
    class whose body declares methods under `if TYPE_CHECKING:`."""
    declared: dict[tuple[str, str], tuple[list[str], list[str]]] = {}
    bases: list[tuple[str, str, set[str]]] = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.ClassDef):
                    continue
                # by its last name: `class Host(serving_shell.ChunkServing)` names ChunkServing too
                bases.append((module, node.name, {ast.unparse(b).split(".")[-1] for b in node.bases}))
                methods = [s.name for stmt in node.body if _is_type_checking(stmt) for s in stmt.body
                           if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))]
                if methods:
                    attributes = [s.target.id for s in node.body
                                  if isinstance(s, ast.AnnAssign) and s.value is None and isinstance(s.target, ast.Name)]
                    declared[(module, node.name)] = (methods, attributes)
    return [(module, name, methods, attributes,
             [(m, c) for m, c, names in bases if name in names and (m, c) != (module, name)])
            for (module, name), (methods, attributes) in sorted(declared.items())]


def _set_in(cls: type, declared: dict[tuple[str, str], list[str]]) -> set[str]:
    """Names `cls` and its project bases assign on `self` in any method (`self.a = ...`,
    `self.a, self.b = ...`, `self.a: T = ...`) or define in the class body, leaving out what each
    mixin among them declares of its host (`declared`, by (module, class))."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] not in PACKAGES:
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        own: set[str] = set()
        for node in ast.walk(tree):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets = [node.target]
            while targets:
                target = targets.pop()
                if isinstance(target, (ast.Tuple, ast.List)):
                    targets.extend(target.elts)
                elif isinstance(target, ast.Starred):
                    targets.append(target.value)
                elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                    own.add(target.attr)
        own.update(k for k in vars(klass) if not k.startswith("__"))  # (a bare annotation is not in `vars`)
        names |= own - set(declared.get((klass.__module__, klass.__name__), ()))
    return names


MIXINS = _mixins()
DECLARED = {(module, name): attributes for module, name, _, attributes, _ in MIXINS}


def test_the_mixins_are_found():
    found = {name for _, name, *_ in MIXINS}
    assert {"StoreSide", "ChunkServing", "SourceChoice", "DilocoServing", "CatchingUp"} <= found, found
    assert all(hosts for *_, hosts in MIXINS), [name for _, name, _, _, hosts in MIXINS if not hosts]


@pytest.mark.parametrize("module, name, methods, attributes, hosts", MIXINS, ids=[m[1] for m in MIXINS])
def test_what_a_mixin_declares_of_its_host_is_there(module, name, methods, attributes, hosts):
    mixin = getattr(importlib.import_module(module), name)
    for host_module, host_name in hosts:
        host = getattr(importlib.import_module(host_module), host_name)
        assert issubclass(host, mixin)
        missing = [m for m in methods if not hasattr(host, m)]  # a method, or a property
        assert not missing, f"{name} calls {missing} on {host_name}, which has no such method"
        set_by_host = _set_in(host, DECLARED)  # parses the host's classes: once per host, not per attribute
        unset = [a for a in attributes if a not in set_by_host]
        assert not unset, f"{name} uses {unset} of {host_name}, which never sets them"

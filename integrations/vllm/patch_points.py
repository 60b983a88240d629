"""A patch point: one named place in vLLM that the plugin changes, and why.

Each supported vLLM version lists its patch points in its own ``patches_<version>.py``.
``check`` proves every point exists before anything is changed, so a vLLM release that
moved one fails at start-up with the point's dotted path, not later with an AttributeError.
"""

import ast
import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple


class VllmPatchError(RuntimeError):
    """The installed vLLM cannot take the uccl plugin: unsupported version or a missing patch point."""


@dataclass(frozen=True)
class PatchPoint:
    #: ``package.module:Qualified.name`` (the object the patch replaces or edits).
    path: str
    #: Why the plugin touches it, for people reading the error or the code.
    reason: str
    #: Applies the patch, given the resolved owner object and the attribute name; None for a point
    #: that is only used (subclassed, read), not changed.
    apply: Optional[Callable[[Any, str], None]] = None
    #: Extra check on the resolved value (e.g. "is a property"); returns a problem or None.
    expect: Optional[Callable[[Any], Optional[str]]] = None

    @property
    def module(self) -> str:
        return self.path.split(":", 1)[0]

    @property
    def attribute_path(self) -> List[str]:
        return self.path.split(":", 1)[1].split(".")


def resolve(path: str) -> Tuple[Any, str, Any]:
    """``(owner, attribute name, current value)`` for ``module:a.b.c``; raises LookupError naming the missing part."""
    module_name, _, attributes = path.partition(":")
    try:
        owner = importlib.import_module(module_name)
    except ImportError as error:
        raise LookupError(f"module {module_name} cannot be imported ({error})") from None
    parts = attributes.split(".")
    for depth, part in enumerate(parts[:-1]):
        owner = _lookup(owner, part, module_name, parts[:depth + 1])
    return owner, parts[-1], _lookup(owner, parts[-1], module_name, parts)


def _lookup(owner: Any, name: str, module_name: str, walked: List[str]) -> Any:
    if isinstance(owner, dict):
        if name in owner:
            return owner[name]
        raise LookupError(f"{module_name}:{'.'.join(walked)} does not exist")
    # Read from __dict__: properties come back as property objects, and an attribute a class only
    # inherits does not count (the patch replaces it on that very class).
    namespace = getattr(owner, "__dict__", {})
    if name in namespace:
        return namespace[name]
    raise LookupError(f"{module_name}:{'.'.join(walked)} does not exist")


def source_problems(modules: Dict[str, Tuple[str, ...]]) -> List[str]:
    """Problems with modules that cannot be imported as they are (they need ``deep_ep``): each must
    exist and define ``names`` at top level. Read from source, nothing executed."""
    problems = []
    for module_name, names in modules.items():
        try:
            spec = importlib.util.find_spec(module_name)
        except ImportError as error:
            spec, reason = None, str(error)
        else:
            reason = "not found"
        if spec is None or not spec.origin or not os.path.isfile(spec.origin):
            problems.append(f"{module_name}: module {reason}")
            continue
        with open(spec.origin, "r", encoding="utf-8") as handle:
            tree = ast.parse(handle.read(), spec.origin)
        defined = set()
        for node in tree.body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                defined.update(t.id for t in targets if isinstance(t, ast.Name))
        problems += [f"{module_name}:{name} does not exist" for name in names if name not in defined]
    return problems


def check(points: List[PatchPoint], source_modules: Optional[Dict[str, Tuple[str, ...]]] = None) -> None:
    """Raise VllmPatchError listing every point that is missing or has changed shape."""
    problems = source_problems(source_modules or {})
    for point in points:
        try:
            _, _, value = resolve(point.path)
        except LookupError as error:
            problems.append(f"{point.path}: {error} (needed because: {point.reason})")
            continue
        problem = point.expect(value) if point.expect is not None else None
        if problem:
            problems.append(f"{point.path}: {problem} (needed because: {point.reason})")
    if problems:
        raise VllmPatchError("uccl vLLM plugin: patch point(s) missing in the installed vLLM:\n  "
                             + "\n  ".join(problems))


def apply(points: List[PatchPoint]) -> None:
    for point in points:
        if point.apply is not None:
            owner, name, _ = resolve(point.path)
            point.apply(owner, name)


def is_property(value: Any) -> Optional[str]:
    return None if isinstance(value, property) else f"expected a property, found {type(value).__name__}"


def is_class(value: Any) -> Optional[str]:
    return None if isinstance(value, type) else f"expected a class, found {type(value).__name__}"


def reads_globals(*names: str) -> Callable[[Any], Optional[str]]:
    """Expect a function whose code looks up each of ``names`` as a global (the plugin rebinds them)."""
    def expect(value: Any) -> Optional[str]:
        code = getattr(value, "__code__", None)
        if code is None:
            return f"expected a function, found {type(value).__name__}"
        missing = [name for name in names if name not in code.co_names]
        return f"its code no longer reads {', '.join(missing)}" if missing else None
    return expect

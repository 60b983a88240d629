"""Running vLLM's DeepEP code against ``uccl_ep_plugin`` without a global ``deep_ep`` module.

vLLM's DeepEP code says ``import deep_ep`` (at module level in the prepare/finalize modules,
inside methods of the all2all managers). Installing a ``deep_ep`` module would shadow the real
DeepEP for every other user of the process, so instead the code objects we reuse run with
their own builtins, whose ``__import__`` answers ``deep_ep`` with ``uccl_ep_plugin`` and
leaves every other import alone. ``sys.modules`` never gets a ``deep_ep`` entry.
"""

import builtins
import importlib.util
import sys
import types
from typing import Any, Callable, Dict

import uccl_ep_plugin

DEEP_EP = "deep_ep"
_real_import = builtins.__import__


def _import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and name == DEEP_EP:
        return uccl_ep_plugin
    return _real_import(name, globals, locals, fromlist, level)


#: builtins for code that should see uccl_ep_plugin as deep_ep.
UCCL_BUILTINS: Dict[str, Any] = dict(vars(builtins), __import__=_import)


def rebind(func: Callable, **names: Any) -> Callable:
    """A copy of ``func`` whose ``import deep_ep`` gives uccl_ep_plugin and whose globals ``names`` override.

    The globals are a snapshot of ``func``'s module taken now: rebind at call time for code
    that reads module state that may change, or once for code that reads only constants.
    """
    namespace = dict(func.__globals__)
    namespace["__builtins__"] = UCCL_BUILTINS
    namespace.update(names)
    copy = types.FunctionType(func.__code__, namespace, func.__name__, func.__defaults__, func.__closure__)
    copy.__kwdefaults__ = func.__kwdefaults__
    copy.__qualname__ = func.__qualname__
    copy.__doc__ = func.__doc__
    copy.__dict__.update(func.__dict__)
    copy.__wrapped__ = func
    return copy


_bound_modules: Dict[str, types.ModuleType] = {}


def load_bound_module(dotted: str) -> types.ModuleType:
    """vLLM's module ``dotted`` executed afresh with ``deep_ep`` meaning uccl_ep_plugin.

    The copy lives under ``uccl_ep_plugin.integrations.vllm.bound.<dotted>``; vLLM's own entry in
    ``sys.modules`` (if DeepEP is installed and vLLM imported it) is untouched.
    """
    module = _bound_modules.get(dotted)
    if module is not None:
        return module
    spec = importlib.util.find_spec(dotted)
    if spec is None or spec.origin is None:
        raise ImportError(f"cannot find vLLM module {dotted}")
    name = f"{__package__}.bound.{dotted}"
    bound_spec = importlib.util.spec_from_file_location(name, spec.origin)
    module = importlib.util.module_from_spec(bound_spec)
    module.__builtins__ = UCCL_BUILTINS
    sys.modules[name] = module        # dataclasses and pickling look classes up through sys.modules
    try:
        bound_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    _bound_modules[dotted] = module
    return module

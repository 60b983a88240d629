"""What the installed native extension ``uccl_ep_plugin._C`` was built with."""

import importlib
from typing import Any, Dict

_EXTENSION = (__package__ or "uccl_ep_plugin") + "._C"

NOT_BUILT_MESSAGE = (
    "the native extension uccl_ep_plugin._C is not built; reinstall with pip install . "
    "(or pip install -e . / python setup.py build_ext --inplace in a source checkout)"
)


def build_info() -> Dict[str, Any]:
    """Compile-time facts of ``uccl_ep_plugin._C`` as a new dict.

    Keys: ``version`` (str), ``cuda`` (bool), ``cuda_runtime_version`` (int such as
    13000, or None without CUDA), ``cuda_archs`` (list of str such as ["90"]),
    ``cuda_static_runtime`` (bool), ``hip`` (bool), ``verbs`` (bool), ``features``
    (list of str; "dispatch_layout" when the layout kernel is compiled in), ``compiler``
    (str) and ``extension_path`` (str, the loaded shared object).

    Raises ImportError if the extension cannot be imported.
    """
    try:
        extension = importlib.import_module(_EXTENSION)
    except ImportError as error:
        raise ImportError(f"{NOT_BUILT_MESSAGE} ({error})") from error
    info = dict(extension.build_info())
    info["extension_path"] = str(extension.__file__)
    return info

"""A user's functions and classes by name: `path/to/file.py:NAME` or `package.module:NAME` (reward
functions, tools, environments), with errors that name the spec and what is wrong."""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

USER_MODULE_PREFIX = "colo_user_"   # the module name a FILE.py is loaded under


def load_object(spec: str, what: str):
    """The object `spec` names; ValueError led by `what` (e.g. "reward", "--tool") otherwise."""
    where, sep, name = spec.rpartition(":") if isinstance(spec, str) else ("", "", "")
    if not sep or not where or not name.isidentifier():
        raise ValueError(f"{what} {spec!r}: expected FILE.py:NAME or module:NAME")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ValueError(f"{what} {spec!r}: no file {path}")
        module_name = f"{USER_MODULE_PREFIX}{abs(hash(str(path.resolve())))}"
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module  # so pickling and dataclasses in it work
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - the user's file: say which and why
            raise ValueError(f"{what} {spec!r}: importing {path} raised {type(e).__name__}: {e}") from e
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise ValueError(f"{what} {spec!r}: cannot import module {where!r}: {e}") from e
    if not hasattr(module, name):
        raise ValueError(f"{what} {spec!r}: {where} has no {name!r}")
    return getattr(module, name)

"""jaxkv's public names: what `from jaxkv import *` binds, each documented."""

from __future__ import annotations

import inspect

import jaxkv


def _exported() -> set[str]:
    """The classes and functions jaxkv re-exports (its submodules and the `annotations`
    of `from __future__` are attributes of the package too, but no part of its API)."""
    return {
        name
        for name, value in vars(jaxkv).items()
        if not name.startswith("_") and not inspect.ismodule(value) and name != "annotations"
    }


def test_star_import_binds_the_exported_names_and_no_submodule():
    # Without __all__ it bound every loaded submodule too (config, engine, metrics,
    # request, router, ...: 71 of them) and `annotations`, rebinding a caller's own
    # `config` or `engine`.
    assert sorted(jaxkv.__all__) == sorted(_exported())
    namespace: dict = {}
    exec("from jaxkv import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(jaxkv.__all__)
    assert "config" not in namespace and "engine" not in namespace


def test_every_exported_name_has_a_docstring():
    undocumented = [name for name in jaxkv.__all__ if not inspect.getdoc(getattr(jaxkv, name))]
    assert undocumented == []

"""Every docstring example in the package runs and prints what it shows."""

import doctest
import importlib
import pkgutil

import pytest

import lsgd_jax

MODULES = sorted(
    m.name
    for m in pkgutil.iter_modules(lsgd_jax.__path__, "lsgd_jax.")
    if m.name != "lsgd_jax.demo"
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
    if name != "lsgd_jax":
        assert result.attempted > 0, f"{name} has no docstring examples"


def test_public_api_is_documented_with_examples():
    for name in lsgd_jax.__all__:
        obj = getattr(lsgd_jax, name)
        doc = obj.__doc__ or ""
        assert "Example" in doc or "Attributes" in doc, f"{name} has no example"

"""Sphinx configuration: python -m sphinx -W --keep-going -b html docs docs/_build.

Offline (no intersphinx), warnings are errors, and unresolved cross-references warn
(nitpicky), except references into third-party packages, which have no inventory here.
"""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lsgd_jax  # noqa: E402

project = "lsgd_jax"
author = "lsgd_jax authors"
copyright = "2026, lsgd_jax authors"  # noqa: A001
version = release = lsgd_jax.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "myst_nb",
]

# Pages are MyST markdown; the notebook is rendered with its stored outputs, never run.
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
nb_execution_mode = "off"
myst_enable_extensions = ["colon_fence", "dollarmath"]
myst_heading_anchors = 3
exclude_patterns = ["_build", "jupyter_execute", "Thumbs.db", ".DS_Store"]

napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autodoc_preserve_defaults = True
autodoc_default_options = {"members": True}

nitpicky = True
# No intersphinx (the build is offline): names from these packages stay plain text.
nitpick_ignore_regex = [
    (r"py:.*", r"(jax|jaxlib|optax|numpy|np|jnp|flax|orbax)(\..*)?"),
    (r"py:.*", r"(typing|collections|abc|os|pathlib)(\..*)?"),
    (r"py:.*", r"(Any|Callable|Sequence|Mapping|Hashable|Iterable|Iterator|NamedTuple)"),
    (r"py:.*", r"(int|float|str|bool|bytes|dict|list|tuple|set|frozenset|object|type|None)"),
    (r"py:.*", r"(Exception|RuntimeError|ValueError|TypeError|OverflowError|BaseException)"),
]

html_theme = "furo"
html_title = f"lsgd_jax {release}"

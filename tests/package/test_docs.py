"""The guide pages stay true: every ```python block of docs/*.md runs, in page order.

Each page runs in a namespace of its own, so a page is self-contained. A block that
cannot run here (several processes, a cluster) is written as a ```py listing instead,
which Sphinx highlights the same and this test leaves alone. The pages end their
examples with ``assert`` blocks on a few results.
"""

import pathlib
import re
import tomllib
import types

import pytest

import lsgd_jax

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
PAGES = sorted(p.name for p in DOCS.glob("*.md"))


def python_blocks(text):
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_the_pages_have_code_to_run():
    runnable = [p for p in PAGES if python_blocks((DOCS / p).read_text())]
    assert {
        "getting_started.md",
        "training_loops.md",
        "flax.md",
        "equinox.md",
        "checkpoints.md",
    } <= set(runnable)


@pytest.mark.parametrize("page", PAGES)
def test_page_runs(page):
    namespace = {"__name__": f"docs.{page}"}
    for i, code in enumerate(python_blocks((DOCS / page).read_text())):
        exec(compile(code, f"docs/{page} (block {i + 1})", "exec"), namespace)  # noqa: S102


def test_the_api_reference_names_every_public_name():
    # every name of lsgd_jax.__all__ and of each namespace's __all__, documented under its
    # top-level alias (the same object), under the heading of its namespace
    api = (DOCS / "api.md").read_text()
    documented = set(re.findall(r"\.\. auto(?:class|function|data):: (\w+)", api))
    qualified = set(re.findall(r"\.\. auto(?:class|function|data):: (lsgd_jax\.[\w.]+)", api))
    for namespace in (lsgd_jax.comm, lsgd_jax.elastic):
        listed = re.search(rf"automodule:: {namespace.__name__}\n\s+:members: (.*)", api)
        assert listed and set(namespace.__all__) <= set(listed[1].split(", ")), namespace
    for name in lsgd_jax.__all__:
        obj = getattr(lsgd_jax, name)
        if not isinstance(obj, types.ModuleType):
            assert name in documented, name
        elif obj not in (lsgd_jax.comm, lsgd_jax.elastic):
            assert f"`{obj.__name__}`" in api, f"no heading names {obj.__name__}"
            for n in obj.__all__:  # its top-level alias, or (no alias) its full name
                if f"{obj.__name__}.{n}" in qualified:
                    assert not hasattr(lsgd_jax, n), n  # then one name only
                    continue
                assert n in documented and getattr(lsgd_jax, n) is getattr(obj, n), n


def test_the_install_commands_bring_what_the_pages_need():
    # flax.md imports Flax, equinox.md Equinox; the checkpoint functions (checkpoints.md,
    # equinox.md's last section) import orbax-checkpoint. Each page says which extra to
    # install, the test extra (which runs the pages) has them too, and
    # getting_started.md (as README) installs both extras.
    pyproject = tomllib.loads((DOCS.parent / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    for page, extra, dist in [
        ("flax.md", "examples", "flax"),
        ("equinox.md", "examples", "equinox"),
        ("equinox.md", "checkpoint", "orbax-checkpoint"),
        ("checkpoints.md", "checkpoint", "orbax-checkpoint"),
    ]:
        assert f'pip install -e ".[{extra}]"' in (DOCS / page).read_text(), page
        for needed_by in (extra, "test"):
            assert any(re.match(rf"{dist}\b", d) for d in extras[needed_by]), (needed_by, dist)
    assert 'pip install -e ".[examples,checkpoint]"' in (DOCS / "getting_started.md").read_text()


def test_the_hand_written_loops_keep_at_most_two_steps_in_flight():
    # training_loops.md, "Threads for simulated CPU devices": a loop of jitted steps on
    # simulated CPU devices that never waits fills XLA's queues, which with too few
    # threads aborts the process in XLA's rendezvous.
    for code in python_blocks((DOCS / "training_loops.md").read_text()):
        if re.search(r"^for .* in range", code, flags=re.M):
            assert "in_flight.popleft().block_until_ready()" in code, code

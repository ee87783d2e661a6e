"""README.md stays true: its commands are what CI runs, and its snippets run."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def blocks(lang):
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_the_two_commands_come_first_and_ci_runs_the_test_command():
    demo_cmd, test_cmd = [b.strip() for b in blocks("bash")[:2]]
    assert demo_cmd.endswith("python -m lsgd_jax.demo")
    assert "pytest" in test_cmd
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_cmd in ci.splitlines()
    assert ci.splitlines()[-1] == test_cmd  # the static checks and the docs build run first


def test_python_snippets_run():
    namespace = {}
    for code in blocks("python"):
        exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102
    assert float(namespace["loss"]) >= 0.0
    assert namespace["model"]["w"].shape == (4, 1)
    # The snippets that moved to docs/ (shard_map, plain jit, pmap, Flax) are checked
    # there: tests/package/test_docs.py.


def test_the_pages_it_links_exist():
    for page in re.findall(r"`(docs/[a-z_]+\.md)`", README):
        assert (ROOT / page).is_file(), page


def test_it_says_which_extras_the_pages_need():
    # The demo needs the package alone; docs/flax.md and docs/checkpoints.md need Flax
    # and orbax-checkpoint (tests/package/test_docs.py checks that the extras bring them).
    assert 'pip install -e ".[examples,checkpoint]"' in README

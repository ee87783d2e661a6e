"""README.md stays true: its commands are what CI runs, and its snippets run."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def blocks(lang):
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_the_two_commands_come_first_and_ci_runs_the_test_command():
    demo_cmd, test_cmd = [b.strip() for b in blocks("bash")[:2]]
    assert demo_cmd.endswith("python -m lsgd_jax.demo")
    assert "pytest" in test_cmd
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_cmd in ci.splitlines()


def test_python_snippets_run():
    namespace = {}
    for code in blocks("python"):
        exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102
    assert float(namespace["loss"]) >= 0.0
    assert namespace["model"]["w"].shape == (4, 1)
    assert namespace["jp"]["w"].shape == (8, 4, 1)  # the plain-jit step's stacked params
    assert namespace["y"].shape == (64, 1)  # the Flax (NNX) snippet's consensus model
    assert namespace["bs"]["norm"]["mean"].shape == (8, 16)  # statistics per replica

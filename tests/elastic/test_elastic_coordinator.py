"""lsgd_jax.elastic_coordinator (JAX's coordination service in a process of its own):
its command line refuses a bad port or process count."""

from __future__ import annotations

import re

import pytest


@pytest.mark.parametrize(
    "args,match",
    [
        (["--port", "0", "--processes", "2"], "port must be in 1-65535, got 0"),
        (["--port", "9876", "--processes", "0"], "num_processes.*got 0"),
    ],
)
def test_the_coordinator_refuses_a_bad_port_or_count(args, match, capsys):
    from lsgd_jax import elastic_coordinator

    with pytest.raises(SystemExit) as e:
        elastic_coordinator.main(args)
    assert e.value.code == 2
    assert re.search(match, capsys.readouterr().err)

"""docs/equinox.md on integer arrays says what the library does (issue 33): ``tx.init``
takes them, ``data_parallel_step`` names an integer param before its first step runs.
Before, the page said ``post_local_sgd``'s init refused them."""

import pathlib
import re

import jax.numpy as jnp
import optax
import pytest

import lsgd_jax

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "equinox.md"
PARAMS = {"w": jnp.zeros(3), "ids": jnp.arange(4)}


def test_the_page_says_what_init_and_the_step_do_with_integer_arrays():
    text = " ".join(PAGE.read_text().split())
    assert not re.search(r"init also refuses integer arrays", text)
    assert "Integer arrays pass `tx.init`; `data_parallel_step` names an integer param" in text
    # what it says
    tx = optax.chain(
        lsgd_jax.post_local_sgd(2),
        optax.sgd(0.1),
        lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(2, warmup_steps=2)),
    )
    assert tx.init(PARAMS) is not None
    with pytest.raises(TypeError, match=r"example_params: leaf \['ids'\] is an int32 array"):
        lsgd_jax.data_parallel_step(
            lambda p, b: jnp.sum(p["w"]) * b.mean(),
            tx,
            lsgd_jax.make_mesh(2, 4),
            example_params=PARAMS,
        )

"""The private JAX functions lsgd_jax relies on are still where it looks for them."""

import jax
import jax.numpy as jnp
from helpers import DATA, mesh_2x4, put, smap

from lsgd_jax import _compat


def test_pmap_axis_names_are_found():
    names = []

    def f(x):
        names.append(_compat.mapped_axis_names())
        return x

    jax.pmap(f, axis_name="batch")(jnp.zeros(jax.local_device_count()))
    assert names == [("batch",)]
    assert _compat.mapped_axis_names() == ()


def test_all_gather_invariant_exists_and_gathers():
    gather = _compat.all_gather_invariant()
    assert gather is not None, "jax moved all_gather_invariant: update lsgd_jax/_compat.py"
    mesh = mesh_2x4()
    f = smap(
        lambda x: gather(x, ("node", "local"), tiled=True), mesh, DATA, jax.sharding.PartitionSpec()
    )
    out = f(put(jnp.arange(8.0), mesh, DATA))
    assert out.tolist() == list(range(8))

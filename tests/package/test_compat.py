"""The private JAX functions lsgd_jax relies on are still where it looks for them."""

import jax
import jax.numpy as jnp
from helpers import DATA, mesh_2x4, put, smap

from lsgd_jax._core import _compat


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


def test_backend_and_distributed_state_are_found():
    jax.devices()  # the tests' backend is up; jax.distributed is not initialized here
    assert _compat.backends_are_initialized() is True
    assert _compat.distributed_client() is None


def test_compilation_is_seen_on_a_threads_stack():
    import threading

    me = threading.get_ident()
    seen = []

    def f(x):
        seen.append(_compat.compiling(me))  # runs while jit traces f
        return x * 2

    assert _compat.compiling(me) is False
    jax.jit(f)(jnp.ones(3))
    assert seen == [True]
    assert _compat.compiling(me) is False
    # Each function it looks for is still where it looks (tracing, lowering, compiling).
    for module, name in _compat.COMPILE_FUNCTIONS:
        assert callable(getattr(module, name, None)), f"jax moved {module.__name__}.{name}"


def test_a_recoverable_coordination_service_starts_and_stops():
    # lsgd_jax.elastic_coordinator's service: port 0 lets the system pick a free port.
    service = _compat.distributed_runtime_service("127.0.0.1:0", 2, 3, 5)
    service.shutdown()


def test_importing_the_library_does_not_start_jaxs_backend():
    # elastic.initialize must come before the backend starts (its collective timeouts);
    # an array made at import (a module constant) started it, and every trainer failed.
    import subprocess
    import sys

    code = (
        "import lsgd_jax, lsgd_jax.elastic, lsgd_jax.demo\n"
        "from lsgd_jax import _compat\n"
        "print(_compat.backends_are_initialized())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_an_optax_chain_says_what_it_holds():
    # the chain-order check reads which tuples of a state are optax.chain's from here
    import optax

    from lsgd_jax._core import _compat

    inner = optax.chain(optax.clip(1.0), optax.scale(2.0))
    inits = _compat.chain_inits(optax.chain(inner, optax.sgd(0.1)).init)
    assert inits is not None and len(inits) == 2
    assert len(_compat.chain_inits(inits[0])) == 2
    assert _compat.chain_inits(optax.clip(1.0).init) is None
    assert _compat.chain_inits(lambda p: ()) is None

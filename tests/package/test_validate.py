"""lsgd_jax._core._validate: NumPy and JAX scalars are numbers like Python's (issue 33,
item 5), and what is not a number of the right kind is refused with the fix named."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lsgd_jax
from lsgd_jax._core import _validate
from lsgd_jax.averaging import diloco_outer, num_outer_steps

INTEGERS = {
    "int": 4,
    "np.int64": np.int64(4),
    "np.int32": np.int32(4),
    "np.uint8": np.uint8(4),
    "np 0-d array": np.array(4),
    "jnp.int32": jnp.int32(4),
    "jnp 0-d array": jnp.array(4),
}
NOT_INTEGERS = {  # value, what the message says after "period must be "
    "bool": (True, r"a Python int, got True \(bool\); pass a whole number as an int"),
    "np.bool_": (np.bool_(True), "a Python int, got np.True_"),
    "jnp bool": (jnp.array(True), r"a Python int, got Array\(True"),
    "float": (2.5, r"a Python int, got 2.5 \(float\); pass a whole number as an int"),
    "whole float": (4.0, r"a Python int, got 4.0 \(float\); pass 4 "),
    "np.float32": (np.float32(4), r"a Python int, got np.float32\(4.0\) \(float32\); pass 4 "),
    "jnp.float32": (jnp.float32(4), r"a Python int, got Array\(4., dtype=float32\)"),
    "shape (1,)": (jnp.array([4]), r"a single int, got an array of shape \(1,\)"),
    "str": ("4", "a Python int, got '4'"),
    "None": (None, "a Python int, got None"),
}


@pytest.mark.parametrize("kind", list(INTEGERS))
@pytest.mark.parametrize(
    "check", [_validate.positive_int, _validate.nonnegative_int, _validate.optional_positive_int]
)
def test_integer_scalars_are_ints(check, kind):
    got = check(INTEGERS[kind], "period")
    assert got == 4 and type(got) is int


@pytest.mark.parametrize("kind", list(NOT_INTEGERS))
def test_what_is_not_an_integer_is_refused_with_the_fix(kind):
    value, message = NOT_INTEGERS[kind]
    with pytest.raises(TypeError, match=f"^period must be {message}"):
        _validate.positive_int(value, "period")
    with pytest.raises(TypeError, match="NumPy and JAX integer scalars work too"):
        _validate.nonnegative_int(value, "period")
    if value is not None:  # None means "none" there
        with pytest.raises(TypeError, match="^period must be a (positive|single|concrete) int"):
            _validate.optional_positive_int(value, "period")
    assert not _validate._is_int(value)


def test_a_bool_or_a_wrong_type_is_a_type_error_in_every_int_check():
    # issue 33: data_parallel_step(max_in_flight=True) raised ValueError, a bool was a
    # TypeError everywhere else; elastic.initialize(process_id=True) too
    import optax

    mesh = lsgd_jax.make_mesh(2, 4)
    for options in ({"max_in_flight": True}, {"check_in_sync_every": np.bool_(True)}):
        (name,) = options
        with pytest.raises(TypeError, match=f"data_parallel_step: {name} must be a positive "):
            lsgd_jax.data_parallel_step(lambda p, b: jnp.sum(p), optax.sgd(0.1), mesh, **options)
    with pytest.raises(TypeError, match="max_in_flight must be a positive int or None, got 2.0"):
        lsgd_jax.data_parallel_step(
            lambda p, b: jnp.sum(p), optax.sgd(0.1), mesh, max_in_flight=2.0
        )
    with pytest.raises(ValueError, match="max_in_flight must be a positive int or None, got 0"):
        lsgd_jax.data_parallel_step(lambda p, b: jnp.sum(p), optax.sgd(0.1), mesh, max_in_flight=0)
    with pytest.raises(TypeError, match=r"initialize: process_id must be a Python int, got True"):
        lsgd_jax.elastic.initialize("127.0.0.1:1", 2, True)
    with pytest.raises(TypeError, match="num_cpu_devices must be a positive int or None, got Tr"):
        lsgd_jax.elastic.initialize("127.0.0.1:1", 2, 0, num_cpu_devices=True)


def test_ranges_are_still_checked():
    with pytest.raises(ValueError, match="period must be a positive int, got 0; use 1 or more"):
        _validate.positive_int(jnp.int32(0), "period")
    with pytest.raises(ValueError, match="must be a non-negative int, got -1"):
        _validate.nonnegative_int(np.int64(-1), "warmup_steps")


def test_a_traced_value_is_refused_with_the_fix():
    @jax.jit
    def build(n):
        return _validate.positive_int(n, "period")

    with pytest.raises(TypeError, match="period must be a concrete int, got a traced value"):
        build(4)

    @jax.jit
    def rate(x):
        return _validate.real_number(x, "learning_rate")

    with pytest.raises(TypeError, match="learning_rate must be a concrete number, got a traced"):
        rate(0.5)


REALS = {
    "float": 0.5,
    "int": 1,
    "np.float32": np.float32(0.5),
    "np.float64": np.float64(0.5),
    "np.float16": np.float16(0.5),
    "np.int64": np.int64(1),
    "np 0-d array": np.array(0.5),
    "jnp.float32": jnp.float32(0.5),
    "jnp.bfloat16": jnp.bfloat16(0.5),
    "jnp 0-d array": jnp.array(0.5),
    "jnp.int32": jnp.int32(1),
}
NOT_REALS = {
    "bool": (True, TypeError, r"a real number, got True \(bool\)"),
    "np.bool_": (np.bool_(False), TypeError, "a real number, got np.False_"),
    "complex": (1 + 2j, TypeError, r"a real number, got \(1\+2j\)"),
    "np.complex64": (np.complex64(1), TypeError, "a real number, got np.complex64"),
    "str": ("0.5", TypeError, "a real number, got '0.5'"),
    "None": (None, TypeError, "a real number, got None"),
    "shape (1,)": (jnp.array([0.5]), TypeError, r"a single number, got an array of shape \(1,\)"),
    "shape (2, 2)": (np.ones((2, 2)), TypeError, r"a single number, got an array of shape \(2, 2"),
    "nan": (float("nan"), ValueError, "a finite number, got nan"),
    "inf": (np.float32("inf"), ValueError, r"a finite number, got np.float32\(inf\)"),
    "jnp -inf": (jnp.float32(-np.inf), ValueError, "a finite number, got Array"),
}


@pytest.mark.parametrize("kind", list(REALS))
def test_real_scalars_are_floats(kind):
    value = REALS[kind]
    got = _validate.real_number(value, "learning_rate")
    assert type(got) is float and got == float(np.asarray(value))


@pytest.mark.parametrize("kind", list(NOT_REALS))
def test_what_is_not_a_real_number_is_refused_with_the_fix(kind):
    value, error, message = NOT_REALS[kind]
    with pytest.raises(error, match=f"learning_rate must be {message}.*learning_rate=0.7"):
        _validate.real_number(value, "learning_rate", example="learning_rate=0.7")


# --- the public constructors that take numbers ------------------------------------------

SCALARS = {
    "np.int64": np.int64,
    "np.int32": np.int32,
    "jnp.int32": jnp.int32,
    "np 0-d": np.array,
}


@pytest.mark.parametrize("kind", list(SCALARS))
def test_public_constructors_take_integer_scalars_and_equal_the_python_built(kind):
    n = SCALARS[kind]
    built = {
        "PeriodicModelAverager": (
            lambda: lsgd_jax.PeriodicModelAverager(n(4), warmup_steps=n(2)),
            lambda: lsgd_jax.PeriodicModelAverager(4, warmup_steps=2),
        ),
        "HierarchicalModelAverager": (
            lambda: lsgd_jax.HierarchicalModelAverager(
                {2: "local", 8: ("node", "local")}, warmup_steps=n(2)
            ),
            lambda: lsgd_jax.HierarchicalModelAverager(
                {2: "local", 8: ("node", "local")}, warmup_steps=2
            ),
        ),
        "PeriodicSchedule": (
            lambda: lsgd_jax.PeriodicSchedule(n(4), n(2), n(2), n(1)),
            lambda: lsgd_jax.PeriodicSchedule(4, 2, 2, 1),
        ),
        "HierarchicalSchedule": (
            lambda: lsgd_jax.HierarchicalSchedule((n(2), n(8)), n(2)),
            lambda: lsgd_jax.HierarchicalSchedule((2, 8), 2),
        ),
        "comm.quantized block_size": (
            lambda: lsgd_jax.comm.quantized(block_size=n(32)),
            lambda: lsgd_jax.comm.quantized(block_size=32),
        ),
        "comm.quantized bits": (
            lambda: lsgd_jax.comm.quantized(n(4)),
            lambda: lsgd_jax.comm.quantized(4),
        ),
        "fragments and delay": (
            lambda: lsgd_jax.PeriodicModelAverager(n(4), fragments=n(2), delay=n(1)),
            lambda: lsgd_jax.PeriodicModelAverager(4, fragments=2, delay=1),
        ),
        "a hierarchy's delay": (
            lambda: lsgd_jax.HierarchicalModelAverager({2: "local", 4: None}, delay=n(1)),
            lambda: lsgd_jax.HierarchicalModelAverager({2: "local", 4: None}, delay=1),
        ),
    }
    for name, (got, want) in built.items():
        assert got() == want(), name
        assert hash(got()) == hash(want()), name
    hook = lsgd_jax.post_local_sgd(n(3)).init(jnp.zeros(2))
    assert hook.start_localSGD_iter == 3 and type(hook.start_localSGD_iter) is int
    assert num_outer_steps(n(1500), n(100), n(32)) == 44


def test_diloco_outer_takes_numpy_and_jax_scalars():
    # issue 33 item 5: each of these raised "... must be positive, got np.float32(0.7)"
    want = diloco_outer(6, 0.7, 0.8, cooldown=0.3)  # 5 updates, the last 2 cooled
    spellings = [
        dict(learning_rate=np.float32(0.7)),
        dict(learning_rate=jnp.float32(0.7)),
        dict(momentum=np.float32(0.8)),
        dict(momentum=jnp.array(0.8)),
        dict(cooldown=np.float64(0.3)),
        dict(cooldown=jnp.float32(0.3)),
    ]
    for options in spellings:
        values = {"learning_rate": 0.7, "momentum": 0.8, "cooldown": 0.3, **options}
        tx = diloco_outer(np.int64(6), values["learning_rate"], values["momentum"],
                          cooldown=values["cooldown"])  # fmt: skip
        a, b = tx.init(jnp.zeros(2)), want.init(jnp.zeros(2))
        for _ in range(5):
            _, a = tx.update(jnp.ones(2), a)
            _, b = want.update(jnp.ones(2), b)
        for key in ("learning_rate", "momentum"):
            np.testing.assert_allclose(
                a.hyperparams[key], b.hyperparams[key], rtol=1e-6, err_msg=str(options)
            )
        assert float(a.hyperparams["learning_rate"]) == 1.0, options
    assert diloco_outer(10, np.int64(1), np.int64(0)) is not None  # integer scalars too


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"learning_rate": np.float32(np.nan)}, ValueError, "learning_rate must be a finite"),
        ({"learning_rate": jnp.array([0.7])}, TypeError, r"learning_rate must be a single"),
        ({"momentum": np.bool_(False)}, TypeError, "momentum must be a real number, got np.F"),
        ({"momentum": jnp.float32(1.0)}, ValueError, r"momentum must be a number in \[0, 1\)"),
        ({"cooldown": np.float32(np.inf)}, ValueError, "cooldown must be a finite number"),
        ({"cooldown": np.ones(2)}, TypeError, "cooldown must be a single number"),
        ({"num_outer_steps": np.float32(44)}, TypeError, "num_outer_steps must be a Python int"),
    ],
)
def test_diloco_outer_refuses_what_is_not_a_number_of_its_kind(options, error, message):
    values = {"num_outer_steps": 44, **options}
    with pytest.raises(error, match=f"diloco_outer: {message}"):
        diloco_outer(**values)

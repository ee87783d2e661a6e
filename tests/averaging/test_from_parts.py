"""The configuration as one value: an averager's parts (when, what, how, then) and
``from_parts``, which builds the averager back from them (issue 28)."""

import jax.numpy as jnp
import optax
import pytest

import lsgd_jax
from lsgd_jax import comm
from lsgd_jax.averaging import Assign, OuterStep, Parts, SendDelta, SendParams, from_parts
from lsgd_jax.schedules import PeriodicSchedule

P, H = lsgd_jax.PeriodicModelAverager, lsgd_jax.HierarchicalModelAverager
OUTER = optax.sgd(0.7, momentum=0.9, nesterov=True)
HIER = {2: "local", 8: ("node", "local")}

# ids by name: a repr holds function addresses, which differ between xdist workers
CONFIGS = {
    "plain": P(4),
    "delta-on-axes": P(4, 2, ("node", "local"), delta=True),
    "outer-no-skip": P(8, 3, outer_optimizer=OUTER, outer_skip_first=False),
    "nonfinite-skip": P(4, nonfinite="skip"),
    "bf16-delta": P(4, communication_dtype=jnp.bfloat16, delta=True),
    "quantized": P(4, communication=comm.quantized(4, two_level=True)),
    "fragments": P(8, fragments=4, delta=True),
    "delay-outer": P(8, delay=2, outer_optimizer=OUTER),
    "callable-period": P(lambda s: 4, 5),
    "offload": P(4, offload_state=True, delta=True),
    "hierarchical": H(HIER),
    "hierarchical-all": H(HIER, 4, delay=1, outer_optimizer=OUTER, nonfinite="exclude"),
}


@pytest.mark.parametrize("avg", list(CONFIGS.values()), ids=list(CONFIGS))
def test_from_parts_builds_the_averager_back(avg):
    groups = list(avg.groups) if isinstance(avg, H) else None
    back = from_parts(avg.parts, groups, avg.process_group, offload_state=avg.offload_state)
    assert back == avg and hash(back) == hash(avg)
    assert type(back) is type(avg) and back.parts == avg.parts
    assert back.schedule(40).tolist() == avg.schedule(40).tolist()


def test_the_parts_say_what_the_keywords_chose():
    parts = P(8, 3, outer_optimizer=OUTER, delta=True, nonfinite="skip").parts
    assert parts.when == PeriodicSchedule(8, 3)
    assert parts.what == SendDelta() and parts.how == comm.finite_only("skip")
    assert parts.then == OuterStep(OUTER, True)
    assert P(4).parts == Parts(PeriodicSchedule(4), SendParams(), comm.flat(), Assign())
    # one part changed, the rest kept: a configuration handled as one value
    changed = from_parts(parts._replace(how=comm.quantized(8)))
    assert changed.communicator == comm.quantized(8) and changed.delta and changed.warmup_steps == 3


def test_wrong_parts_are_refused_with_the_fix():
    parts = P(4).parts
    with pytest.raises(TypeError, match="averager's Parts"):
        from_parts((parts.when, parts.what, parts.how, parts.then))
    with pytest.raises(TypeError, match="SendParams\\(\\) or SendDelta\\(\\)"):
        from_parts(parts._replace(what="delta"))
    with pytest.raises(TypeError, match="Assign\\(\\) or OuterStep"):
        from_parts(parts._replace(then=OUTER))
    with pytest.raises(TypeError, match="one group per period"):
        from_parts(H(HIER).parts)
    with pytest.raises(TypeError, match="give its group as process_group="):
        from_parts(parts, groups=["local"])
    with pytest.raises(TypeError, match="a lsgd_jax.schedules.Schedule"):
        from_parts(parts._replace(when=4))

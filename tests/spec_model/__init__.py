"""An executable specification of lsgd_jax: the documented rules, in plain NumPy.

Nothing here imports lsgd_jax, jax or optax. The model replays R replicas step by step,
each rule in its own small function whose docstring quotes the rule it implements. Values
are stacked per replica: every array has a leading replica axis of size R, and replica r
is the device at row-major position r of the mesh. Arithmetic is float32 where the library
is float32 (group means are taken in float64 and rounded once, so they agree with any
summation order to a float32 ulp or so); ``ml_dtypes.bfloat16`` models the rounding of
``communication_dtype=jnp.bfloat16``, and ``quantize_blocks`` replays the rounding of
``comm.quantized`` exactly (it is deterministic), stage by stage, with its residual.

A run is described by plain, hashable configs (``Topology``, ``HookConfig``,
``InnerConfig``, ``AveragerConfig``, ``RunConfig``) and a list of per-step ``Batch``es;
``simulate`` returns one ``Snapshot`` (a dict of named per-replica arrays) per step, the
names being what the tests read back from the library's state.
"""

from __future__ import annotations

from spec_model.averagers import (  # noqa: F401
    SCHEDULES,
    Averaged,
    AveragerConfig,
    AveragerState,
    OuterConfig,
    _average,
    _average_extra,
    _contribution,
    _finite,
    _outer_steps,
    _set_anchor,
    average_call,
    average_model_state,
    averager_init,
    averager_level,
    first_global_step,
    fragment_masks,
    hierarchical_level,
    land,
    lands,
    outer_step,
    periodic_level,
    quantized_buffers,
    scheduled_level,
    working_anchor,
)
from spec_model.base import (  # noqa: F401
    BF16,
    F32,
    TRAINABLE,
    Snapshot,
    Topology,
    Tree,
    bf16_mean,
    exact_mean,
    group_mean,
    is_floating,
    short_repr,
    used_members,
)
from spec_model.hook import (  # noqa: F401
    HookConfig,
    InnerConfig,
    adam_update,
    ddp_mean,
    grad_norm_ema,
    hook_step,
    inner_init,
    inner_update,
    sgd_update,
)
from spec_model.quantized import (  # noqa: F401
    QMAX,
    QuantConfig,
    bytes_across,
    quant_layout,
    quantize_blocks,
    quantized_group_mean,
    quantized_one_level,
    wire,
)
from spec_model.run import (  # noqa: F401
    Batch,
    Replay,
    RunConfig,
    _chain_step,
    _data_parallel_step,
    _functional_step,
    _snapshot,
    _updates_step,
    chosen_components,
    gradients,
    initial_replay,
    loss_value,
    model_state_step,
    simulate,
)

"""Elastic post-local SGD: keep training when a process dies, take it back when it returns.

Local SGD does not need every node on every step, so when a process dies the others
can go on and average among themselves. :class:`ElasticLoop` runs
:func:`~lsgd_jax.data_parallel_step` one step at a time inside JAX's ``live_devices``
barrier (every live process agrees on who is alive and on whether the step succeeded).
On a failure (a dead process, a collective that timed out) it

1. rebuilds the mesh over the live processes (the ``"node"`` axis shrinks; each device
   keeps its own replica's params and optimizer state: no checkpoint reload),
2. re-runs the failed step from the state before it (nothing is donated),
3. keeps every survivor's step counters equal (they never diverge: a step is
   committed on all processes or on none), and the means are over the live replicas,
4. logs who failed at which step and how long recovery took.

A process that (re)starts joins the running job: it receives the survivors' consensus
params (and model state, if any), one live replica's optimizer state and the step
counters, and is in the next step's averages; the survivors do not stop. A process
that hangs without dying (its heartbeats stop, e.g. SIGSTOP) is treated as dead after
the heartbeat timeout; one that stalls inside Python is ended by the loop's watchdog
(``stall_timeout_s``).

No trainer needs to be special: run JAX's coordination service in a process of its own
(``python -m lsgd_jax.elastic_coordinator --port P --processes N``) and start every
trainer with ``initialize(..., external_coordinator=True)``; then any trainer, process 0
included, may die and come back, and the lowest live process that holds the model leads
each membership change. Without it, process 0 hosts the service: if process 0 dies,
every process ends with an error (JAX terminates them). A process that (re)starts after
the run is over prints one line saying so and exits with status 0.

Start every process with :func:`initialize` (instead of ``jax.distributed.initialize``),
which turns on JAX's recoverability, sets collective timeouts and keeps a dead peer
from ending the others. The user's ``batch_fn(step, layout)`` returns this process's
rows of the global batch; ``layout`` (a :class:`Layout`) says which processes are live
and where this one sits, so each live process keeps feeding its own rows.

Example (each of N processes runs this, with its own ``process_id``)::

    import lsgd_jax.elastic as elastic
    elastic.initialize("127.0.0.1:9876", num_processes=3, process_id=i, num_cpu_devices=2)
    loop = elastic.ElasticLoop(loss_fn, tx, init_params, batch_fn)
    result = loop.run(num_steps=200)   # survives dead processes; takes back restarted ones
    model = loop.consensus(result.params)
"""

from lsgd_jax.elastic._loop import ElasticLoop
from lsgd_jax.elastic._records import ElasticResult
from lsgd_jax.elastic._records import StepRecord
from lsgd_jax.elastic._initialize import initialize
from lsgd_jax.elastic._initialize import shutdown
from lsgd_jax.elastic._process import CoordinatorLostError
from lsgd_jax.elastic._membership import Layout
from lsgd_jax.elastic._process import LeftBehindError

# Names lsgd_jax.elastic had as a module (before commit 9c4ecf6), kept as they were:
# attributes, not in __all__ (use_compilation_cache is lsgd_jax.use_compilation_cache).
from lsgd_jax.elastic._initialize import logger as logger
from lsgd_jax.step import use_compilation_cache as use_compilation_cache

__all__ = [
    "CoordinatorLostError",
    "ElasticLoop",
    "ElasticResult",
    "Layout",
    "LeftBehindError",
    "StepRecord",
    "initialize",
    "shutdown",
]

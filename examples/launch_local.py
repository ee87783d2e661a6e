"""Post-local SGD on N local processes, each with M CPU devices: a cluster on one machine.

Run::

    python examples/launch_local.py --processes 2 --devices 4 --steps 60

the same as ``python -m lsgd_jax.elastic.launch_local`` with the same options: the
launcher and its workers live in the package (``lsgd_jax/elastic/launch_local.py``,
importable as ``lsgd_jax.elastic.launch_local``), and this script runs them. Every
worker joins the others with ``jax.distributed`` over 127.0.0.1 and gloo, builds the
global mesh with ``lsgd_jax.make_mesh()``, feeds only its own rows of each global batch,
and trains with ``post_local_sgd`` + SGD with momentum + ``model_averaging``, saving a
checkpoint every ``--ckpt-every`` steps to ``--ckpt-dir`` and resuming from the newest
one when started again. ``--help`` lists the options; see docs/many_hosts.md.
"""

import sys

from lsgd_jax.elastic.launch_local import main

if __name__ == "__main__":
    sys.exit(main())

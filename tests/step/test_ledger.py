"""The byte ledger against counts made by hand from the schedule and the leaf sizes."""

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import mesh_2x4

import lsgd_jax

N = 256  # float32 params: 1,024 bytes per replica
LOSS = 4  # the reported mean loss, an all-reduce over every device, every step


def post_local_tx():
    """Global gradient means in steps 0-2, then node-local ones and a global average
    at steps 3, 7, 11, ..."""
    return optax.chain(
        lsgd_jax.post_local_sgd(3),
        optax.sgd(0.1),
        lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(4, warmup_steps=3)),
    )


def ledger_for(tx, num_steps, n=N, **kwargs):
    mesh = mesh_2x4()
    step = lsgd_jax.data_parallel_step(lambda p, b: jnp.mean((b @ p) ** 2), tx, mesh, **kwargs)
    p = lsgd_jax.replicate(jnp.zeros(n), mesh)
    s = lsgd_jax.replicate(tx.init(jnp.zeros(n)), mesh)
    return step, lsgd_jax.communication_ledger(step, p, s, jnp.ones((8, n)), num_steps=num_steps)


def test_post_local_sgd_bytes_per_step_and_per_run_by_hand():
    tx = post_local_tx()
    step, ledger = ledger_for(tx, 12)
    # steps 0-2: global gradient mean; from 3: node-local gradient mean, and a global
    # average of the params at 3, 7, 11
    global_steps = {0, 1, 2, 3, 7, 11}
    want_across = [4 * N * (t in global_steps) + LOSS for t in range(12)]
    want_inside = [4 * N * (t >= 3) for t in range(12)]
    assert ledger.per_step().tolist() == want_across
    assert ledger.per_step("inside").tolist() == want_inside
    assert ledger.total() == 6 * 4 * N + 12 * LOSS
    assert ledger.total("all") == ledger.total() + 9 * 4 * N
    # a ring all-reduce over 8 devices puts 2 * 7 / 8 of its bytes on the wire
    assert ledger.per_step(wire=True)[0] == round(2 * 7 / 8 * 4 * N) + round(2 * 7 / 8 * LOSS)
    # phases: 2 (global gradients), 1 (node-local gradients + average), 0 (node-local)
    assert ledger.steps == (2, 2, 2, 1, 0, 0, 0, 1, 0, 0, 0, 1)
    assert "run" in str(ledger) and f"{ledger.total():,}" in str(ledger)
    # the ledger compiled the programs the run uses: the steps compile nothing more
    assert set(ledger.phases) <= step._programs.compiled_modes()


def test_two_level_averages_send_a_quarter_across_nodes():
    tx = optax.chain(
        lsgd_jax.post_local_sgd(0, post_local_gradient_allreduce=False),
        optax.sgd(0.1),
        lsgd_jax.model_averaging(
            lsgd_jax.PeriodicModelAverager(2, communication=lsgd_jax.comm.two_level())
        ),
    )
    _, ledger = ledger_for(tx, 4)
    # an average: reduce-scatter in the node (1,024 B), all-reduce of the quarter
    # across nodes (256 B), all-gather in the node (256 B)
    assert ledger.per_step().tolist() == [N + LOSS, LOSS, N + LOSS, LOSS]
    assert ledger.per_step("inside").tolist() == [4 * N + N, 0, 4 * N + N, 0]


def averages_only(communication):
    return optax.chain(
        lsgd_jax.post_local_sgd(0, post_local_gradient_allreduce=False),
        optax.sgd(0.1),
        lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(2, communication=communication)),
    )


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_two_level_averages_send_integers_across_nodes(bits):
    # Issue 26: 520 params sent one float32 all-reduce over all 8 devices (2,084 B
    # across nodes a step with the loss, 3,647 wire bytes), 4x comm.two_level()'s.
    n = 520
    _, ledger = ledger_for(averages_only(lsgd_jax.comm.quantized(bits, two_level=True)), 2, n)
    _, two_level = ledger_for(averages_only(lsgd_jax.comm.two_level()), 2, n)
    # Each device's shard of its node's sum: 130 values; its chunk 65, padded to two
    # blocks of 64: 128 integers and 2 float32 scales. Across nodes an all-to-all of
    # both chunks and an all-gather of one; inside, a float32 reduce-scatter of the
    # padded 8 x 128 values and an all-gather of the 2 x 128 of the shard.
    chunk = 128 * bits // 8 + 2 * 4
    assert ledger.per_step().tolist() == [3 * chunk + LOSS, LOSS]
    assert ledger.per_step("inside").tolist() == [4 * 8 * 128 + 4 * 2 * 128, 0]
    assert two_level.per_step().tolist() == [4 * n // 4 + LOSS, LOSS]
    # on the link (a ring all-reduce of 2 sends its bytes once): 2 chunks against 520
    assert ledger.per_step(wire=True)[0] < two_level.per_step(wire=True)[0]
    assert ledger.per_step(wire=True)[0] - round(2 * 7 / 8 * LOSS) == 2 * chunk


def test_node_link_bytes_count_only_the_hops_that_cross_nodes():
    # Issue 29: on the emulated link the veths carried 11,033 MB for DDP and 143 MB for
    # the slow-link recipe, where per-device wire bytes said 8 x 5,029 and 8 x 17.4: a
    # flat ring over 2 nodes of 4 crosses the node boundary at 2 of its 8 hops, while a
    # two-level exchange sends every device's share across. By hand, every device
    # together: the flat all-reduce of grads + loss (1,028 B, 1,799 wire bytes a
    # device) crosses twice; the loss alone (7 wire bytes) twice.
    _, ledger = ledger_for(post_local_tx(), 8)
    flat, loss = 2 * round(2 * 7 / 8 * (4 * N + LOSS)), 2 * round(2 * 7 / 8 * LOSS)
    assert ledger.link_per_step().tolist() == [flat] * 4 + [loss] * 3 + [flat]
    assert ledger.link_total() == 5 * flat + 3 * loss
    assert f"{ledger.link_total():,}" in str(ledger)
    # Quantized two-level (8-bit, 520 params): each device sends one chunk of its
    # all-to-all and its all-gathered chunk to its peer in the other node.
    n, chunk = 520, 128 + 2 * 4
    _, quantized = ledger_for(averages_only(lsgd_jax.comm.quantized(8, two_level=True)), 2, n)
    assert quantized.link_per_step().tolist() == [8 * 2 * chunk + loss, loss]


def test_link_bytes_of_a_collective_by_hand():
    from lsgd_jax import Collective
    from lsgd_jax.step._ledger import link_bytes

    def make(kind, groups, nbytes):
        g = len(groups[0])
        return Collective(kind, g, len(groups), None, nbytes, False, "c", "f", "", groups)

    node = lambda p: p // 4  # noqa: E731  (2 nodes of 4)
    # inside one node: nothing crosses
    assert link_bytes(make("all-reduce", ((0, 1, 2, 3), (4, 5, 6, 7)), 800), node) == 0
    # pairs across nodes: a ring of 2 crosses twice, 1 x bytes each (all-gather)
    pairs = ((0, 4), (1, 5), (2, 6), (3, 7))
    assert link_bytes(make("all-gather", pairs, 100), node) == 4 * 2 * 100
    # all-to-all over all 8: each device sends bytes / 8 to each of the 4 in the other node
    assert link_bytes(make("all-to-all", (tuple(range(8)),), 800), node) == 8 * 4 * 100
    # a permute's (source, target) pairs: those across nodes carry bytes one way
    permute = make("collective-permute", ((0, 4), (4, 0), (1, 2)), 100)
    assert link_bytes(permute, node) == 2 * 100
    # groups unknown: every device's wire bytes
    unknown = Collective("all-reduce", 8, 1, None, 800, False, "c", "f", "", ())
    assert link_bytes(unknown, node) == 8 * round(2 * 7 / 8 * 800)


def test_post_local_sgd_counts_its_collectives_by_hand():
    tx = post_local_tx()
    _, ledger = ledger_for(tx, 8)
    # across nodes: the loss every step, fused with the global gradient mean (steps 0-2)
    # or the average (3, 7) into one all-reduce; inside: the node-local gradient mean
    assert ledger.collectives().tolist() == [1] * 8
    assert ledger.collectives("inside").tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert ledger.collectives("all").tolist() == [1, 1, 1, 2, 2, 2, 2, 2]
    assert "ops across" in str(ledger).splitlines()[0]


@pytest.mark.parametrize("specialize", ["switch", False])
def test_a_step_with_one_program_is_charged_its_own_branch(specialize):
    # Before, every branch of the one program was charged on every step: 4,100 bytes
    # across nodes per step with "switch" (all four phases), 2,052 with False.
    tx = post_local_tx()
    _, want = ledger_for(tx, 12)
    _, got = ledger_for(tx, 12, specialize=specialize)
    assert got.exact and got.steps == want.steps
    for where in ("across", "inside"):
        assert got.per_step(where).tolist() == want.per_step(where).tolist()
        assert got.collectives(where).tolist() == want.collectives(where).tolist()


def test_a_step_that_may_skip_updates_is_charged_an_upper_bound():
    # optax.MultiSteps decides on the device whether the inner update (and its
    # branch) runs: every branch of the one program is charged, and the ledger says so.
    inner = optax.chain(
        lsgd_jax.post_local_sgd(2),
        optax.sgd(0.1),
        lsgd_jax.model_averaging(lsgd_jax.PeriodicModelAverager(4, warmup_steps=2)),
    )
    _, ledger = ledger_for(optax.MultiSteps(inner, 2), 4)
    assert not ledger.exact and ledger.steps == ("switch",) * 4
    assert "an upper bound" in str(ledger)
    assert ledger.per_step()[0] > 4 * N + LOSS  # both gradient means and the average


def test_a_step_with_one_program_and_bad_arguments():
    tx = optax.chain(lsgd_jax.post_local_sgd(2), optax.sgd(0.1))
    _, ledger = ledger_for(tx, 3, specialize="switch")
    assert ledger.steps == (1, 1, 0)  # global gradient means, then node-local
    with pytest.raises(TypeError, match="data_parallel_step"):
        lsgd_jax.communication_ledger(lambda x: x, num_steps=3)
    with pytest.raises(ValueError, match="num_steps must be a positive int"):
        ledger_for(tx, 0)


def ddp_bytes_per_step():
    """A DDP step by hand: one all-reduce of the gradients and the loss over all 8."""
    return 4 * N + LOSS


@pytest.mark.parametrize("specialize", [True, "switch", False])
def test_plain_ddp_is_labelled_ddp(specialize):
    # Before: the one program of a chain without post_local_sgd (nothing phased) was
    # labelled "switch" (or "cond"), words for a branch it does not have.
    _, ledger = ledger_for(optax.sgd(0.1), 3, specialize=specialize)
    assert ledger.steps == ("ddp",) * 3 and list(ledger.phases) == ["ddp"]
    assert ledger.exact and ledger.per_step().tolist() == [ddp_bytes_per_step()] * 3
    assert str(ledger).splitlines()[2].split()[:2] == ["ddp", "3"]


def test_a_hook_that_never_switches_is_charged_as_ddp():
    # DDP spelled with a hook whose switch lies beyond the run: every step takes the
    # hook's global phase (1, as before the switch of any post-local run), same bytes
    tx = optax.chain(lsgd_jax.post_local_sgd(10**6), optax.sgd(0.1))
    _, ledger = ledger_for(tx, 3)
    assert ledger.steps == (1, 1, 1)
    assert ledger.per_step().tolist() == [ddp_bytes_per_step()] * 3
    _, ddp = ledger_for(optax.sgd(0.1), 3)
    assert ledger.link_total() == ddp.link_total()


def test_inner_axes_the_mesh_lacks_are_refused():
    # Before: inner_axes="nodes" (meant "local") reported every collective as crossing
    # nodes: [1028, 1028, 2052, ...] bytes a step, a link total of 92,496 for 10,836.
    mesh = mesh_2x4()
    tx = post_local_tx()
    step = lsgd_jax.data_parallel_step(lambda p, b: jnp.mean((b @ p) ** 2), tx, mesh)
    args = (
        lsgd_jax.replicate(jnp.zeros(N), mesh),
        lsgd_jax.replicate(tx.init(jnp.zeros(N)), mesh),
        jnp.ones((8, N)),
    )
    said = r"mesh's axes are \('node', 'local'\)"
    for typo in ["nodes", ("local", "nodes"), ["nodes"]]:
        with pytest.raises(ValueError, match=rf"inner_axes names 'nodes'.*{said}"):
            lsgd_jax.communication_ledger(step, *args, num_steps=8, inner_axes=typo)
    for wrong in [3, ("local", 3)]:
        with pytest.raises(TypeError, match=r"inner_axes must be a mesh axis's name"):
            lsgd_jax.communication_ledger(step, *args, num_steps=8, inner_axes=wrong)
    # a bare string is one axis; a list is a tuple; the default is make_mesh's "local"
    want = lsgd_jax.communication_ledger(step, *args, num_steps=8)
    assert want.inner_axes == ("local",)
    for same in ["local", ["local"], ("local",)]:
        got = lsgd_jax.communication_ledger(step, *args, num_steps=8, inner_axes=same)
        assert got.inner_axes == ("local",) and got.per_step().tolist() == want.per_step().tolist()
        assert got.link_total() == want.link_total()
    # one node (nothing crosses), or every device a node of its own (nothing stays inside)
    one = lsgd_jax.communication_ledger(step, *args, num_steps=8, inner_axes=("node", "local"))
    assert one.total() == 0 and one.link_total() == 0 and one.total("inside") == want.total("all")
    each = lsgd_jax.communication_ledger(step, *args, num_steps=8, inner_axes=())
    assert each.total("inside") == 0 and each.total() == want.total("all")


def test_the_default_inner_axes_on_a_mesh_without_local():
    # A mesh of the user's own without make_mesh's "local" axis: the default takes each
    # device for a node (as before), where an explicit "local" is refused.
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    step = lsgd_jax.data_parallel_step(lambda p, b: jnp.mean((b @ p) ** 2), optax.sgd(0.1), mesh)
    p = lsgd_jax.replicate(jnp.zeros(N), mesh)
    s = lsgd_jax.replicate(optax.sgd(0.1).init(jnp.zeros(N)), mesh)
    ledger = lsgd_jax.communication_ledger(step, p, s, jnp.ones((8, N)), num_steps=2)
    assert ledger.inner_axes == () and ledger.per_step().tolist() == [ddp_bytes_per_step()] * 2
    with pytest.raises(ValueError, match=r"inner_axes names 'local'.*mesh's axes are \('data',\)"):
        lsgd_jax.communication_ledger(step, p, s, jnp.ones((8, N)), num_steps=2, inner_axes="local")

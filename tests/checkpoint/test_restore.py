"""Restores that neither cry wolf nor fail on one damaged step (one process, 8 devices).

Static configuration (an averager, its outer optimizer) is compared by a stable
description, so an identical configuration restores silently and a changed one warns
with one short line per field. A damaged newest step is skipped, with a warning.
"""

from __future__ import annotations

import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mesh_2x4, state_for
from mp_worker import CFG

import lsgd_jax

OURS = ("restore_checkpoint", "latest_checkpoint_step", "save_checkpoint")

# After a failed array read, tensorstore may report to orbax's already closed event loop,
# from another thread, during whichever test runs then: noise from orbax, not ours.
pytestmark = pytest.mark.filterwarnings(
    "ignore:(?s).*Event loop is closed:pytest.PytestUnraisableExceptionWarning"
)


def ours(record):
    """The messages of the warnings that lsgd_jax's checkpoint functions gave."""
    return [str(w.message) for w in record if str(w.message).startswith(OURS)]


def averaging_tx(period=2, outer_lr=0.7, hook_start=CFG["start"]):
    """A fresh optax chain with an outer optimizer (closures with new addresses each time)."""
    return optax.chain(
        lsgd_jax.post_local_sgd(hook_start),
        optax.sgd(0.1),
        lsgd_jax.model_averaging(
            lsgd_jax.PeriodicModelAverager(
                period, CFG["start"], outer_optimizer=optax.sgd(outer_lr, momentum=0.9)
            )
        ),
    )


def optimizer_tx():
    return optax.chain(
        lsgd_jax.post_local_sgd(CFG["start"], post_local_gradient_allreduce=False),
        lsgd_jax.post_local_sgd_optimizer(
            optax.adam(0.01),
            lsgd_jax.HierarchicalModelAverager(
                {2: "local", 4: ("node", "local")},
                CFG["start"],
                outer_optimizer=optax.chain(optax.clip(1.0), optax.sgd(0.7, momentum=0.9)),
            ),
        ),
    )


def restore_recording(*args, **kwargs):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        restored = lsgd_jax.restore_checkpoint(*args, **kwargs)
    return restored, ours(record)


def assert_values_equal(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("make", [averaging_tx, optimizer_tx], ids=["averaging", "optimizer"])
def test_an_identical_outer_optimizer_restores_without_a_warning(make, tmp_path):
    mesh = mesh_2x4()
    saved = state_for(make(), mesh, scale=2.0)
    lsgd_jax.save_checkpoint(tmp_path, 3, saved)
    restored, warned = restore_recording(tmp_path, state_for(make(), mesh))  # rebuilt tx
    assert warned == []
    assert_values_equal(restored, saved)
    lsgd_jax.restore_checkpoint(tmp_path, state_for(make(), mesh), strict=True)  # no raise


def test_a_changed_period_warns_in_one_short_line_and_strict_raises(tmp_path):
    mesh = mesh_2x4()
    lsgd_jax.save_checkpoint(tmp_path, 3, state_for(averaging_tx(period=2), mesh))
    restored, warned = restore_recording(tmp_path, state_for(averaging_tx(period=3), mesh))
    assert len(warned) == 1
    msg = warned[0]
    assert "['opt_state'][2].averager.period: 2 -> 3" in msg
    assert len(msg) < 500 and len(msg.splitlines()) == 2, msg  # a header and one line
    assert "PyTreeDef" not in msg and "0x" not in msg
    assert restored["opt_state"][2].averager.period == 3  # the target's metadata wins
    with pytest.raises(ValueError, match=r"averager\.period: 2 -> 3(.|\n)*strict=False"):
        lsgd_jax.restore_checkpoint(tmp_path, state_for(averaging_tx(period=3), mesh), strict=True)


def test_another_outer_learning_rate_and_hook_start_are_reported(tmp_path):
    mesh = mesh_2x4()
    lsgd_jax.save_checkpoint(tmp_path, 3, state_for(averaging_tx(outer_lr=0.7), mesh))
    target = state_for(averaging_tx(outer_lr=0.5, hook_start=CFG["start"] + 1), mesh)
    _, warned = restore_recording(tmp_path, target)
    assert len(warned) == 1
    lines = warned[0].splitlines()[1:]
    assert lines[0].strip() == f"['opt_state'][0].start_localSGD_iter: {CFG['start']} -> 5"
    assert lines[1].strip().startswith("['opt_state'][2].averager.outer_optimizer: ")
    assert "step_size=-0.7" in lines[1] and "step_size=-0.5" in lines[1]
    assert len(lines) == 2 and len(warned[0]) < 500, warned[0]


def test_a_renamed_leaf_is_one_line(tmp_path):
    mesh = mesh_2x4()
    state = state_for(averaging_tx(), mesh)
    lsgd_jax.save_checkpoint(tmp_path, 1, {**state, "a": jnp.zeros(2)})
    _, warned = restore_recording(tmp_path, {**state, "b": jnp.zeros(2)})
    assert len(warned) == 1 and warned[0].splitlines()[1:] == ["  leaf ['a'] -> ['b']"]


def damage(step_dir, how):
    """Cuts every file of a step folder to half its size, or to 0 bytes."""
    for root, _, names in os.walk(step_dir):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "r+b") as f:
                f.truncate(0 if how == "zero" else os.path.getsize(path) // 2)


def listing(directory):
    return sorted(
        (os.path.relpath(os.path.join(root, n), directory), os.path.getsize(os.path.join(root, n)))
        for root, _, names in os.walk(directory)
        for n in names
    )


@pytest.mark.parametrize("how", ["half", "zero"])
def test_a_truncated_newest_step_is_skipped_with_a_warning(how, tmp_path):
    mesh = mesh_2x4()
    tx = averaging_tx()
    older = state_for(tx, mesh, scale=2.0)
    lsgd_jax.save_checkpoint(tmp_path, 2, older)
    lsgd_jax.save_checkpoint(tmp_path, 4, state_for(tx, mesh, scale=3.0))
    damage(tmp_path / "4", how)
    before = listing(tmp_path)

    with pytest.warns(UserWarning, match="latest_checkpoint_step: skipping checkpoint 4"):
        assert lsgd_jax.latest_checkpoint_step(tmp_path) == 2
    restored, warned = restore_recording(tmp_path, state_for(averaging_tx(), mesh))
    assert len(warned) == 1, warned
    assert warned[0].startswith("restore_checkpoint: skipping checkpoint 4")
    assert str(tmp_path / "4") + os.sep in warned[0]  # names the damaged file
    assert "bytes" in warned[0] or "JSON" in warned[0]  # and what is wrong with it
    assert_values_equal(restored, older)

    with pytest.raises(lsgd_jax.UnreadableCheckpointError) as err:
        lsgd_jax.restore_checkpoint(tmp_path, state_for(tx, mesh), step=4)
    msg = str(err.value)
    assert "checkpoint 4" in msg and err.value.path in msg and "readable: [2]" in msg
    assert err.value.step == 4 and err.value.path.startswith(str(tmp_path / "4"))
    assert isinstance(err.value, ValueError)
    assert listing(tmp_path) == before  # nothing deleted, nothing rewritten


def test_saving_a_skipped_step_again_sets_the_damaged_folder_aside(tmp_path):
    # Resumed from step 2 past a damaged step 4, training reaches step 4 again and saves
    # it: the damaged folder used to block that save (orbax's StepAlreadyExistsError).
    mesh = mesh_2x4()
    tx = averaging_tx()
    lsgd_jax.save_checkpoint(tmp_path, 2, state_for(tx, mesh, scale=2.0))
    lsgd_jax.save_checkpoint(tmp_path, 4, state_for(tx, mesh, scale=3.0))
    damage(tmp_path / "4", "half")
    damaged = listing(tmp_path / "4")
    newer = state_for(tx, mesh, scale=5.0)
    with pytest.warns(UserWarning, match=r"checkpoint 4 exists but is unreadable.*4.unreadable"):
        lsgd_jax.save_checkpoint(tmp_path, 4, newer)
    assert listing(tmp_path / "4.unreadable") == damaged  # kept as it was
    assert lsgd_jax.latest_checkpoint_step(tmp_path) == 4
    restored, warned = restore_recording(tmp_path, state_for(tx, mesh))
    assert warned == []
    assert_values_equal(restored, newer)
    with pytest.raises(ValueError, match="step 4 already exists"):  # an intact step stays put
        lsgd_jax.save_checkpoint(tmp_path, 4, newer)


def test_every_step_damaged_raises_one_error_that_lists_them(tmp_path):
    mesh = mesh_2x4()
    for s in (1, 2):
        lsgd_jax.save_checkpoint(tmp_path, s, state_for(averaging_tx(), mesh))
        damage(tmp_path / str(s), "zero")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert lsgd_jax.latest_checkpoint_step(tmp_path) is None
    assert [m[:47] for m in ours(record)] == [
        "latest_checkpoint_step: skipping checkpoint 2, ",
        "latest_checkpoint_step: skipping checkpoint 1, ",
    ]
    with pytest.warns(UserWarning, match="skipping checkpoint"):
        with pytest.raises(
            lsgd_jax.UnreadableCheckpointError, match=r"no readable checkpoint.*step 2: "
        ):
            lsgd_jax.restore_checkpoint(tmp_path, state_for(averaging_tx(), mesh))


def strip_to_old_format(step_dir):
    """What today's code saved: no file-size list, no static config in the manifest."""
    os.remove(step_dir / "lsgd_jax_files.json")
    manifest = step_dir / "manifest" / "metadata"
    saved = json.loads(manifest.read_text())
    assert {"static", "skeleton"} <= saved.keys()
    manifest.write_text(json.dumps({k: saved[k] for k in ("paths", "shapes", "dtypes", "treedef")}))


def test_a_checkpoint_of_the_old_format_restores_silently(tmp_path):
    mesh = mesh_2x4()
    saved = state_for(averaging_tx(), mesh, scale=2.0)
    lsgd_jax.save_checkpoint(tmp_path, 3, saved)
    strip_to_old_format(tmp_path / "3")
    assert lsgd_jax.latest_checkpoint_step(tmp_path) == 3
    restored, warned = restore_recording(tmp_path, state_for(averaging_tx(), mesh))
    assert warned == []  # the treedefs differ only in memory addresses
    assert_values_equal(restored, saved)
    _, warned = restore_recording(tmp_path, state_for(averaging_tx(period=3), mesh))
    assert len(warned) == 1 and len(warned[0]) < 500, warned
    assert "period=2" in warned[0] and "period=3" in warned[0]


def test_arrays_that_fail_to_read_fall_back_to_the_older_step(tmp_path):
    mesh = mesh_2x4()
    older = state_for(averaging_tx(), mesh, scale=2.0)
    lsgd_jax.save_checkpoint(tmp_path, 2, older)
    lsgd_jax.save_checkpoint(tmp_path, 4, state_for(averaging_tx(), mesh, scale=3.0))
    strip_to_old_format(tmp_path / "4")  # no size list: the cheap check cannot see it
    damage(tmp_path / "4" / "arrays" / "d", "zero")
    assert lsgd_jax.latest_checkpoint_step(tmp_path) == 4
    restored, warned = restore_recording(tmp_path, state_for(averaging_tx(), mesh))
    assert len(warned) == 1 and "skipping checkpoint 4" in warned[0], warned
    assert "arrays failed to read" in warned[0]
    assert_values_equal(restored, older)
    with pytest.raises(
        lsgd_jax.UnreadableCheckpointError, match="checkpoint 4 .*arrays failed to read"
    ):
        lsgd_jax.restore_checkpoint(tmp_path, state_for(averaging_tx(), mesh), step=4)


def test_the_file_size_list_is_written_after_the_save_and_stays_true(tmp_path):
    mesh = mesh_2x4()
    state = state_for(averaging_tx(), mesh)
    path = lsgd_jax.save_checkpoint(tmp_path, 5, state)
    assert path == str(tmp_path / "5")
    sizes = dict(listing(path))
    files = json.loads((tmp_path / "5" / "lsgd_jax_files.json").read_text())["files"]
    assert files == {k: v for k, v in sizes.items() if k != "lsgd_jax_files.json"}
    assert "_CHECKPOINT_METADATA" in files and "manifest/metadata" in files
    # Later saves (and their max_to_keep clean-up) and restores leave older steps intact.
    for s in (6, 7):
        lsgd_jax.save_checkpoint(tmp_path, s, state, max_to_keep=2)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert lsgd_jax.latest_checkpoint_step(tmp_path) == 7
        lsgd_jax.restore_checkpoint(tmp_path, state, step=6)
        lsgd_jax.restore_checkpoint(tmp_path, state)
    assert ours(record) == []
    assert sorted(os.listdir(tmp_path)) == ["6", "7"]
    assert not any(n.startswith(".") for _, _, names in os.walk(tmp_path) for n in names)

"""The old module paths keep every name they had, and the namespaces every name.

The package moved its flat modules into folders in commit 9c4ecf6 (``lsgd_jax/_moved.py``
keeps the old paths for one release). The lists below were generated once from the
commit before it, 70159c6beb0a3204477d0e24cd9927f4c807a5ee (``git archive 70159c6
lsgd_jax``, each module imported there): every name without a leading underscore that
a module defined at its top level or imported from lsgd_jax itself (names it imported
from other packages, such as ``jax`` or ``Any``, are left out).
"""

import importlib
import sys
import warnings

import pytest

import lsgd_jax
from lsgd_jax import _moved

# old private module -> its public-looking names at 70159c6
OLD_MODULES = {
    "lsgd_jax._attempts": (
        "AXES Attempts CoordinatorLostError Layout LeftBehindError RunEndedError View Watchdog "
        "adopt check_members data_axes first_line logger peer_gone settle"
    ),
    "lsgd_jax._average_call": (
        "ModelAveragerState alongside average_level comm dispatch like_params run "
        "strategy_alongside"
    ),
    "lsgd_jax._averager_state": (
        "ModelAveragerState Struct check_state comm initial_state pytree_dataclass static_field"
    ),
    "lsgd_jax._averaging": (
        "AdaptiveSchedule Averager Group GroupSpec HierarchicalModelAverager "
        "HierarchicalSchedule ModelAveragerState NONFINITE_POLICIES PeriodicModelAverager "
        "PeriodicSchedule check_averager check_state comm initial_state logger"
    ),
    "lsgd_jax._chain_order": "ModelAveragerState Place PostLocalSGDState check describe places",
    "lsgd_jax._checkpoint": (
        "UnreadableCheckpointError assert_replicas_in_sync latest_checkpoint_step "
        "restore_checkpoint save_checkpoint"
    ),
    "lsgd_jax._checkpoint_config": (
        "ModelAveragerState PostLocalSGDState differences mismatch skeleton static_config "
        "strip_addresses"
    ),
    "lsgd_jax._checkpoint_files": (
        "Damaged UnreadableCheckpointError damage readable set_aside_if_damaged skipped_message "
        "step_dir write_file_sizes"
    ),
    "lsgd_jax._collectives": (
        "Axes AxisName AxisNotBoundError Group GroupSpec IndexGroups accumulation_dtype "
        "all_gather_tiled all_reduce bound_axes cast_like cast_tree_like cast_varying "
        "finite_mean global_axes group_axes group_covers group_size is_averaged mean "
        "node_groups normalize_group resolve vma"
    ),
    "lsgd_jax._compat": (
        "COMPILE_FUNCTIONS all_gather_invariant backends_are_initialized compiling "
        "distributed_client distributed_runtime_service mapped_axis_names stablehlo_module"
    ),
    "lsgd_jax._compile_cache": "DEFAULT ENV default_directory use_compilation_cache",
    "lsgd_jax._elastic_checkpoint": (
        "Checkpoints as_dict as_state check_args data_axes finalized latest_step logger "
        "write_staged"
    ),
    "lsgd_jax._fragments": "Cut Fragment WHOLE Whole",
    "lsgd_jax._fsdp": "check_axes gather leaf_spec scatter size split_rows",
    "lsgd_jax._heal": "heal local_flags replica_spec reshard",
    "lsgd_jax._hook": (
        "DEFAULT_SUBGROUP GroupSpec PostLocalSGDState comm keeps_residual post_localSGD_hook "
        "post_local_sgd"
    ),
    "lsgd_jax._ledger": (
        "CommunicationReport Ledger PhaseBytes communication_ledger crosses_nodes parse_hlo "
        "skips_on_device"
    ),
    "lsgd_jax._membership": (
        "COMMITTED CoordinatorLostError FAILED FINISHED LATEST Layout LeftBehindError "
        "Membership PREFIX RunEndedError RunOver View client device_rows external_coordinator "
        "finished_step forget_global_topology forget_own_gloo_keys forget_user_error layout_for "
        "leader logger lost mark_committed mark_failed mark_finished newcomer note_committed "
        "post_user_error raise_user_error run_over set_external_coordinator"
    ),
    "lsgd_jax._mesh": (
        "LOCAL_AXIS NODE_AXIS consensus data_axes make_mesh replica_spec replicate unreplicate"
    ),
    "lsgd_jax._offload": "BUFFERS HOST ModelAveragerState buffers is_offloaded place",
    "lsgd_jax._optim": (
        "Averager ModelAveragerState PostLocalSGDOptimizerState Struct averaged_updates "
        "check_averager check_state comm model_averaging post_local_sgd_optimizer "
        "pytree_dataclass"
    ),
    "lsgd_jax._outer": (
        "Assign Group IndexGroups OuterStep Parts SendDelta SendParams common_anchor delta_of "
        "outer_step select undelta"
    ),
    "lsgd_jax._pairing": (
        "DEFAULT_SUBGROUP ModelAveragerState PostLocalSGDState check_configuration has_hook"
    ),
    "lsgd_jax._phase": (
        "ModelAveragerState PostLocalSGDState STATE_TYPES branching_states calls_left "
        "counters_snapshot num_phases phase_index pin replay_digits replay_phases unpin"
    ),
    "lsgd_jax._phase_plan": "PhasePlan SKIPPING_WRAPPERS skips_on_device",
    "lsgd_jax._preflight": (
        "ModelAveragerState PostLocalSGDState check_phases check_tx describe_phase "
        "explicit_axes probe"
    ),
    "lsgd_jax._quantize": (
        "Group IndexGroups Layout MAX_BLOCK QMAX check_bits_and_block decode dequantize encode "
        "one_level pack_nibbles plan position quantize quantized_mean two_level unpack_nibbles "
        "wire_bytes_per_value zeros_state"
    ),
    "lsgd_jax._report": (
        "Collective CommunicationReport SCOPES communication_report parse_hlo parse_stablehlo"
    ),
    "lsgd_jax._resize": "ModelAveragerState ReplicasOutOfSyncError apply read_abstract roles",
    "lsgd_jax._schedule": (
        "AdaptiveSchedule HierarchicalSchedule INT32_MAX PeriodicSchedule Schedule"
    ),
    "lsgd_jax._stacked": "data_axes stacked",
    "lsgd_jax._state": "GroupSpec PostLocalSGDState Struct keeps_residual logger static_field",
    "lsgd_jax._step": (
        "DataParallelStep MAX_PHASES PhasePlan StepSpec assert_replicas_in_sync averager_states "
        "data_axes data_parallel_step"
    ),
    "lsgd_jax._step_inputs": (
        "Identity check_axes check_batch check_compiler_options check_replicated place_batch"
    ),
    "lsgd_jax._step_program": (
        "MAX_PHASES ModelAveragerState StepSpec averager_states check_optimizer "
        "check_when_built program"
    ),
    "lsgd_jax._struct": "Struct T pytree_dataclass static_field",
    "lsgd_jax._sync": (
        "ModelAveragerState PostLocalSGDState ReplicasOutOfSyncError assert_replicas_in_sync "
        "step_counters"
    ),
    "lsgd_jax._validate": "boolean nonnegative_int one_of optional_positive_int positive_int",
    "lsgd_jax._wire": (
        "Group IndexGroups Packed axis_and_kwargs check_inner_axis empty_mean narrow_mean pack "
        "split_two_level two_level_mean two_level_sum"
    ),
}

# public namespace -> every public name it had at 70159c6 (lsgd_jax.comm and
# lsgd_jax.elastic were modules then; their names outside __all__ count too)
OLD_NAMESPACES = {
    "lsgd_jax": (
        "AdaptiveSchedule AxisNotBoundError Collective CommunicationReport DataParallelStep "
        "HierarchicalModelAverager HierarchicalSchedule IndexGroups Ledger ModelAveragerState "
        "PeriodicModelAverager PeriodicSchedule PhaseBytes PostLocalSGDOptimizerState "
        "PostLocalSGDState ReplicasOutOfSyncError UnreadableCheckpointError "
        "assert_replicas_in_sync averager_states check_configuration comm communication_ledger "
        "communication_report consensus data_axes data_parallel_step elastic "
        "latest_checkpoint_step make_mesh model_averaging node_groups num_phases phase_index "
        "post_localSGD_hook post_local_sgd post_local_sgd_optimizer replay_phases replicate "
        "restore_checkpoint save_checkpoint stacked step_counters unreplicate "
        "use_compilation_cache"
    ),
    "lsgd_jax.comm": (
        "Communication Compressed FiniteOnly Flat Group Mean NONFINITE_POLICIES Quantized "
        "TwoLevel apply compressed finite_only flat logger quantized two_level"
    ),
    "lsgd_jax.elastic": (
        "CoordinatorLostError ElasticLoop ElasticResult Layout LeftBehindError StepRecord "
        "initialize logger shutdown use_compilation_cache"
    ),
}


def fresh_import(old):
    """Imports the old path anew (a test before may have imported it already)."""
    sys.modules.pop(old, None)
    return importlib.import_module(old)


def test_the_lists_cover_every_old_path():
    assert {old.removeprefix("lsgd_jax.") for old in OLD_MODULES} == set(_moved.MOVED)
    assert sum(len(names.split()) for names in OLD_MODULES.values()) == 329


@pytest.mark.parametrize("old", sorted(OLD_MODULES))
def test_every_name_an_old_module_had_imports_from_its_old_path(old):
    # Before: 22 of these raised ImportError (e.g. from lsgd_jax._report import
    # Collective; _quantize.quantize, _membership.LeftBehindError, _phase.STATE_TYPES).
    new = "lsgd_jax." + _moved.MOVED[old.removeprefix("lsgd_jax.")]
    with pytest.warns(DeprecationWarning, match=f"^{old} has moved to {new};"):
        module = fresh_import(old)
    home = importlib.import_module(new)
    missing = []
    for name in OLD_MODULES[old].split():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                value = {}
                exec(f"from {old} import {name} as value", {}, value)  # noqa: S102
            except ImportError as error:
                missing.append(f"{name}: {error}")
                continue
        if hasattr(home, name):  # the same object as at its new home, without a word
            assert value["value"] is getattr(home, name), name
            assert caught == [], name
        else:  # from a neighbour: a warning that names where it lives now
            (warning,) = caught
            assert warning.category is DeprecationWarning
            assert str(warning.message).startswith(f"{old}.{name} has moved: use "), name
    assert missing == []
    assert set(OLD_MODULES[old].split()) <= set(dir(module))


def test_the_names_that_moved_elsewhere_are_what_they_were():
    from lsgd_jax.comm import _codec
    from lsgd_jax.report import _records

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from lsgd_jax._attempts import data_axes
        from lsgd_jax._average_call import strategy_alongside
        from lsgd_jax._averaging import NONFINITE_POLICIES
        from lsgd_jax._elastic_checkpoint import data_axes as mesh_data_axes
        from lsgd_jax._membership import LeftBehindError, RunOver
        from lsgd_jax._phase import STATE_TYPES
        from lsgd_jax._quantize import QMAX, quantize
        from lsgd_jax._report import SCOPES, Collective

    assert STATE_TYPES == (lsgd_jax.PostLocalSGDState, lsgd_jax.ModelAveragerState)
    assert NONFINITE_POLICIES == ("propagate", "exclude", "skip")
    assert data_axes() == ("node", "local") and data_axes(("local",)) == ("node",)
    assert mesh_data_axes is lsgd_jax.data_axes
    quantized = lsgd_jax.comm.quantized(8)
    assert strategy_alongside(quantized) == quantized.alongside() != quantized
    assert strategy_alongside(lsgd_jax.comm.flat()) == lsgd_jax.comm.flat()
    assert LeftBehindError is lsgd_jax.elastic.LeftBehindError and issubclass(RunOver, SystemExit)
    assert (quantize, QMAX) == (_codec.quantize, {8: 127, 4: 7})
    assert (Collective, SCOPES) == (lsgd_jax.Collective, _records.SCOPES)


def test_the_warnings_name_the_replacement_and_unknown_names_fail_clearly(monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        report = fresh_import("lsgd_jax._report")
        phase = fresh_import("lsgd_jax._phase")
    said = r"^lsgd_jax\._report\.Collective has moved: use lsgd_jax\.report\._records\.Collective"
    with pytest.warns(DeprecationWarning, match=said):
        _ = report.Collective
    with pytest.warns(DeprecationWarning, match=r"STATE_TYPES has moved: use a state's KIND"):
        _ = phase.STATE_TYPES
    with pytest.raises(
        AttributeError, match=r"'lsgd_jax\._report' \(now lsgd_jax\.report\._report\)"
    ):
        _ = report.no_such_name
    with pytest.raises(ImportError, match="no_such_name"):
        from lsgd_jax._report import no_such_name  # noqa: F401
    # as when the old path was the module itself: setting a name sets it at the new home
    monkeypatch.setattr(report, "communication_report", "patched")
    assert lsgd_jax.report._report.communication_report == "patched"


@pytest.mark.parametrize("namespace", sorted(OLD_NAMESPACES))
def test_every_public_name_of_a_namespace_before_the_move_still_resolves(namespace):
    # Before: lsgd_jax.comm.NONFINITE_POLICIES (and .Group, .logger) and
    # lsgd_jax.elastic.use_compilation_cache (and .logger) were gone.
    module = importlib.import_module(namespace)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # public names: no deprecation
        missing = [n for n in OLD_NAMESPACES[namespace].split() if not hasattr(module, n)]
    assert missing == []


def test_the_restored_namespace_names_are_what_they_were():
    assert lsgd_jax.comm.NONFINITE_POLICIES == ("exclude", "skip")  # finite_only's policies
    assert lsgd_jax.elastic.use_compilation_cache is lsgd_jax.use_compilation_cache
    assert lsgd_jax.comm.logger.name == "lsgd_jax"
    assert lsgd_jax.elastic.logger.name == "lsgd_jax.elastic"
    assert lsgd_jax.comm.Group is lsgd_jax._core._collectives.Group

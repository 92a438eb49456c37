"""Fixtures: an autouse leak check around every test, and MXNet warmed for the tests marked
``mxnet`` (the pure-Python modules' tests run without it). Helpers live in ``_helpers``."""
from __future__ import annotations

import gc
import os
import signal
import sys
import tempfile

import pytest

from _helpers import known_stats, leaks, snapshot
from _servers import moto_server  # noqa: F401  (fixture: the one `s3` of _servers asks for)

# Not in the edit loop's subset (``python -m pytest -m fast``, about 45 s on 2 cores): the tests
# that start interpreters, MXNet jobs, clusters, servers or examples, search deeply, or wait out a
# timeout on purpose (each takes about a second or more). A test is ``fast`` unless it is named
# here (every parametrization of it); the whole suite, which CI runs, holds them all.
EVERY_TEST = ("*",)
NOT_FAST = {
    "test_api.py": (
        "test_the_pure_python_parts_are_tested_without_mxnet",
    ),
    "test_bench.py": (
        "test_bench_runs_end_to_end_and_json_has_every_contender_and_figure",
        "test_stragglers_and_window_epochs_run_end_to_end_on_tiny_settings",
        "test_the_generator_sleeps_longer_for_straggling_keys_and_varies_per_epoch",
    ),
    "test_cache.py": (
        "test_a_cache_whose_shards_cannot_be_touched_still_serves_them",
        "test_a_changed_command_regenerates_the_shard_with_a_warning",
        "test_a_complete_cache_on_a_read_only_file_system_serves_its_shards",
        "test_a_generator_that_writes_a_symlink_is_refused",
        "test_a_shard_made_by_another_process_with_another_command_is_regenerated",
        "test_a_symlink_in_the_cache_is_not_followed",
        "test_cache_limit_keeps_an_endless_stream_within_the_limit",
        "test_demo_rerun_with_other_rows_trains_on_new_shards",
        "test_stale_temp_and_lock_files_are_removed_at_start_but_live_ones_kept",
        "test_the_demo_generator_with_other_arguments_does_not_reuse_shards",
        "test_the_eviction_lock_excludes_other_processes",
        "test_two_processes_on_the_same_key_share_one_generation",
        "test_version_and_env_are_part_of_the_recipe",
        "test_when_the_lock_holder_is_killed_the_waiter_takes_over",
    ),
    "test_checkpoint.py": (
        "test_estimator_resumes_from_epoch_checkpoints_with_the_same_batches",
        "test_without_mxnet_the_names_import_and_using_them_names_the_extra",
    ),
    "test_checkpoint_example.py": EVERY_TEST,
    "test_cli.py": (
        "test_demo_trains_prints_a_table_and_writes_the_timeline",
        "test_generate_failures_name_cli_flags_and_keep_the_stderr_tail",
        "test_generate_fills_the_cache_in_parallel_then_skips_cached_keys",
        "test_help_on_every_subcommand",
        "test_inspect_works_without_mxnet",
        "test_light_commands_never_import_mxnet_or_matplotlib",
        "test_python_m_gluon_stream_help",
    ),
    "test_cores.py": (
        "test_auto_producers_do_not_grow_past_the_cores_this_process_may_use",
    ),
    "test_dask.py": EVERY_TEST,
    "test_distributed.py": (
        "test_a_cache_filled_ahead_by_generate_counts_as_sizes_known",
        "test_ranks_as_real_processes",
    ),
    "test_docs.py": (
        "test_runnable_blocks_run",
    ),
    "test_drop_in.py": (
        "test_a_gluoncv_cifar_style_training_loop",
    ),
    "test_elastic.py": (
        "test_resized_twice_every_sample_once",
    ),
    "test_elastic_kvstore.py": EVERY_TEST,
    "test_endless_resume.py": (
        "test_a_state_resumes_exactly_in_a_new_process_that_builds_its_keys_anew",
        "test_the_shard_each_state_resumes_in_is_not_the_first_one",
    ),
    "test_examples.py": EVERY_TEST,
    "test_fuzz.py": EVERY_TEST,
    "test_import_order.py": EVERY_TEST,
    "test_horovod.py": EVERY_TEST,
    "test_kvstore.py": EVERY_TEST,
    "test_loader.py": (
        "test_an_unclosed_loader_does_not_hold_up_the_interpreters_exit",
        "test_close_does_not_wait_forever_for_a_stuck_python_fn",
        "test_command_source_caches_and_reports_failures",
        "test_epoch_in_command_caches_per_key_and_epoch",
    ),
    "test_mix.py": (
        "test_command_sources_sharing_a_cache_dir_stay_apart_per_epoch",
        "test_resume_after_every_batch_over_three_epochs_equals_the_uninterrupted_run",
    ),
    "test_mx.py": (
        "test_ending_a_pool_whose_worker_died_holding_a_queue_lock_does_not_hang",
    ),
    "test_mx_numpy_aliases.py": EVERY_TEST,
    "test_reference_model.py": EVERY_TEST,
    "test_resume.py": (
        "test_resume_after_every_batch_gives_the_uninterrupted_sequence",
    ),
    "test_robustness.py": (
        "test_a_loader_waiting_for_a_slow_generator_sleeps",
        "test_a_slow_batch_raises_batch_timeout_naming_what_was_slow",
        "test_close_from_another_thread_while_a_worker_is_busy_gives_loader_closed",
        "test_command_failures_with_skip_drop_exactly_those_shards",
        "test_jupyter_style_interrupts_20_times_leak_nothing",
        "test_schema_drift_raises_before_any_batch_of_that_shard",
        "test_timeout_errors_from_generators_and_transforms_reach_the_user",
    ),
    "test_s3.py": (
        "test_two_processes_share_an_s3_cache_dir",
    ),
    "test_scale.py": EVERY_TEST,
    "test_shuffle_window.py": (
        "test_resume_at_every_batch_gives_the_same_batches_twice_in_a_row",
        "test_resume_is_exact_around_a_skipped_shard",
        "test_the_per_sample_paths_give_the_slice_paths_batches",
    ),
    "test_sources.py": (
        "test_a_directory_left_at_a_temp_path_by_a_crashed_run_is_cleaned_up",
        "test_a_fifo_at_path_is_never_opened",
        "test_hang_raises_shard_timeout_and_kills_the_whole_process_group",
        "test_nonzero_exit_raises_shard_error_after_the_retries_with_the_stderr_tail",
        "test_waiting_for_a_slow_generator_does_not_busy_wait",
    ),
    "test_state_fuzz.py": EVERY_TEST,
    "test_stats.py": (
        "test_endless_streams_keep_a_bounded_window_of_records_and_exact_totals",
    ),
    "test_stream.py": (
        "test_generate_ahead_keeps_batches_and_resumes_exactly",
        "test_generating_ahead_reaches_the_next_epoch_only",
    ),
    "test_tuning.py": (
        "test_the_bench_compares_the_budget_with_a_grid_and_a_tight_budget",
        "test_tuned_loaders_resumed_anywhere_match_the_reference_model",
        "test_the_budget_holds_on_shards_of_known_size",
        "test_the_budget_holds_in_every_shape_in_a_fresh_process",
    ),
    "test_types.py": (
        "test_mypy_finds_nothing_in_the_package",
    ),
    "test_worker_parent.py": (
        "test_a_training_process_killed_with_sigkill_leaves_no_worker_and_no_shm_file",
    ),
    "test_worker_seeding.py": (
        "test_a_resumed_run_augments_the_rest_as_the_unbroken_run_did",
        "test_mxnet_draws_are_seeded_per_batch_whichever_way_operators_run",
        "test_the_same_seed_gives_the_same_batches_with_any_number_of_worker_processes",
    ),
    "test_workers.py": (
        "test_after_a_batch_timeout_the_stuck_worker_is_replaced_and_the_next_epoch_works",
        "test_batches_keep_their_structure_and_types_through_the_slots",
    ),
}


# Tests that one pytest-xdist worker runs one after another (``xdist_group``), never two at
# once: the kvstore jobs (four MXNet processes each, which wait for one another at every step).
XDIST_GROUPS = {
    "test_kvstore.py": "kvstore",
    "test_elastic_kvstore.py": "kvstore",
}


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (setup.cfg): a worker per core this process may use (its affinity, as
    ``producers='auto'`` counts them, not psutil's physical cores: 1 on a 2-vCPU machine), at
    most 8 (each imports MXNet; the longest tests bound the time beyond), none on one core
    (the tests run in pytest's own process). ``PYTEST_XDIST_AUTO_NUM_WORKERS`` overrides it."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return min(cores or 1, 8) if (cores or 1) > 1 else 0


def pytest_collection_modifyitems(config, items):
    """Mark ``fast`` every test that ``NOT_FAST`` does not name; under pytest-xdist, put the
    ones it names first (each takes a second or more: handed out first, they leave the short
    ones to the end, where the workers then finish together) and group the tests of
    ``XDIST_GROUPS``."""
    slow = []
    for item in items:
        not_fast = NOT_FAST.get(item.path.name, ())
        if not_fast == EVERY_TEST or getattr(item, "originalname", item.name) in not_fast:
            slow.append(item)
        else:
            item.add_marker(pytest.mark.fast)
        group = XDIST_GROUPS.get(item.path.name)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    if hasattr(config, "workerinput"):  # an xdist worker: every worker orders them alike
        first = set(map(id, slow))
        items[:] = slow + [item for item in items if id(item) not in first]


def pytest_collection_finish(session):
    """Move what collection imported (MXNet, numpy, hypothesis, the test modules) out of the
    collector's reach: the leak check's ``gc.collect()`` after every test then walks only what
    the tests made (a tenth of a second less per test). Frozen objects are still freed by
    reference counting; only cycles among them, made before any test ran, stay."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session", autouse=True)
def own_temp_dir(tmp_path_factory):
    """``tempfile``'s directory (TMPDIR, children inherit it) is this process's own: what a
    test finds there, or leaves, is its own, not another xdist worker's or session's."""
    path = str(tmp_path_factory.mktemp("tmp"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TMPDIR", path)
        mp.setattr(tempfile, "tempdir", path)
        yield path


@pytest.fixture(scope="session")
def warm_mxnet():
    """Start MXNet's engine once so its own lazily opened files do not count as leaks."""
    import mxnet as mx
    import numpy as np

    import gluon_stream as gs

    (mx.nd.ones((2, 2)) + 1).asnumpy()
    loader = gs.StreamLoader(gs.FunctionSource([0], lambda k: np.zeros((4, 2))), batch_size=2,
                             batchify_fn=mx.gluon.data.dataloader.default_batchify_fn,
                             num_workers=1)
    list(loader)
    loader.close()
    del loader
    gc.collect()
    gc.freeze()  # what MXNet made at start, as pytest_collection_finish does
    yield


@pytest.fixture(scope="session")
def warm_matplotlib(tmp_path_factory):
    """matplotlib opens its font files lazily and keeps them open: not a leak of ours."""
    pytest.importorskip("matplotlib")
    known_stats().plot(tmp_path_factory.mktemp("warm") / "warm.png")


@pytest.fixture(autouse=True)
def leak_check(request):
    """Fail a test that leaves threads, child processes, fds or /dev/shm entries behind."""
    if request.node.get_closest_marker("mxnet"):
        request.getfixturevalue("warm_mxnet")
    before = snapshot()
    yield
    if request.node.get_closest_marker("no_leak_check"):
        return
    found = leaks(before)
    assert not found, f"resources leaked by {request.node.name}: {found}"


@pytest.fixture
def python() -> str:
    return sys.executable


@pytest.fixture
def sigint():
    """Ctrl-C raises KeyboardInterrupt during the test, even when the suite runs in a shell that
    ignores SIGINT (``nohup ... &`` starts it with SIG_IGN); the handler is restored after."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)

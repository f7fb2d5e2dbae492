"""Shared fixtures.

``ranks`` runs a module-level function on every rank of a gloo process group, using
persistent worker pools (one per world size) that live for the whole session; see
``tests/distributed.py`` for the rules and failure behaviour::

    def _work(x):
        ...  # runs on each rank; torch.distributed is initialised (gloo)
        return result  # picklable; tensors come back detached, on CPU

    def test_something(ranks):
        per_rank = ranks.run(2, _work, x, timeout=60)  # list indexed by rank
"""

from __future__ import annotations

import os
import sys

# The example models (examples/models.py, examples/model_styles.py, ...) import as top-level
# modules in every test module and, through the inherited sys.path, in the rank workers.
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)

# No GPU here: the Triton kernels run under Triton's interpreter. It is chosen when a
# kernel is decorated, so the variable is set before anything imports them; the
# spawned rank workers inherit it.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# tests/ has no __init__.py: pytest (rootdir, prepend import mode) puts tests/ on
# sys.path, which the spawned workers inherit, so this and the test modules import
# as top-level modules there too.
from distributed import RankPools


# Test tiers. ``./dev test`` runs everything (CI); ``./dev test --fast`` (``-m "not slow and
# not inductor"``) is the inner loop, about 5 minutes here. SLOW: the test functions one of
# whose cases took 2 s or more in a full run on 2 busy cores (``./dev test --durations=0``),
# except one end-to-end model test and one ring-op test that the fast tier keeps as smoke.
INDUCTOR = {"test_schedule.py": {"test_inductor_overlap_config_reorders_the_backward_and_the_warm_cache_hits"},
            "test_zoo_encoders.py": {"test_rank_dependent_graphs_keep_one_collective_order_under_inductor"}}
SLOW = {
    "test_zoo.py": {"test_zoo_member_is_exact_ring_only_and_sharded", "test_cli_explain_on_the_member_file_prints_the_record"},
    "test_zoo_bias.py": {"test_alibi_variants_are_exact"},
    "test_zoo_positions.py": {"test_position_ids_member_with_padding_is_exact"},
    "test_zoo_shift.py": {"test_next_frame_regression_losses_are_exact_without_a_gather", "test_shifted_losses_are_exact_without_a_gather"},
    "test_zoo_encoders.py": {"test_eval_mode_is_exact"},
    "test_zoo_moe.py": {"test_aux_loss_is_the_one_process_aux_loss", "test_graph_breaks_at_nonzero_are_exact", "test_hf_mixtral_experts_stay_on_this_ranks_rows"},
    "test_attention_always_ring.py": {"test_attention_on_whole_values_becomes_the_ring"},
    "test_backend.py": {"test_any_sequence_length_is_padded_and_exact", "test_backend_name_resolves_without_importing_cp_compile", "test_gqa_ships_only_the_kv_heads", "test_grad_sync_none_leaves_shares_that_sum_to_the_gradient", "test_graph_break_between_layers_stays_exact", "test_label_shift_inside_model_is_exact_without_a_gather", "test_llama_on_four_ranks", "test_padding_rows_never_count_in_the_loss", "test_rewritten_graph_metadata_holds_local_and_global_shapes", "test_step_issues_exactly_the_expected_ring_transfers", "test_twenty_adamw_steps_track_single_device", "test_without_process_group_the_backend_is_a_passthrough"},
    "test_backend_dynamic.py": {"test_changing_sequence_lengths_stay_exact", "test_dynamic_shapes_on_other_models", "test_local_inputs_with_a_symbolic_length_are_exact", "test_outputs_full_and_local"},
    "test_backend_masks.py": {"test_hf_attention_mask_with_padding_is_exact", "test_masks_under_dynamic_shapes"},
    "test_cli_graph.py": {"test_dump_backward_stage_shows_the_ring_and_every_gradient_all_reduce", "test_explain_hf_llama_packed_documents_states_the_document_ids", "test_factory_return_forms_explain_and_dump"},
    "test_cli_plan.py": {"test_module_entry_point"},
    "test_compose.py": {"test_ddp_default_mean_over_dp_x_cp_halves_the_gradient", "test_ddp_optimizer_with_grad_sync_none_equals_one_process", "test_dp_x_cp_equals_one_process_on_the_global_batch", "test_graph_breaks_with_grad_sync_none_leave_shares_that_sum_to_the_gradient", "test_per_layer_fsdp_with_grad_sync_none_equals_one_process"},
    "test_compose_recipes.py": {"test_fsdp_bf16_mixed_precision_within_twice_the_one_process_error", "test_gradient_accumulation_with_no_sync_equals_one_process"},
    "test_determinism.py": {"test_compiled_model_bitwise_identical_across_runs_and_ranks"},
    "test_doc_balance_backend.py": {"test_hand_written_packed_model_is_exact", "test_hf_llama_packed_is_exact", "test_the_graph_table_balances_where_zigzag_does_not"},
    "test_faults.py": {"test_backend_timeout_reaches_the_ring", "test_default_limit_is_the_process_group_timeout", "test_peer_exits_during_step_1_four_ranks", "test_peer_exits_during_step_1_two_ranks", "test_peer_raises_and_stays_alive_times_out"},
    "test_fuzz.py": {"test_fuzz_models_world_2", "test_fuzz_models_world_4"},
    "test_flex_attention.py": {"test_flex_model_is_exact_and_ring_only", "test_reference_is_the_compiled_one_process_run", "test_return_lse_is_the_rings"},
    "test_hand_attention.py": {"test_hand_written_attention_becomes_the_ring"},
    "test_harness.py": {"test_all_reduce_sums_over_ranks", "test_dead_worker_is_reported_and_pool_recovers", "test_exception_names_rank_and_pool_recovers", "test_hang_times_out_and_pool_recovers"},
    "test_hf_alibi.py": {"test_alibi_families_are_exact_ring_attention"},
    "test_hf_architectures.py": {"test_slow_architecture_has_its_outcome"},
    "test_autocast.py": {"test_autocast_on_two_ranks", "test_autocast_on_four_ranks"},
    "test_checkpointed.py": {"test_checkpointed_blocks_are_context_parallel_and_exact", "test_hugging_face_gradient_checkpointing"},
    "test_hf_trainer.py": {"test_trainer_losses_equal_one_process"},
    "test_per_block_compile.py": {"test_blocks_compiled_one_by_one_are_exact_ring_only_and_gather_only_their_output", "test_compile_blocks_keeps_the_sequence_sharded_between_blocks"},
    "test_hf_models.py": {"test_hf_causal_lm_is_exact_on_two_ranks", "test_hf_gpt2_dynamic_lengths", "test_hf_gpt2_with_labels_across_a_graph_break", "test_hf_llama_on_four_ranks_with_padding", "test_hf_sliding_window_shorter_than_the_sequence"},
    "test_mha.py": {"test_eval_fast_path_becomes_ring_attention", "test_mha_becomes_ring_attention"},
    "test_misuse.py": {"test_mode_and_options_with_a_ringcp_object"},
    "test_model_styles.py": {"test_style_is_exact_ring_only_and_gather_free"},
    "test_models.py": {"test_compiles_as_one_graph"},
    "test_options.py": {"test_decorator_takes_every_mesh_form", "test_option_value_compiles_runs_and_is_exact"},
    "test_ring_masks.py": {"test_sliding_window_matches_sdpa"},
    "test_packed_docs.py": {"test_hand_written_document_masks", "test_hf_llama_packed_position_ids_give_the_ring_document_ids", "test_hf_llama_packed_with_padding", "test_hf_mistral_packed_sliding_window_keeps_its_window"},
    "test_ring_docs.py": {"test_documents_match_sdpa"},
    "test_same_batch.py": {"test_ranks_given_different_batches_all_raise_naming_the_input_and_the_fix",
                           "test_local_inputs_are_not_checked"},
    "test_ring_opcheck.py": {"test_ring_custom_ops_pass_opcheck"},
    "test_ring_mods.py": {"test_ring_op_with_mods_passes_opcheck", "test_traced_ring_attention_is_one_graph_and_exact"},
    "test_ring_table.py": {"test_ring_op_with_table_passes_opcheck", "test_table_layout_matches_sdpa", "test_table_layout_on_triton"},
    "test_row_select.py": {"test_each_rank_computes_only_its_rows_of_the_pieces"},
    "test_schedule.py": {"test_inductor_overlap_config_reorders_the_backward_and_the_warm_cache_hits"},
    "test_step.py": {"test_twenty_decorated_steps_equal_single_process"},
    "test_train_bytes.py": {"test_train_bytes_single_prints_json", "test_train_bytes_torchrun_two_ranks"},
    "test_train_demo.py": {"test_train_demo_runs_and_losses_match"},
    "test_triton_docs.py": {"test_document_kernels_compile_for_real_gpus", "test_ring_attention_api_with_doc_ids_on_triton", "test_ring_with_documents_matches_fp64_and_skips_steps", "test_step_with_documents_matches_fp64_and_skips_tiles"},
    "test_triton_kernels.py": {"test_every_layout_step_matches_fp64", "test_kernels_compile_for_real_gpus", "test_low_precision_within_2x_of_aten", "test_mixed_lengths_padding_and_masked_blocks"},
    "test_triton_ring.py": {"test_in_kernel_merge_error_does_not_grow_with_ring_size", "test_ring_cp_backend_with_triton_kernel_matches_single_device", "test_ring_with_triton_kernel_matches_sdpa", "test_tile_skipping_counts_only_visible_tiles"},
}


def pytest_collection_modifyitems(config, items):
    """Mark the tiers: ``multirank`` for every test that starts rank processes (the ``ranks``
    fixture), ``slow`` and ``inductor`` from the tables above."""
    for item in items:
        module, _, name = item.nodeid.split("[")[0].partition("::")
        module = os.path.basename(module)
        if "ranks" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.multirank)
        if name in SLOW.get(module, ()):
            item.add_marker(pytest.mark.slow)
        if name in INDUCTOR.get(module, ()):
            item.add_marker(pytest.mark.inductor)


@pytest.fixture(scope="session")
def ranks():
    pools = RankPools()
    try:
        yield pools
    finally:
        pools.close()

"""The suite's tiers: every test is fast, slow, server or distributed, by the one table below.

``-m "not slow"`` is the fast tier (README's Development section says what it costs) and
``-m slow`` the rest; ``-m server`` selects the tests that start a real ``specdec serve`` process
(tests/server.py's ``Server``, or the CLI's ``serve`` as a subprocess) and ``-m distributed`` those
that run ranks as processes (``mlx.launch``, or two ranks spawned by hand). Server and distributed
tests are slow too. CI runs everything (no ``-m``).

A test's tier is the longest key in ``TESTS`` that names it, else its file's entry in ``FILES``.
Every ``test_*.py`` here must be in ``FILES`` (the session stops with a usage error otherwise), so
a new file forces a decision; a new test in a listed file takes its file's tier. A ``TESTS`` key is
``file::test`` (every parametrization), ``file::Class::test``, or ``file::test[id-prefix`` (the
parametrizations whose id starts so); a key naming a test its file does not define is an error.

Slow: whatever the fast tier cannot hold in its budget (measured with ``--durations=0``, a
module-scoped fixture charged to its file's first test), every package keeping fast tests.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# The zoo's assertions live in a helper its three test files share: rewritten as a test file's are.
pytest.register_assert_rewrite("zoo_parts")

FAST: tuple[str, ...] = ()
SLOW = ("slow",)
SERVER = ("server", "slow")
DISTRIBUTED = ("distributed", "slow")

# Every test file, by the tier of most of its tests.
FILES: dict[str, tuple[str, ...]] = {
    "serve/test_agents.py": SERVER,
    "test_architecture.py": FAST,  # the import rule, read from the source
    "loop/test_batch.py": FAST,
    "cli/test_batch_cli.py": FAST,
    "drafters/test_bench.py": FAST,
    "cache/test_caches.py": FAST,
    "cache/test_batch_check.py": FAST,  # the batch check on this CPU and on the GPU-like backend
    "cli/test_cli.py": FAST,
    "drafters/test_dflash.py": FAST,
    "drafters/test_dflash_batch.py": FAST,
    "serve/test_dialects.py": SERVER,
    "session/test_disk_cache.py": FAST,
    "session/test_exact.py": SLOW,  # --exact on the GPU-like backend: many batch runs of three families
    "session/test_disk_tier.py": FAST,  # the disk tier through Session, the CLI and a restarted server
    "cli/test_display.py": FAST,
    "distill/test_distill.py": FAST,
    "model/test_distributed.py": DISTRIBUTED,
    "drafters/test_drafting.py": FAST,
    "loop/test_engine.py": FAST,
    "loop/test_pipeline.py": FAST,  # blocks without drafts pipelined as plain decoding is
    "cli/test_first_hour.py": FAST,
    "cli/test_first_run.py": FAST,
    "drafters/test_history_file.py": FAST,
    "loop/test_compare.py": FAST,
    "model/test_hooks.py": FAST,
    "drafters/test_hybrid.py": FAST,
    "drafters/test_lookup.py": FAST,
    "drafters/test_mtp.py": FAST,
    "drafters/test_registry.py": FAST,
    "core/test_processors.py": FAST,
    "model/test_recurrence_check.py": FAST,
    "cli/test_limits.py": FAST,
    "cli/test_interrupts.py": FAST,
    "cli/test_bad_input.py": FAST,
    "cli/test_mlx_lm_options.py": FAST,
    "cache/test_rollback.py": FAST,
    "core/test_sampling.py": FAST,
    "core/test_shapes.py": FAST,  # bucketed verify shapes (issue 42)
    "serve/test_lockstep.py": FAST,  # the sharded server's passes on a group of one rank, in-process
    "serve/test_scheduler.py": FAST,  # the generation thread in-process: no server process
    "core/test_seeded_sampling.py": FAST,
    "serve/test_serve.py": SERVER,
    "serve/test_serve_defects.py": SERVER,
    "serve/test_serve_distributed.py": SERVER + DISTRIBUTED[:1],  # a server sharded over ranks
    "serve/test_serve_gpu_like.py": SERVER,  # a server on the GPU-like backend (tests/gpu_like.py)
    "serve/test_serve_faults.py": SERVER,
    "serve/test_serve_processors.py": SERVER,
    "session/test_session.py": FAST,
    "core/test_stats.py": FAST,
    "model/test_templates.py": FAST,
    # The architecture zoo, one test per architecture, in three parts by name (tests/zoo_parts.py)
    # so that two workers can share it.
    "loop/test_zoo_1.py": SLOW,
    "loop/test_zoo_2.py": SLOW,
    "loop/test_zoo_3.py": SLOW,
}

# Tests whose tier is not their file's.
TESTS: dict[str, tuple[str, ...]] = {
    "session/test_disk_tier.py::test_a_restarted_server_answers_the_next_turn_from_disk_as_a_cacheless_one": SERVER,
    # A head fitted first (~8 s), and two processes importing MLX: over the fast tier's budget.
    "session/test_disk_tier.py::test_an_mtp_head_resumes_from_the_hidden_states_on_disk_and_drafts_as_from_memory": SLOW,
    "session/test_disk_cache.py::test_two_processes_saving_into_one_folder_leave_only_files_that_load_exactly": SLOW,
    # The step queued ahead (off by default): every family and dtype, every ending and interrupt point.
    # Out of the fast tier's 2-minute budget (--durations, 2026-11-27: 1.5-3.6 s each); their subjects keep
    # fast tests beside them (bucketed float32, one sweep, one warm-up, the hybrid's own checks).
    "core/test_shapes.py::test_bucketed_output_and_caches_equal_exact[gemma3_text-bfloat16": SLOW,
    "core/test_shapes.py::test_bucketed_output_and_caches_equal_exact[qwen3_5-bfloat16": SLOW,
    "core/test_shapes.py::test_bucketed_output_and_caches_equal_exact[llama-bfloat16": SLOW,
    "core/test_shapes.py::test_a_bucketed_batch_gives_each_row_its_text_alone[gemma3_text": SLOW,
    "drafters/test_hybrid.py::test_hybrid_is_exact_uses_both_and_keeps_both_drafters_in_step": SLOW,
    "distill/test_distill.py::test_reduced_vocabulary_q_is_a_distribution_over_the_draft_tokens": SLOW,
    "loop/test_compare.py::test_runner_reports_the_warm_up_apart_and_output_is_unchanged": SLOW,
    "cli/test_cli.py::test_sweep_flags_a_run_that_is_not_identical": SLOW,
    "model/test_recurrence_check.py::test_a_batched_recurrence_that_differs_is_verified_one_token_at_a_time": SLOW,
    "drafters/test_hybrid.py::test_hybrid_samples": SLOW,
    "distill/test_distill.py::test_head_trained_for_another_model_is_refused": SLOW,
    "drafters/test_lookup.py::test_long_lookup_drafts_keep_output_identical[qwen3_5": SLOW,
    "core/test_shapes.py::test_a_bucketed_batch_gives_each_row_its_text_alone[qwen3_5": SLOW,
    # Moved 2026-11-27 (the fast tier read 123-129 s; these took 2.0-3.6 s each): bucketed llama and qwen3_5
    # in float32, the llama oracle, --draft-p-min in the DFlash rows' test, distill's training and chain
    # tests and the qwen3_5 checkpoint resume stay fast.
    "core/test_shapes.py::test_bucketed_output_and_caches_equal_exact[qwen3-bfloat16": SLOW,
    "core/test_shapes.py::test_bucketed_output_and_caches_equal_exact[gemma3_text-float32": SLOW,
    "drafters/test_bench.py::test_oracle_drafter_controls_acceptance_and_keeps_output_exact[qwen3_5": SLOW,
    "drafters/test_drafting.py::test_p_min_stops_drafting_early_and_output_stays_identical": SLOW,
    "distill/test_distill.py::test_drafter_auto_with_a_head_drafts_with_lookup_and_the_head": SLOW,
    "session/test_session.py::test_recurrent_and_window_layers_resume_at_a_checkpoint_a_request_named[gemma3_text": SLOW,
    # Statistical (chi-square) checks: thousands of draws each.
    "core/test_sampling.py::test_sampled_tokens_follow_the_target_distribution": SLOW,
    "core/test_sampling.py::test_seeded_speculative_sampling_follows_the_target_distribution": SLOW,
    "core/test_sampling.py::test_a_lossy_shortcut_fails_the_same_check": SLOW,
    "core/test_sampling.py::test_greedy_drafter_with_one_hot_q_is_lossless_too": SLOW,
    "core/test_processors.py::test_sampled_tokens_follow_the_processed_distribution": SLOW,
    "core/test_processors.py::test_without_the_residual_row_a_cut_sampled_draft_is_lossy": SLOW,
    "core/test_processors.py::test_fifty_seeded_samples_under_a_json_schema_each_parse_and_validate": SLOW,
    "core/test_processors.py::test_a_seeded_sampled_text_is_plain_decodings_with_the_same_processor": SLOW,
    "drafters/test_dflash.py::test_chi_square_sampling_is_lossless": SLOW,
    "drafters/test_dflash.py::test_a_q_without_the_targets_transforms_fails_the_same_check": SLOW,
    "drafters/test_mtp.py::test_sampling_with_an_mtp_head_is_lossless": SLOW,
    # Matrices (family x dtype, x draft length, x strategy): slow, but for a few parametrizations
    # that keep attention (llama, qwen3), hybrids (qwen3_5, nemotron_h, mamba) and sliding
    # windows (gemma3_text) in the fast tier.
    "loop/test_engine.py::test_plain_layout_matches_mlx_lm_stock_cache": SLOW,
    "loop/test_engine.py::test_plain_layout_matches_mlx_lm_stock_cache[llama-bfloat16": FAST,
    "loop/test_engine.py::test_plain_layout_matches_mlx_lm_stock_cache[qwen3_5-float32": FAST,
    "loop/test_engine.py::test_plain_layout_matches_mlx_lm_stock_cache[gemma3_text-float32": FAST,
    "loop/test_engine.py::test_speculative_equals_plain_with_partial_accepts": SLOW,
    "loop/test_engine.py::test_speculative_equals_plain_with_partial_accepts[llama-float32": FAST,
    "loop/test_engine.py::test_speculative_equals_plain_with_partial_accepts[qwen3-bfloat16": FAST,
    "loop/test_engine.py::test_rolled_back_cache_equals_cache_built_directly": SLOW,
    "loop/test_engine.py::test_drafter_equal_to_target_accepts_everything": SLOW,
    "loop/test_engine.py::test_one_host_sync_per_block_unless_timed": SLOW,
    "loop/test_engine.py::test_one_host_sync_per_block_unless_timed[llama]": FAST,
    "loop/test_engine.py::test_interrupt_mid_block_restores_caches_and_resumes_exactly": SLOW,
    "loop/test_engine.py::test_interrupt_mid_block_restores_caches_and_resumes_exactly[target-qwen3_5": FAST,
    "loop/test_engine.py::test_interrupt_mid_block_restores_caches_and_resumes_exactly[drafter-llama": FAST,
    "loop/test_engine.py::test_carry_equals_plain_with_partial_accepts": SLOW,
    "loop/test_engine.py::test_carry_max_tokens_and_eos_leave_consistent_caches": SLOW,
    "loop/test_engine.py::test_carry_max_tokens_and_eos_leave_consistent_caches[11-qwen3_5": FAST,
    "loop/test_engine.py::test_carry_max_tokens_and_eos_leave_consistent_caches[1-nemotron_h": FAST,
    "loop/test_engine.py::test_carry_interrupt_mid_block_resumes_exactly": SLOW,
    "loop/test_engine.py::test_carry_interrupt_mid_block_resumes_exactly[6-qwen3_5": FAST,
    "core/test_processors.py::test_plain_decoding_with_penalties_is_mlx_lms_generate_step": SLOW,
    "core/test_processors.py::test_plain_decoding_with_penalties_is_mlx_lms_generate_step[float32-llama": FAST,
    "core/test_processors.py::test_plain_decoding_with_penalties_is_mlx_lms_generate_step[bfloat16-qwen3_5": FAST,
    "core/test_processors.py::test_speculative_equals_plain_with_the_same_processor": SLOW,
    "core/test_processors.py::test_speculative_equals_plain_with_the_same_processor[penalties-lookup-float32": FAST,
    "core/test_processors.py::test_speculative_equals_plain_with_the_same_processor[grammar-lookup-float32": FAST,
    "core/test_processors.py::test_penalties_and_a_grammar_together_and_every_rollback": SLOW,
    "core/test_processors.py::test_a_batch_of_rows_each_with_its_own_processors[qwen3_5": SLOW,
    "loop/test_batch.py::test_each_row_equals_its_prompt_alone": SLOW,
    "loop/test_batch.py::test_each_row_equals_its_prompt_alone[qwen3-float32": FAST,
    "loop/test_batch.py::test_rows_sharing_a_draft_model_draft_in_one_forward_and_as_they_would_alone": SLOW,
    "loop/test_batch.py::test_an_interrupt_inside_a_batched_draft_leaves_every_row_as_it_was": SLOW,
    "loop/test_batch.py::test_an_interrupt_inside_a_batched_mtp_draft_leaves_every_row_as_it_was": SLOW,
    "loop/test_batch.py::test_mtp_heads_of_one_head_draft_every_row_in_one_forward": SLOW,
    "loop/test_batch.py::test_rows_join_and_leave_mid_run": SLOW,
    "cli/test_batch_cli.py::test_each_row_is_its_prompt_alone_and_compare_ar_proves_it[qwen3_5": SLOW,
    "session/test_session.py::test_a_drafter_reading_hidden_states_gets_them_for_the_cached_tokens": SLOW,
    "session/test_session.py::test_recurrent_and_window_layers_resume_at_a_checkpoint_a_request_named[nemotron_h": SLOW,
    "session/test_session.py::test_three_turns_then_a_branch_back_to_where_the_first_ended[gemma3_text": SLOW,
    "session/test_session.py::test_three_turns_then_a_branch_back_to_where_the_first_ended[nemotron_h": SLOW,
    "session/test_session.py::test_a_later_turn_resumes_everything_the_last_one_left_and_generates_what_a_cold_session_does"
    "[qwen3_5": SLOW,
    "session/test_session.py::test_a_later_turn_resumes_everything_the_last_one_left_and_generates_what_a_cold_session_does"
    "[nemotron_h": SLOW,
    "cache/test_rollback.py::test_k_1_to_8_with_partial_accepts": SLOW,
    "cache/test_rollback.py::test_every_strategy_generates_plain_greedy_output": SLOW,
    "cache/test_rollback.py::test_cut_back_state_equals_plain_decoding_for_every_k_and_accepted_length": SLOW,
    "cache/test_rollback.py::test_cut_back_state_equals_plain_decoding_for_every_k_and_accepted_length[qwen3_5]": FAST,
    "cache/test_rollback.py::test_cut_back_state_equals_plain_decoding_for_every_k_and_accepted_length[mamba]": FAST,
    "cache/test_rollback.py::test_eos_max_tokens_and_interrupt_leave_exact_caches[capture-qwen3_5": SLOW,
    "cache/test_rollback.py::test_eos_max_tokens_and_interrupt_leave_exact_caches[tape-qwen3_5": SLOW,
    "drafters/test_dflash.py::test_speculative_equals_plain_and_the_context_is_the_one_built_directly[qwen3_5": SLOW,
    "drafters/test_dflash.py::test_random_drafter_on_unmodified_targets_is_exact": SLOW,
    "drafters/test_dflash.py::test_random_drafter_on_unmodified_targets_is_exact[qwen3-2]": FAST,
    "drafters/test_dflash.py::test_random_drafter_on_unmodified_targets_is_exact[qwen3_5-4]": FAST,
    # A head fitted first (mtp_fixtures.fitted_head: 150 training steps a family); the MTP
    # drafter stays in the fast tier with random heads (core/test_seeded_sampling.py, the CLI's detection).
    "drafters/test_mtp.py::test_greedy_drafts_equal_mlx_vlm_draft_block": SLOW,
    "drafters/test_mtp.py::test_speculative_equals_plain_and_caches_roll_back_exactly": SLOW,
    "drafters/test_mtp.py::test_p_min_stops_drafting_early": SLOW,
    "drafters/test_mtp.py::test_one_token_prompt_and_cancel_keep_the_pairs_aligned": SLOW,
    "drafters/test_mtp.py::test_cli_drafts_with_the_mtp_head": SLOW,
    "loop/test_compare.py::test_exact_kernels_give_identical_paths": SLOW,
    "loop/test_compare.py::test_warm_up_runs_every_shape_and_leaves_caches_and_drafter_as_they_were": SLOW,
    "loop/test_compare.py::test_warm_up_runs_every_shape_and_leaves_caches_and_drafter_as_they_were[llama]": FAST,
    "loop/test_compare.py::test_a_rounding_tie_is_proven[qwen3_5": SLOW,
    "core/test_seeded_sampling.py::test_one_seed_gives_one_text_under_any_draft_lengths": SLOW,
    "core/test_seeded_sampling.py::test_every_rollback_keeps_the_seeded_text": SLOW,
    "serve/test_scheduler.py::test_requests_with_an_mtp_head_draft_together_through_the_prompt_cache": SLOW,
    "serve/test_scheduler.py::test_requests_with_a_dflash_drafter_draft_together": SLOW,
    # The fast tier keeps one of each (its other parameters, or the same path by another test).
    "drafters/test_dflash_batch.py::test_each_row_drafts_what_it_drafts_alone_block_after_block[causal-sliding]": SLOW,
    "drafters/test_dflash_batch.py::test_p_min_cuts_each_row_as_alone_in_one_sync_for_the_batch": SLOW,
    "cache/test_caches.py::test_rows_prefilled_together_hold_what_each_prefill_alone_leaves[gemma3_text]": SLOW,
    "loop/test_compare.py::test_a_sweep_runs_each_block_size_through_the_loop_generate_drives": SLOW,
    "cli/test_cli.py::test_sweep_flags_a_run_that_is_not_identical": SLOW,
    "model/test_templates.py::test_strict_templates_refuse_these_shapes_unfolded": SLOW,
    "model/test_templates.py::test_strict_templates_refuse_these_shapes_unfolded[qwen3_5-codex]": FAST,
    "model/test_templates.py::test_strict_templates_refuse_these_shapes_unfolded[mistral-middle]": FAST,
    # The bundled model in a process of its own (tens of seconds: over the fast tier's budget alone).
    "core/test_shapes.py::test_generate_reports_its_verify_shapes_on_a_long_copy": SLOW,
    "cli/test_cli.py::test_sweep_json_has_a_row_per_block_size": SLOW,
    "cli/test_cli.py::test_rollback_strategy_option": SLOW,
    "loop/test_zoo_1.py::test_the_zoo_covers_every_mlx_lm_architecture": FAST,  # a listing, no model
    # Training a head.
    "distill/test_distill.py::test_cli_distills_a_head_that_generate_loads": SLOW,
    "distill/test_distill.py::test_a_trained_head_drafts_and_speculation_stays_exact": SLOW,
    "distill/test_distill.py::test_training_lowers_the_loss_and_raises_agreement": SLOW,
    "distill/test_distill.py::test_a_head_trains_and_drafts_exactly_for_every_family": SLOW,
    "distill/test_distill.py::test_drafter_auto_says_what_it_picked": SLOW,
    "distill/test_distill.py::test_ctrl_c_during_training_leaves_a_loadable_head": SLOW,
    "distill/test_distill.py::test_chained_hits_count_what_a_greedy_draft_chain_gets_accepted": SLOW,
    # The CLI as a subprocess: signals, pipes, many processes, the wheel, the bundled model.
    "cli/test_bad_input.py::test_fuzzed_options_exit_1_or_2_in_at_most_3_lines": SLOW,
    "cli/test_mlx_lm_options.py::test_extra_eos_token_names_the_leading_space_form": SLOW,
    "cli/test_interrupts.py::test_ctrl_c_during_prefill_exits_130_quickly": SLOW,
    "cli/test_interrupts.py::test_ctrl_c_during_decoding_prints_the_text_once": SLOW,
    "cli/test_interrupts.py::test_ctrl_c_with_json_gives_one_object": SLOW,
    "cli/test_interrupts.py::test_a_closed_stdout_ends_quietly": SLOW,
    "cli/test_interrupts.py::test_a_closed_stderr_ends_quietly_with_141": SLOW,
    "cli/test_interrupts.py::test_a_standard_stream_closed_by_the_caller_is_no_error": SLOW,
    "cli/test_mlx_lm_options.py::test_quantized_kv_cache_speculation_equals_plain_decoding": SLOW,
    "cli/test_first_run.py::test_the_wheel_carries_the_bundled_model": SLOW,
    "cli/test_first_run.py::test_the_cli_reexecutes_once_and_the_child_sees_the_preload": SLOW,
    "cli/test_first_run.py::test_first_run_the_bundled_model_speculates_exactly": SLOW,
    "cli/test_first_run.py::test_the_bundled_head_drafts_for_the_bundled_model_exactly": SLOW,
    # In server files, the tests that start no process (translations, the reply parser, the
    # generation thread in-process, the terminal chat).
    "serve/test_dialects.py::test_anthropic_blocks_become_chat_messages_in_order": FAST,
    "serve/test_dialects.py::test_a_failure_after_the_answer_started_is_an_event_in_each_dialect": FAST,
    "serve/test_dialects.py::test_codex_tools_are_served_namespaced_and_hosted_ones_left_out": FAST,
    "serve/test_dialects.py::test_a_namespaced_name_that_another_tool_has_is_made_unique": FAST,
    "serve/test_dialects.py::test_a_custom_tool_call_is_answered_as_custom_tool_call": FAST,
    "serve/test_dialects.py::test_a_responses_stream_keeps_a_waiting_client_alive_with_events": FAST,
    "serve/test_dialects.py::test_text_between_two_calls_keeps_its_place": FAST,
    "serve/test_dialects.py::test_responses_logprobs_do_not_split_parallel_calls": FAST,
    "serve/test_dialects.py::test_anthropic_errors_name_the_block_list_at_fault_once": FAST,
    "serve/test_dialects.py::test_responses_errors_about_text_format_name_no_chat_field": FAST,
    "serve/test_serve.py::test_chat_in_the_terminal_reuses_the_last_turn": FAST,
    "serve/test_serve_defects.py::test_a_tool_call_that_is_not_an_object_is_returned_as_text": FAST,
    "serve/test_serve_defects.py::test_a_list_of_objects_is_still_several_calls": FAST,
    "serve/test_serve_defects.py::test_a_call_whose_arguments_are_not_an_object_is_the_models_text_where_they_must_be_one": FAST,
    "serve/test_serve_defects.py::test_a_schema_that_compiles_but_cannot_be_decoded_is_refused_before_it_is_queued": FAST,
    "serve/test_serve_defects.py::test_a_fault_handling_one_rows_text_fails_that_row_alone": FAST,
    "serve/test_serve_defects.py::test_a_fault_outside_any_row_fails_the_rows_in_flight_and_the_thread_serves_on": FAST,
    "serve/test_serve_defects.py::test_a_generation_thread_that_ended_fails_its_requests_and_health_says_503": FAST,
    "serve/test_serve_defects.py::test_a_schema_of_true_is_any_json_value_and_false_is_refused": FAST,
    "serve/test_serve_defects.py::test_a_tool_call_cut_or_unclosed_is_returned_as_the_model_wrote_it": FAST,
    "serve/test_serve_defects.py::test_the_default_byte_bound_comes_from_the_machines_memory": FAST,
    "serve/test_serve_defects.py::test_the_prompt_cache_stays_within_its_bytes_and_frees_what_it_drops": FAST,
    "serve/test_serve_defects.py::test_a_validation_error_becomes_one_clean_line": FAST,
    "serve/test_serve_defects.py::test_the_legacy_function_fields_are_refused_by_name_not_ignored": FAST,
    "serve/test_serve_defects.py::test_a_message_with_an_empty_content_list_is_refused_not_read_as_empty_text": FAST,
    "serve/test_serve_defects.py::test_an_assistant_refusal_part_sent_back_is_its_text": FAST,
    "serve/test_serve_defects.py::test_a_chat_tool_choice_of_another_type_is_named_as_unsupported": FAST,
    "serve/test_serve_defects.py::test_a_responses_tool_choice_without_its_name_is_told_in_that_apis_shape": FAST,
    "serve/test_serve_defects.py::test_a_non_finite_temperature_or_top_p_is_called_so_on_the_responses_and_messages_apis": FAST,
    # In the distributed file, the tests that launch nothing (one watchdog process at most).
    "model/test_distributed.py::test_checksum_sees_order_and_content": FAST,
    "model/test_distributed.py::test_settle_takes_rank_0s_decision_and_raises_on_other_inputs": FAST,
    "model/test_distributed.py::test_settle_rows_takes_rank_0s_decision_per_row_and_names_the_row_fed_otherwise": FAST,
    "model/test_distributed.py::test_heads_must_divide_by_the_ranks": FAST,
    "model/test_distributed.py::test_a_handshake_names_the_options_that_differ": FAST,
    "model/test_distributed.py::test_ranks_compare_samples_of_the_weights_not_only_their_shapes": FAST,
    "model/test_distributed.py::test_a_family_that_cannot_pipeline_is_refused_naming_those_that_can": FAST,
    "model/test_distributed.py::test_what_a_sharded_target_cannot_do_is_refused_before_loading": FAST,
    "model/test_distributed.py::test_backend_read_from_what_mlx_launch_exports": FAST,
    "model/test_distributed.py::test_ranks_sharing_this_machine_get_its_cores_for_blas": FAST,
    "model/test_distributed.py::test_ring_noise_is_recognised_and_nothing_else": FAST,
    "model/test_distributed.py::test_pipeline_alone_is_refused": FAST,
    "model/test_distributed.py::test_the_watchdog_ends_a_process_whose_peers_stopped_answering": FAST,
    "model/test_distributed.py::test_a_backends_lost_peer_becomes_one_line_and_other_errors_pass": FAST,
    "model/test_distributed.py::test_a_long_prefill_chunk_is_allowed_for_and_a_stop_after_it_is_not": FAST,
    "model/test_distributed.py::test_a_processs_first_chunk_is_short_then_rank_0s_sizes_are_allowed_for": FAST,
    "model/test_distributed.py::test_a_capped_first_chunk_does_not_cap_the_rest": FAST,
    "model/test_distributed.py::test_an_uneven_split_by_kv_heads_sums_to_the_whole_layer": FAST,
    "model/test_distributed.py::test_what_cannot_be_split_unevenly_is_named": FAST,
    # The agents against a server sharded over 2 ranks.
    "serve/test_agents.py::test_codex_exec_ends_with_the_answer[qwen3_5-2-ranks]": SERVER + DISTRIBUTED[:1],
    "serve/test_agents.py::test_claude_p_ends_with_the_answer[qwen3_5-2-ranks]": SERVER + DISTRIBUTED[:1],
}

MARKERS = {"slow", "server", "distributed"}
HERE = Path(__file__).resolve().parent
# Test files live in folders that mirror the packages (tests/core for specdec_cli/core, ...); some
# share fixtures and reference checks by importing each other by name (``from test_sampling import
# chi_square``), wherever pytest happens to start. Every folder is importable, as tests/ itself is.
for _folder in sorted(p for p in HERE.iterdir() if p.is_dir() and any(p.glob("test_*.py"))):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))


def _split(key: str) -> tuple[str, str]:
    file, _, test = key.partition("::")
    return file, test


def _matches(key_test: str, test: str) -> bool:
    """Whether a TESTS key's test part names ``test`` (a node id within its file). BOTH_BACKENDS's parameter
    (``[own-...]``, ``[gpu-like-...]``) is not part of the key: the key names the test on either."""
    test = re.sub(r"\[(own|gpu-like)(-|\])", lambda m: "[" if m.group(2) == "-" else "", test)
    if "[" in key_test:
        return test.startswith(key_test)
    return test == key_test or test.startswith(key_test + "[") or test.startswith(key_test + "::")


def _defined(path: Path) -> set[str]:
    """The test functions a file defines, as ``name`` and ``Class::name`` (read, not imported)."""
    out = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(node.name)
        elif isinstance(node, ast.ClassDef):
            out |= {f"{node.name}::{f.name}" for f in node.body
                    if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return out


def check_table() -> None:
    """Every test file has a tier, and every entry names a file or test that exists."""
    files = {p.relative_to(HERE).as_posix() for p in HERE.rglob("test_*.py")}
    problems = [f"{f}: not in FILES (give it a tier: FAST, SLOW, SERVER or DISTRIBUTED)"
                for f in sorted(files - FILES.keys())]
    problems += [f"{key}: in TESTS but {_split(key)[0]} is not in FILES" for key in TESTS
                 if _split(key)[0] not in FILES]
    problems += [f"{name}: markers must be among {sorted(MARKERS)}"
                 for name, marks in [*FILES.items(), *TESTS.items()] if not set(marks) <= MARKERS]
    # A key naming no test (renamed or removed) would leave a slow test in the fast tier.
    defined = {f: _defined(HERE / f) for f in files & {_split(key)[0] for key in TESTS}}
    for key in TESTS:
        file, test = _split(key)
        if file in defined and test.split("[", 1)[0] not in defined[file]:
            problems.append(f"{key}: in TESTS but {file} defines no such test")
    if problems:
        raise pytest.UsageError("tests/conftest.py's tier table:\n  " + "\n  ".join(problems))


def tier(file: str, test: str) -> tuple[str, ...]:
    """The markers of test ``test`` (its node id within the file) of ``file``."""
    keys = [key for key in TESTS if _split(key)[0] == file and _matches(_split(key)[1], test)]
    return TESTS[max(keys, key=len)] if keys else FILES[file]


# One folder per test session, shared by pytest-xdist's workers (they inherit the environment of the
# process that starts them): what is expensive to make and the same every time (tests/server.py's
# tool-calling model) is made there once. Read through this name by tests/server.py.
SESSION_DIR_ENV = "SPECDEC_TEST_SESSION_DIR"
_OWNS_SESSION_DIR = pytest.StashKey[bool]()


def _build_each_cli_once() -> None:
    """Typer's CliRunner builds the whole command tree from the app on every ``invoke``: 80 of the
    100 ms an invocation that fails at an option check took here (hundreds of tests invoke the CLI).
    The app does not change during a session, so each app's tree is built once."""
    import typer.testing

    build = typer.testing._get_command
    built: dict[int, tuple] = {}

    def once(app):
        if id(app) not in built:
            built[id(app)] = (app, build(app))  # the app is kept, so its id is never reused
        return built[id(app)][1]

    typer.testing._get_command = once


def pytest_configure(config: pytest.Config) -> None:
    _build_each_cli_once()
    if not os.environ.get(SESSION_DIR_ENV):
        os.environ[SESSION_DIR_ENV] = tempfile.mkdtemp(prefix="specdec-tests-")
        config.stash[_OWNS_SESSION_DIR] = True
    # The prompt cache's disk tier is on by default and shared by every run of a model: tests that
    # repeat a prompt would resume each other's caches. It is off here (the processes the tests start
    # inherit this) and never in the user's cache folder; tests/session/test_disk_tier.py turns it on by option.
    os.environ["SPECDEC_PROMPT_CACHE_DISK_GB"] = "0"
    os.environ["SPECDEC_PROMPT_CACHE_DIR"] = os.path.join(os.environ[SESSION_DIR_ENV], "prompt-cache")


def pytest_unconfigure(config: pytest.Config) -> None:
    if config.stash.get(_OWNS_SESSION_DIR, False):
        shutil.rmtree(os.environ.pop(SESSION_DIR_ENV), ignore_errors=True)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    # Here, not at collection: under pytest-xdist only the workers collect, and an error
    # raised there reads as a crash; this one is a plain usage error, before any test runs.
    check_table()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # tryfirst: the markers must be on the items before -m deselects by them.
    for item in items:
        path = item.path.resolve()
        if not path.is_relative_to(HERE):
            continue
        file = path.relative_to(HERE).as_posix()
        if file not in FILES:  # a test file made after the session started
            raise pytest.UsageError(f"{file}: not in tests/conftest.py's FILES")
        for mark in tier(file, item.nodeid.split("::", 1)[-1]):
            item.add_marker(mark)
        if getattr(item, "callspec", None) and item.callspec.params.get("arithmetic") == "gpu-like":
            item.add_marker("slow")  # the fast tier keeps each such test's run on this CPU's own arithmetic


# --- the GPU-like backend (tests/gpu_like.py) -------------------------------------------------------------

@pytest.fixture
def gpu_like():
    """Forwards round like a GPU's for this test (and the processes it starts with gpu_like.environment())."""
    import gpu_like as backend

    with backend.installed():
        yield backend


def _on(arithmetic: str):
    """Yields ``arithmetic`` with forwards computed on it: ``own`` (the device's) or ``gpu-like``."""
    if arithmetic == "own":
        yield arithmetic
        return
    import gpu_like as module

    with module.installed():
        yield arithmetic


@pytest.fixture(params=["own", "gpu-like"])
def backend(request):
    """The test runs twice: on the device's own arithmetic (this CPU's: bit-identical rows) and on the GPU-like
    backend."""
    yield from _on(request.param)


# Files whose tests run twice (those that take neither ``gpu_like`` nor ``backend``): on this CPU's own
# arithmetic and on the GPU-like backend, each asserting what is promised there: bit identity where the
# kernels agree; elsewhere plain decoding's text up to a rounding tie and caches within rounding
# (tests/helpers.py: kernels_agree, assert_alone_or_tie, assert_cache_built_by). scripts/gpu_check.sh's tests step
# runs them on CUDA, where the own arithmetic is a GPU's.
BOTH_BACKENDS = ("loop/test_engine.py", "loop/test_pipeline.py", "loop/test_batch.py", "serve/test_scheduler.py",
                 "session/test_disk_tier.py")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    path = Path(metafunc.definition.path).resolve()
    if (path.is_relative_to(HERE) and path.relative_to(HERE).as_posix() in BOTH_BACKENDS
            and not {"gpu_like", "backend"} & set(metafunc.fixturenames)):
        metafunc.parametrize("arithmetic", ["own", "gpu-like"], indirect=True)


@pytest.fixture(autouse=True)
def arithmetic(request):
    """The arithmetic a test of BOTH_BACKENDS runs on (every other test: the device's own)."""
    yield from _on(getattr(request, "param", "own"))

"""The two tiers of the suite. ``python -m pytest -q`` (the README's command) runs the default
tier: every op, layer kind, model family and public API, in minutes on a 2-core CPU.
``python -m pytest -q -m exhaustive`` runs the rest: the grids in full, every family under
torch.compile, the accuracy and benchmark runs. CI (``.ci/run``) runs both.

``EXHAUSTIVE`` names tests by ``file::function``: ``None`` puts every case of it in the
exhaustive tier; a set keeps those parameter ids in the default tier (the rest are
exhaustive); ``("every", k)`` keeps about one case in k in the default tier, chosen by a hash
of its parameter id (so a case's tier does not depend on which tests a command selects).
"""

from __future__ import annotations

import zlib

EXHAUSTIVE: dict[str, object] = {
    # torch.compile on the CPU: each compile takes seconds; the default tier compiles a ViT,
    # a Llama, GPT-2 with dropout, a ReLU network and a convolutional one once each
    "tests/test_compile_families.py::test_compiled_language_model_gradients_match_plain": {
        "llama-nodropout-labels"
    },
    "tests/test_compile_families.py::test_compiled_language_model_over_several_sequence_lengths": None,
    "tests/test_compile_families.py::test_compiled_vision_model_gradients_match_plain": None,
    "tests/test_compile_families.py::test_inductor_compiled_gpt2_with_dropout_trains_like_plain": None,
    "tests/test_compile.py::test_inductor_cpu_backend_trains_within_the_floor": None,
    "tests/test_compile.py::test_compiled_training_matches_eager_wrapped": {"vit-fused"},
    "tests/test_compile.py::test_wrapped_model_compiles_into_one_graph": {
        "vit-fused-train",
        "vit-fused-eval",
    },
    "tests/test_compile.py::test_compiled_model_keeps_what_eager_mode_keeps": None,
    "tests/test_compile.py::test_mesa_lite_compile_turns_off_inductor_peak_memory_reordering": None,
    "tests/models/test_trainer.py::test_mesa_lite_compile_in_the_trainer": None,
    "tests/test_conv.py::test_compiles_into_one_graph_within_the_floor": None,
    "tests/test_compile_memory.py::test_compiled_keeps_no_weight_copies": {"convnet"},
    "tests/test_compile_memory.py::test_inductor_writes_no_fp32_logits_in_the_loss_backward": None,
    "tests/test_compile_memory.py::test_inductor_builds_no_logits_with_the_head_and_loss_fused": None,
    # the fused head and loss (issue 52): two families and no compile in the default tier
    "tests/models/test_fused_head.py::test_no_logits_are_built_in_training_with_labels": {
        "gpt2",
        "llama",
    },
    "tests/models/test_fused_head.py::test_compiled_fullgraph_matches_eager": None,
    "tests/test_batch_norm.py::test_conv_bn_relu_compiles_into_one_graph_within_the_floor": None,
    "tests/test_cnn_activations.py::test_hardswish_compiles_like_eager": None,
    "tests/test_relu.py::test_relu_family_compiles_like_eager": None,
    # benchmark scripts' full runs (each script's --help and bad options stay in the default)
    "tests/benchmarks/test_accuracy.py::test_int8_trains_as_well_as_plain_on_digits": None,
    "tests/benchmarks/test_benchmarks.py::test_budget_plans_and_measures_each_budget": None,
    "tests/benchmarks/test_benchmarks.py::test_train_deit_synthetic_checkpoint_and_resume": None,
    "tests/benchmarks/test_benchmarks.py::test_grad_fidelity_small": None,
    "tests/benchmarks/test_benchmarks.py::test_ablation_rows_pareto_and_resume": None,
    "tests/benchmarks/test_benchmarks.py::test_checkpoint_pareto_cpu_rows_and_chart": None,
    "tests/benchmarks/test_cli.py::test_entry_point_exit_status_of_a_run": None,
    "tests/benchmarks/test_cli.py::test_default_output_is_a_fresh_run_folder_and_results_stay_untouched": None,
    # the planner on more families, and against brute force on many random cases
    "tests/test_planner.py::test_measure_and_plan_other_timm_families": None,
    "tests/test_planner.py::test_the_choice_against_brute_force_on_seeded_random_blocks": None,
    # the default tier's time (issue 53, at most 5 minutes): planner runs the other tests repeat
    "tests/test_planner.py::test_a_larger_budget_never_loses_a_plan": None,
    "tests/test_planner.py::test_the_plan_applies_the_base_it_was_measured_on": None,
    "tests/test_planner.py::test_mixes_of_blocks_sharing_several_tensors_or_one_further_back": {
        "context"
    },
    "tests/test_lm_ops.py::test_gated_mlp_block": ("every", 3),
    "tests/test_lm_ops.py::test_activations": ("every", 2),
    "tests/test_parametrize.py::test_each_parameter_read_as_often_as_torch_reads_it": ("every", 2),
    # whole models: ResNet-18 and DeiT-Tiny stay in the default tier (test_cnn, test_deit)
    "tests/models/test_cnn.py::test_bf16_autocast_keeps_at_most_half": None,
    "tests/benchmarks/test_text_accuracy.py::test_int8_learns_real_text_as_well_as_plain": None,
    "tests/models/test_deit.py::test_deit_tiny_low_bits": None,
    # grids: a sample in the default tier, all of it in the exhaustive one
    "tests/kernels/test_group_quant.py::test_stochastic_rounding_unbiased_and_within_one_step": {
        "cpu-signed-triton-8",
        "cpu-unsigned-triton-8",
        "cpu-signed-reference-4",
    },
    "tests/kernels/test_group_quant.py::test_kernel_matches_reference_nearest": ("every", 4),
    # the lane layout of packed codes against the reshaped tile: one 4-bit and one 2-bit case
    "tests/kernels/test_group_quant.py::test_packed_lanes_give_the_bytes_and_values_of_the_reshaped_tile": {
        "torch.float16-4-6",
        "torch.bfloat16-2-12",
    },
    "tests/test_composition.py::test_triples": ("every", 4),
    "tests/test_layouts.py::test_forward_is_torch_s_for_every_layout": ("every", 5),
    "tests/test_wrap.py::test_first_wrap_prints_one_line_each": {"unconfigured", "configured"},
}


def exhaustive(nodeid: str) -> bool:
    """Whether the test ``nodeid`` belongs to the exhaustive tier."""
    function, _, params = nodeid.partition("[")
    rule = EXHAUSTIVE.get(function, False)
    if rule is False:
        return False
    if rule is None:
        return True
    if isinstance(rule, tuple):
        return zlib.crc32(params.encode()) % rule[1] != 0
    return params.rstrip("]") not in rule

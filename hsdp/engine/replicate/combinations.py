"""Which replicate-layer features combine: one table that the library, ``hsdp train`` and ``hsdp plan`` consult.

A feature is a mode of the replicate layer or of what it carries (:class:`Feature`). Every pair of features has
one :class:`Rule`: supported (with the tests that show it exact against a one-process simulation), refused (with
the reason, and whether the reason is the math or the failure model, or only that it is not built yet), or
exclusive (two choices of one setting, e.g. two hops). Checks elsewhere ask :func:`rule` instead of carrying
their own list, so they cannot disagree; the documentation's matrix is :func:`markdown_matrix`
(``tests/test_combinations.py`` fails when the docs drift from it, or a named test does not exist).
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass


class Feature(enum.Enum):
    """A replicate-layer feature; the value is its name in the matrix."""

    HETEROGENEOUS = "heterogeneous degrees"
    ELASTIC = "elastic"
    DILOCO = "DiLoCo"
    TENSOR_PARALLEL = "tensor parallel"
    SLICED_OPTIMIZER = "optimizer across replicas"
    INT8_HOP = "int8 hop"
    BF16_HOP = "bf16 hop"
    BATCH_WEIGHTS = "batch weights"


@dataclass(frozen=True)
class Spelling:
    """How a user turns a feature on, in the library and in ``hsdp train``'s config, and how the config turns it
    off (the fix a refusal names)."""

    api: str
    config: str
    config_off: str


SPELLINGS = {
    Feature.HETEROGENEOUS: Spelling("init_mesh(sharding_degree=[...])", "parallel.sharding_degree = [...]",
                                    "give one integer to parallel.sharding_degree"),
    Feature.ELASTIC: Spelling("init_mesh(elastic=True)", "parallel.elastic = true", "parallel.elastic = false"),
    Feature.DILOCO: Spelling("replica_sync=hsdp.DiLoCo(...)", "parallel.replica_sync = 'diloco'",
                             "parallel.replica_sync = 'every_step'"),
    Feature.TENSOR_PARALLEL: Spelling("tensor_parallel_degree > 1", "parallel.tensor_parallel > 1",
                                      "set parallel.tensor_parallel = 1"),
    Feature.SLICED_OPTIMIZER: Spelling("shard_optimizer_across_replicas=True",
                                       "parallel.shard_optimizer_across_replicas = true",
                                       "set parallel.shard_optimizer_across_replicas = false"),
    Feature.INT8_HOP: Spelling("replica_hop=hsdp.Int8ErrorFeedbackHop()", "parallel.replica_hop = 'int8'",
                               "set parallel.replica_hop to 'fp32' or 'bf16'"),
    Feature.BF16_HOP: Spelling("replica_hop=hsdp.AllReduceHop(torch.bfloat16)", "parallel.replica_hop = 'bf16'",
                               "set parallel.replica_hop = 'fp32'"),
    Feature.BATCH_WEIGHTS: Spelling("model.set_batch_weight(n)", "parallel.batch_weights != 'even'",
                                    "set parallel.batch_weights = 'even'"),
}
# The order in which a refusal names a pair: the second is the mode (DiLoCo, elastic, ...) the first option does
# not combine with, as users think of it ("tensor parallelism does not combine with an elastic job").
MODE_ORDER = (Feature.DILOCO, Feature.ELASTIC, Feature.TENSOR_PARALLEL, Feature.HETEROGENEOUS,
              Feature.SLICED_OPTIMIZER, Feature.INT8_HOP, Feature.BF16_HOP, Feature.BATCH_WEIGHTS)


class Status(enum.Enum):
    SUPPORTED = "supported"
    REFUSED = "refused"
    EXCLUSIVE = "exclusive"  # two values of one setting: not a combination


@dataclass(frozen=True)
class Rule:
    """One pair's verdict. ``why``: for a refusal the reason (``permanent``: the math or the failure model rules
    the pair out; otherwise it is not built yet); ``tests``: ``file::test`` of the parity or simulation test of
    a supported pair, or of the test that shows the refusal."""

    status: Status
    why: str = ""
    tests: tuple[str, ...] = ()
    permanent: bool = False


F = Feature
_ELASTIC_TEST = "tests/test_elastic_bad_input.py::test_an_elastic_replica_refuses_what_it_cannot_do_naming_the_fix"
_WEIGHTS_TEST = "tests/test_batch_weights.py::test_weighted_backwards_equal_one_process_over_the_concatenated_batches"
_DILOCO_TEST = "tests/test_diloco.py::test_refusals_name_the_fix"
# Its streaming-2-1-1 case: Streaming DiLoCo on elastic replicas of 2, 1 and 1 ranks, a joiner healed across degrees.
_ELASTIC_HETERO_DILOCO_TEST = ("tests/test_elastic_diloco.py::test_diloco_on_an_elastic_mesh_replays_exactly_the_"
                               "syncs_members")


def _refused(why: str, test: str, permanent: bool = False) -> Rule:
    return Rule(Status.REFUSED, why, (test,), permanent)


def _supported(*tests: str) -> Rule:
    return Rule(Status.SUPPORTED, "", tests)



TABLE: dict[frozenset[Feature], Rule] = {frozenset(pair): rule for pair, rule in {
    (F.HETEROGENEOUS, F.ELASTIC): _supported("tests/test_elastic.py::test_a_failed_replica_costs_a_step_and_rejoins_"
                                             "from_a_peer", _ELASTIC_HETERO_DILOCO_TEST),
    (F.HETEROGENEOUS, F.DILOCO): _supported(
        "tests/test_diloco_compose.py::test_diloco_on_degrees_2_1_equals_two_simulated_workers",
        "tests/test_diloco_compose.py::test_streaming_diloco_with_delay_and_batch_weights_on_degrees_2_1",
        _ELASTIC_HETERO_DILOCO_TEST),
    (F.HETEROGENEOUS, F.TENSOR_PARALLEL): _supported(
        "tests/test_tp_hetero.py::test_tp_on_heterogeneous_replicas_matches_one_process"),
    (F.HETEROGENEOUS, F.SLICED_OPTIMIZER): _supported(
        "tests/test_sliced_hetero.py::test_sliced_optimizer_on_degrees_2_1_matches_one_process",
        "tests/test_sliced_hetero.py::test_sliced_optimizer_on_degrees_2_1_halves_the_state_at_the_all_reduce_floor",
        "tests/test_sliced_hetero.py::test_sliced_optimizer_on_degrees_2_1_checkpoints"),
    (F.HETEROGENEOUS, F.INT8_HOP): _supported(
        "tests/test_int8_compose.py::test_int8_hop_on_hetero_degrees_equals_the_simulated_error_feedback_mean",
        "tests/test_int8_compose.py::test_int8_hop_on_hetero_degrees_sends_a_quarter_of_fp32",
        "tests/test_int8_compose.py::test_int8_residuals_on_hetero_degrees_checkpoint"),
    (F.HETEROGENEOUS, F.BF16_HOP): _supported(
        "tests/test_hetero_mesh.py::test_a_bf16_hop_keeps_the_replicas_identical_and_the_training_within_bf16_of_one_"
        "process"),
    (F.HETEROGENEOUS, F.BATCH_WEIGHTS): _supported("tests/test_hetero_mesh.py::test_training_matches_one_process"),
    (F.ELASTIC, F.DILOCO): _supported(
        "tests/test_elastic_diloco.py::test_diloco_on_an_elastic_mesh_replays_exactly_the_syncs_members",
        "tests/test_elastic_diloco.py::test_the_closing_sync_leaves_every_replica_the_global_copy_and_the_writer_"
        "checkpoints_it",
        "tests/test_train_elastic.py::test_elastic_streaming_diloco_on_degrees_2_1_with_the_int8_wire_ends_synced_"
        "and_checkpointed"),
    (F.ELASTIC, F.TENSOR_PARALLEL): _supported(
        "tests/test_elastic.py::test_a_failed_replica_costs_a_step_and_rejoins_from_a_peer",
        "tests/test_elastic.py::test_a_live_replica_the_coordinator_dropped_rejoins_healed_without_a_restart",
        "tests/test_train_elastic.py::test_a_killed_replica_costs_a_step_hands_the_run_to_a_survivor_and_writes_"
        "again_after_rejoining"),
    (F.ELASTIC, F.SLICED_OPTIMIZER): _refused("a dead replica would take its slice of the optimizer state with it",
                                              _ELASTIC_TEST, permanent=True),
    (F.ELASTIC, F.INT8_HOP): _supported(
        "tests/test_elastic_buffers.py::test_an_int8_hop_discarded_step_keeps_the_residuals_and_joiners_start_from_"
        "zero", "tests/test_int8_compose.py::test_a_discarded_step_puts_the_residuals_back_and_a_joiner_zeroes_them"),
    (F.ELASTIC, F.BF16_HOP): _supported("tests/test_train_elastic.py::test_below_the_minimum_every_rank_stops_and_the_"
                                        "survivor_checkpoints_its_last_step"),
    (F.ELASTIC, F.BATCH_WEIGHTS): _supported(
        "tests/test_elastic.py::test_a_failed_replica_costs_a_step_and_rejoins_from_a_peer",
        "tests/test_train_elastic.py::test_a_killed_replica_costs_a_step_hands_the_run_to_a_survivor_and_writes_"
        "again_after_rejoining"),
    (F.DILOCO, F.TENSOR_PARALLEL): _supported(
        "tests/test_tensor_parallel.py::test_diloco_under_tensor_parallel_equals_two_simulated_workers"),
    (F.DILOCO, F.SLICED_OPTIMIZER): _refused("DiLoCo's inner optimizer state is per replica by definition",
                                             _DILOCO_TEST, permanent=True),
    (F.DILOCO, F.INT8_HOP): Rule(Status.EXCLUSIVE, "DiLoCo sends no per-step hop; its own int8 wire, "
                                                   "DiLoCo(wire_dtype=torch.int8), quantises the pseudo-gradients "
                                                   "with error feedback (the int8 hop's quantiser, residuals per "
                                                   "replica, any degrees, batch weights, Streaming, elastic "
                                                   "replicas of different degrees too)",
                                 ("tests/test_diloco_int8.py::test_int8_wire_equals_two_simulated_workers_with_error_"
                                  "feedback",)),
    (F.DILOCO, F.BF16_HOP): Rule(Status.EXCLUSIVE, "DiLoCo sends no per-step hop (DiLoCo(wire_dtype=bf16) halves "
                                                   "its syncs)"),
    (F.DILOCO, F.BATCH_WEIGHTS): _supported(
        "tests/test_diloco_compose.py::test_diloco_with_batch_weights_weighs_each_replica_by_its_samples",
        "tests/test_diloco_compose.py::test_streaming_diloco_with_delay_and_batch_weights_on_degrees_2_1"),
    (F.TENSOR_PARALLEL, F.SLICED_OPTIMIZER): _supported(
        "tests/test_tensor_parallel.py::test_optimizer_sharded_across_replicas_under_tensor_parallel_matches_one_process"),
    (F.TENSOR_PARALLEL, F.INT8_HOP): _supported(
        "tests/test_tensor_parallel.py::test_compressed_hops_under_tensor_parallel_stay_consistent_and_int8_residuals_"
        "checkpoint"),
    (F.TENSOR_PARALLEL, F.BF16_HOP): _supported(
        "tests/test_tensor_parallel.py::test_compressed_hops_under_tensor_parallel_stay_consistent_and_int8_residuals_"
        "checkpoint"),
    (F.TENSOR_PARALLEL, F.BATCH_WEIGHTS): _supported(
        "tests/test_tensor_parallel.py::test_batch_weights_under_tensor_parallel_equal_one_process_over_the_"
        "concatenated_batches"),
    (F.SLICED_OPTIMIZER, F.INT8_HOP): _supported(
        "tests/test_sliced_int8.py::test_int8_reduce_scatter_equals_the_simulated_error_feedback_mean",
        "tests/test_sliced_int8.py::test_int8_reduce_scatter_sends_a_quarter_of_fp32",
        "tests/test_sliced_int8.py::test_int8_residuals_across_replicas_checkpoint",
        "tests/test_sliced_hetero.py::test_int8_hop_with_the_sliced_optimizer_on_degrees_2_1_equals_the_simulated_error_"
        "feedback"),
    (F.SLICED_OPTIMIZER, F.BF16_HOP): _supported(
        "tests/test_replica_sharded_optimizer.py::test_parity_and_the_bf16_hop"),
    (F.SLICED_OPTIMIZER, F.BATCH_WEIGHTS): _supported(_WEIGHTS_TEST),
    (F.INT8_HOP, F.BF16_HOP): Rule(Status.EXCLUSIVE, "one replica_hop at a time"),
    (F.INT8_HOP, F.BATCH_WEIGHTS): _supported(
        "tests/test_batch_weights.py::test_an_int8_hop_applies_the_weights_and_keeps_the_replicas_identical"),
    (F.BF16_HOP, F.BATCH_WEIGHTS): _supported(_WEIGHTS_TEST),
}.items()}


def rule(a: Feature, b: Feature) -> Rule:
    """The verdict on features ``a`` and ``b`` together."""
    return TABLE[frozenset((a, b))]


def refused(a: Feature, b: Feature) -> bool:
    return rule(a, b).status is Status.REFUSED


def first_refused(features: set[Feature]) -> tuple[Feature, Feature, Rule] | None:
    """The first refused pair among ``features`` as ``(option, mode, rule)``: ``mode`` the one earlier in
    :data:`MODE_ORDER`; ``None`` when they all combine."""
    ordered = [f for f in MODE_ORDER if f in features]
    for i, mode in enumerate(ordered):
        for option in ordered[i + 1:]:
            r = rule(option, mode)
            if r.status is Status.REFUSED:
                return option, mode, r
    return None


def reason(r: Rule) -> str:
    """A refusal's reason, saying whether it is for good or not built yet."""
    return r.why + (" (ruled out by the math or the failure model)" if r.permanent else " (not supported yet)")


def markdown_matrix() -> str:
    """The table as Markdown: one row and column per feature, then the reasons of the refusals."""
    features = list(Feature)
    mark = {Status.SUPPORTED: "yes", Status.REFUSED: "no", Status.EXCLUSIVE: "-"}

    lines = ["| | " + " | ".join(f.value for f in features) + " |", "|---" * (len(features) + 1) + "|"]
    for a in features:
        cells = ["" if a is b else mark[rule(a, b).status] for b in features]
        lines.append(f"| **{a.value}** | " + " | ".join(cells) + " |")
    lines += ["", "| feature | in the library | in `hsdp train` |", "|---|---|---|"]
    lines += [f"| {f.value} | `{SPELLINGS[f].api}` | `{SPELLINGS[f].config}` |" for f in features]
    lines += ["", "| pair | verdict | why, or the test that shows it |", "|---|---|---|"]
    for (a, b) in itertools.combinations(features, 2):
        r = rule(a, b)
        detail = r.why + (" (by the math or the failure model)" if r.permanent else "") if r.why else ""
        tests = ", ".join(f"`{t}`" for t in r.tests)
        lines.append(f"| {a.value} + {b.value} | {mark[r.status]} | {'; '.join(x for x in (detail, tests) if x)} |")
    return "\n".join(lines) + "\n"


def counts() -> dict[Status, int]:
    """How many pairs have each verdict."""
    out = dict.fromkeys(Status, 0)
    for r in TABLE.values():
        out[r.status] += 1
    return out


if __name__ == "__main__":
    print("# Which replicate-layer features combine\n")
    print("Generated from `hsdp/engine/replicate/combinations.py` (the one table the library, `hsdp train` and "
          "`hsdp plan` consult): `python -m hsdp.engine.replicate.combinations > docs/concepts/combinations.md`.\n")
    print(markdown_matrix(), end="")

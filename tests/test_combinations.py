"""The one table of replicate-layer combinations (``hsdp/engine/replicate/combinations.py``) and what follows it.

- every pair of features has one verdict; every test a verdict names exists;
- ``hsdp train``'s config refuses a pair exactly when the table does (a drift between the two fails here), and
  its message names the table's reason;
- the matrix in the docs is the table's (``docs/concepts/combinations.md``; regenerate it with
  ``python -m hsdp.engine.replicate.combinations > docs/concepts/combinations.md``).
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

from hsdp.apps.train.config_io import resolve_config
from hsdp.engine.replicate.combinations import TABLE, Feature, Status, markdown_matrix, rule

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {Feature.HETEROGENEOUS: "parallel.sharding_degree=[2,1]", Feature.ELASTIC: "parallel.elastic=true",
          Feature.DILOCO: "parallel.replica_sync=diloco", Feature.TENSOR_PARALLEL: "parallel.tensor_parallel=2",
          Feature.SLICED_OPTIMIZER: "parallel.shard_optimizer_across_replicas=true",
          Feature.INT8_HOP: "parallel.replica_hop=int8", Feature.BF16_HOP: "parallel.replica_hop=bf16",
          Feature.BATCH_WEIGHTS: "parallel.batch_weights=[1,2]"}
PAIRS = [p for p in itertools.combinations(Feature, 2) if rule(*p).status is not Status.EXCLUSIVE]


def test_every_pair_has_one_verdict_and_its_tests_exist() -> None:
    assert len(TABLE) == len(list(itertools.combinations(Feature, 2)))
    for pair, verdict in TABLE.items():
        assert verdict.status is Status.EXCLUSIVE or verdict.tests, pair
        for test in verdict.tests:
            path, _, name = test.partition("::")
            assert (ROOT / path).is_file(), test
            assert not name or re.search(rf"def {re.escape(name)}\b", (ROOT / path).read_text()), test


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0].name}+{p[1].name}")
def test_hsdp_train_refuses_a_pair_exactly_when_the_table_does(pair: tuple[Feature, Feature]) -> None:
    overrides = [CONFIG[f] for f in pair]
    verdict = rule(*pair)
    if verdict.status is Status.REFUSED:
        with pytest.raises(ValueError) as e:
            resolve_config(None, overrides)
        assert "does not combine with" in str(e.value), e.value
    else:
        resolve_config(None, overrides)


def test_the_docs_matrix_is_the_tables() -> None:
    text = (ROOT / "docs" / "concepts" / "combinations.md").read_text()
    assert markdown_matrix() in text, "regenerate: python -m hsdp.engine.replicate.combinations"

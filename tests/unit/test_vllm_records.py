"""consumers/engines/vllm_records.py: a classify-by-embedding record's label and scores from its vector. (The
functions that translate a record's options are held against vLLM itself in tests/integration/test_vllm_options.py.)"""

from __future__ import annotations

import math

import numpy as np
import pytest

from consumers.engines.vllm_records import SCORE_TEMPERATURE, by_similarity


def test_each_vector_gets_the_label_it_is_nearest_with_softmaxed_cosine_scores() -> None:
    labels = ("billing", "shipping", "other")
    label_vectors = np.eye(3)  # unit rows, one per label
    vectors = [[0.9, 0.1, 0.0], [0.0, 2.0, 0.1], [1.0, 1.0, 1.0]]  # lengths differ: cosine, not dot product
    out = by_similarity(labels, label_vectors, vectors, [5, 7, 9])
    assert [o.label for o in out[:2]] == ["billing", "shipping"]
    assert [o.prompt_tokens for o in out] == [5, 7, 9] and {o.finish_reason for o in out} == {"stop"}
    for o in out:
        assert o.scores is not None and set(o.scores) == set(labels)
        assert math.isclose(sum(o.scores.values()), 1.0, rel_tol=1e-9)
    assert out[2].scores == pytest.approx(dict.fromkeys(labels, 1 / 3))  # equally near every label
    cos = 0.9 / math.hypot(0.9, 0.1)
    want = math.exp(cos / SCORE_TEMPERATURE) / (
        math.exp(cos / SCORE_TEMPERATURE) + math.exp(0.1 / math.hypot(0.9, 0.1) / SCORE_TEMPERATURE) + 1
    )
    assert out[0].scores is not None and out[0].scores["billing"] == pytest.approx(want)

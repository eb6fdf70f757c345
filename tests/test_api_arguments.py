"""The public functions' arguments given as a careless user would: one clear message (issue 69)."""

from __future__ import annotations

import pytest
import torch

from bert_cluster import ClusteredAttentionConfig, clustered_attention
from bert_cluster.attention import windowed_attention


@pytest.mark.parametrize("function", ["clustered_attention", "windowed_attention"])
@pytest.mark.parametrize("given", [{"clusters": 4}, "i-clustered", 4], ids=["dict", "str", "int"])
def test_a_config_that_is_not_one_is_refused_saying_what_to_give(function, given):
    """A dict was ``TypeError: unhashable type: 'dict'`` from the plan cache, naming nothing."""
    q = torch.randn(1, 2, 8, 4)
    call = {
        "clustered_attention": lambda: clustered_attention(q, q, q, None, given),
        "windowed_attention": lambda: windowed_attention(q, q, q, None, 2, given),
    }[function]
    with pytest.raises(
        TypeError, match=rf"^{function}: config must be a ClusteredAttentionConfig or None"
    ) as e:
        call()
    assert f"got a {type(given).__name__}" in str(e.value)
    if isinstance(given, dict):
        assert "ClusteredAttentionConfig(**settings)" in str(e.value)
    expected = clustered_attention(q, q, q, None, ClusteredAttentionConfig(clusters=4))
    assert torch.equal(
        clustered_attention(q, q, q, None, ClusteredAttentionConfig(**{"clusters": 4})), expected
    )

"""Tenant limits (batchline/api/quota.py): the prompt-token estimate and which limit a batch passes, named as OpenAI
names it."""

from __future__ import annotations

from batchline.api.quota import BYTES_PER_TOKEN, Enqueued, TenantLimits, over_limit, prompt_tokens
from schemas import Request


def test_prompt_tokens_are_the_prompt_texts_utf8_bytes_over_four_rounded_up() -> None:
    one = prompt_tokens(Request(id="a", prompt="x" * 400))
    assert one == -(-len('["' + "x" * 400 + '"]') // BYTES_PER_TOKEN)
    wide = prompt_tokens(Request(id="b", prompt="é" * 400))  # two bytes a character
    assert wide > one
    chat = prompt_tokens(Request(id="c", messages=[{"role": "user", "content": "x" * 400}]))
    assert chat > one  # the role and the structure count too


def test_a_batch_that_fits_passes_and_one_over_names_the_limit_it_passes() -> None:
    limits = TenantLimits(requests=100, tokens=1000)
    assert over_limit(limits, Enqueued(50, 500), Enqueued(50, 500), "m", "acme") is None
    tokens = over_limit(limits, Enqueued(10, 900), Enqueued(10, 101), "m", "acme")
    assert tokens is not None and tokens.code == "token_limit_exceeded"
    assert "Limit: 1,000 enqueued tokens (900 enqueued, this batch 101)" in tokens.message
    requests = over_limit(limits, Enqueued(95, 0), Enqueued(6, 0), "m", "acme")
    assert requests is not None and requests.code == "request_limit_exceeded" and "tenant acme" in requests.message
    both = over_limit(limits, Enqueued(100, 1000), Enqueued(1, 1), "m", "acme")
    assert both is not None and both.code == "token_limit_exceeded"  # tokens first, as OpenAI's own limit

"""Batched sampling: tokens follow the processed distribution, masked tokens never appear, the reported
log-probability is that of the distribution sampled from, and SGLang's parameter checks."""

from __future__ import annotations

import pytest
import torch

from workers.engines.sampling import SamplingSpec, sample

LOGITS = torch.tensor([0.0, 1.0, 2.0, -1.0, -30.0, 0.5])


def draw(temperature: float, top_p: float, top_k: int, n: int = 40000) -> tuple[torch.Tensor, torch.Tensor]:
    params = torch.tensor([[temperature, top_p, float(top_k)]]).repeat(n, 1)
    return sample(LOGITS.repeat(n, 1), params, torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k", "kept"),
    [
        (1.0, 1.0, -1, [0, 1, 2, 3, 4, 5]),
        (0.7, 1.0, 3, [1, 2, 5]),
        (1.0, 0.8, -1, [1, 2, 5]),
        (1.0, 0.7, -1, [1, 2]),
        (1.0, 0.5, -1, [2]),
        (1.3, 0.95, 4, [0, 1, 2, 5]),
    ],
)
def test_tokens_follow_the_processed_distribution_and_logprobs_are_its_own(
    temperature: float, top_p: float, top_k: int, kept: list[int]
) -> None:
    z = torch.full_like(LOGITS, float("-inf"))
    z[kept] = LOGITS[kept] / temperature
    expected = z.softmax(-1)
    tokens, logprobs = draw(temperature, top_p, top_k)
    freq = torch.bincount(tokens, minlength=len(LOGITS)).double() / len(tokens)
    assert set(tokens.unique().tolist()) <= set(kept)
    assert freq.tolist() == pytest.approx(expected.tolist(), abs=0.012)
    assert torch.allclose(logprobs, expected.log()[tokens], atol=1e-5)


def test_greedy_rows_take_the_argmax_with_the_raw_log_softmax_even_in_a_mixed_batch() -> None:
    params = torch.tensor([[0.0, 0.5, 2.0], [1.0, 1.0, -1.0]])
    tokens, logprobs = sample(LOGITS.repeat(2, 1), params, torch.Generator().manual_seed(0))
    assert tokens[0] == 2 and logprobs[0] == pytest.approx(float(LOGITS.log_softmax(-1)[2]))


def test_sglang_parameter_rules() -> None:
    spec = SamplingSpec.from_sglang({"temperature": 0, "max_new_tokens": 5, "stop_token_ids": [7], "n": 1})
    assert spec.greedy and spec.stop_token_ids == frozenset({7}) and spec.max_new_tokens == 5
    assert SamplingSpec.from_sglang(None) == SamplingSpec()
    for bad, field in [
        ({"top_k": 0}, "top_k"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -1}, "temperature"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingSpec.from_sglang(bad)
    with pytest.raises(ValueError, match=r"not supported.*\['min_p', 'stop'\]"):
        SamplingSpec.from_sglang({"stop": ["\n"], "min_p": 0.1, "repetition_penalty": 1.0})

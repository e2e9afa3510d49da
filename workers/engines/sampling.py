"""Sampling for the embedded engine: SGLang's sampling parameters, and batched sampling that returns the
log-probability of each sampled token under the distribution it was actually drawn from.

Which log-probability (streamrl needs the behaviour policy's probability of the sampled token):

- sampled rows: log softmax of the processed logits, i.e. logits / temperature, then top-k, then
  top-p, each on the renormalised distribution (the order of Hugging Face's warpers). This is the
  exact distribution the token is drawn from.
- greedy rows (temperature < 1e-6, as SGLang): the argmax, with the log softmax of the raw logits
  (SGLang's greedy path reports the same).

What SGLang reports (0.4-0.5 `layers/sampler.py`): for sampled rows the log of the temperature-
scaled softmax renormalised by top-p (its torch path computes top-p mass before top-k and does not
renormalise the reported value for top-k); with `SGLANG_RETURN_ORIGINAL_LOGPROB=1` the raw log
softmax. So with top-k unset the two agree; with top-k set this engine reports the renormalised
value, which is the true behaviour probability.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

GREEDY_EPS = 1e-6  # SGLang's threshold below which a temperature means greedy


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """One request's sampling parameters (the SGLang subset streamrl uses), validated as SGLang does."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @classmethod
    def from_sglang(cls, params: dict[str, Any] | None) -> SamplingSpec:
        """Parse SGLang's `sampling_params`; raises ValueError with the offending field."""
        p = dict(params or {})
        unsupported = sorted(
            k
            for k, v in p.items()
            if k not in _SUPPORTED and k not in _TEXT_ONLY and v is not None and v not in _NEUTRAL.get(k, ())
        )
        if unsupported:
            raise ValueError(f"sampling_params not supported by the embedded engine: {unsupported}")
        spec = cls(
            temperature=float(_get(p, "temperature", 1.0)),
            top_p=float(_get(p, "top_p", 1.0)),
            top_k=int(_get(p, "top_k", -1)),
            max_new_tokens=int(_get(p, "max_new_tokens", 128)),
            stop_token_ids=frozenset(int(t) for t in (p.get("stop_token_ids") or ())),
            ignore_eos=bool(_get(p, "ignore_eos", False)),
        )
        if spec.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {spec.temperature}")
        if not 0 < spec.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {spec.top_p}")
        if spec.top_k < 1 and spec.top_k != -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {spec.top_k}")
        if spec.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {spec.max_new_tokens}")
        return spec

    def row(self) -> list[float]:
        """This request's row of the batch parameter tensor: temperature, top_p, top_k."""
        return [self.temperature, self.top_p, float(self.top_k)]


_SUPPORTED = {"temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "ignore_eos"}
_TEXT_ONLY = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}  # no effect on tokens
# other SGLang parameters are accepted only at values that change nothing
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "min_new_tokens": (0,),
    "min_p": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "n": (1,),
    "stop": ([], ""),
}


def _get(p: dict[str, Any], key: str, default: Any) -> Any:
    value = p.get(key)
    return default if value is None else value


def sample(
    logits: torch.Tensor, params: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row. logits (B, V); params (B, 3) = temperature, top_p, top_k (-1: off).

    Returns (tokens (B,) int64, logprobs (B,) float32) where logprobs are those of the distribution
    sampled from (see the module docstring).
    """
    logits = logits.float()
    temperature, top_p, top_k = params[:, 0], params[:, 1], params[:, 2].long()
    greedy = temperature < GREEDY_EPS
    if bool(greedy.all()):
        tokens = logits.argmax(dim=-1)
        return tokens, logits.log_softmax(dim=-1).gather(1, tokens[:, None]).squeeze(1)

    vocab = logits.shape[-1]
    z = logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]
    k_on = (top_k > 0) & (top_k < vocab) & ~greedy
    if bool(k_on.any()):
        k_max = int(top_k[k_on].max())
        kth = z.topk(k_max, dim=-1).values.gather(1, (top_k.clamp(1, k_max) - 1)[:, None])
        kth = torch.where(k_on[:, None], kth, torch.full_like(kth, float("-inf")))
        z = z.masked_fill(z < kth, float("-inf"))
    p_on = (top_p < 1.0) & ~greedy
    if bool(p_on.any()):
        z_sorted, order = z.sort(dim=-1, descending=True)
        probs = z_sorted.softmax(dim=-1)
        # drop a token when the mass strictly before it already exceeds top_p (the first always stays)
        drop_sorted = ((probs.cumsum(dim=-1) - probs) > top_p[:, None]) & p_on[:, None]
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    logp = z.log_softmax(dim=-1)
    # Inverse-CDF sampling: one uniform per row. (torch.multinomial and exponential_ cost ~0.5 ms for a
    # 64 x 300 batch on these CPUs, several times the rest of sampling.) The CDF is summed in float64
    # so it ends at 1 within rounding; a zero-probability token never wins (its CDF step is flat).
    cdf = logp.exp().double().cumsum(dim=-1)
    u = torch.rand((z.shape[0], 1), generator=generator, dtype=torch.float64, device=z.device) * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=vocab - 1)
    if bool(greedy.any()):
        tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
        logp = torch.where(greedy[:, None], logits.log_softmax(dim=-1), logp)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)

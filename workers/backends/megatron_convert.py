"""Hugging Face <-> Megatron-core weights and config for Qwen2/Qwen2.5/Qwen3/Llama (no megatron import).

Three layouts appear here:

- HF: `model.layers.{i}.self_attn.{q,k,v,o}_proj`, `mlp.{gate,up,down}_proj`, RMSNorms, optional
  `lm_head` (absent when embeddings are tied).
- Megatron full (unsharded, tp=1): `decoder.layers.{i}.self_attention.linear_qkv` holds q, k and v
  interleaved per query group (`[g][q_0..q_{h/g-1}, k, v] x head_dim` rows), `mlp.linear_fc1` holds
  `[gate; up]`, and vocab rows are padded to a multiple of the TP size (megatron splits the vocab
  evenly); the padded rows are zeros and never seen by the loss (the backend slices them off).
- Megatron shard (one TP rank): column-parallel weights split on dim 0, row-parallel on dim 1, norms
  replicated. `linear_fc1` is special: each rank holds `[gate_r; up_r]` (its slice of both halves),
  because SwiGLU splits the *local* fc1 output in two.

All functions are pure over `dict[str, Tensor]` so the round trip is testable without megatron.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED = ("qwen2", "qwen3", "llama")


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What megatron needs to know about a Hugging Face decoder (Qwen2, Qwen2.5, Qwen3, Llama)."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int  # HF embedding rows (the real vocab the softmax covers)
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    qkv_bias: bool  # Qwen2/2.5: True; Qwen3, Llama: False
    qk_norm: bool  # Qwen3: RMSNorm over each head's q and k before RoPE
    tie_word_embeddings: bool
    llama3_rope_scaling: float | None = None  # factor of Llama 3.1's rope scaling, else None

    def padded_vocab(self, tp: int) -> int:
        """Vocab rows megatron holds: the smallest multiple of `tp` >= the real vocab."""
        return -(-self.vocab_size // tp) * tp


def shape_from_hf_config(cfg: dict[str, Any]) -> ModelShape:
    """Map a Hugging Face `config.json` (as a dict) to a `ModelShape`; raise on what we cannot map."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED:
        raise ValueError(f"megatron backend: model_type {model_type!r} is not supported (one of {SUPPORTED})")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"megatron backend: hidden_act {cfg.get('hidden_act')!r}, only silu (SwiGLU)")
    if cfg.get("use_sliding_window"):
        raise ValueError("megatron backend: sliding-window attention (use_sliding_window) is not supported")
    if cfg.get("mlp_bias"):
        raise ValueError("megatron backend: mlp_bias=True is not supported")
    rope = dict(cfg.get("rope_parameters") or {})  # transformers >= 5
    legacy = cfg.get("rope_scaling") or {}  # transformers 4.x
    rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", legacy.get("rope_type", legacy.get("type", "default")))
    scaling = {**legacy, **rope}
    llama3 = None
    if rope_type == "llama3":
        # megatron's rope_scaling implements Llama 3.1's rule with these constants only.
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        got = {k: scaling.get(k) for k in expected}
        if any(got[k] is None or float(got[k]) != float(v) for k, v in expected.items()):
            raise ValueError(
                f"megatron backend: llama3 rope scaling {got}, megatron supports only {expected}"
            )
        llama3 = float(scaling["factor"])
    elif rope_type not in (None, "default"):
        raise ValueError(f"megatron backend: rope_type {rope_type!r} is not supported")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    # Qwen2/2.5 always have q/k/v biases (their config has no attention_bias key); Qwen3 and Llama don't
    qkv_bias = model_type == "qwen2" or bool(cfg.get("attention_bias", False))
    return ModelShape(
        model_type=model_type,
        num_layers=int(cfg["num_hidden_layers"]),
        hidden_size=hidden,
        num_heads=heads,
        num_query_groups=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        ffn_hidden_size=int(cfg["intermediate_size"]),
        vocab_size=int(cfg["vocab_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        rope_theta=rope_theta,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        qkv_bias=qkv_bias,
        qk_norm=model_type == "qwen3",
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        llama3_rope_scaling=llama3,
    )


# ---------------------------------------------------------------- HF <-> Megatron (full)

_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_MG_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_RENAME = {  # per-layer tensors that map one to one
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
}
_RENAME_BACK = {v: k for k, v in _RENAME.items()}


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def interleave_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: ModelShape) -> torch.Tensor:
    """[h*d, ...], [g*d, ...], [g*d, ...] -> [(h + 2g)*d, ...] grouped as megatron's linear_qkv."""
    g, d = s.num_query_groups, s.head_dim
    per = s.num_heads // g
    rest = q.shape[1:]
    return torch.cat(
        [q.reshape(g, per * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1
    ).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, s: ModelShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `interleave_qkv` (also valid on a TP shard given the shard's group count)."""
    d = s.head_dim
    per = s.num_heads // s.num_query_groups
    rest = qkv.shape[1:]
    grouped = qkv.reshape(-1, (per + 2) * d, *rest)
    q, k, v = torch.split(grouped, [per * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def hf_to_megatron(hf: dict[str, torch.Tensor], s: ModelShape, tp: int = 1) -> dict[str, torch.Tensor]:
    """Full megatron state dict (vocab padded for `tp`) from a Hugging Face state dict."""
    out: dict[str, torch.Tensor] = {}
    vocab = s.padded_vocab(tp)
    out["embedding.word_embeddings.weight"] = _pad_rows(hf["model.embed_tokens.weight"], vocab)
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if not s.tie_word_embeddings:
        out["output_layer.weight"] = _pad_rows(hf["lm_head.weight"], vocab)
    for i in range(s.num_layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_name, mg_name in _RENAME.items():
            if p + hf_name in hf:
                out[m + mg_name] = hf[p + hf_name]
        a = p + "self_attn."
        out[m + "self_attention.linear_qkv.weight"] = interleave_qkv(
            hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], s
        )
        if s.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = interleave_qkv(
                hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"], s
            )
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]]
        )
    return out


def megatron_to_hf(mg: dict[str, torch.Tensor], s: ModelShape) -> dict[str, torch.Tensor]:
    """Hugging Face tensors for the full megatron tensors in `mg` (any subset of whole tensors), in
    HF order per layer. Vocab padding is dropped; a tied model has no `lm_head.weight`."""
    out: dict[str, torch.Tensor] = {}
    for name, t in mg.items():
        if name == "embedding.word_embeddings.weight":
            out["model.embed_tokens.weight"] = t[: s.vocab_size]
        elif name == "output_layer.weight":
            if not s.tie_word_embeddings:
                out["lm_head.weight"] = t[: s.vocab_size]
        elif name == "decoder.final_layernorm.weight":
            out["model.norm.weight"] = t
        elif (match := _MG_LAYER.fullmatch(name)) is not None:
            p, rest = f"model.layers.{match.group(1)}.", match.group(2)
            if rest in _RENAME_BACK:
                out[p + _RENAME_BACK[rest]] = t
            elif rest.startswith("self_attention.linear_qkv."):
                kind = rest.rsplit(".", 1)[1]  # weight | bias
                q, k, v = split_qkv(t, s)
                for proj, x in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                    out[f"{p}self_attn.{proj}.{kind}"] = x
            elif rest == "mlp.linear_fc1.weight":
                gate, up = torch.chunk(t, 2)
                out[p + "mlp.gate_proj.weight"] = gate
                out[p + "mlp.up_proj.weight"] = up
            elif not rest.endswith("_extra_state"):
                raise KeyError(f"megatron_to_hf: no Hugging Face name for {name}")
        elif not name.endswith("_extra_state"):
            raise KeyError(f"megatron_to_hf: no Hugging Face name for {name}")
    return out


def hf_names(s: ModelShape) -> list[str]:
    """Hugging Face tensor names in the fixed order weights are sent (embeddings, layers, norm, head)."""
    names = ["model.embed_tokens.weight"]
    for i in range(s.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight"]
        for proj in ("q_proj", "k_proj", "v_proj"):
            names += [f"{p}self_attn.{proj}.weight"] + ([f"{p}self_attn.{proj}.bias"] if s.qkv_bias else [])
        if s.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        names += [p + "self_attn.o_proj.weight", p + "post_attention_layernorm.weight"]
        names += [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", p + "mlp.down_proj.weight"]
    names.append("model.norm.weight")
    if not s.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


# ---------------------------------------------------------------- TP sharding


def tp_split_dim(name: str) -> int | None:
    """Dimension a megatron tensor is split on across TP ranks (None: replicated)."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return 0
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight")):
        return 0
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None


def shard(mg: dict[str, torch.Tensor], tp_rank: int, tp: int) -> dict[str, torch.Tensor]:
    """The tensors TP rank `tp_rank` of `tp` holds, from full megatron tensors (vocab already padded)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in mg.items():
        dim = tp_split_dim(name)
        if dim is None:
            out[name] = t
        elif name.endswith("linear_fc1.weight"):
            gate, up = torch.chunk(t, 2)
            out[name] = torch.cat([torch.chunk(gate, tp)[tp_rank], torch.chunk(up, tp)[tp_rank]])
        else:
            if t.shape[dim] % tp:
                raise ValueError(
                    f"shard: {name} has {t.shape[dim]} rows on dim {dim}, not divisible by tp={tp}"
                )
            out[name] = torch.chunk(t, tp, dim=dim)[tp_rank].contiguous()
    return out


def unshard(name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """Full megatron tensor from every TP rank's part of `name` (rank order); inverse of `shard`."""
    dim = tp_split_dim(name)
    if dim is None or len(parts) == 1:
        return parts[0]
    if name.endswith("linear_fc1.weight"):
        halves = [torch.chunk(p, 2) for p in parts]
        return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    return torch.cat(parts, dim=dim)


# ---------------------------------------------------------------- pipeline stages


def stage_tensors(
    mg: dict[str, torch.Tensor],
    s: ModelShape,
    first_layer: int,
    num_layers: int,
    pre_process: bool,
    post_process: bool,
) -> dict[str, torch.Tensor]:
    """The full megatron tensors one pipeline stage holds, under the stage's own names: layers
    `first_layer .. first_layer + num_layers - 1` renumbered from 0 (megatron's state dict counts
    layers per stage), the embedding on the first stage, the final norm and output layer on the last.
    With tied embeddings and more than one stage, the last stage keeps its own copy of the embedding
    as `output_layer.weight` (megatron keeps the two in sync by all-reducing their gradients)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in mg.items():
        if (match := _MG_LAYER.fullmatch(name)) is not None:
            local = int(match.group(1)) - first_layer
            if 0 <= local < num_layers:
                out[f"decoder.layers.{local}.{match.group(2)}"] = t
        elif name == "embedding.word_embeddings.weight":
            if pre_process:
                out[name] = t
            if post_process and not pre_process and s.tie_word_embeddings:
                out["output_layer.weight"] = t
        elif post_process:
            out[name] = t  # decoder.final_layernorm.weight, output_layer.weight
    return out


def global_layer_name(name: str, first_layer: int) -> str:
    """A stage's tensor name with its layer index made global (inverse of `stage_tensors`' renaming)."""
    match = _MG_LAYER.fullmatch(name)
    if match is None or first_layer == 0:
        return name
    return f"decoder.layers.{int(match.group(1)) + first_layer}.{match.group(2)}"


def full_shape(name: str, local: torch.Size, tp: int) -> torch.Size:
    """Shape of the full tensor `name` whose TP shard has shape `local` (what `unshard` returns)."""
    dim = tp_split_dim(name)
    if dim is None or tp == 1:
        return local
    return torch.Size(n * tp if i == dim else n for i, n in enumerate(local))

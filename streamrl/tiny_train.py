"""The tiny models' supervised warm start: shared-prefix batching, held-out checks, the stopping rule.

Speed is the whole game on 2 CPU cores. Two things make it affordable:

* Shared prefix. Every tool-task example starts with the same ~340-token rStar2 system prompt, while
  the part that differs is ~130 tokens. A batch runs that prefix once (batch 1, with gradient), repeats
  its KV cache over the batch and runs only the suffixes on top: the same loss and gradients as the
  full sequences (repeat's backward sums over the batch), about 5x less compute.
* Right padding without an attention mask. The model is causal, so a real token never attends to the
  padding after it; padded positions are simply not in the loss.

Held-out checks decode (greedy, or sampled at temperature 1 with a seeded generator) with the
model's own KV cache, like the agent loop: the tool task parses the first turn's `<tool_call>`,
answers it with `tiny_data.run_formulaic` (the sandbox's output for that formula, without starting
a sandbox) and decodes the second turn.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from sandbox_bridge.tool import render_tool_result
from streamrl import templates
from streamrl.data import PromptItem
from streamrl.tiny_data import (
    WARMUP_STEPS,
    Example,
    Plan,
    Task,
    heldout,
    last_boxed,
    parse_tool_call,
    prompt_text,
    run_formulaic,
    train_stream,
)

IGNORE = -100
MIN_SHARED_PREFIX = 16  # below this the extra forward call costs more than it saves


@dataclass
class Batch:
    prefix: torch.Tensor  # (1, P) token ids shared by every row; P may be 0
    ids: torch.Tensor  # (B, S) the rest of each sequence, right-padded
    labels: torch.Tensor  # (B, S) ids where trained, IGNORE elsewhere (prompt, tool turn, padding)
    tokens: int  # real tokens in the batch as if run without the prefix trick


def _encode(tok: PreTrainedTokenizerFast, texts: Sequence[str]) -> list[list[int]]:
    return [e.ids for e in tok.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False)]


def encode(tok: PreTrainedTokenizerFast, examples: Sequence[Example]) -> Batch:
    """Tokenize segment by segment (as the agent loop concatenates ids) and split off the shared prefix."""
    flat = [seg for ex in examples for seg in ex.segments]
    ids_flat = iter(_encode(tok, [text for text, _ in flat]))
    rows: list[tuple[list[int], list[int]]] = []
    prompt_len = 1 << 30
    for ex in examples:
        ids: list[int] = []
        labels: list[int] = []
        for _, trained in ex.segments:
            seg = next(ids_flat)
            prompt_len = min(prompt_len, len(seg)) if not ids else prompt_len
            ids += seg
            labels += seg if trained else [IGNORE] * len(seg)
        rows.append((ids, labels))
    # The prefix stays inside the prompt (never trained) and leaves every row at least one token.
    shared = _common_prefix([ids for ids, _ in rows], limit=prompt_len - 1)
    if shared < MIN_SHARED_PREFIX:
        shared = 0
    width = max(len(ids) for ids, _ in rows) - shared
    pad = tok.pad_token_id
    assert pad is not None
    batch_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    batch_labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for r, (ids, labels) in enumerate(rows):
        batch_ids[r, : len(ids) - shared] = torch.tensor(ids[shared:])
        batch_labels[r, : len(ids) - shared] = torch.tensor(labels[shared:])
    prefix = torch.tensor([rows[0][0][:shared]], dtype=torch.long)
    return Batch(prefix, batch_ids, batch_labels, sum(len(ids) for ids, _ in rows))


def _common_prefix(seqs: Sequence[Sequence[int]], limit: int) -> int:
    n = min(limit, *(len(s) for s in seqs))
    first = seqs[0]
    for i in range(n):
        if any(s[i] != first[i] for s in seqs):
            return i
    return max(n, 0)


def sft_loss(model: PreTrainedModel, batch: Batch) -> torch.Tensor:
    """Mean cross-entropy over the trained tokens."""
    rows = batch.ids.shape[0]
    if batch.prefix.shape[1] == 0:
        logits = model(batch.ids).logits[:, :-1]  # (B, S-1, V) predicts ids[:, 1:]
        targets = batch.labels[:, 1:]
    else:
        head = model(batch.prefix, use_cache=True, logits_to_keep=1)
        cache = head.past_key_values
        cache.batch_repeat_interleave(rows)  # (1, ...) -> (B, ...); autograd sums the copies back
        body = model(batch.ids, past_key_values=cache).logits  # (B, S, V)
        # The prefix's last logit predicts ids[:, 0]; body position t predicts ids[:, t + 1].
        logits = torch.cat([head.logits[:, -1:].expand(rows, 1, -1), body[:, :-1]], dim=1)
        targets = batch.labels
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE)


@torch.no_grad()
def decode(
    model: PreTrainedModel,
    seqs: Sequence[list[int]],
    max_new: int,
    eos: int,
    pad: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """Continue each sequence (left-padded, KV-cached), cut after the first `eos`.

    Greedy at temperature 0, else plain sampling (no top-k/top-p, as the RL rollouts sample).
    """
    width = max(len(s) for s in seqs)
    ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], dtype=torch.long)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    out: list[list[int]] = [[] for _ in seqs]
    done = torch.zeros(len(seqs), dtype=torch.bool)
    cache = None
    step_ids, step_pos = ids, positions
    for _ in range(max_new):
        res = model(
            step_ids, attention_mask=mask, position_ids=step_pos, past_key_values=cache, use_cache=True
        )
        cache = res.past_key_values
        logits = res.logits[:, -1]  # (B, V)
        if temperature > 0:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)[:, 0]
        else:
            nxt = logits.argmax(-1)  # (B,)
        for r in range(len(seqs)):
            if not done[r]:
                out[r].append(int(nxt[r]))
        done |= nxt == eos
        if bool(done.all()):
            break
        step_ids = nxt[:, None]
        step_pos = step_pos[:, -1:] + 1
        mask = torch.cat([mask, torch.ones(len(seqs), 1, dtype=torch.long)], dim=1)
    return out


@dataclass
class EvalResult:
    accuracy: float  # the final \boxed{} equals the answer
    tool_call_rate: float | None  # first turn holds a well-formed python_code_with_standard_io call
    tool_success_rate: float | None  # ... and its code ran without error
    samples: list[str]  # the first few decoded responses, for eyeballing


def evaluate(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerFast,
    task: Task,
    items: Sequence[PromptItem],
    temperature: float = 0.0,
    seed: int = 0,
) -> EvalResult:
    """Greedy (temperature 0) or sampled answers to `items`, through the tool loop for `tool`."""
    was_training = model.training
    model.eval()
    try:
        return _evaluate(model, tok, task, items, temperature, torch.Generator().manual_seed(seed))
    finally:
        model.train(was_training)


def _evaluate(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerFast,
    task: Task,
    items: Sequence[PromptItem],
    temperature: float,
    gen: torch.Generator,
) -> EvalResult:
    eos, pad = tok.convert_tokens_to_ids(templates.IM_END), tok.pad_token_id
    assert isinstance(eos, int) and pad is not None
    prompts = _encode(tok, [prompt_text(task, it) for it in items])
    first = decode(model, prompts, 12 if task == "arith" else 96, eos, pad, temperature, gen)
    first_text = [tok.decode(ids) for ids in first]
    if task == "arith":
        correct = [last_boxed(t) == it.answer for t, it in zip(first_text, items, strict=True)]
        return EvalResult(sum(correct) / len(items), None, None, first_text[:4])
    codes = [parse_tool_call(t) for t in first_text]
    results = {r: run_formulaic(code) for r, code in enumerate(codes) if code is not None}
    finals = list(first_text)
    called = sorted(results)
    if called:
        turns = _encode(tok, [templates.tool_turn([render_tool_result(results[r])]) for r in called])
        contexts = [prompts[r] + first[r] + turns[i] for i, r in enumerate(called)]
        second = decode(model, contexts, 48, eos, pad, temperature, gen)
        for i, r in enumerate(called):
            finals[r] = tok.decode(turns[i] + second[i])
    correct = [last_boxed(t) == it.answer for t, it in zip(finals, items, strict=True)]
    n = len(items)
    ok = sum(1 for r in called if results[r].run_success)
    samples = [f + (finals[r] if r in results else "") for r, f in enumerate(first_text[:3])]
    return EvalResult(sum(correct) / n, len(called) / n, ok / n, samples)


# ---------------------------------------------------------------- the warm-start loop


@torch.no_grad()
def copy_prior_init(model: PreTrainedModel, scale: float) -> None:
    """Start the last layer's attention heads as copiers: output = scale * P^T P v, P orthonormal.

    With tied embeddings, attending to a token then raises that token's own logit from step 0, so
    training only has to learn *where* to look. From Hugging Face's random init the 2-layer tool
    model sits on a loss plateau for 600-1500+ steps before it discovers copying (question -> code,
    stdout -> answer); with this init the jump comes after about 100 steps. Only the last layer: the
    same init in every layer made one of the two copies stall again (measured, seeds 0-2).
    """
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    attn = model.model.layers[-1].self_attn
    basis, _ = torch.linalg.qr(torch.randn(cfg.hidden_size, cfg.num_key_value_heads * head_dim))  # (H, kv*hd)
    attn.v_proj.weight.copy_(basis.T)  # project the normed input onto an orthonormal subspace ...
    if attn.v_proj.bias is not None:
        attn.v_proj.bias.zero_()
    for h in range(cfg.num_attention_heads):
        kv = slice((h // group) * head_dim, (h // group + 1) * head_dim)
        attn.o_proj.weight[:, h * head_dim : (h + 1) * head_dim] = scale * basis[:, kv]  # ... and back


@dataclass
class WarmStart:
    steps: int  # the step whose weights the model holds at the end
    train_loss: float  # mean of the last 20 training steps' losses (before any rollback)
    greedy: EvalResult  # held-out results of the kept weights
    sampled: EvalResult  # ... at temperature 1, as RL rollouts sample
    stopped: str  # "band" | "rollback" | "budget"
    history: list[dict[str, float]]  # one row per check: step, elapsed_s, the criterion's accuracy


def warm_start(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerFast,
    task: Task,
    plan: Plan,
    seed: int,
    deadline: float,
    on_update: Callable[[int, float, list[dict[str, float]]], None] = lambda *_: None,
) -> WarmStart:
    """Seeded SFT until held-out accuracy enters `plan.band` or `time.monotonic()` nears `deadline`.

    Accuracy is `plan.criterion`'s: greedy, or sampled at temperature 1 (seeded). Learning to copy
    comes in a sharp jump, so a check can land above the band; it then binary-searches the snapshots
    taken since the previous check for one inside it. Checks happen at fixed steps, so the result
    depends only on the seed unless the deadline hits.
    """
    held = heldout(task, seed, plan.heldout)
    stream = train_stream(task, seed, exclude={str(it.text) for it in held})
    opt = torch.optim.AdamW(model.parameters(), lr=plan.lr, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP_STEPS))
    temperature = 1.0 if plan.criterion == "sampled" else 0.0
    losses: list[float] = []
    history: list[dict[str, float]] = []
    snaps: list[tuple[int, dict[str, torch.Tensor]]] = []
    check_s, step, began = 1.0, 0, time.monotonic()

    def check(at: int) -> EvalResult:
        nonlocal check_s
        t0 = time.monotonic()
        res = evaluate(model, tok, task, held, temperature, seed)
        check_s = max(check_s, time.monotonic() - t0)
        row = {
            "step": at,
            "elapsed_s": round(time.monotonic() - began, 1),
            f"{plan.criterion}_accuracy": res.accuracy,
        }
        if res.tool_call_rate is not None:
            row[f"{plan.criterion}_tool_call_rate"] = res.tool_call_rate
        history.append(row)
        return res

    def loss_now() -> float:
        return sum(losses[-20:]) / len(losses[-20:])

    model.train()
    while True:
        batch = encode(tok, [next(stream) for _ in range(plan.batch)])
        loss = sft_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        step += 1
        losses.append(loss.item())
        # Keep room for this check, a rollback probe and the report's other evaluation.
        over = time.monotonic() + 3 * check_s >= deadline
        if step % plan.check_every == 0 or over:
            res = check(step)
            kept, stopped = step, "band" if plan.band[0] <= res.accuracy <= plan.band[1] else ""
            if res.accuracy > plan.band[1]:
                kept, res = _roll_back(model, snaps, (step, res), check, plan.band, deadline, check_s)
                stopped = "rollback" if kept != step else "band"
            stopped = stopped or ("budget" if over else "")
            on_update(step, loss_now(), history)
            if stopped:
                other = evaluate(model, tok, task, held, 1.0 - temperature, seed)
                greedy, sampled = (other, res) if temperature else (res, other)
                return WarmStart(kept, loss_now(), greedy, sampled, stopped, history)
            snaps.clear()
        elif step % plan.snap_every == 0:
            snaps.append((step, {k: v.detach().clone() for k, v in model.state_dict().items()}))
        if step % 10 == 0:
            on_update(step, loss_now(), history)


def _roll_back(
    model: PreTrainedModel,
    snaps: list[tuple[int, dict[str, torch.Tensor]]],
    current: tuple[int, EvalResult],
    check: Callable[[int], EvalResult],
    band: tuple[float, float],
    deadline: float,
    check_s: float,
) -> tuple[int, EvalResult]:
    """Binary-search snapshots (oldest first) for accuracy inside `band`; else keep the closest.

    Accuracy is noisy and not monotone in the step, so this is a heuristic: it probes at most
    log2(len(snaps)) + 1 snapshots and never one past the deadline.
    """
    low, high = band
    latest = {k: v.detach().clone() for k, v in model.state_dict().items()}
    tried: list[tuple[int, EvalResult, dict[str, torch.Tensor]]] = [(current[0], current[1], latest)]
    lo, hi = 0, len(snaps) - 1
    while lo <= hi and time.monotonic() + 2 * check_s < deadline:
        mid = (lo + hi) // 2
        model.load_state_dict(snaps[mid][1])
        res = check(snaps[mid][0])
        tried.append((snaps[mid][0], res, snaps[mid][1]))
        if low <= res.accuracy <= high:
            return snaps[mid][0], res
        lo, hi = (mid + 1, hi) if res.accuracy < low else (lo, mid - 1)

    def distance(acc: float) -> float:
        return max(low - acc, acc - high, 0.0)

    step, res, state = min(tried, key=lambda t: (distance(t[1].accuracy), -t[0]))
    model.load_state_dict(state)
    return step, res

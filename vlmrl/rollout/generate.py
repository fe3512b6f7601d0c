"""Stage I, collect: G answers per prompt in one batched, KV-cached sampling loop.

Each prompt's images go through the vision tower and its tokens through the prefill once, for all G answers of its
group. Each decoding step then runs one row per distinct answer prefix: the answers of a prompt that sampled the
same tokens so far have the same next-token distribution, so they share a row (and its KV cache row) until their
tokens differ. Each answer still draws its own token from that distribution. A policy that answers most prompts the
same way (RL on short answers, late in training) decodes a few rows per prompt instead of G. `share_prefixes=False`
runs one row per unfinished answer; both compute the same distributions, up to float rounding in matrix products
over a different number of rows. The loop records each sampled token's log-probability under the temperature-scaled
distribution (logits upcast to float32 first) — the same quantity the training forward recomputes; the update
logs the gap between the two (rollout/logprob_gap_*).

Multi-turn trajectories (vlmrl.agent) generate their later turns from whole conversations (a `ConversationBatch`,
one row per trajectory): the prompt that a group's trajectories share is prefilled once and its keys and values
copied to their rows, then each trajectory's turns and observations are prefilled after it
(`vlmrl.models.forward.shared_prefill`), instead of every whole row. The distributions are the same up to rounding.

Memory is bounded by a chunk of answers, as the log-prob passes are bounded by a chunk of tokens
(vlmrl/models/forward.py): each token's float32 log-softmax, top-k/top-p filters and Gumbel noise are built for at
most `chunk_rows` answers at a time (whole groups, so each prompt's stream draws exactly what it drew unchunked), and
the KV cache is copied only on a token where an answer split from its row or finished, and then only its filled
columns (vlmrl/models/kv_cache.py). Both leave the answers and log-probs bit-identical. The language-model head
still runs on every row of the step at once, in the model's dtype: a matrix product over fewer rows can round
differently.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from vlmrl.models.batch import ConversationBatch, PromptBatch, concat_prompt_batches
from vlmrl.models.forward import head_chunk_tokens, shared_prefill
from vlmrl.models.policy import Policy

OnToken = Callable[[Tensor, Tensor], Tensor | None]  # (tokens [N], alive [N]) -> rows to end now, or None
OnLogits = Callable[[Tensor, Tensor], None]  # (logits [rows, vocab], each answer's row [N]), before sampling


@dataclass
class Rollout:
    """G completions per prompt; row n belongs to prompt `prompt_index[n]` (rows of a group are contiguous)."""

    prompt_index: Tensor  # [N]
    completion_ids: Tensor  # [N, T] right-padded with the pad token
    completion_mask: Tensor  # [N, T] 1 on generated tokens, the end token included
    logprobs: Tensor  # [N, T] sampling-time log-probs (0 on padding)
    truncated: Tensor  # [N] bool: hit max_new_tokens without an end token
    texts: list[str]  # decoded completions, end token stripped
    # multi-turn trajectories (vlmrl.agent): row n's whole conversation, whose last tokens are completion n (the
    # policy's turns, masked in, and the observations, masked out); every log-prob pass then runs on it
    context: ConversationBatch | None = None
    columns: dict[str, list] = field(default_factory=dict)  # per-row columns for the rewards (turns, tool calls)

    @property
    def lengths(self) -> Tensor:
        return self.completion_mask.sum(-1)

    def scoring_inputs(self, prompts: PromptBatch) -> tuple[PromptBatch, Tensor]:
        """What a log-prob pass over these rows runs on: (prompts, prompt_index), or each row's own conversation."""
        if self.context is None:
            return prompts, self.prompt_index
        return self.context, torch.arange(len(self.texts))

    def select(self, rows: Tensor, prompt_index: Tensor | None = None) -> Rollout:
        """Rows `rows` (e.g. the groups DAPO's dynamic sampling keeps), with `prompt_index` replaced if given."""
        keep = rows.tolist()
        return Rollout(self.prompt_index[rows] if prompt_index is None else prompt_index, self.completion_ids[rows],
                       self.completion_mask[rows], self.logprobs[rows], self.truncated[rows],
                       [self.texts[i] for i in keep], None if self.context is None else self.context.subset(keep),
                       {k: [v[i] for i in keep] for k, v in self.columns.items()})


def concat_rollouts(rollouts: list[Rollout], pad_token_id: int) -> Rollout:
    """Rollouts of consecutive PromptBatches joined: prompt indices are offset, completions right-padded."""
    width = max(r.completion_ids.shape[1] for r in rollouts)

    def right_pad(x: Tensor, value) -> Tensor:
        return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

    offsets, total = [], 0
    for r in rollouts:
        offsets.append(total)
        total += int(r.prompt_index.max()) + 1 if len(r.prompt_index) else 0
    contexts = [r.context for r in rollouts]
    context = concat_prompt_batches(contexts, pad_token_id) if all(c is not None for c in contexts) else None
    return Rollout(torch.cat([r.prompt_index + o for r, o in zip(rollouts, offsets, strict=True)]),
                   torch.cat([right_pad(r.completion_ids, pad_token_id) for r in rollouts]),
                   torch.cat([right_pad(r.completion_mask, 0) for r in rollouts]),
                   torch.cat([right_pad(r.logprobs, 0.0) for r in rollouts]),
                   torch.cat([r.truncated for r in rollouts]), [t for r in rollouts for t in r.texts], context,
                   {k: [v for r in rollouts for v in r.columns[k]] for k in rollouts[0].columns})


def sample_tokens(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                  generator: torch.Generator | None = None, uniform: Tensor | None = None,
                  rows: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Sample one token per row; return (tokens, log-prob of each under softmax(logits / temperature)).

    temperature == 0 is greedy decoding (log-probs then at temperature 1). top-k / top-p restrict what is sampled;
    the returned log-probs stay those of the unrestricted tempered distribution, which is what training recomputes.
    `rows` [N]: sample N tokens, token n from logits row rows[n] (answers that share a prefix share their logits).
    `uniform` [N, vocab] (Gumbel-max noise instead of `generator`) is overwritten: the caller's buffer, refilled for
    every token.
    """
    logits = logits.float()
    if temperature <= 0:
        tokens = logits.argmax(-1)
        logp = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
        return (tokens, logp) if rows is None else (tokens[rows], logp[rows])
    # [rows, vocab] temporaries are few and updated in place: with a real vocabulary each is ~0.6 MB per row
    logp = torch.log_softmax(logits if temperature == 1 else logits / temperature, -1)  # (x / 1 is x: one copy less)
    if rows is not None:
        logp = logp[rows]
    filtered = logp
    if top_k > 0:
        kth = logp.topk(min(top_k, logp.shape[-1]), -1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logp, order = filtered.sort(-1, descending=True)
        cum = sorted_logp.exp().cumsum(-1)
        drop_sorted = cum - sorted_logp.exp() > top_p  # keep the smallest prefix whose mass reaches top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        filtered = filtered.masked_fill(drop, float("-inf"))
    if uniform is not None:  # Gumbel-max with the caller's noise: argmax(log p + g) is a sample of p
        gumbel = uniform.clamp_(1e-20, 1.0 - 1e-7).log_().neg_().log_().neg_()  # -log(-log u), in place
        tokens = gumbel.add_(filtered).argmax(-1)
    else:
        tokens = torch.multinomial(filtered.exp(), 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def answer_chunks(sizes: list[int], chunk_rows: int) -> list[tuple[int, int]]:
    """Consecutive prompts (first, end) whose answers together are at most `chunk_rows` (0: all of them), a group
    never split: a prompt's stream draws its whole group's noise in one call, as it does unchunked. A group larger
    than `chunk_rows` is a chunk of its own."""
    if chunk_rows <= 0:
        return [(0, len(sizes))]
    chunks, first, rows = [], 0, 0
    for i, size in enumerate(sizes):
        if rows and rows + size > chunk_rows:
            chunks.append((first, i))
            first, rows = i, 0
        rows += size
    return chunks + [(first, len(sizes))] if sizes else [(0, 0)]


def same_rows(parent: Tensor, count: int) -> bool:
    """Whether the next step's rows are this step's, in order: no answer split from its row and no row lost its last
    unfinished answer, so the KV cache needs no copy."""
    return len(parent) == count and torch.equal(parent, torch.arange(count, device=parent.device))


@torch.no_grad()
def generate(policy: Policy, prompts: PromptBatch, group_size: int | list[int], max_new_tokens: int,
             temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, generator: torch.Generator | None = None,
             prompt_seeds: list[int] | None = None, on_token: OnToken | None = None,
             share_prefixes: bool = True, chunk_rows: int | None = None,
             on_logits: OnLogits | None = None) -> Rollout:
    """Sample `group_size` completions for every prompt in one batched call (a list: that many for each prompt).

    With `prompt_seeds` (one per prompt), each prompt's answers draw their noise from their own random stream, so
    they do not depend on which other prompts share the batch: the same seeds give the same answers whether the
    step runs in one process or is sharded across ranks. Otherwise `generator` drives the whole batch.

    `on_token(tokens, alive)` is called after every decoding step with the sampled tokens [N] and which rows were
    still generating [N] (a finished row's token is padding); it may return a bool [N] of rows to end after this
    token (the server's stop strings, per-request max_tokens, a client gone). The other rows are unaffected.
    `on_logits(logits, rows)`, before each step samples: that step's logits [rows, vocab] (the model's dtype,
    unscaled) and the row each answer reads [N] (the server's per-token log-probs); it must not change them.

    `chunk_rows`: answers per sampling chunk (None: `head_chunk_tokens`, 128 MiB of float32 logits per chunk; 0: all
    at once); any value gives the same answers. Chunks hold whole groups. Sampling at temperature > 0 from the one
    `generator` (no `prompt_seeds`) draws for all answers at once, as `torch.multinomial` over fewer rows would draw
    other numbers: its callers bound the rows (eval.batch_size).
    """
    family = policy.family
    sizes = [group_size] * len(prompts) if isinstance(group_size, int) else [int(g) for g in group_size]
    index = torch.arange(len(prompts)).repeat_interleave(torch.tensor(sizes, dtype=torch.long))
    pe = family.prompt_embeds(prompts)
    # the prompt is encoded (vision tower and prefill) once; each decoding step then runs one row per distinct
    # answer prefix (module docstring): `phys[n]` is answer n's row of `hidden` and of the cache
    if isinstance(prompts, ConversationBatch) and not pe.extras:  # multi-turn: a group's prompt prefilled once
        width = max(prompts.completion_tokens)
        shared = shared_prefill(family, prompts, pe, width, reserve=max_new_tokens)
        cache, base_mask = shared.cache, shared.attention_mask
        last = torch.tensor(prompts.completion_tokens, device=pe.embeds.device) - 1
        hidden = shared.first if not width else shared.last if shared.last is not None else \
            shared.tail[torch.arange(len(prompts), device=last.device), last]
    else:
        cache, base_mask = family.new_cache(reserve=max_new_tokens), pe.attention_mask
        hidden = family.forward_hidden(pe.embeds, pe.attention_mask, pe.position_ids, cache, pe.extras)[:, -1]
    n, device = len(index), pe.embeds.device
    phys = index.to(device)
    row_prompt = torch.arange(len(prompts), device=device)  # each computed row's prompt
    eos = torch.tensor(policy.eos_token_ids, device=device)
    tokens, logps, alive_steps = [], [], []
    alive = torch.ones(n, dtype=torch.bool, device=device)
    streams, noise = None, None
    if prompt_seeds is not None and temperature > 0:
        streams = [torch.Generator(device=device).manual_seed(int(s)) for s in prompt_seeds]
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size)
    one_draw = temperature > 0 and streams is None  # torch.multinomial over every answer at once
    chunk = head_chunk_tokens(family) if chunk_rows is None else chunk_rows
    chunks = answer_chunks(sizes, 0 if one_draw else chunk)
    for t in range(max_new_tokens):
        logits = family.lm_head(hidden)  # [rows, vocab] in the model's dtype; float32 only chunk by chunk
        vocab = logits.shape[-1]
        if on_logits is not None:
            on_logits(logits, phys)
        if streams is not None and noise is None:  # one buffer for the whole loop, refilled chunk by chunk
            noise = torch.empty(max(starts[b] - starts[a] for a, b in chunks), vocab, device=device)
        tok, logp = [], []
        for a, b in chunks:
            rows, uniform = phys[starts[a]:starts[b]], None
            if streams is not None:
                uniform = noise[:len(rows)]
                for i in range(a, b):  # each prompt's answers from its own stream, written in place
                    torch.rand(sizes[i], vocab, generator=streams[i], device=device,
                               out=uniform[starts[i] - starts[a]:starts[i + 1] - starts[a]])
            if len(chunks) == 1:
                part = sample_tokens(logits, temperature, top_k, top_p, generator, uniform, rows=rows)
            else:  # the chunk's own rows of the step (its answers' distinct prefixes)
                used, inverse = torch.unique(rows, return_inverse=True)
                first, last = int(used[0]), int(used[-1])  # consecutive rows (a group's): a view, not a copy
                part = sample_tokens(logits[first:last + 1] if last - first + 1 == len(used) else
                                     logits.index_select(0, used), temperature, top_k, top_p, generator, uniform,
                                     rows=inverse)
            tok.append(part[0])
            logp.append(part[1])
        tok, logp = (tok[0], logp[0]) if len(chunks) == 1 else (torch.cat(tok), torch.cat(logp))
        logits = None  # not held through the next decoding forward
        tok = torch.where(alive, tok, policy.pad_token_id)
        tokens.append(tok)
        logps.append(torch.where(alive, logp, 0.0))
        alive_steps.append(alive)
        alive = alive & ~torch.isin(tok, eos)
        if on_token is not None:
            ended = on_token(tok, alive_steps[-1])
            if ended is not None:
                alive = alive & ~ended.to(device)
        if not alive.any() or t == max_new_tokens - 1:
            break
        # the next rows, and which of them each answer still generating reads (a finished answer reads row 0: its
        # token is padding from here on, whatever that row samples)
        live = alive.nonzero().squeeze(1)
        if share_prefixes:  # one row per distinct (row, token)
            key, inverse = torch.unique(phys[live] * vocab + tok[live], return_inverse=True)
            parent, step_tok = key // vocab, key % vocab
        else:  # one row per answer
            inverse = torch.arange(len(live), device=device)
            parent, step_tok = phys[live], tok[live]
        phys = torch.zeros_like(phys).index_put_((live,), inverse)
        if not same_rows(parent, len(row_prompt)):  # an answer split or finished: the kept rows' cache, compacted
            cache.batch_select_indices(parent)
            row_prompt = row_prompt[parent]
        count = len(row_prompt)
        mask = torch.cat([base_mask[row_prompt], base_mask.new_ones(count, t + 1)], dim=1)
        pos = (pe.next_position[row_prompt] + t).view(1, count, 1).expand(3, count, 1)
        hidden = family.forward_hidden(family.embed_tokens(step_tok[:, None]), mask, pos, cache)[:, -1]
    completion_ids = torch.stack(tokens, 1)
    completion_mask = torch.stack(alive_steps, 1).long()
    texts = policy.processor.tokenizer.batch_decode(
        completion_ids.masked_fill(torch.isin(completion_ids, eos), policy.pad_token_id), skip_special_tokens=True)
    return Rollout(index, completion_ids, completion_mask, torch.stack(logps, 1), alive.cpu(), texts)

"""Generation and the training forward agree; groups stay aligned with their prompts, images and solutions."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vlmrl.data import make_task
from vlmrl.models import load_policy
from vlmrl.models.forward import completion_logprobs, sequence_logprobs
from vlmrl.rollout.batch import make_prompts, reward_columns
from vlmrl.rollout.generate import generate, sample_tokens


def test_generation_logprobs_match_training_forward(policy, count_samples):
    """Invariant 3 (docs/concepts.md): same weights, same log-probs, batch > 1 with left padding and mixed image sizes."""
    samples = count_samples[:6] + make_task("digits_sum", 2, "train", seed=0)  # 56/84 px scenes and wide digit strips
    prompts = make_prompts(policy, samples)
    assert (prompts.attention_mask == 0).any(), "the batch should need left padding"
    rollout = generate(policy, prompts, group_size=3, max_new_tokens=8, temperature=1.0,
                       generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logp = sequence_logprobs(policy, prompts, rollout.prompt_index, rollout.completion_ids,
                                    rollout.completion_mask, 1.0).logprobs
    assert rollout.completion_mask.sum() > len(samples)  # something was generated beyond one token
    assert torch.allclose(logp, rollout.logprobs, atol=1e-4), (logp - rollout.logprobs).abs().max()


def test_temperature_is_applied_in_both_paths(policy, count_samples):
    prompts = make_prompts(policy, count_samples[:3])
    rollout = generate(policy, prompts, 2, 6, temperature=0.7, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logp = sequence_logprobs(policy, prompts, rollout.prompt_index, rollout.completion_ids,
                                    rollout.completion_mask, 0.7).logprobs
    assert torch.allclose(logp, rollout.logprobs, atol=1e-4)


def test_completion_mask_stops_after_end_token(policy, count_samples):
    prompts = make_prompts(policy, count_samples[:4])
    r = generate(policy, prompts, 4, 10, 1.0, generator=torch.Generator().manual_seed(2))
    eos = torch.tensor(policy.eos_token_ids)
    for ids, mask, trunc in zip(r.completion_ids, r.completion_mask, r.truncated, strict=True):
        n = int(mask.sum())
        assert mask[:n].all() and not mask[n:].any()  # a contiguous prefix
        ended = bool(torch.isin(ids[n - 1], eos))
        assert ended != bool(trunc)  # either it ended with the end token or it was truncated, never both
        assert (ids[n:] == policy.pad_token_id).all()


def test_vision_tower_runs_once_per_prompt_not_per_answer(policy, count_samples):
    prompts = make_prompts(policy, count_samples[:5])
    before = policy.family.vision_calls
    generate(policy, prompts, group_size=8, max_new_tokens=4, temperature=1.0)
    assert policy.family.vision_calls - before == 5


def test_greedy_sampling_is_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.0]])
    tokens, logp = sample_tokens(logits, temperature=0.0)
    assert tokens.tolist() == [1, 0]
    assert torch.allclose(logp, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])


def test_top_k_one_is_greedy():
    logits = torch.randn(16, 30)
    tokens, _ = sample_tokens(logits, 1.0, top_k=1, generator=torch.Generator().manual_seed(0))
    assert torch.equal(tokens, logits.argmax(-1))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n_prompts=st.integers(2, 5), group=st.integers(1, 4), seed=st.integers(0, 1000))
def test_groups_stay_aligned_under_shuffle(tiny_model_dir, count_samples, n_prompts, group, seed):
    """Invariant 1 (docs/concepts.md): row n's prompt, image, solution and answer all belong to sample prompt_index[n].

    Each row's batched log-probs are recomputed with its own sample alone (batch of one): a row paired with the
    wrong prompt or image would give different numbers."""
    policy = load_policy(tiny_model_dir)
    order = torch.randperm(len(count_samples), generator=torch.Generator().manual_seed(seed)).tolist()
    samples = [count_samples[i] for i in order[:n_prompts]]
    prompts = make_prompts(policy, samples)
    r = generate(policy, prompts, group, 6, 1.0, generator=torch.Generator().manual_seed(seed))
    assert r.prompt_index.tolist() == [p for p in range(n_prompts) for _ in range(group)]
    cols = reward_columns(samples, r.prompt_index)
    for n, p in enumerate(r.prompt_index.tolist()):
        assert cols["id"][n] == samples[p]["id"] and cols["solution"][n] == samples[p]["solution"]
        single = make_prompts(policy, [samples[p]])
        pe = policy.family.prompt_embeds(single)
        with torch.no_grad():
            logp = completion_logprobs(policy.family, pe, r.completion_ids[n:n + 1], r.completion_mask[n:n + 1]).logprobs
        assert torch.allclose(logp[0], r.logprobs[n], atol=1e-4)


def test_every_prompt_position_and_step_samples_from_its_own_stream(tiny_model_dir, count_samples):
    """The prompts of one step draw from independent random streams: the same prompt at two positions of a step (or
    at one position in two steps) gets different answers, and a group's G answers differ from each other. A sampler
    that reused one noise stream per position, per step or per group would give identical answers here."""
    from vlmrl.config import load_config
    from vlmrl.rewards import RewardSpec
    from vlmrl.trainer.rl import StepContext, collect

    cfg = load_config(None, ["rollout.group_size=4", "rollout.max_new_tokens=8", "rollout.temperature=1.0"])
    policy = load_policy(tiny_model_dir)
    opt = torch.optim.SGD(policy.model.parameters(), lr=0.0)
    ctx = StepContext(policy, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), [RewardSpec("format")],
                      cfg.rollout, cfg.algorithm, cfg.trainer, generator=torch.Generator().manual_seed(0), step=1)
    same = [count_samples[0]] * 3  # one prompt at positions 0, 1 and 2

    def answers(step: int, round_index: int = 0) -> list[tuple[tuple[int, ...], ...]]:
        ctx.step = step
        r = collect(ctx, same, round_index=round_index)[1]
        rows = [tuple(ids[mask.bool()].tolist()) for ids, mask in zip(r.completion_ids, r.completion_mask, strict=True)]
        return [tuple(rows[i * 4:(i + 1) * 4]) for i in range(3)]  # the group of each position

    step1 = answers(1)
    assert len(set(step1)) == 3  # positions 0, 1, 2: three different groups of answers
    assert all(len(set(group)) > 1 for group in step1)  # a group's answers are not copies of one draw
    assert set(answers(2)).isdisjoint(step1)  # the next step: fresh answers at every position
    assert set(answers(1, round_index=1)).isdisjoint(step1)  # a dynamic-sampling round: fresh answers too
    assert answers(1) == step1  # and all of it is a function of (seed, step, round, position): reproducible


def rows_per_step(policy, run, width: int = 1):
    """Run `run()` and return the rows of each decoder call on `width` tokens per row (1: each decoding step; the
    prefill, whose rows are whole prompts, is left out)."""
    calls, forward = [], policy.family.forward_hidden

    def counted(embeds, *args, **kwargs):
        if embeds.shape[1] == width:
            calls.append(embeds.shape[0])
        return forward(embeds, *args, **kwargs)

    policy.family.forward_hidden = counted
    try:
        return run(), calls
    finally:
        del policy.family.forward_hidden


def distinct_prefixes(r, t: int) -> int:
    """How many distinct (prompt, first t + 1 tokens) the answers still generating after token t have."""
    alive = r.completion_mask[:, t + 1].bool() if t + 1 < r.completion_mask.shape[1] else None
    if alive is None:
        return 0
    return len({(int(p), tuple(ids[:t + 1].tolist())) for p, ids, a in
                zip(r.prompt_index, r.completion_ids, alive, strict=True) if a})


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(group=st.sampled_from([1, 3, 8]), temperature=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
       top_k=st.sampled_from([0, 3]), seed=st.integers(0, 10_000))
def test_answers_that_share_a_prefix_share_a_decoding_row(policy, count_samples, group, temperature, top_k, seed):
    """Each decoding step runs one row per distinct (prompt, answer so far) among the unfinished answers, and the
    answers, masks and log-probs are those of one row per answer (share_prefixes=False). A sharing bug that fed an
    answer another prefix's distribution, or dropped a prefix, changes the tokens or the row counts here."""
    prompts = make_prompts(policy, count_samples[:5])
    seeds = [seed + i for i in range(5)]

    def run(share):
        return generate(policy, prompts, group, 8, temperature, top_k=top_k, prompt_seeds=seeds, share_prefixes=share)

    shared, shared_rows = rows_per_step(policy, lambda: run(True))
    plain, plain_rows = rows_per_step(policy, lambda: run(False))
    assert torch.equal(shared.completion_ids, plain.completion_ids)
    assert torch.equal(shared.completion_mask, plain.completion_mask)
    assert torch.equal(shared.truncated, plain.truncated)
    assert torch.allclose(shared.logprobs, plain.logprobs, atol=1e-5)
    assert shared_rows == [distinct_prefixes(shared, t) for t in range(len(shared_rows))]
    assert plain_rows == [int(plain.completion_mask[:, t + 1].sum()) for t in range(len(plain_rows))]


def test_a_greedy_group_decodes_one_row_per_prompt(policy, count_samples):
    """G greedy answers of one prompt are one answer: every decoding step runs one row per unfinished prompt."""
    prompts = make_prompts(policy, count_samples[:4])
    r, rows = rows_per_step(policy, lambda: generate(policy, prompts, 6, 8, temperature=0.0))
    unfinished = [int(r.completion_mask[::6, t + 1].sum()) for t in range(len(rows))]  # prompts still generating
    assert rows and rows == unfinished
    assert all((r.completion_ids[i * 6:(i + 1) * 6] == r.completion_ids[i * 6]).all() for i in range(4))


def test_an_answer_ended_by_on_token_stops_while_its_prefix_twins_go_on(policy, count_samples):
    """The server's per-request stop ends one answer of a shared row; the others keep decoding that row."""
    prompts = make_prompts(policy, count_samples[:2])

    def stop_first_answer(tokens, alive):
        ended = torch.zeros_like(alive)
        ended[0] = True
        return ended

    r = generate(policy, prompts, 3, 6, temperature=0.0, on_token=stop_first_answer)
    assert int(r.completion_mask[0].sum()) == 1
    assert int(r.completion_mask[1].sum()) > 1 and torch.equal(r.completion_ids[1], r.completion_ids[2])


def test_equal_answers_are_scored_once_with_the_gradients_of_every_copy(policy, count_samples):
    """The training forward runs each distinct (prompt, answer) once; log-probs, entropies and every gradient equal
    those of one row per answer (a copy that dropped its duplicates' gradients, or scored one answer with another's
    tokens, fails here), and the decoder's answer pass ran fewer rows."""
    prompts = make_prompts(policy, count_samples[:3])
    pad, eos = policy.pad_token_id, policy.eos_token_ids[0]
    a, b, c = [7, 8, 9, eos], [7, 9, eos, pad], [8, eos, pad, pad]
    answers = [a, b, a, c, a, a, b, b, c, b, a, c]  # prompt p owns rows 4p..4p+3: 8 distinct (prompt, answer)
    ids = torch.tensor(answers)
    mask = (ids != pad).long()
    index = torch.arange(3).repeat_interleave(4)
    params = [p for p in policy.model.parameters() if p.requires_grad]
    weights = torch.linspace(0.5, 1.5, ids.numel()).view_as(ids.float())

    def scored(shared: bool):
        pe = policy.family.prompt_embeds(prompts)
        out = completion_logprobs(policy.family, pe if shared else pe.select(index), ids, mask, 1.0,
                                  with_entropy=True, entropy_grad=True, rows=index if shared else None)
        grads = torch.autograd.grad((out.logprobs * weights).sum() + out.entropy.sum(), params, allow_unused=True)
        return out, grads

    (shared, shared_grads), rows = rows_per_step(policy, lambda: scored(True), width=3)
    full, full_grads = scored(False)
    assert rows == [8]  # the answer pass: 8 distinct answers of 12
    assert torch.allclose(shared.logprobs, full.logprobs, atol=1e-5)
    assert torch.allclose(shared.entropy, full.entropy, atol=1e-5)
    assert torch.equal(shared.logprobs[0], shared.logprobs[2]) and not torch.equal(shared.logprobs[0], shared.logprobs[4])
    for x, y in zip(shared_grads, full_grads, strict=True):
        assert (x is None) == (y is None)
        if x is not None:
            assert torch.allclose(x, y, atol=1e-5, rtol=1e-4), (x - y).abs().max()


def copy_steps(run) -> tuple[object, list[int]]:
    """Run `run(on_token)` and return its rollout and the decoding steps t after which the KV cache was copied (a
    `batch_select_indices` between token t's `on_token` call and token t + 1)."""
    from transformers.cache_utils import DynamicCache

    seen, copies, select = [], [], DynamicCache.batch_select_indices

    def counted(self, indices):
        copies.append(len(seen) - 1)
        return select(self, indices)

    DynamicCache.batch_select_indices = counted
    try:
        return run(lambda tokens, alive: seen.append(1)), copies
    finally:
        DynamicCache.batch_select_indices = select


def split_or_finished_steps(r, share_prefixes: bool) -> list[int]:
    """The steps t after which the rows of token t + 1 are not the rows of token t: an answer split from its row
    (sampled another token than its prefix twins) or a row lost its last unfinished answer. Rows are the distinct
    (prompt, answer so far) with share_prefixes, else the answers (token 0 is decoded on one row per prompt)."""
    prompts = r.prompt_index.tolist()

    def alive(col: int) -> list[int]:
        return r.completion_mask[:, col].nonzero().squeeze(1).tolist()

    out = []
    for t in range(r.completion_ids.shape[1] - 1):
        if share_prefixes:
            before = {(prompts[n], tuple(r.completion_ids[n, :t].tolist())) for n in alive(t)}
            after = {(prompts[n], tuple(r.completion_ids[n, :t + 1].tolist())) for n in alive(t + 1)}
            same = len(after) == len(before) and {(p, prefix[:-1]) for p, prefix in after} == before
        elif t == 0:  # one row per prompt becomes one row per answer
            same = [prompts[n] for n in alive(1)] == list(range(len(set(prompts))))
        else:
            same = alive(t + 1) == alive(t)
        if not same:
            out.append(t)
    return out


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(group=st.sampled_from([1, 3, 6]), temperature=st.sampled_from([0.0, 0.7, 1.0]),
       share=st.booleans(), seed=st.integers(0, 10_000))
def test_decoding_copies_the_cache_only_on_a_token_where_an_answer_split_or_finished(
        policy, count_samples, group, temperature, share, seed, monkeypatch):
    """Issue 41 item 4: the KV cache is copied (`batch_select_indices`) after token t exactly when an answer split
    from its row or a row finished; the answers and log-probs are bit-identical to copying after every token (the
    code before the fix)."""
    import vlmrl.rollout.generate as gen

    prompts = make_prompts(policy, count_samples[:4])

    def run(on_token):
        return generate(policy, prompts, group, 10, temperature, prompt_seeds=[seed + i for i in range(4)],
                        on_token=on_token, share_prefixes=share)

    r, copies = copy_steps(run)
    assert copies == split_or_finished_steps(r, share)
    with monkeypatch.context() as m:
        m.setattr(gen, "same_rows", lambda parent, count: False)  # the old loop: a copy after every token
        old, old_copies = copy_steps(run)
    assert old_copies == list(range(old.completion_ids.shape[1] - 1))
    for x, y in zip((r.completion_ids, r.completion_mask, r.logprobs, r.truncated),
                    (old.completion_ids, old.completion_mask, old.logprobs, old.truncated), strict=True):
        assert torch.equal(x, y)


def test_a_greedy_group_that_never_splits_copies_no_cache(policy, count_samples):
    """G greedy answers per prompt never split; with the end token out of reach (an empty end set), no row finishes
    either: not one copy of the KV cache in the whole decode."""
    prompts = make_prompts(policy, count_samples[:3])
    policy.eos_token_ids = [-1]
    r, copies = copy_steps(lambda on_token: generate(policy, prompts, 5, 8, 0.0, on_token=on_token))
    assert r.completion_ids.shape[1] == 8 and r.truncated.all()
    assert copies == []


def test_rows_are_the_same_only_when_each_row_keeps_one_successor_in_order():
    from vlmrl.rollout.generate import same_rows

    assert same_rows(torch.tensor([0, 1, 2]), 3)
    assert not same_rows(torch.tensor([0, 0, 2]), 3)  # row 0 split while row 1 finished: as many rows, not the same
    assert not same_rows(torch.tensor([0, 2]), 3) and not same_rows(torch.tensor([0, 1, 2, 2]), 3)
    assert not same_rows(torch.tensor([1, 0, 2]), 3)


def test_answer_chunks_keep_groups_whole():
    from vlmrl.rollout.generate import answer_chunks

    assert answer_chunks([3, 1, 4, 2, 5], 0) == [(0, 5)]
    assert answer_chunks([3, 1, 4, 2, 5], 4) == [(0, 2), (2, 3), (3, 4), (4, 5)]  # the group of 5 is one chunk
    assert answer_chunks([3, 1, 4, 2, 5], 6) == [(0, 2), (2, 4), (4, 5)]
    assert answer_chunks([3, 1, 4, 2, 5], 100) == [(0, 5)]


@pytest.mark.parametrize("temperature,top_k,top_p,seeded", [(1.0, 0, 1.0, True), (0.7, 3, 1.0, True),
                                                            (1.3, 0, 0.8, True), (1.0, 5, 0.9, True),
                                                            (0.0, 0, 1.0, False), (1.0, 0, 1.0, False)])
def test_sampling_in_chunks_of_answers_is_bit_identical(policy, count_samples, temperature, top_k, top_p, seeded):
    """Issue 41 item 3: the sampler's [answers, vocab] work runs on at most `chunk_rows` answers at a time (whole
    groups), and the answers, masks and log-probs are bit-identical to sampling every answer at once: each prompt's
    stream draws the same numbers in the same order. (Sampling from one shared generator is one draw for all
    answers: it ignores the chunk.)"""
    import vlmrl.rollout.generate as gen

    prompts = make_prompts(policy, count_samples[:5])
    sizes = [3, 1, 4, 2, 5]
    calls, sample = [], gen.sample_tokens

    def counted(logits, *args, rows=None, **kwargs):
        calls.append(len(logits) if rows is None else len(rows))
        return sample(logits, *args, rows=rows, **kwargs)

    def run(chunk_rows):
        calls.clear()
        generator = None if seeded else torch.Generator().manual_seed(3)
        r = generate(policy, prompts, sizes, 8, temperature, top_k, top_p, generator=generator,
                     prompt_seeds=[11, 12, 13, 14, 15] if seeded else None, chunk_rows=chunk_rows)
        return r, list(calls)

    gen.sample_tokens = counted
    try:
        whole, whole_calls = run(0)
        for chunk_rows in (1, 4, 6):
            r, chunk_calls = run(chunk_rows)
            for x, y in zip((r.completion_ids, r.completion_mask, r.logprobs, r.truncated),
                            (whole.completion_ids, whole.completion_mask, whole.logprobs, whole.truncated), strict=True):
                assert torch.equal(x, y), chunk_rows
            if seeded or temperature == 0:  # at most chunk_rows answers per call, or one whole group
                assert max(chunk_calls) <= max(chunk_rows, 5) and len(chunk_calls) > len(whole_calls)
            else:
                assert chunk_calls == whole_calls
    finally:
        gen.sample_tokens = sample

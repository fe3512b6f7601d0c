"""Group bookkeeping and micro-batch invariance across model families (invariants 1 and 5 in docs/concepts.md).

Prompt i <-> its G answers <-> its solution <-> its images stay aligned for any batch size, group size, shuffle,
micro-batch size and group filtering; splitting a rollout batch into micro-batches changes memory, not gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from vlmrl.config import load_config
from vlmrl.data import make_task, vocabulary_texts
from vlmrl.models import load_policy
from vlmrl.models.forward import sequence_logprobs
from vlmrl.models.tiny_families import TINY_FAMILIES, build_tiny_family
from vlmrl.rewards import RewardSpec
from vlmrl.trainer.rl import StepContext, build_trajectories, collect_and_score, keep_groups
from vlmrl.trainer.update import update

# the property test draws from a subset to stay fast: M-RoPE (Qwen2-VL), deepstack (Qwen3-VL), tiles (SmolVLM),
# anyres (LLaVA-NeXT), image-block attention (Gemma 3); every family runs the micro-batch test below
PROPERTY_FAMILIES = ("qwen2_vl", "qwen3_vl", "smolvlm", "llava_next", "gemma3")


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    torch.set_num_threads(1)
    texts = vocabulary_texts(0)
    return {f: build_tiny_family(f, tmp_path_factory.mktemp(f), texts) for f in TINY_FAMILIES}


@pytest.fixture(scope="module")
def pool():
    """Prompts of every kind: 0, 1 or 2 images of different sizes, each with its own id and solution."""
    shapes = make_task("shapes_count", 8, "train", seed=5)
    out = []
    for i, s in enumerate(shapes):
        images = [s["images"][0], Image.new("RGB", (90, 40), (20 * i, 90, 200))][: i % 3]
        out.append({**s, "id": f"p{i}", "images": images, "solution": str(i)})
    return out


def context(policy, group_size: int, micro_batch: int = 0, **algo) -> StepContext:
    # reinforce_pp: one answer per prompt is a valid recipe only without a group baseline (config RULES)
    cfg = load_config(None, [f"rollout.group_size={group_size}", "rollout.max_new_tokens=4",
                             f"trainer.micro_batch={micro_batch}"] + (["algorithm.advantage=reinforce_pp"]
                                                                      if group_size == 1 else []))
    for k, v in algo.items():
        setattr(cfg.algorithm, k, v)
    opt = torch.optim.SGD(policy.model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return StepContext(policy, opt, sched, [RewardSpec("accuracy", 1.0, {"strict": False})], cfg.rollout,
                       cfg.algorithm, cfg.trainer, generator=torch.Generator().manual_seed(0))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(family=st.sampled_from(PROPERTY_FAMILIES), n_prompts=st.integers(1, 5), group=st.integers(1, 4),
       micro=st.integers(1, 7), seed=st.integers(0, 10_000))
def test_group_bookkeeping_property(policies, pool, family, n_prompts, group, micro, seed):
    policy = load_policy(policies[family])
    g = torch.Generator().manual_seed(seed)
    samples = [pool[i] for i in torch.randperm(len(pool), generator=g)[:n_prompts].tolist()]
    ctx = context(policy, group)
    batch = collect_and_score(ctx, samples)
    r = batch.rollout
    assert r.prompt_index.tolist() == [p for p in range(n_prompts) for _ in range(group)]
    for n, p in enumerate(r.prompt_index.tolist()):  # every column of row n belongs to prompt p
        assert batch.columns["id"][n] == samples[p]["id"] and batch.columns["solution"][n] == samples[p]["solution"]
        assert batch.columns["images"][n] is samples[p]["images"]
    # shuffled rows in micro-batches: each row's log-probs recomputed through its own prompt and images
    order = torch.randperm(len(r.prompt_index), generator=g)
    with torch.no_grad():
        for rows in order.split(micro):
            logp = sequence_logprobs(policy, batch.prompts, r.prompt_index[rows], r.completion_ids[rows],
                                     r.completion_mask[rows], 1.0).logprobs
            assert torch.allclose(logp, r.logprobs[rows], atol=1e-4)
    # dropping a random set of groups (DAPO's dynamic sampling) keeps prompts, images, answers and columns aligned
    keep = torch.rand(n_prompts, generator=g) < 0.5
    keep[torch.randint(n_prompts, (1,), generator=g)] = True
    kept = keep_groups(batch, keep, group)
    kept_prompts = keep.nonzero().flatten().tolist()
    assert kept.prompts.sample_ids == [samples[p]["id"] for p in kept_prompts]
    assert kept.columns["id"] == [samples[p]["id"] for p in kept_prompts for _ in range(group)]
    with torch.no_grad():
        logp = sequence_logprobs(policy, kept.prompts, kept.rollout.prompt_index, kept.rollout.completion_ids,
                                 kept.rollout.completion_mask, 1.0).logprobs
    assert torch.allclose(logp, kept.rollout.logprobs, atol=1e-4)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_micro_batching_does_not_change_the_update(policies, pool, family):
    """micro_batch = 1 and the whole batch give the same parameters after one step, on a batch mixing text-only,
    one-image and two-image prompts."""
    a = load_policy(policies[family])
    b = copy.deepcopy(a)
    b.family = type(a.family)(b.model)
    start = {k: p.detach().clone() for k, p in a.model.named_parameters()}
    ctx_a, ctx_b = context(a, 3, micro_batch=0), context(b, 3, micro_batch=1)
    batch = collect_and_score(ctx_a, pool[:3])
    batch.rewards.total = torch.tensor([1.0, 0.0, 0.5] * 3)  # every group carries signal
    traj = build_trajectories(ctx_a, batch)
    update(ctx_a, batch.prompts, traj)
    update(ctx_b, batch.prompts, traj)
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert max((pa[k] - start[k]).abs().max().item() for k in pa) > 1e-4  # the step did something
    for k in pa:
        assert torch.allclose(pa[k], pb[k], atol=1e-5), k

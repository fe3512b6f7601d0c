"""bf16 log-prob consistency, the chunked head (memory bounded by a chunk, same values and gradients), the device of
each torchrun rank, dropout in RL forwards, and Policy.clone."""

from __future__ import annotations

import datetime

import pytest
import torch

from vlmrl.config import LoraConfig, load_config
from vlmrl.data import make_task
from vlmrl.models import load_policy
from vlmrl.models.forward import chunk_tokens_for, sequence_logprobs, token_scores
from vlmrl.models.scoring import score_batch
from vlmrl.models.trainable import add_lora, disable_dropout
from vlmrl.rewards import RewardSpec
from vlmrl.rollout.batch import make_prompts
from vlmrl.rollout.generate import generate
from vlmrl.trainer import distributed
from vlmrl.trainer.critic import Critic
from vlmrl.trainer.rl import StepContext, build_trajectories, collect_and_score
from vlmrl.trainer.update import micro_batch_loss, update


# -- the head: float32 before the temperature, chunks that change nothing ------------------------------------------
def test_head_upcasts_before_the_temperature():
    """bf16 logits: log-probs are those of softmax(float32(logits) / T), as the sampler computes them. Dividing in
    bf16 first (the old training forward) rounds every tempered logit and misses this by ~1e-2."""
    torch.manual_seed(0)
    weight = (torch.randn(50, 8) * 8).bfloat16()
    hidden = torch.randn(1, 6, 8).bfloat16()
    tokens = torch.randint(0, 50, (1, 6))
    logp, _ = token_scores(lambda h: h @ weight.T, hidden, tokens, torch.ones(1, 6), temperature=0.7)
    expected = torch.log_softmax((hidden @ weight.T).float() / 0.7, -1).gather(-1, tokens[..., None])[..., 0]
    assert torch.equal(logp, expected)


def test_chunks_change_neither_values_nor_gradients():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 40, bias=False)
    tokens = torch.randint(0, 40, (3, 7))
    mask = (torch.rand(3, 7) > 0.3).long()
    results = []
    for chunk in (0, 1, 4, 1000):
        hidden = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        head.zero_grad()
        logp, ent = token_scores(head, hidden, tokens, mask, 0.8, with_entropy=True, entropy_grad=True,
                                 chunk_tokens=chunk)
        (logp.sum() + 0.1 * ent.sum()).backward()
        results.append((logp.detach(), ent.detach(), hidden.grad.clone(), head.weight.grad.clone()))
        assert (logp[mask == 0] == 0).all() and (ent[mask == 0] == 0).all()
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.allclose(a, b, atol=1e-6)
    # the values themselves, against a plain full-vocabulary computation
    full = torch.log_softmax(head(torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(1))) / 0.8, -1)
    assert torch.allclose(results[0][0], full.gather(-1, tokens[..., None])[..., 0] * mask, atol=1e-6)


def test_training_forward_never_holds_rows_x_tokens_x_vocab(policy):
    """Every tensor autograd saves in the training forward is smaller than one chunk of logits: with 8 rows x 6
    tokens and chunks of 5 tokens, a [rows, T, vocab] tensor (the old forward's) cannot hide."""
    samples = make_task("shapes_count", 2, "train", seed=0)
    prompts = make_prompts(policy, samples)
    rollout = generate(policy, prompts, 4, 6, temperature=1.0, generator=torch.Generator().manual_seed(0))
    vocab = policy.model.get_output_embeddings().out_features
    sizes = []

    def pack(t):
        sizes.append(t.numel() if t.dim() >= 2 and t.shape[-1] == vocab else 0)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = sequence_logprobs(policy, prompts, rollout.prompt_index, rollout.completion_ids,
                                rollout.completion_mask, 1.0, with_entropy=True, chunk_tokens=5)
    out.logprobs.sum().backward()
    assert int(rollout.completion_mask.sum()) > 5  # several chunks
    assert max(sizes) <= 5 * vocab
    assert chunk_tokens_for(151_936) == 220 and chunk_tokens_for(400) > 8 * 1024


def test_score_batch_equals_one_forward(policy):
    samples = make_task("shapes_count", 3, "train", seed=1)
    prompts = make_prompts(policy, samples)
    r = generate(policy, prompts, 3, 6, temperature=1.0, generator=torch.Generator().manual_seed(0))
    args = (prompts, r.prompt_index, r.completion_ids, r.completion_mask, 1.0)
    with torch.no_grad():
        whole = sequence_logprobs(policy, *args).logprobs
    for micro, tokens in ((1, 0), (4, 0), (0, 40)):
        assert torch.allclose(score_batch(policy, *args, micro, tokens).logprobs, whole, atol=1e-5)


# -- bf16 on CPU at T=0.7: the first update's ratio is exactly 1 ---------------------------------------------------
@pytest.mark.parametrize("loss", ["ppo_clip", "gspo"])
def test_bf16_first_ratio_is_exactly_one(tiny_model_dir, loss):
    policy = load_policy(tiny_model_dir, dtype="bfloat16")
    cfg = load_config(None, ["rollout.group_size=4", "rollout.max_new_tokens=6", "rollout.temperature=0.7",
                             f"algorithm.policy_loss={loss}", "algorithm.epsilon_low=3e-4",
                             "algorithm.epsilon_high=4e-4", "algorithm.loss_aggregation=seq-mean-token-mean"])
    opt = torch.optim.SGD(policy.model.parameters(), lr=0.0)
    ctx = StepContext(policy, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                      [RewardSpec("accuracy", 1.0, {"strict": False})], cfg.rollout, cfg.algorithm, cfg.trainer,
                      generator=torch.Generator().manual_seed(0))
    batch = collect_and_score(ctx, make_task("shapes_count", 4, "train", seed=0))
    traj = build_trajectories(ctx, batch)
    assert traj.old_logprobs is None  # used once: the update's own forward gives them
    rows = torch.arange(len(traj.advantages))
    loss_value, parts = micro_batch_loss(ctx, batch.prompts, traj, rows, traj.loss_mask.sum().float(),
                                         float(len(rows)), False)
    assert parts["clip_fraction"] == 0.0
    # the sampler's log-probs (KV-cached decoding in bf16) differ from the training forward's: now a diagnostic
    metrics = update(ctx, batch.prompts, traj)
    assert metrics["clip_fraction"] == 0.0
    assert 0.0 < metrics["rollout/logprob_gap_max"] < 0.5


# -- devices under torchrun ----------------------------------------------------------------------------------------
def test_each_rank_binds_its_own_gpu(monkeypatch):
    calls = []
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")  # second GPU of the second node
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group",
                        lambda backend, **kw: calls.append(("init", backend, kw.get("device_id"), kw["timeout"])))
    monkeypatch.setattr(distributed.dist, "get_rank", lambda: 3)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda: 4)
    hour = datetime.timedelta(hours=1)
    info = distributed.init_distributed("fsdp2", "cuda", timeout=hour)
    assert info.device == "cuda:1" and info.local_rank == 1 and info.rank == 3
    assert calls == [("set_device", 1), ("init", "nccl", torch.device("cuda", 1), hour)]  # the device, then NCCL
    calls.clear()
    info = distributed.init_distributed("ddp", "cpu", timeout=hour)
    assert info.device == "cpu" and calls == [("init", "gloo", None, hour)]


def test_process_device():
    assert distributed.process_device("cuda", 3, 8) == "cuda:3"
    assert distributed.process_device("cuda:3", 3, 8) == "cuda:3"
    assert distributed.process_device("cuda:1", 0, 1) == "cuda:1"  # one process: as asked
    assert distributed.process_device("cpu", 2, 4) == "cpu"
    with pytest.raises(ValueError, match="model.device=cuda"):
        distributed.process_device("cuda:0", 2, 4)  # every rank on GPU 0: NCCL refuses it


# -- dropout and copies --------------------------------------------------------------------------------------------
def test_disabled_dropout_makes_train_and_eval_forwards_equal(tiny_model_dir):
    policy = load_policy(tiny_model_dir)
    policy = add_lora(policy, LoraConfig(r=4, dropout=0.5), tiny_model_dir)
    for name, p in policy.model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    samples = make_task("shapes_count", 2, "train", seed=0)
    prompts = make_prompts(policy, samples)
    r = generate(policy, prompts, 2, 5, temperature=1.0, generator=torch.Generator().manual_seed(0))
    args = (prompts, r.prompt_index, r.completion_ids, r.completion_mask, 1.0)

    def forward(train: bool):
        policy.model.train(train)
        with torch.no_grad():
            return sequence_logprobs(policy, *args).logprobs

    assert not torch.allclose(forward(True), forward(False))  # LoRA dropout 0.5 is live
    assert disable_dropout(policy.model) > 0
    assert torch.equal(forward(True), forward(False))


def test_separate_critic_keeps_the_autocast_setting(tiny_model_dir):
    policy = load_policy(tiny_model_dir, autocast=False)
    critic = Critic(policy, "separate")
    assert critic.trunk.family.autocast_dtype is None
    assert critic.trunk.model is not policy.model
    assert critic.trunk.family.model is critic.trunk.model


def test_allocator_setting_is_opt_in(monkeypatch):
    from vlmrl.allocator import keep_freed_memory

    monkeypatch.delenv("VLMRL_MALLOC_REUSE", raising=False)
    assert keep_freed_memory() is False  # off by default: it trades memory for speed
    monkeypatch.setenv("VLMRL_MALLOC_REUSE", "1")
    assert keep_freed_memory() is True  # glibc on Linux: the thresholds were raised

"""torchrun with 2 processes (gloo, CPU): DDP and FSDP2 steps equal a single-process run on the same global batch, and
a run resumed under torchrun from its step-1 checkpoint (FSDP2: sharded optimizer state) ends where it would have."""

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2VLForConditionalGeneration

from .test_train_e2e import GRPO, SMALL

STEPS = ["trainer.steps=2", "sft.steps=2", "rollout.prompts_per_step=4", "rollout.group_size=4", "data.eval.n=4",
         "trainer.lr=1e-2"]  # a large lr makes a wrong update visible

# a reward that differs within groups even for an untrained model, so the steps move the weights
REWARD = "def score(completions, **columns):\n    return [float(len(c) % 3) for c in completions]\n"


def run(tmp_path, name: str, mode: str, nproc: int, resume: str | None = None, extra: tuple = (),
        checkpoint: str = "checkpoint-2", recipe: str = GRPO, stdout: list | None = None) -> dict:
    reward = tmp_path / "varied_reward.py"
    reward.write_text(REWARD)
    args = ["-m", "vlmrl", "train", recipe, *SMALL, *STEPS, f"trainer.output_dir={tmp_path / name}", "trainer.save_every=1",
            f"trainer.distributed={mode}", f"rewards=[{{name: '{reward}:score'}}]", *extra]
    args += ["--resume", str(tmp_path / name / resume)] if resume else []
    if nproc > 1:
        args = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    if stdout is not None:
        stdout.append(done.stdout)
    return weights(tmp_path / name / checkpoint)


def assert_matches(one: dict, two: dict, floor: dict | None = None, atol: float = 2e-5) -> None:
    """`two` (N ranks) ends where `one` (one process) does: every tensor within `atol`, or, given `floor` (one process
    again with trainer.micro_batch=1: the same math, other float rounding), within twice the largest difference
    rounding alone makes there. Adam turns a gradient's rounding into an update of up to lr where |grad| ~ eps, so
    after a few steps at lr 1e-2 rounding alone moves some weights by several 1e-5; a wrong update moves them by
    ~lr."""
    if floor is not None:
        atol = max(atol, 2 * max((one[k] - floor[k]).abs().max().item() for k in one))
    for k in one:
        assert torch.allclose(one[k], two[k], atol=atol), (k, (one[k] - two[k]).abs().max().item(), atol)


def assert_resumes(tmp_path, name: str, mode: str, uninterrupted: dict, **kwargs) -> dict:
    """The 2-rank run `name`, resumed under torchrun from its checkpoint-1 (step 2 again, from the saved optimizer
    shards, scheduler, data order, RNG and the feature's own state), ends where it did without the interruption."""
    resumed = run(tmp_path, name, mode, 2, resume="checkpoint-1", **kwargs)
    for k in uninterrupted:
        assert torch.allclose(uninterrupted[k], resumed[k], atol=1e-6), \
            (k, (uninterrupted[k] - resumed[k]).abs().max().item())
    return resumed


def weights(checkpoint) -> dict:
    """A checkpoint's trained tensors: the whole model, or under LoRA its adapters."""
    if (checkpoint / "adapter_model.safetensors").exists():
        from safetensors.torch import load_file

        return load_file(checkpoint / "adapter_model.safetensors")
    return Qwen2VLForConditionalGeneration.from_pretrained(checkpoint).state_dict()


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    return run(tmp, "single", "none", 1), Qwen2VLForConditionalGeneration.from_pretrained(
        tmp / "single" / "checkpoint-0").state_dict()


@pytest.mark.parametrize("mode", [pytest.param("ddp", marks=pytest.mark.slow), "fsdp2"])  # ddp: ~2 min
def test_two_process_training_matches_one_process(tmp_path, single, mode):
    one, start = single
    two = run(tmp_path, mode, mode, 2)
    moved = max((one[k] - start[k]).abs().max().item() for k in one)
    assert moved > 1e-3  # training changed the weights, so equality below means something
    for k in one:
        assert torch.allclose(one[k], two[k], atol=2e-5), (k, (one[k] - two[k]).abs().max().item())
    # resume from checkpoint-1 under torchrun: step 2 again, from the saved optimizer shards, scheduler, data order
    # and RNG (a DDP checkpoint is a one-process checkpoint: tests/test_resume.py; its torchrun run is -m slow)
    if mode == "ddp":
        return
    assert (tmp_path / mode / "checkpoint-1" / "sharded").is_dir()
    resumed = run(tmp_path, mode, mode, 2, resume="checkpoint-1")
    for k in one:
        assert torch.allclose(two[k], resumed[k], atol=1e-6), (k, (two[k] - resumed[k]).abs().max().item())


@pytest.mark.slow  # ~90 s; online DPO with uneven pair counts under FSDP2 is in the default run (below)
def test_online_dpo_under_ddp_matches_one_process(tmp_path):
    """Online DPO: pairs differ per rank (one rank may have none); the loss is the mean over all of the step's pairs."""
    dpo = ("algorithm.policy_loss=dpo", "algorithm.dpo_beta=0.1")
    one = run(tmp_path, "dpo-single", "none", 1, extra=dpo)
    two = run(tmp_path, "dpo-ddp", "ddp", 2, extra=dpo)
    floor = run(tmp_path, "dpo-single-mb1", "none", 1, extra=(*dpo, "trainer.micro_batch=1"))
    start = Qwen2VLForConditionalGeneration.from_pretrained(tmp_path / "dpo-single" / "checkpoint-0").state_dict()
    assert max((one[k] - start[k]).abs().max().item() for k in one) > 1e-3
    assert_matches(one, two, floor)  # (2.4e-5 apart at 3c75986, over a 2e-5 bound: rounding, see assert_matches)


def mixed_data(tmp_path) -> str:
    """8 RL prompts, every second one text-only: the ranks' micro-batches differ in images and in length."""
    import json

    from vlmrl.data import make_task

    rows = []
    for i, s in enumerate(make_task("shapes_count", 8, "train", seed=3)):
        if i % 2:
            rows.append({"problem": f"What is {i} plus one? Answer with a number.", "solution": str(i + 1)})
        else:
            s["images"][0].save(tmp_path / f"img{i}.png")
            rows.append({"image": f"img{i}.png", "problem": s["problem"], "solution": s["solution"]})
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("name,extra", [
    ("budget", ("trainer.micro_batch_tokens=80",)),
    pytest.param("dpo", ("algorithm.policy_loss=dpo", "trainer.micro_batch=1", "model.lora.r=4"),
                 marks=pytest.mark.slow),  # ~120 s
])
def test_fsdp2_with_uneven_ranks_matches_one_process(tmp_path, name, extra):
    """FSDP2 gathers and reduces each unit in every forward and backward, so every rank must run the same sequence of
    them: here a token budget gives the ranks different numbers of chunks (text-only prompts are shorter), one
    rank's chunk may hold no image (the vision units still run), and online DPO gives the ranks different pair
    counts, under LoRA, whose reference (the policy with its adapters disabled) runs inside the gathered
    parameters. Each run finishes and ends where one process does."""
    data = f"data.train={{path: {mixed_data(tmp_path)}}}"
    one = run(tmp_path, f"{name}-single", "none", 1, extra=(data, *extra))
    two = run(tmp_path, f"{name}-fsdp2", "fsdp2", 2, extra=(data, *extra))
    start = weights(tmp_path / f"{name}-single" / "checkpoint-0")
    assert max((one[k] - start[k]).abs().max().item() for k in one) > 1e-3
    for k in one:
        assert torch.allclose(one[k], two[k], atol=2e-5), (name, k, (one[k] - two[k]).abs().max().item())


# a signal only in the groups of prompts whose answer is odd: dynamic sampling drops the rest and resamples
ODD_REWARD = ("def score(completions, solution, **columns):\n"
              "    return [float(len(c) % 3) if int(s) % 2 else 0.0 for c, s in zip(completions, solution)]\n")


def test_dynamic_sampling_and_curriculum_under_torchrun_match_one_process(tmp_path):
    """Dynamic sampling and the online filter under FSDP2: every rank draws the same prompts, generates for its shard
    of each round, and the ranks agree on the rounds (kept groups summed over ranks) and on the pass rates (every
    rank's groups observed). The kept groups are the first prompts_per_step in the rounds' order, wherever they were
    generated; a rank holding none runs the update on padding. The run ends where one process does."""
    reward = tmp_path / "odd_reward.py"
    reward.write_text(ODD_REWARD)
    extra = (f"rewards=[{{name: '{reward}:score'}}]", "algorithm.dynamic_sampling=true", "algorithm.max_resample_rounds=2",
             "algorithm.resample_draw=fill", "curriculum.order=learnability", "curriculum.filter_unsolved=true",
             "curriculum.filter_after=1", "trainer.steps=3", "trainer.minibatches=2", "trainer.seed=1",
             "data.train.n=16", "rollout.prompts_per_step=2")
    one = run(tmp_path, "ds-single", "none", 1, extra=extra, checkpoint="checkpoint-3")
    two = run(tmp_path, "ds-fsdp2", "fsdp2", 2, extra=extra, checkpoint="checkpoint-3")
    start = weights(tmp_path / "ds-single" / "checkpoint-0")
    assert max((one[k] - start[k]).abs().max().item() for k in one) > 1e-3
    for k in one:
        assert torch.allclose(one[k], two[k], atol=2e-5), (k, (one[k] - two[k]).abs().max().item())
    logged = [json.loads(line) for line in (tmp_path / "ds-fsdp2" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in logged if "dynamic_sampling/prompts" in m]
    assert len(steps) == 3
    assert any(m["dynamic_sampling/rounds"] > 0 for m in steps)  # resampling ran under torchrun
    # the curriculum's counts are the same on every rank (a rank-local count would average to a fraction), and its
    # filter acted: prompts never solved were filtered, and drawn again as rechecks or refills
    assert all(m["curriculum/filtered_unsolved"] == int(m["curriculum/filtered_unsolved"]) > 0 for m in steps)
    assert steps[-1]["curriculum/groups_filtered"] > 0
    assert any(m["dynamic_sampling/padding_ranks"] > 0 for m in steps)  # a rank held only padding


# every first message gets the sample's image back and the second ends the episode, so the small model's episodes
# have two turns (an image in the observation) whatever it writes
LOOK_AGAIN = '''from vlmrl.agent.env import Observation


class LookAgain:
    def __init__(self, sample, tools, context):
        self.context, self.turns = context, 0

    def step(self, message):
        self.turns += 1
        if self.turns > 1:
            return Observation(done=True)
        return Observation([{"type": "text", "text": "look"}, {"type": "image", "image": self.context.images[0]}])


def make_env(sample, tools, context):
    return LookAgain(sample, tools, context)
'''
AGENT = str(Path(GRPO).parent / "agentic_zoom.yaml")


@pytest.mark.slow  # ~2-3 min per mode on 2 cores
@pytest.mark.parametrize("mode", ["fsdp2", "ddp"])
def test_agents_under_torchrun_match_one_process(tmp_path, mode):
    """The agentic recipe under torchrun: each rank runs its prompts' turns with no collective inside the turn loop
    (ranks end with different numbers of turns and images), the conversations go through the wrapped training
    forward, and 2 ranks end where one process does."""
    env = tmp_path / "look_again.py"
    env.write_text(LOOK_AGAIN)
    extra = ("trainer.steps=2", "sft.steps=40", "sft.lr=3e-3", "agent.turn_tokens=48", "rollout.max_new_tokens=48",
             "rollout.prompts_per_step=4", "rollout.group_size=4", "algorithm.dynamic_sampling=false",
             f"agent.env={env}:make_env")
    one = run(tmp_path, "agent-single", "none", 1, extra=extra, recipe=AGENT)
    two = run(tmp_path, f"agent-{mode}", mode, 2, extra=extra, recipe=AGENT)
    start = weights(tmp_path / "agent-single" / "checkpoint-0")
    assert max((one[k] - start[k]).abs().max().item() for k in one) > 1e-3
    for k in one:
        assert torch.allclose(one[k], two[k], atol=2e-5), (k, (one[k] - two[k]).abs().max().item())
    logged = [json.loads(line) for line in (tmp_path / f"agent-{mode}" / "metrics.jsonl").read_text().splitlines()]
    turns = [m["agent/turns_per_episode"] for m in logged if "agent/turns_per_episode" in m and m["phase"] == "train"]
    assert len(turns) == 2 and max(turns) > 1.0  # multi-turn episodes ran under torchrun
    if mode == "fsdp2":  # resumed under torchrun
        assert_resumes(tmp_path, f"agent-{mode}", mode, two, extra=extra, recipe=AGENT)


CRITIC = ("algorithm.advantage=gae", "algorithm.critic_warmup_steps=0", "trainer.minibatches=2",
          "algorithm.critic_lr=1e-2")


@pytest.fixture(scope="module")
def critic_single(tmp_path_factory):
    """One process, per critic kind: the run, and its rounding floor (the same run with trainer.micro_batch=1)."""
    runs = {}
    for critic in ("head", "separate"):
        tmp = tmp_path_factory.mktemp(f"critic-{critic}")
        extra = (*CRITIC, f"algorithm.critic={critic}")
        runs[critic] = (tmp, run(tmp, "single", "none", 1, extra=extra),
                        run(tmp, "single-mb1", "none", 1, extra=(*extra, "trainer.micro_batch=1")))
    return runs


def critic_head(run_dir) -> dict:
    return torch.load(run_dir / "checkpoint-2" / "trainer_state.pt", weights_only=False)["critic"]["head"]


@pytest.mark.slow  # ~1 min per case on 2 cores, plus the one-process runs
@pytest.mark.parametrize("mode,critic", [("ddp", "head"), ("fsdp2", "head"), ("ddp", "separate"),
                                         ("fsdp2", "separate")])
def test_ppo_with_a_critic_under_torchrun_matches_one_process(tmp_path, critic_single, mode, critic):
    """PPO with GAE: the critic (its value head, or a separate copy of the policy) is outside the policy's wrapper,
    so its gradients are averaged over the ranks before each step; 2 ranks end where one process does, policy and
    critic, with 2 minibatches (two optimizer steps per step)."""
    tmp, one, floor = critic_single[critic]
    two = run(tmp_path, mode, mode, 2, extra=(*CRITIC, f"algorithm.critic={critic}"))
    start = weights(tmp / "single" / "checkpoint-0")
    assert max((one[k] - start[k]).abs().max().item() for k in one) > 1e-3
    assert_matches(one, two, floor)
    heads = critic_head(tmp / "single"), critic_head(tmp_path / mode), critic_head(tmp / "single-mb1")
    assert heads[0]["weight"].abs().max() > 1e-3  # the value head trained
    assert_matches(heads[0], heads[1], heads[2])
    if mode == "fsdp2":  # resumed under torchrun: the critic's weights and optimizer come back with the policy's
        assert_resumes(tmp_path, mode, mode, two, extra=(*CRITIC, f"algorithm.critic={critic}"))
        resumed_head = critic_head(tmp_path / mode)
        for k in heads[1]:
            assert torch.allclose(heads[1][k], resumed_head[k], atol=1e-6), k


@pytest.mark.slow  # ~3 min on 2 cores
def test_sft_replay_under_torchrun_matches_one_process(tmp_path):
    """SFT replay: every rank draws the same replay batch and trains its share through the wrapped forward, divided
    by the whole batch's target tokens; under DDP and FSDP2, 2 ranks end where one process does."""
    extra = ("replay.weight=0.5", "replay.batch_size=4")
    one = run(tmp_path, "single", "none", 1, extra=extra)
    floor = run(tmp_path, "single-mb1", "none", 1, extra=(*extra, "trainer.micro_batch=1"))
    start = weights(tmp_path / "single" / "checkpoint-0")
    plain = run(tmp_path, "no-replay", "none", 1)
    assert max((one[k] - plain[k]).abs().max().item() for k in one) > 1e-3  # replay changed the update
    assert max((one[k] - start[k]).abs().max().item() for k in one) > 1e-3
    for mode in ("ddp", "fsdp2"):
        two = run(tmp_path, mode, mode, 2, extra=extra)
        assert_matches(one, two, floor)
    assert_resumes(tmp_path, "fsdp2", "fsdp2", two, extra=extra)  # the replay stream's position comes back too


@pytest.mark.slow  # ~2 min on 2 cores
def test_offline_dpo_under_torchrun_matches_one_process(tmp_path):
    """Offline DPO: every rank draws the same pairs, trains its share through the wrapped forward (FSDP2's root
    unit unsharded there), the loss over the step's whole pair count; 2 ranks end where one process does."""
    recipe = str(Path(GRPO).parent / "dpo_offline.yaml")
    extra = ("data.preferences={task: shapes_count, n: 16}", "rollout.prompts_per_step=4")
    one = run(tmp_path, "single", "none", 1, extra=extra, recipe=recipe)
    floor = run(tmp_path, "single-mb1", "none", 1, extra=(*extra, "trainer.micro_batch=1"), recipe=recipe)
    start = weights(tmp_path / "single" / "checkpoint-0")
    assert max((one[k] - start[k]).abs().max().item() for k in one) > 1e-3
    for mode in ("ddp", "fsdp2"):
        two = run(tmp_path, mode, mode, 2, extra=extra, recipe=recipe)
        # 1e-4: on an AMD EPYC the tied embedding/head differed by 4.2e-5 under both DDP and FSDP2 (identically)
        # while every other weight stayed within 1.7e-6 and the micro-batch floor was 0 (Adam amplifying the
        # rounding of the two ranks' gradient sum on rows DPO barely touches); a wrong update moves weights by ~lr
        assert_matches(one, two, floor, atol=1e-4)
    assert_resumes(tmp_path, "fsdp2", "fsdp2", two, extra=extra, recipe=recipe)


@pytest.mark.slow  # ~3 min on 2 cores
def test_async_rollouts_under_torchrun_match_one_process(tmp_path):
    """Asynchronous rollouts (staleness 1): each rank's producer samples its shard with its own copy of the weights
    (under FSDP2 handed over from the gathered shards), so 2 ranks end where one process does; resumed under
    torchrun from checkpoint-1 (its saved, not yet trained answers: whole steps, in rank 0's file, shared again over
    the ranks) they end there again."""
    extra = ("rollout.asynchronous=true", "rollout.max_staleness=1")
    one = run(tmp_path, "single", "none", 1, extra=extra)
    floor = run(tmp_path, "single-mb1", "none", 1, extra=(*extra, "trainer.micro_batch=1"))
    sync = run(tmp_path, "sync", "none", 1)
    assert max((one[k] - sync[k]).abs().max().item() for k in one) > 1e-4  # stale answers: another run
    two = run(tmp_path, "fsdp2", "fsdp2", 2, extra=extra)
    assert_matches(one, two, floor)
    assert not (tmp_path / "fsdp2" / "checkpoint-1" / "pending_rollouts-rank1.pt").exists()
    assert torch.load(tmp_path / "fsdp2" / "checkpoint-1" / "pending_rollouts.pt", weights_only=False)["whole_steps"]
    assert_resumes(tmp_path, "fsdp2", "fsdp2", two, extra=extra)


@pytest.mark.slow  # ~3 min on 2 cores
def test_rollout_ranks_match_one_process(tmp_path):
    """rollout.rollout_ranks=1: the last rank only generates (stages I + II, from the weights rank 0 broadcasts) and
    the others only train. One training rank and one rollout rank end exactly where one process with asynchronous
    rollouts does (the same answers from the same weights, the same update); two FSDP2 training ranks and one rollout
    rank end there within the rounding floor, and resumed from checkpoint-1 (whole steps saved by training rank 0)
    they end there again."""
    # 3 steps: step 3 trains on version 1's answers, sampled after a weight broadcast
    extra, last = ("rollout.asynchronous=true", "rollout.max_staleness=1", "trainer.steps=3"), "checkpoint-3"
    one = run(tmp_path, "single", "none", 1, extra=extra, checkpoint=last)
    floor = run(tmp_path, "single-mb1", "none", 1, extra=(*extra, "trainer.micro_batch=1"), checkpoint=last)
    said: list[str] = []
    split = (*extra, "rollout.rollout_ranks=1")
    two = run(tmp_path, "ddp", "ddp", 2, extra=split, stdout=said, checkpoint=last)
    assert "rollout rank 0: produced 4 steps" in said[0]  # steps 1-4 (step 4 asked for ahead of step 3)
    for k in one:
        assert torch.equal(one[k], two[k]), k
    three = run(tmp_path, "fsdp2", "fsdp2", 3, extra=split, checkpoint=last)
    assert_matches(one, three, floor)
    assert not (tmp_path / "fsdp2" / "checkpoint-1" / "pending_rollouts-rank1.pt").exists()
    assert torch.load(tmp_path / "fsdp2" / "checkpoint-1" / "pending_rollouts.pt", weights_only=False)["whole_steps"]
    resumed = run(tmp_path, "fsdp2", "fsdp2", 3, resume="checkpoint-1", extra=split, checkpoint=last)
    for k in three:
        assert torch.allclose(three[k], resumed[k], atol=1e-6), (k, (three[k] - resumed[k]).abs().max().item())


@pytest.mark.slow  # ~20 s
def test_a_failing_rollout_rank_stops_the_run_with_its_error(tmp_path):
    """A reward that raises FatalRewardError on the rollout rank (global rank 1) only: the training rank stops the
    run with the rollout rank's traceback, naming the step, instead of waiting for answers that never come."""
    reward = tmp_path / "fatal.py"
    reward.write_text("import os\nfrom vlmrl.errors import FatalRewardError\n"
                      "def score(completions, **columns):\n    if os.environ['RANK'] == '1':\n"
                      "        raise FatalRewardError('the judge is gone')\n    return [1.0 for c in completions]\n")
    args = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "vlmrl", "train", GRPO, *SMALL,
            *STEPS, f"trainer.output_dir={tmp_path / 'run'}", "trainer.distributed=ddp",
            f"rewards=[{{name: '{reward}:score'}}]", "rollout.asynchronous=true", "rollout.rollout_ranks=1"]
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode != 0
    assert "rollout rank 1 failed on step 1" in done.stderr and "the judge is gone" in done.stderr


@pytest.mark.slow  # ~15 s
def test_a_silent_rollout_rank_stops_the_run_after_the_timeout(tmp_path):
    """A reward that never returns on the rollout rank: the training rank stops the run after
    rollout.producer_timeout, naming the rank and the step it waited for, instead of hanging."""
    reward = tmp_path / "slow.py"
    reward.write_text("import os, time\ndef score(completions, **columns):\n    if os.environ['RANK'] == '1':\n"
                      "        time.sleep(120)\n    return [1.0 for c in completions]\n")
    args = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "vlmrl", "train", GRPO, *SMALL,
            *STEPS, f"trainer.output_dir={tmp_path / 'run'}", "trainer.distributed=ddp",
            # (inline: a reward worker process left sleeping would hold the captured output open)
            f"rewards=[{{name: '{reward}:score', isolate: false}}]", "rollout.asynchronous=true",
            "rollout.rollout_ranks=1", "rollout.producer_timeout=3"]
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=100,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode != 0
    assert "no answer from rank 1 within rollout.producer_timeout=3 s while waiting for step 1's answers" in \
        done.stderr, done.stderr[-2000:]


SHORT_GROUPS = """import datetime, runpy, sys
import torch.distributed as dist
_new_group = dist.new_group
def new_group(*args, **kwargs):  # every group without a timeout of its own gets 10 s, not torch's 30 minutes
    kwargs.setdefault("timeout", datetime.timedelta(seconds=10))
    return _new_group(*args, **kwargs)
dist.new_group = new_group
sys.argv = ["vlmrl", *sys.argv[1:]]
runpy.run_module("vlmrl", run_name="__main__")
"""


@pytest.mark.slow  # ~60 s
def test_a_rollout_rank_waits_through_a_training_phase_longer_than_the_group_timeout(tmp_path):
    """The rollout rank waits for the training ranks' first message through their whole SFT warm-start. With torch's
    default group timeout (30 minutes; cut to 10 s here, with an SFT of ~35 s) the rollout rank died and torchrun
    ended the run without its final checkpoint; its wait is now ROLLOUT_RANK_IDLE (vlmrl/deadlines.py)."""
    launcher = tmp_path / "short_groups.py"
    launcher.write_text(SHORT_GROUPS)
    args = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(launcher), "train", GRPO, *SMALL,
            *STEPS, "sft.steps=3500", "sft.batch_size=4", f"trainer.output_dir={tmp_path / 'run'}",
            "trainer.distributed=ddp", "rollout.asynchronous=true", "rollout.rollout_ranks=1", "trainer.eval_every=0"]
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=400,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoint-2").exists()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # the rollout rank's first wait spans the training ranks' SFT: ~35 s of the run, well past the cut 10 s timeout
    assert [r for r in rows if r["phase"] == "summary"][0]["wall_seconds"] > 15


def test_rollout_ranks_are_refused_where_they_cannot_run():
    from vlmrl.config import load_config
    from vlmrl.errors import ConfigError
    from vlmrl.trainer.rollout_ranks import split_ranks

    for bad, said in ((["rollout.rollout_ranks=1"], "asynchronous"),
                      (["rollout.rollout_ranks=1", "rollout.asynchronous=true", "algorithm.dynamic_sampling=true"],
                       "dynamic_sampling"),
                      (["rollout.rollout_ranks=1", "rollout.asynchronous=true", "curriculum.filter_solved=true"],
                       "curriculum"),
                      (["rollout.rollout_ranks=1", "rollout.asynchronous=true", "model.lora.r=4"], "LoRA"),
                      (["rollout.rollout_ranks=1", "rollout.asynchronous=true", "rollout.engine=vllm"],
                       "external launcher")):
        with pytest.raises(ConfigError, match=said):
            load_config(GRPO, bad)
    with pytest.raises(ConfigError, match="more processes than rollout ranks"):
        split_ranks("ddp", "cpu", 1, timeout=datetime.timedelta(hours=1))  # one process: nothing left to train

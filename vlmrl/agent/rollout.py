"""Stage I for agents: multi-turn rollouts, every live trajectory of a step generating together each turn.

Turn 0 is the single-turn sampler itself (G answers per prompt, the prompt encoded once). After each turn, every
trajectory's environment answers its message (vlmrl.agent.env); the observation's ids and images are appended to the
trajectory (vlmrl.agent.render), and the trajectories still going generate their next turn in one batched call, each
from its own random stream (a function of its prompt's seed, its index in the group and the turn), so the same
seed gives the same trajectories whatever else shares the batch. Each trajectory also has its own token budget
per turn (`turn_tokens`, or less when its episode has less room left in `max_total_tokens`), enforced per row
through `generate`'s `on_token`: one long trajectory never shortens the others. A trajectory ends when its
environment says so, at `max_turns`, when a turn uses its budget without an end token, when the next observation
would leave it no room for another token (`max_total_tokens`) or pass its image budget (`max_images`) — these
count as truncated — or when an observation cannot be rendered (`agent/ended/render_error`; the run goes on).

With `engine` (rollout.engine=vllm, vlmrl.rollout.vllm_engine) the same loop samples on vLLM: turn 0 one request
per prompt (G answers from the prompt's seed), each later turn one request per live trajectory with the ids of the
`ConversationBatch` the built-in sampler would run (the trainer's ids exactly), all its images, its own seed and its
own budget; the engine stays awake from the first turn to the last. vLLM cannot be told that an image placeholder
id the policy sampled is text (the built-in sampler and training mark it so), so such a trajectory ends before its
next turn (`agent/ended/sampled_placeholder`).

The result is an ordinary `Rollout` whose completion is everything after the prompt (the policy's tokens and the
observations) with `completion_mask` on the policy's tokens only, plus the `ConversationBatch` of the whole
trajectories that every log-prob pass runs on. So advantages, losses, KL, micro-batching and checkpoints work on
multi-turn trajectories unchanged, and an observation token never gets a gradient.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from PIL import Image

from vlmrl.agent.env import EnvFactory
from vlmrl.agent.render import TurnRenderer, conversation_batch
from vlmrl.agent.steps import EnvSteps
from vlmrl.agent.tools import Tool, ToolContext
from vlmrl.models.batch import PromptBatch
from vlmrl.models.policy import Policy
from vlmrl.rollout.generate import OnToken, Rollout, generate
from vlmrl.rollout.vllm_requests import batch_requests


@dataclass
class AgentLimits:
    max_turns: int = 3  # policy turns per episode
    turn_tokens: int = 32  # new tokens per turn
    max_total_tokens: int = 512  # tokens after the prompt (policy and observations)
    max_images: int = 4  # images the tools may add to one trajectory


@dataclass
class Episode:
    """One trajectory in progress."""

    prompt: int  # its prompt's row in the PromptBatch
    sample: dict
    env: object
    context: ToolContext
    ids: list[int] = field(default_factory=list)  # every token after the prompt
    policy_mask: list[int] = field(default_factory=list)  # 1 on the policy's tokens
    logprobs: list[float] = field(default_factory=list)  # sampling log-probs (0 on observations)
    images: list = field(default_factory=list)  # the observations' images, in order
    turns: list[dict] = field(default_factory=list)  # per turn: text, tool calls and failures, images returned
    done: bool = False
    truncated: bool = False
    env_reward: float | None = None

    @property
    def final_text(self) -> str:
        return self.turns[-1]["text"] if self.turns else ""


@dataclass
class AgentRollout:
    # completion = all tokens after the prompt, mask = the policy's, texts = each final message, context = the whole
    # trajectories (one ConversationBatch row each), columns = `columns()`
    rollout: Rollout | None
    episodes: list[Episode]

    def columns(self) -> dict[str, list]:
        """Per-trajectory columns for the rewards: the turns, tool calls, their failures, the environment's reward."""
        calls = [sum(len(t["tool_calls"]) for t in e.turns) for e in self.episodes]
        failed = [sum(t["tool_failures"] for t in e.turns) for e in self.episodes]
        return {"turns": [e.turns for e in self.episodes], "num_turns": [len(e.turns) for e in self.episodes],
                "tool_calls": calls, "tool_failures": failed,
                "env_reward": [e.env_reward for e in self.episodes]}


ENDINGS = ("budget", "env_raised", "render_error", "sampled_placeholder")  # what ends an episode early (agent/ended/<kind>)


def agent_metrics(columns: dict[str, list]) -> dict[str, float]:
    """The episodes' tool use and shape: tool calls per episode, failed calls (`tool/failures`, and per kind), the
    share of episodes that called a tool, the share of calls that failed, turns and images per episode."""
    turns = columns["turns"]
    n = max(len(turns), 1)
    calls = sum(len(t["tool_calls"]) for ep in turns for t in ep)
    failures = sum(t["tool_failures"] for ep in turns for t in ep)
    errors: dict[str, int] = {}
    for ep in turns:
        for t in ep:
            for kind in t["errors"]:
                errors[kind] = errors.get(kind, 0) + 1
    out = {"tool/calls_per_episode": calls / n, "tool/failures": float(failures),
           "tool/call_rate": sum(any(t["tool_calls"] for t in ep) for ep in turns) / n,
           "tool/invalid_rate": failures / max(calls, 1),
           "agent/turns_per_episode": sum(len(ep) for ep in turns) / n,
           "agent/images_per_episode": sum(len(t["images"]) for ep in turns for t in ep) / n}
    # the share of episodes whose first turn that says so looked at the target (the zoom task: IoU >= 0.5 with the
    # sample's target_box); an episode that never looked anywhere counts as off target
    firsts = [next((t["on_target"] for t in ep if "on_target" in t), None) for ep in turns]
    if any(f is not None for f in firsts):
        out["agent/on_target"] = sum(bool(f) for f in firsts) / n
    out.update({f"agent/ended/{k}": float(v) for k, v in sorted(errors.items()) if k in ENDINGS})
    out.update({f"tool/failures/{k}": float(v) for k, v in sorted(errors.items())
                if k not in ENDINGS})
    return out


def turn_seed(prompt_seed: int, member: int, turn: int) -> int:
    return ((prompt_seed * 1_000_039 + member) * 1_000_081 + turn) % (2**63 - 1)


def row_budgets(budgets: list[int]) -> OnToken:
    """`generate`'s per-row stop: row j ends after `budgets[j]` tokens, whatever the call's longest budget."""
    limit, count = torch.tensor(budgets), 0

    def on_token(tokens: torch.Tensor, alive: torch.Tensor) -> torch.Tensor:
        nonlocal count
        count += 1
        return limit.to(tokens.device) <= count

    return on_token


@torch.no_grad()
def agent_rollout(policy: Policy, prompts: PromptBatch, samples: list[dict], group_size: int, limits: AgentLimits,
                  tools: dict[str, Tool], make_env: EnvFactory, temperature: float, top_k: int = 0,
                  top_p: float = 1.0, prompt_seeds: list[int] | None = None,
                  max_pixels: int | None = None, engine=None, env_workers: int = 8) -> AgentRollout:
    """G multi-turn trajectories per prompt (module docstring). `prompt_seeds`: one per prompt (None: the global
    torch generator, not reproducible across batch layouts). `engine`: a `VLLMEngine` to sample on (None: the
    built-in sampler). `env_workers`: environment steps at once, each started when its turn ends (vlmrl.agent.steps;
    1: one after another after the turn)."""
    steps = EnvSteps(env_workers, policy.processor.tokenizer, policy.eos_token_ids)
    try:
        with engine.awake() if engine is not None else nullcontext():  # every turn in one waking (the prefix cache)
            return _agent_rollout(policy, prompts, samples, group_size, limits, tools, make_env, temperature, top_k,
                                  top_p, prompt_seeds, max_pixels, engine, steps)
    finally:
        steps.close()


def _agent_rollout(policy, prompts, samples, group_size, limits, tools, make_env, temperature, top_k, top_p,
                   prompt_seeds, max_pixels, engine, steps: EnvSteps) -> AgentRollout:
    renderer = TurnRenderer(policy.processor)
    episodes = []
    for p, sample in enumerate(samples):
        for image in sample.get("images") or []:  # decoded now: the group's tools may read it from several threads
            if isinstance(image, Image.Image):
                image.load()
        for _ in range(group_size):
            context = ToolContext(list(sample.get("images") or []), max_pixels, sample)
            episodes.append(Episode(p, sample, make_env(sample, tools, context), context))
    seeds = prompt_seeds or [None] * len(samples)
    # generation runs equal images through the vision tower once (features bit-identical on the CPU, where that was
    # checked; an accelerator's kernels may depend on how many images share the call)
    same_pixels = renderer.same_pixels if policy.family.device.type == "cpu" else None
    eos = set(policy.eos_token_ids)
    for turn in range(limits.max_turns):
        live = [e for e in episodes if not e.done]
        if not live:
            break
        # each trajectory's own budget: its turn's tokens, within the room its episode has left (at least one token:
        # an observation that would leave none ends the episode below), so what else shares the batch never matters
        budgets = [min(limits.turn_tokens, limits.max_total_tokens - len(e.ids)) for e in live]
        steps.begin([e.env for e in live])  # each row's environment step starts when its turn ends
        if turn == 0 and engine is not None:  # a request per prompt: G answers from the prompt's seed
            shown = [list(s.get("images") or []) for s in samples]
            out = engine.sample(policy, batch_requests(policy, prompts, shown, prompt_seeds,
                                                       budgets[::group_size], group_size, turn),
                                temperature, top_k, top_p)
        elif turn == 0:  # the prompt once per group, G answers from the prompt's own stream: the single-turn sampler
            out = generate(policy, prompts, group_size, max(budgets), temperature, top_k, top_p,
                           prompt_seeds=prompt_seeds, on_token=steps.watch(row_budgets(budgets)))
        else:
            batch = conversation_batch(policy.processor, prompts, [e.prompt for e in live], [e.ids for e in live],
                                       [e.images for e in live], [e.policy_mask for e in live], turn,
                                       same_key=same_pixels)
            index = {id(e): i for i, e in enumerate(episodes)}
            turn_seeds = None if prompt_seeds is None else \
                [turn_seed(seeds[e.prompt], index[id(e)] % group_size, turn) for e in live]
            if engine is not None:  # the trainer's ids of each trajectory, its images, seed and budget
                shown = [list(e.sample.get("images") or []) + e.images for e in live]
                out = engine.sample(policy, batch_requests(policy, batch, shown, turn_seeds, budgets, 1, turn),
                                    temperature, top_k, top_p)
            else:
                out = generate(policy, batch, 1, max(budgets), temperature, top_k, top_p, prompt_seeds=turn_seeds,
                               on_token=steps.watch(row_budgets(budgets)))
        steps.start_rest(out)  # (vLLM: every row at once, after the call)
        for j, e in enumerate(live):
            n = int(out.completion_mask[j].sum())
            ids = out.completion_ids[j, :n].tolist()
            e.ids += ids
            e.policy_mask += [1] * n
            e.logprobs += out.logprobs[j, :n].tolist()
            e.turns.append({"text": out.texts[j], "tool_calls": [], "tool_failures": 0, "errors": [],
                            "images": []})
            ended = bool(ids) and ids[-1] in eos
            if not ended:  # the turn ran out of tokens: no well-formed message to answer
                e.done = e.truncated = True
                continue
            obs, env_error = steps.result(j, out.texts[j])
            t = e.turns[-1]
            if env_error is not None:  # a user environment's bug ends this episode, counted, not the run
                t["errors"].append("env_raised")
                t["env_error"] = env_error
            t["tool_calls"] = [r.name for r in obs.tool_results]
            t.update(obs.info)  # what the environment knows of this turn (e.g. on_target)
            t["tool_failures"] = sum(not r.ok for r in obs.tool_results)
            t["errors"] += [r.error for r in obs.tool_results if not r.ok]
            if obs.reward is not None:
                e.env_reward = (e.env_reward or 0.0) + obs.reward
            if obs.done or turn == limits.max_turns - 1:
                e.done = True
                continue
            if engine is not None and policy.processor.image_token_id in ids:  # vLLM would read it as an image slot
                e.done = True
                t["errors"].append("sampled_placeholder")
                continue
            try:
                obs_ids, images, _ = renderer.observation(obs.content, str(e.sample.get("id")), turn + 1)
            except Exception as exc:  # an observation that cannot be shown (a user environment's bad image block)
                e.done = True  # ends this episode, counted, not the run
                t["errors"].append("render_error")
                t["render_error"] = f"{type(exc).__name__}: {exc}"
                continue
            # the observation must leave room for at least one more policy token
            if len(e.ids) + len(obs_ids) >= limits.max_total_tokens or len(e.images) + len(images) > limits.max_images:
                e.done = e.truncated = True  # the budget ends the episode before the observation is shown
                t["errors"].append("budget")
                continue
            t["images"] = images
            e.ids += obs_ids
            e.policy_mask += [0] * len(obs_ids)
            e.logprobs += [0.0] * len(obs_ids)
            e.images += images
    return _finish(policy, prompts, episodes, group_size)


def _finish(policy: Policy, prompts: PromptBatch, episodes: list[Episode], group_size: int) -> AgentRollout:
    width = max(max((len(e.ids) for e in episodes), default=1), 1)
    n = len(episodes)
    ids = torch.full((n, width), policy.pad_token_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    logprobs = torch.zeros((n, width), dtype=torch.float32)
    for i, e in enumerate(episodes):
        ids[i, :len(e.ids)] = torch.tensor(e.ids, dtype=torch.long)
        mask[i, :len(e.ids)] = torch.tensor(e.policy_mask, dtype=torch.long)
        logprobs[i, :len(e.ids)] = torch.tensor(e.logprobs)
    index = torch.arange(len(prompts)).repeat_interleave(group_size)
    context = conversation_batch(policy.processor, prompts, [e.prompt for e in episodes], [e.ids for e in episodes],
                                 [e.images for e in episodes], [e.policy_mask for e in episodes])
    out = AgentRollout(None, episodes)
    out.rollout = Rollout(index, ids, mask, logprobs, torch.tensor([e.truncated for e in episodes]),
                          [e.final_text for e in episodes], context, out.columns())
    return out

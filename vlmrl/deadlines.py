"""Every wait between the processes and threads of one training run, and its deadline: chosen for what it waits for.

Each wait: who waits, for what | its deadline | why that long | what the error says when it expires.

1. A collective of the training ranks (barrier, all-reduce, FSDP2 gather, the scatter of a step's answers, the
   weights' broadcast to the rollout ranks): every training rank waits for every other one.
   | `collective_timeout(cfg.rollout)`: 1 hour with the defaults, longer when a rank's own waits below are longer
     (the process groups' `timeout`; torch's own defaults are 30 minutes for gloo, 10 for NCCL).
   | The others wait while one rank works alone: rank 0 writes a checkpoint between two barriers (a 72B model's
     145 GB at 100 MB/s: ~25 min) or merges a LoRA start for vLLM, takes the rollout ranks' answers; a rank's
     producer or engine runs late. The lone rank's own deadline (3-5) expires first, so its error names what it
     waited for; what has no deadline of its own (a write to a stuck filesystem, a deadlock) is caught here.
   | gloo: `Timed out waiting ...ms`, which vlmrl.trainer.peers turns into `rank R lost contact with the other
     ranks (...): rank K stopped without a word in 10 s (... or it hangs)`. NCCL: its watchdog aborts the process
     (`Watchdog caught collective operation timeout`) and torchrun ends the job.
2. A rollout rank's next message: each rollout rank waits for training rank 0's next request (the start, a weight
   push, a step's prompts, stop). | `ROLLOUT_RANK_IDLE`, 7 days (the control group's timeout).
   | The training ranks may be silent for hours: the SFT warm-start, the start's evaluation, evaluations,
     checkpoints (under torch's 30 minutes the rollout rank died and torchrun ended the run before its final
     checkpoint). A training rank that dies ends the job at once through torchrun.
   | `TrainingError: no answer from rank 0 while waiting for the next request`.
3. A rollout rank's answers: training rank 0 waits for one step's answers from one rollout rank.
   | `rollout.producer_timeout` per message (default `PRODUCER_TIMEOUT_S`, 600 s).
   | One step's generation and scoring at scale; a reward, tool or judge that never returns stops the run here.
   | `TrainingError: no answer from rank R within rollout.producer_timeout=600 s while waiting for step S's answers`.
4. The producer threads (asynchronous rollouts in the training process): the trainer's thread waits for the
   producer or scorer thread to finish what it was given. | `rollout.producer_timeout` per wait. | As in 3.
   | `TrainingError: no rollouts after rollout.producer_timeout=600 s: the producer has been generating step S's
     answers for N s`.
5. A call into the vLLM engine (start, generation, weight push, cache resets): the calling thread waits for the
   engine thread. | `rollout.vllm.timeout` per call (default `ENGINE_CALL_S`, 1800 s).
   | A step's whole generation at scale fits well within it; an engine that loops on a cache miss never returns.
   | `EngineTimeout: rollout.engine=vllm: the engine's generation (...) did not return within 1800 s`.
6. The other ranks' words: a rank whose collective failed waits for each other rank's word in torchrun's store.
   | `PEER_WORD_S`, 10 s; reaching the store: `STORE_CONNECT_S`, 10 s.
   | A rank that fails writes its word at once, before it exits; the store is up for the whole job, or gone with
     its launcher.
   | `rank K stopped without a word in 10 s (killed: ...; or it hangs)`; `the rendezvous store at HOST:PORT is gone
     too`.
7. The producer threads' exit, as the run ends: the trainer joins the producer and scorer threads.
   | `THREAD_EXIT_S`, 5 s. | The run is ending; a thread still inside a generation is a daemon, left behind.
   | Nothing: the run ends.

Not between the run's processes, and set beside what they bound: a reward's worker process (`rewards[].timeout`,
60 s a call; vlmrl.rewards.safe), a tool (its `timeout`, 10 s; vlmrl.agent.tools), the judge's HTTP calls (its
`timeout` and `batch_timeout`; vlmrl.rewards.judge), the server's request, header and body deadlines (`vlmrl serve --timeout`, ...). The user's view
of this list: docs/scaling.md, "Deadlines".
"""

from __future__ import annotations

import datetime

# the rollout ranks' control group (vlmrl.trainer.rollout_ranks): a rollout rank waits this long for the training
# ranks' next message
ROLLOUT_RANK_IDLE = datetime.timedelta(days=7)
PRODUCER_TIMEOUT_S = 600.0  # rollout.producer_timeout's default: one step's answers (a rollout rank's, or a thread's)
ENGINE_CALL_S = 1800.0  # rollout.vllm.timeout's default: one call into the vLLM engine
COLLECTIVE_MIN_S = 3600.0  # the training ranks' collectives: rank 0 writing a large checkpoint alone
COLLECTIVE_SLACK_S = 600.0  # on top of a rank's own bounded wait: the rest of its step around that wait
PEER_WORD_S = 10.0  # a rank that lost contact waits this long for the other ranks' word (vlmrl.trainer.peers)
STORE_CONNECT_S = 10.0  # and tries this long to reach the rendezvous store
THREAD_EXIT_S = 5.0  # the asynchronous producer's threads, joined as the run ends


def collective_timeout(rollout) -> datetime.timedelta:
    """The deadline of every collective among the training ranks (the process groups' `timeout`), for a recipe's
    `rollout` section: long enough that a rank's own bounded wait expires first and names what it waited for.

    max(COLLECTIVE_MIN_S,
        (max_staleness + 1) x producer_timeout + COLLECTIVE_SLACK_S   with asynchronous rollouts (the steps a rank
                                                                     may wait for at once, each within the timeout),
        rollout.vllm.timeout + COLLECTIVE_SLACK_S                     with rollout.engine=vllm)

    With the defaults: 1 hour, on gloo and NCCL alike (torch's own defaults: 30 minutes for gloo, 10 for NCCL)."""
    seconds = COLLECTIVE_MIN_S
    if rollout.asynchronous:
        seconds = max(seconds, (rollout.max_staleness + 1) * rollout.producer_timeout + COLLECTIVE_SLACK_S)
    if rollout.engine == "vllm":
        seconds = max(seconds, float((rollout.vllm or {}).get("timeout", ENGINE_CALL_S)) + COLLECTIVE_SLACK_S)
    return datetime.timedelta(seconds=seconds)

"""What the demo's two trainers (trainer.py on TinyLM, hf_trainer.py on transformers) and
their runners (run.py, vllm_run.py) share: rollouts, the GRPO step, distilling the draft,
the greedy evaluation, regenerating stale rollouts, and the fleet/progress wiring."""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import torch
import torch.nn.functional as F

from rlbus.schemas import GenerateReply
from rlbus.sdk.client import RLClient

from .task import Task, split_by_staleness

if TYPE_CHECKING:
    from rich.console import Console

    from rlbus.runners.launcher import ProcessFleet

Request = tuple[list[int], int]
"""A prompt and the seed it is sampled with."""
Logits = Callable[[torch.Tensor], torch.Tensor]
"""A model's next-token logits for a 1-D sequence of token ids: (len, vocab)."""
Teacher = list[tuple[torch.Tensor, torch.Tensor, int]]
"""(input ids, the policy's detached response logits, prompt length) per rollout."""


class GrpoConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The settings both demo trainers share (each sets its own `steps` and `max_staleness`)."""

    steps: int
    seed: int = 0
    prompts_per_step: int = 8
    samples_per_prompt: int = 4
    eval_prompts: int = 6
    lr: float = 3e-3
    clip: float = 0.2
    max_staleness: int
    """Drop rollouts more than this many versions older than the trainer (0 = on-policy)."""
    draft: bool = True
    draft_every: int = 4
    """Push the distilled draft every this many steps."""
    draft_distill_steps: int = 2
    task: Task = Task()


def requests(task: Task, rng: random.Random, prompts_per_step: int, samples_per_prompt: int) -> list[Request]:
    prompts = task.prompts(rng, prompts_per_step)
    return [(p, rng.randrange(2**31)) for p in prompts for _ in range(samples_per_prompt)]


async def generate(rl: RLClient, task: Task, reqs: Sequence[Request]) -> list[GenerateReply]:
    """Sampled rollouts (temperature 1, with logprobs), all in flight at once, in order."""
    out: list[GenerateReply | None] = [None] * len(reqs)

    async def one(i: int, prompt: list[int], seed: int) -> None:
        out[i] = await rl.generate(prompt, task.response_len, temperature=1.0, seed=seed, return_logprobs=True)

    async with anyio.create_task_group() as tg:
        for i, (p, s) in enumerate(reqs):
            tg.start_soon(one, i, p, s)
    return out  # type: ignore[return-value]


async def regenerate_stale(
    replies: list[GenerateReply],
    reqs: Sequence[Request],
    current_step: int,
    max_staleness: int,
    generate: Callable[[list[Request]], Awaitable[list[GenerateReply]]],
) -> tuple[list[GenerateReply], list[GenerateReply], list[GenerateReply], int]:
    """(replies, fresh, dropped, regenerated): a rollout more than `max_staleness` versions
    older than the trainer is dropped and generated again on the current weights."""
    fresh, dropped = split_by_staleness(replies, current_step, max_staleness)
    regenerated = 0
    if dropped:
        keep = {id(r) for r in fresh}
        again = await generate([q for q, r in zip(reqs, replies) if id(r) not in keep])
        regenerated = len(again)
        it = iter(again)
        replies = [r if id(r) in keep else next(it) for r in replies]
    return replies, fresh, dropped, regenerated


def grpo_step(
    logits_of: Logits,
    opt: torch.optim.Optimizer,
    task: Task,
    samples_per_prompt: int,
    clip: float,
    prompts: list[list[int]],
    replies: list[GenerateReply],
) -> tuple[float, Teacher]:
    """One clipped policy-gradient step with group-normalised advantages (GRPO); returns the
    loss and the policy's logits for distilling the draft."""
    rewards = torch.tensor([task.reward(r.tokens) for r in replies])
    g = samples_per_prompt
    adv = torch.zeros_like(rewards)
    for i in range(0, len(replies), g):
        grp = rewards[i : i + g]
        adv[i : i + g] = (grp - grp.mean()) / (grp.std(unbiased=False) + 1e-4)
    opt.zero_grad()
    total = torch.zeros(())
    teacher: Teacher = []
    for prompt, reply, a in zip(prompts, replies, adv):
        seq = torch.tensor(prompt + reply.tokens, dtype=torch.long)
        logits = logits_of(seq[:-1])[len(prompt) - 1 :]
        logp = torch.log_softmax(logits, dim=-1).gather(1, seq[len(prompt) :, None]).squeeze(1)
        behaviour = torch.tensor(reply.logprobs or [0.0] * len(reply.tokens))
        ratio = torch.exp(logp - behaviour)
        obj = torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a)
        total = total - obj.mean() / len(replies)
        teacher.append((seq[:-1], logits.detach(), len(prompt)))
    total.backward()
    opt.step()
    return float(total.detach()), teacher


def distill(logits_of: Logits, opt: torch.optim.Optimizer, teacher: Teacher, steps: int) -> None:
    """Keep the draft close to the policy: forward KL to the policy's next-token distribution."""
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.zeros(())
        for inp, t_logits, n in teacher:
            d_logits = logits_of(inp)[n - 1 :]
            loss = loss + F.kl_div(
                torch.log_softmax(d_logits, -1), torch.log_softmax(t_logits, -1), log_target=True, reduction="batchmean"
            )
        (loss / len(teacher)).backward()
        opt.step()


async def evaluate(rl: RLClient, task: Task, prompts: Sequence[list[int]]) -> tuple[float, float | None]:
    """(mean reward of greedy generations, draft acceptance or None without a draft)."""
    proposed = accepted = 0
    rewards = []
    for p in prompts:
        r = await rl.generate(p, task.response_len)
        rewards.append(task.reward(r.tokens))
        proposed += r.proposed
        accepted += r.accepted
    return sum(rewards) / len(rewards), (accepted / proposed if proposed else None)


def mean_reward(task: Task, replies: Sequence[GenerateReply]) -> float:
    return sum(task.reward(r.tokens) for r in replies) / len(replies)


# ---- the runners ------------------------------------------------------------------------


def serve_progress(
    fleet: ProcessFleet,
    console: Console,
    steps: int,
    t0: float,
    *,
    ready_timeout: float | None,
    rpc_timeout: float,
    describe: Callable[[Any], str],
    train: Callable[[RLClient, Callable[[Any], None]], Awaitable[list]],
    stats: Callable[[Any], str],
    logs: list,
) -> None:
    """Wait for the fleet, show it, run `train(rl, on_step)` under a progress bar (each step's
    line from `stats`), collect its logs into `logs`, and show the committed versions."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    async def main() -> None:
        rl = await (fleet.wait_ready() if ready_timeout is None else fleet.wait_ready(timeout=ready_timeout))
        rl.timeout = rpc_timeout
        try:
            info = await rl.server_info()
            console.print(describe(info))
            with Progress(
                TextColumn("[bold]step"),
                MofNCompleteColumn(),
                BarColumn(bar_width=12),
                TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(),
                console=console,
            ) as bar:
                task = bar.add_task("train", total=steps, stats="")

                def on_step(g: Any) -> None:
                    bar.update(task, advance=1, stats=stats(g))

                logs.extend(await train(rl, on_step))
            final = await rl.server_info()
            console.print(f"committed version {final.weight_version}, draft {final.draft_version}")
        finally:
            with anyio.CancelScope(shield=True):
                await rl.close()

    anyio.run(main)


def reward_summary(logs: Sequence[Any], t0: float) -> str:
    """`done in N s: reward a -> b (first/last k steps), median sync M ms`."""
    k = max(1, len(logs) // 5)
    first = sum(g.reward for g in logs[:k]) / k
    last = sum(g.reward for g in logs[-k:]) / k
    syncs = sorted(g.sync_s for g in logs)
    return (
        f"[bold]done[/] in {time.monotonic() - t0:.0f} s: reward {first:.2f} -> {last:.2f} (first/last {k} steps), "
        f"median sync {syncs[len(syncs) // 2] * 1000:.0f} ms"
    )

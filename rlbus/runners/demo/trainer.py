"""The demo trainer: GRPO-style policy gradient on rollouts the workers generate.

Everything it does to the fleet goes through the public SDK (`RLClient.generate`,
`push_weights`, `server_info`), so it is the loop a user would copy into their trainer.

It trains float32 master weights and the workers serve them rounded to the model's dtype
(bfloat16 by default); with `delta` on, each push sends only the elements whose served bits
changed since the last commit (`push_weights(..., delta=True)`), and the log shows the bytes
sent against a dense push and the fraction of elements that changed.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import msgspec
import torch
import torch.nn.functional as F

from rlbus.sdk.client import RLClient
from rlbus.schemas import GenerateReply
from rlbus.models.tinylm import ModelConfig, TinyLM

from .task import Task, split_by_staleness


class DemoConfig(msgspec.Struct, frozen=True, kw_only=True):
    steps: int = 40
    seed: int = 0
    prompts_per_step: int = 8
    samples_per_prompt: int = 4
    eval_prompts: int = 6
    lr: float = 3e-3
    clip: float = 0.2
    max_staleness: int = 1
    """Drop rollouts more than this many versions older than the trainer (0 = on-policy)."""
    async_rollouts: bool = True
    """Generate the next step's rollouts while this step trains (they are one version old)."""
    draft: bool = True
    draft_every: int = 4
    """Push the distilled draft every this many steps."""
    draft_distill_steps: int = 2
    delta: bool = True
    """Push deltas (only the served elements whose bits changed) instead of dense weights."""
    model: ModelConfig = ModelConfig()
    """What the workers serve (its dtype is the served dtype; the trainer keeps float32)."""
    draft_model: ModelConfig | None = None
    task: Task = Task()


class StepLog(msgspec.Struct, kw_only=True):
    step: int
    version: str
    reward: float
    """Mean reward of the rollouts trained on (sampled, temperature 1)."""
    eval_reward: float
    """Mean reward of greedy generations after the push."""
    kept: int
    dropped: int
    regenerated: int
    sync_s: float
    """Wall time of push_weights (pause -> transfer -> two-phase commit -> resume)."""
    bytes_pushed: int
    """Bytes on the wire (main + draft when pushed)."""
    bytes_dense: int = 0
    """What a dense push of the same tensors sends."""
    changed_fraction: float | None = None
    """Of the main model's served elements, the fraction whose bits changed (None: a dense push)."""
    delta: bool = False
    """The main push went as a delta (False: dense, e.g. the first push or a fallback)."""
    fallback: str | None = None
    """Why a delta push went dense (a worker refused its base)."""
    acceptance: float | None
    """Draft acceptance on the greedy eval generations (None without a draft)."""
    draft_version: str | None
    loss: float
    time_s: float


@dataclass
class Trainer:
    rl: RLClient
    cfg: DemoConfig
    on_step: Callable[[StepLog], None] = lambda log: None
    logs: list[StepLog] = field(default_factory=list)

    def __post_init__(self) -> None:
        torch.manual_seed(self.cfg.seed)
        # float32 master weights, same seed as the workers: they serve these rounded to their dtype
        self.policy = TinyLM(msgspec.structs.replace(self.cfg.model, dtype="float32"))
        self.served_dtype = self.cfg.model.torch_dtype
        self.opt = torch.optim.Adam(self.policy.parameters(), lr=self.cfg.lr)
        self.draft: TinyLM | None = None
        if self.cfg.draft and self.cfg.draft_model is not None:
            self.draft = TinyLM(msgspec.structs.replace(self.cfg.draft_model, dtype="float32"))
            self.draft_opt = torch.optim.Adam(self.draft.parameters(), lr=self.cfg.lr * 3)
        self.rng = random.Random(self.cfg.seed)
        self.eval_prompts = self.cfg.task.prompts(random.Random(self.cfg.seed + 1), self.cfg.eval_prompts)
        self.draft_version: str | None = None
        self.dropped_total = 0

    # ---- rollouts ---------------------------------------------------------------------

    def _requests(self) -> list[tuple[list[int], int]]:
        prompts = self.cfg.task.prompts(self.rng, self.cfg.prompts_per_step)
        return [(p, self.rng.randrange(2**31)) for p in prompts for _ in range(self.cfg.samples_per_prompt)]

    async def _generate(self, requests: list[tuple[list[int], int]]) -> list[GenerateReply]:
        out: list[GenerateReply | None] = [None] * len(requests)

        async def one(i: int, prompt: list[int], seed: int) -> None:
            out[i] = await self.rl.generate(
                prompt, self.cfg.task.response_len, temperature=1.0, seed=seed, return_logprobs=True
            )

        async with anyio.create_task_group() as tg:
            for i, (p, s) in enumerate(requests):
                tg.start_soon(one, i, p, s)
        return out  # type: ignore[return-value]

    # ---- learning ---------------------------------------------------------------------

    def _train(self, prompts: list[list[int]], replies: list[GenerateReply]) -> float:
        task = self.cfg.task
        rewards = torch.tensor([task.reward(r.tokens) for r in replies])
        g = self.cfg.samples_per_prompt
        adv = torch.zeros_like(rewards)
        for i in range(0, len(replies), g):  # group-normalised advantages (GRPO)
            grp = rewards[i : i + g]
            adv[i : i + g] = (grp - grp.mean()) / (grp.std(unbiased=False) + 1e-4)
        self.opt.zero_grad()
        total = torch.zeros(())
        teacher: list[tuple[torch.Tensor, torch.Tensor]] = []
        for prompt, reply, a in zip(prompts, replies, adv):
            seq = torch.tensor(prompt + reply.tokens, dtype=torch.long)
            logits = self.policy(seq[:-1])[len(prompt) - 1 :]
            logp = torch.log_softmax(logits, dim=-1).gather(1, seq[len(prompt) :, None]).squeeze(1)
            behaviour = torch.tensor(reply.logprobs or [0.0] * len(reply.tokens))
            ratio = torch.exp(logp - behaviour)
            obj = torch.minimum(ratio * a, ratio.clamp(1 - self.cfg.clip, 1 + self.cfg.clip) * a)
            total = total - obj.mean() / len(replies)
            teacher.append((seq[:-1], logits.detach()))
        total.backward()
        self.opt.step()
        self._distill(teacher, prompts)
        return float(total.detach())

    def _distill(self, teacher: list[tuple[torch.Tensor, torch.Tensor]], prompts: list[list[int]]) -> None:
        """Keep the draft close to the policy: forward KL to the policy's next-token distribution."""
        if self.draft is None:
            return
        for _ in range(self.cfg.draft_distill_steps):
            self.draft_opt.zero_grad()
            loss = torch.zeros(())
            for (inp, t_logits), prompt in zip(teacher, prompts):
                d_logits = self.draft(inp)[len(prompt) - 1 :]
                loss = loss + F.kl_div(
                    torch.log_softmax(d_logits, -1), torch.log_softmax(t_logits, -1), log_target=True, reduction="batchmean"
                )
            (loss / len(teacher)).backward()
            self.draft_opt.step()

    async def _evaluate(self) -> tuple[float, float | None]:
        proposed = accepted = 0
        rewards = []
        for p in self.eval_prompts:
            r = await self.rl.generate(p, self.cfg.task.response_len)
            rewards.append(self.cfg.task.reward(r.tokens))
            proposed += r.proposed
            accepted += r.accepted
        return sum(rewards) / len(rewards), (accepted / proposed if proposed else None)

    def served(self, model: TinyLM) -> list[tuple[str, torch.Tensor]]:
        """The master weights as the workers serve them."""
        return [(n, p.detach().to(self.served_dtype)) for n, p in model.named_parameters()]

    # ---- the loop ---------------------------------------------------------------------

    async def run(self) -> list[StepLog]:
        t0 = time.monotonic()
        ahead: tuple[list[tuple[list[int], int]], list[GenerateReply]] | None = None
        for step in range(1, self.cfg.steps + 1):
            if ahead is None:
                reqs = self._requests()
                ahead = (reqs, await self._generate(reqs))
            reqs, replies = ahead
            ahead = None
            # the trainer's weights are version step-(step-1)
            fresh, dropped = split_by_staleness(replies, step - 1, self.cfg.max_staleness)
            regenerated = 0
            if dropped:  # too old for the trainer: generate again on the current weights
                keep = {id(r) for r in fresh}
                redo = [q for q, r in zip(reqs, replies) if id(r) not in keep]
                again = await self._generate(redo)
                regenerated = len(again)
                it = iter(again)
                replies = [r if id(r) in keep else next(it) for r in replies]
            self.dropped_total += len(dropped)

            next_reqs: list[tuple[list[int], int]] = []
            next_out: list[GenerateReply] = []
            async with anyio.create_task_group() as tg:
                if self.cfg.async_rollouts and step < self.cfg.steps:
                    next_reqs = self._requests()

                    async def gen_ahead() -> None:
                        next_out.extend(await self._generate(next_reqs))

                    tg.start_soon(gen_ahead)  # overlaps with training; done before the push
                loss = await anyio.to_thread.run_sync(self._train, [q[0] for q in reqs], replies)
            if next_reqs:
                ahead = (next_reqs, next_out)

            version = f"step-{step}"
            t = time.monotonic()
            await self.rl.push_weights(self.served(self.policy), version=version, delta=self.cfg.delta)
            main = self.rl.last_push
            assert main is not None
            pushed, dense = main.bytes_sent, main.bytes_dense
            if self.draft is not None and step % self.cfg.draft_every == 0:
                await self.rl.push_weights(self.served(self.draft), version=f"draft-{step}", draft=True, delta=self.cfg.delta)
                self.draft_version = f"draft-{step}"
                assert self.rl.last_push is not None
                pushed += self.rl.last_push.bytes_sent
                dense += self.rl.last_push.bytes_dense
            sync_s = time.monotonic() - t
            eval_reward, acceptance = await self._evaluate()
            log = StepLog(
                step=step, version=version,
                reward=sum(self.cfg.task.reward(r.tokens) for r in replies) / len(replies),
                eval_reward=eval_reward, kept=len(fresh), dropped=len(dropped), regenerated=regenerated,
                sync_s=sync_s, bytes_pushed=pushed, bytes_dense=dense, changed_fraction=main.changed_fraction if main.delta else None,
                delta=main.delta, fallback=main.fallback, acceptance=acceptance, draft_version=self.draft_version,
                loss=loss, time_s=time.monotonic() - t0,
            )
            self.logs.append(log)
            self.on_step(log)
        return self.logs

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

from rlbus.models.tinylm import ModelConfig, TinyLM
from rlbus.schemas import GenerateReply
from rlbus.sdk.client import RLClient

from .common import GrpoConfig, Request, distill, evaluate, generate, grpo_step, mean_reward, regenerate_stale, requests


class DemoConfig(GrpoConfig, frozen=True, kw_only=True):
    steps: int = 40
    max_staleness: int = 1
    async_rollouts: bool = True
    """Generate the next step's rollouts while this step trains (they are one version old)."""
    delta: bool = True
    """Push deltas (only the served elements whose bits changed) instead of dense weights."""
    model: ModelConfig = ModelConfig()
    """What the workers serve (its dtype is the served dtype; the trainer keeps float32)."""
    draft_model: ModelConfig | None = None


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

    def _requests(self) -> list[Request]:
        return requests(self.cfg.task, self.rng, self.cfg.prompts_per_step, self.cfg.samples_per_prompt)

    async def _generate(self, reqs: list[Request]) -> list[GenerateReply]:
        return await generate(self.rl, self.cfg.task, reqs)

    # ---- learning ---------------------------------------------------------------------

    def _train(self, prompts: list[list[int]], replies: list[GenerateReply]) -> float:
        loss, teacher = grpo_step(
            self.policy, self.opt, self.cfg.task, self.cfg.samples_per_prompt, self.cfg.clip, prompts, replies
        )
        if self.draft is not None:
            distill(self.draft, self.draft_opt, teacher, self.cfg.draft_distill_steps)
        return loss

    def served(self, model: TinyLM) -> list[tuple[str, torch.Tensor]]:
        """The master weights as the workers serve them."""
        return [(n, p.detach().to(self.served_dtype)) for n, p in model.named_parameters()]

    # ---- the loop ---------------------------------------------------------------------

    async def run(self) -> list[StepLog]:
        t0 = time.monotonic()
        ahead: tuple[list[Request], list[GenerateReply]] | None = None
        for step in range(1, self.cfg.steps + 1):
            if ahead is None:
                reqs = self._requests()
                ahead = (reqs, await self._generate(reqs))
            reqs, replies = ahead
            ahead = None
            # the trainer's weights are version step-(step-1); too old: generate again on the current weights
            replies, fresh, dropped, regenerated = await regenerate_stale(
                replies, reqs, step - 1, self.cfg.max_staleness, self._generate
            )
            self.dropped_total += len(dropped)

            next_reqs: list[Request] = []
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
                await self.rl.push_weights(
                    self.served(self.draft), version=f"draft-{step}", draft=True, delta=self.cfg.delta
                )
                self.draft_version = f"draft-{step}"
                assert self.rl.last_push is not None
                pushed += self.rl.last_push.bytes_sent
                dense += self.rl.last_push.bytes_dense
            sync_s = time.monotonic() - t
            eval_reward, acceptance = await evaluate(self.rl, self.cfg.task, self.eval_prompts)
            log = StepLog(
                step=step,
                version=version,
                reward=mean_reward(self.cfg.task, replies),
                eval_reward=eval_reward,
                kept=len(fresh),
                dropped=len(dropped),
                regenerated=regenerated,
                sync_s=sync_s,
                bytes_pushed=pushed,
                bytes_dense=dense,
                changed_fraction=main.changed_fraction if main.delta else None,
                delta=main.delta,
                fallback=main.fallback,
                acceptance=acceptance,
                draft_version=self.draft_version,
                loss=loss,
                time_s=time.monotonic() - t0,
            )
            self.logs.append(log)
            self.on_step(log)
        return self.logs

"""The demo's GRPO trainer on a transformers model, for workers that host vLLM
(`rlbus demo --engine vllm`). Same task and loop as trainer.py, but the policy is a
transformers Qwen2 model of the architecture vLLM serves, so what it pushes is exactly
what a transformers trainer would: `model.named_parameters()`, checkpoint names.

Everything it does to the fleet goes through the public SDK (`generate`, `push_weights`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import anyio
import msgspec
import torch

from rlbus.schemas import GenerateReply
from rlbus.sdk.client import RLClient

from .common import GrpoConfig, Request, distill, evaluate, generate, grpo_step, mean_reward, regenerate_stale, requests


class HfDemoConfig(GrpoConfig, frozen=True, kw_only=True):
    steps: int = 30
    max_staleness: int = 0
    hidden: int = 64
    layers: int = 2
    draft_layers: int = 1


class HfStepLog(msgspec.Struct, kw_only=True):
    step: int
    version: str
    reward: float
    """Mean reward of the rollouts trained on (sampled by vLLM, temperature 1)."""
    eval_reward: float
    """Mean reward of vLLM's greedy generations after the push."""
    dropped: int
    sync_s: float
    """Wall time of push_weights (pause -> transfer -> verified commit into vLLM -> resume)."""
    bytes_pushed: int
    bytes_dense: int
    """Pushes here are dense: the same as bytes_pushed (the plot shares trainer.py's fields)."""
    changed_fraction: float | None = None
    acceptance: float | None
    """Draft acceptance on the greedy eval generations, as vLLM counts it."""
    draft_version: str | None
    loss: float
    time_s: float


def write_models(folder: Path, cfg: HfDemoConfig) -> tuple[Path, Path | None]:
    """The policy's (and draft's) model folders: what the vLLM workers start from and the
    trainer loads, so both begin from the same weights."""
    from rlbus.services.worker.vllm.checkpoint import write_toy_model

    vocab = cfg.task.vocab_size
    policy = write_toy_model(
        folder / "policy", seed=cfg.seed, hidden=cfg.hidden, layers=cfg.layers, vocab=vocab, init_std=0.02
    )
    draft = None
    if cfg.draft:
        draft = write_toy_model(
            folder / "draft",
            seed=cfg.seed + 1000,
            hidden=cfg.hidden,
            layers=cfg.draft_layers,
            vocab=vocab,
            init_std=0.02,
        )
    return policy, draft


def _load(folder: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)


def _logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens[None]).logits[0]


@dataclass
class HfTrainer:
    rl: RLClient
    cfg: HfDemoConfig
    policy_dir: Path
    draft_dir: Path | None = None
    on_step: Callable[[HfStepLog], None] = lambda log: None
    logs: list[HfStepLog] = field(default_factory=list)

    def __post_init__(self) -> None:
        torch.manual_seed(self.cfg.seed)
        self.policy = _load(self.policy_dir).train()
        self.opt = torch.optim.Adam(self.policy.parameters(), lr=self.cfg.lr)
        self.draft: torch.nn.Module | None = None
        if self.draft_dir is not None:
            self.draft = _load(self.draft_dir).train()
            self.draft_opt = torch.optim.Adam(self.draft.parameters(), lr=self.cfg.lr * 3)
        self.rng = random.Random(self.cfg.seed)
        self.eval_prompts = self.cfg.task.prompts(random.Random(self.cfg.seed + 1), self.cfg.eval_prompts)
        self.draft_version: str | None = None

    def _requests(self) -> list[Request]:
        return requests(self.cfg.task, self.rng, self.cfg.prompts_per_step, self.cfg.samples_per_prompt)

    async def _generate(self, reqs: list[Request]) -> list[GenerateReply]:
        return await generate(self.rl, self.cfg.task, reqs)

    def _train(self, prompts: list[list[int]], replies: list[GenerateReply]) -> float:
        loss, teacher = grpo_step(
            partial(_logits, self.policy),
            self.opt,
            self.cfg.task,
            self.cfg.samples_per_prompt,
            self.cfg.clip,
            prompts,
            replies,
        )
        if self.draft is not None:
            distill(partial(_logits, self.draft), self.draft_opt, teacher, self.cfg.draft_distill_steps)
        return loss

    async def run(self) -> list[HfStepLog]:
        t0 = time.monotonic()
        nbytes = sum(p.numel() * p.element_size() for p in self.policy.parameters())
        for step in range(1, self.cfg.steps + 1):
            reqs = self._requests()
            replies = await self._generate(reqs)
            # on-policy: a rollout from older weights is generated again
            replies, _, dropped, _ = await regenerate_stale(
                replies, reqs, step - 1, self.cfg.max_staleness, self._generate
            )
            loss = await anyio.to_thread.run_sync(self._train, [q[0] for q in reqs], replies)
            version = f"step-{step}"
            t = time.monotonic()
            await self.rl.push_weights(self.policy.named_parameters(), version=version)
            pushed = nbytes
            if self.draft is not None and step % self.cfg.draft_every == 0:
                await self.rl.push_weights(self.draft.named_parameters(), version=f"draft-{step}", draft=True)
                self.draft_version = f"draft-{step}"
                pushed += sum(p.numel() * p.element_size() for p in self.draft.parameters())
            sync_s = time.monotonic() - t
            eval_reward, acceptance = await evaluate(self.rl, self.cfg.task, self.eval_prompts)
            log = HfStepLog(
                step=step,
                version=version,
                reward=mean_reward(self.cfg.task, replies),
                eval_reward=eval_reward,
                dropped=len(dropped),
                sync_s=sync_s,
                bytes_pushed=pushed,
                bytes_dense=pushed,
                acceptance=acceptance,
                draft_version=self.draft_version,
                loss=loss,
                time_s=time.monotonic() - t0,
            )
            self.logs.append(log)
            self.on_step(log)
        return self.logs

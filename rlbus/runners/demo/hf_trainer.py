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
from pathlib import Path

import anyio
import msgspec
import torch
import torch.nn.functional as F

from rlbus.schemas import GenerateReply
from rlbus.sdk.client import RLClient

from .task import Task, split_by_staleness


class HfDemoConfig(msgspec.Struct, frozen=True, kw_only=True):
    steps: int = 30
    seed: int = 0
    prompts_per_step: int = 8
    samples_per_prompt: int = 4
    eval_prompts: int = 6
    lr: float = 3e-3
    clip: float = 0.2
    max_staleness: int = 0
    draft: bool = True
    draft_every: int = 4
    """Push the distilled draft every this many steps."""
    draft_distill_steps: int = 2
    hidden: int = 64
    layers: int = 2
    draft_layers: int = 1
    task: Task = Task()


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
    policy = write_toy_model(folder / "policy", seed=cfg.seed, hidden=cfg.hidden, layers=cfg.layers, vocab=vocab, init_std=0.02)
    draft = None
    if cfg.draft:
        draft = write_toy_model(folder / "draft", seed=cfg.seed + 1000, hidden=cfg.hidden, layers=cfg.draft_layers, vocab=vocab,
                                init_std=0.02)
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

    def _requests(self) -> list[tuple[list[int], int]]:
        prompts = self.cfg.task.prompts(self.rng, self.cfg.prompts_per_step)
        return [(p, self.rng.randrange(2**31)) for p in prompts for _ in range(self.cfg.samples_per_prompt)]

    async def _generate(self, requests: list[tuple[list[int], int]]) -> list[GenerateReply]:
        out: list[GenerateReply | None] = [None] * len(requests)

        async def one(i: int, prompt: list[int], seed: int) -> None:
            out[i] = await self.rl.generate(prompt, self.cfg.task.response_len, temperature=1.0, seed=seed, return_logprobs=True)

        async with anyio.create_task_group() as tg:
            for i, (p, s) in enumerate(requests):
                tg.start_soon(one, i, p, s)
        return out  # type: ignore[return-value]

    def _train(self, prompts: list[list[int]], replies: list[GenerateReply]) -> float:
        """One clipped policy-gradient step with group-normalised advantages (GRPO)."""
        task, g = self.cfg.task, self.cfg.samples_per_prompt
        rewards = torch.tensor([task.reward(r.tokens) for r in replies])
        adv = torch.zeros_like(rewards)
        for i in range(0, len(replies), g):
            grp = rewards[i : i + g]
            adv[i : i + g] = (grp - grp.mean()) / (grp.std(unbiased=False) + 1e-4)
        self.opt.zero_grad()
        total = torch.zeros(())
        teacher: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        for prompt, reply, a in zip(prompts, replies, adv):
            seq = torch.tensor(prompt + reply.tokens, dtype=torch.long)
            logits = _logits(self.policy, seq[:-1])[len(prompt) - 1 :]
            logp = torch.log_softmax(logits, dim=-1).gather(1, seq[len(prompt) :, None]).squeeze(1)
            behaviour = torch.tensor(reply.logprobs or [0.0] * len(reply.tokens))
            ratio = torch.exp(logp - behaviour)
            obj = torch.minimum(ratio * a, ratio.clamp(1 - self.cfg.clip, 1 + self.cfg.clip) * a)
            total = total - obj.mean() / len(replies)
            teacher.append((seq[:-1], logits.detach(), len(prompt)))
        total.backward()
        self.opt.step()
        self._distill(teacher)
        return float(total.detach())

    def _distill(self, teacher: list[tuple[torch.Tensor, torch.Tensor, int]]) -> None:
        """Keep the draft close to the policy: KL to the policy's next-token distribution."""
        if self.draft is None:
            return
        for _ in range(self.cfg.draft_distill_steps):
            self.draft_opt.zero_grad()
            loss = torch.zeros(())
            for inp, t_logits, n in teacher:
                d_logits = _logits(self.draft, inp)[n - 1 :]
                loss = loss + F.kl_div(torch.log_softmax(d_logits, -1), torch.log_softmax(t_logits, -1), log_target=True,
                                       reduction="batchmean")
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

    async def run(self) -> list[HfStepLog]:
        t0 = time.monotonic()
        nbytes = sum(p.numel() * p.element_size() for p in self.policy.parameters())
        for step in range(1, self.cfg.steps + 1):
            reqs = self._requests()
            replies = await self._generate(reqs)
            fresh, dropped = split_by_staleness(replies, step - 1, self.cfg.max_staleness)
            if dropped:  # on-policy: a rollout from older weights is generated again
                keep = {id(r) for r in fresh}
                again = iter(await self._generate([q for q, r in zip(reqs, replies) if id(r) not in keep]))
                replies = [r if id(r) in keep else next(again) for r in replies]
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
            eval_reward, acceptance = await self._evaluate()
            log = HfStepLog(
                step=step, version=version, reward=sum(self.cfg.task.reward(r.tokens) for r in replies) / len(replies),
                eval_reward=eval_reward, dropped=len(dropped), sync_s=sync_s, bytes_pushed=pushed, bytes_dense=pushed, acceptance=acceptance,
                draft_version=self.draft_version, loss=loss, time_s=time.monotonic() - t0,
            )
            self.logs.append(log)
            self.on_step(log)
        return self.logs

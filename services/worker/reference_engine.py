"""The reference engine: TinyLM behind the Engine protocol, with a real generation loop.

Requests run as tasks that step one token at a time; the model lock is held only for one
forward, so pause, sleep and weight loads slot in between tokens and never race a forward.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import anyio
import torch

from rlbus.errors import FailedPrecondition, InvalidArgument
from rlbus.schemas import DEFAULT_VERSION, SLEEP_TAGS, GenerateRequest, PauseMode, SleepTag, UpdateTarget

from .engine import EngineStatus, GenerateResult, ParamSpec
from .model import KVCache, ModelConfig, TinyLM


class _Request:
    __slots__ = ("id", "abort", "frozen")

    def __init__(self, rid: int) -> None:
        self.id = rid
        self.abort = False
        self.frozen = False


class ReferenceEngine:
    """TinyLM with KV-cache slots, pause modes and sleep levels."""

    def __init__(
        self,
        config: ModelConfig | None = None,
        *,
        model_name: str = "tiny-lm",
        max_concurrency: int = 8,
        sleep_mode_enabled: bool = True,
    ) -> None:
        self.config = config or ModelConfig()
        self.model_name = model_name
        self.sleep_mode_enabled = sleep_mode_enabled
        self.has_draft_model = False
        self.supports_draft_weight_updates = False
        self.weight_version = DEFAULT_VERSION
        self.draft_version: str | None = None
        self.dirty = False
        self.model = TinyLM(self.config).eval()
        self.model.requires_grad_(False)
        self.kv = KVCache(self.config, max_concurrency)
        self._slots = list(range(max_concurrency))
        self._slot_free = anyio.Semaphore(max_concurrency)
        self._model_lock = anyio.Lock()
        self._ids = itertools.count()
        self._running: dict[int, _Request] = {}
        self._waiting = 0
        self._paused = False
        self._pause_mode: PauseMode | None = None
        self._changed = anyio.Event()
        self._sleeping: set[SleepTag] = set()
        self._sleep_level = 0
        self._weights_loaded = True
        self._backup: dict[str, torch.Tensor] = {}
        self._saved_buffers: dict[str, torch.Tensor] = {}
        self._specs = {n: ParamSpec(p.dtype, tuple(p.shape)) for n, p in self.model.named_parameters()}

    # ---- state -------------------------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def _until(self, predicate) -> None:  # noqa: ANN001
        while not predicate():
            await self._changed.wait()

    @property
    def num_params(self) -> int:
        return sum(_numel(s.shape) for s in self._specs.values())

    def status(self) -> EngineStatus:
        return EngineStatus(
            paused=self._paused,
            pause_mode=self._pause_mode,
            sleeping_tags=[t for t in SLEEP_TAGS if t in self._sleeping],
            sleep_level=self._sleep_level,
            weights_loaded=self._weights_loaded,
            in_flight=len(self._running),
            waiting=self._waiting,
            param_bytes=self._param_bytes(),
            kv_cache_bytes=self.kv.nbytes,
        )

    def _param_bytes(self) -> int:
        return sum(p.untyped_storage().nbytes() for p in self.model.parameters())

    def _refuse_if_unservable(self) -> None:
        if self._sleeping:
            asleep = ", ".join(sorted(self._sleeping))
            raise FailedPrecondition(f"engine is asleep ({asleep}); call wake_up() before generating")
        if not self._weights_loaded:
            raise FailedPrecondition(
                "weights were discarded by a level-2 sleep; push new weights before generating"
            )
        if self.dirty:
            raise FailedPrecondition(
                "weights are half-updated after an aborted in-place update; push weights again"
            )

    # ---- generation --------------------------------------------------------------------

    def _check_request(self, req: GenerateRequest) -> None:
        cfg = self.config
        if not req.prompt_tokens:
            raise InvalidArgument("prompt_tokens is empty")
        bad = [t for t in req.prompt_tokens if not 0 <= t < cfg.vocab_size]
        if bad:
            raise InvalidArgument(f"token ids {bad[:5]} are outside the vocabulary [0, {cfg.vocab_size})")
        if req.max_tokens < 1:
            raise InvalidArgument("max_tokens must be >= 1")
        if len(req.prompt_tokens) + req.max_tokens > cfg.max_seq_len:
            raise InvalidArgument(
                f"prompt ({len(req.prompt_tokens)}) + max_tokens ({req.max_tokens}) exceeds "
                f"the model's max_seq_len {cfg.max_seq_len}"
            )
        if req.temperature < 0 or req.temperature != req.temperature:
            raise InvalidArgument("temperature must be >= 0")

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self._check_request(request)
        self._refuse_if_unservable()
        if self._paused:  # new requests wait for resume in every pause mode
            self._waiting += 1
            try:
                await self._until(lambda: not self._paused)
            finally:
                self._waiting -= 1
            self._refuse_if_unservable()
        async with self._slot_free:
            slot = self._slots.pop()
            req = _Request(next(self._ids))
            self._running[req.id] = req
            self._notify()
            try:
                return await self._run(request, req, slot)
            finally:
                del self._running[req.id]
                self._slots.append(slot)
                self._notify()

    async def _run(self, request: GenerateRequest, req: _Request, slot: int) -> GenerateResult:
        version, draft_version = self.weight_version, self.draft_version
        gen = None
        if request.temperature > 0:
            gen = torch.Generator().manual_seed(request.seed if request.seed is not None else 0)
        out: list[int] = []
        logprobs: list[float] = []
        pos = 0
        pending = list(request.prompt_tokens)
        finish = "length"
        while len(out) < request.max_tokens:
            if req.abort:
                finish = "abort"
                break
            if self._paused and self._pause_mode == "keep":
                req.frozen = True
                self._notify()
                await self._until(lambda: not self._paused or req.abort)
                req.frozen = False
                continue
            async with self._model_lock:
                self._refuse_if_unservable()
                token, lp = await anyio.to_thread.run_sync(
                    self._step, pending, slot, pos, request.temperature, gen
                )
            pos += len(pending)
            pending = [token]
            out.append(token)
            logprobs.append(lp)
        return GenerateResult(
            tokens=out,
            finish_reason=finish,  # type: ignore[arg-type]
            weight_version=version,
            draft_version=draft_version,
            logprobs=logprobs if request.return_logprobs else None,
        )

    @torch.inference_mode()
    def _step(
        self, tokens: list[int], slot: int, start: int, temperature: float, gen: torch.Generator | None
    ) -> tuple[int, float]:
        logits = self.model(torch.tensor(tokens, dtype=torch.long), self.kv, slot, start)[-1]
        if temperature > 0:
            logp = torch.log_softmax(logits.float() / temperature, dim=-1)
            token = int(torch.multinomial(logp.exp(), 1, generator=gen).item())
        else:
            logp = torch.log_softmax(logits.float(), dim=-1)
            token = int(torch.argmax(logits).item())
        return token, float(logp[token].item())

    # ---- pause / resume ----------------------------------------------------------------

    async def pause(self, mode: PauseMode) -> None:
        if mode not in ("abort", "wait", "keep"):
            raise InvalidArgument(f"unknown pause mode {mode!r}; use abort, wait or keep")
        if self._paused and mode != "abort":
            return  # idempotent; a second abort still ends frozen requests
        self._paused = True
        self._pause_mode = mode if self._pause_mode is None or mode == "abort" else self._pause_mode
        if mode == "abort":
            self._pause_mode = "abort"
            for r in self._running.values():
                r.abort = True
        self._notify()
        if mode == "keep":
            await self._until(lambda: all(r.frozen for r in self._running.values()))
        else:
            await self._until(lambda: not self._running)

    async def resume(self) -> None:
        if not self._paused:
            return
        self._paused = False
        self._pause_mode = None
        self._notify()

    # ---- sleep / wake ------------------------------------------------------------------

    async def sleep(self, level: int, tags: list[SleepTag]) -> None:
        if not self.sleep_mode_enabled:
            raise FailedPrecondition("sleep mode is off on this worker; start it with --enable-sleep-mode")
        if level not in (1, 2):
            raise InvalidArgument(f"sleep level must be 1 or 2, not {level}")
        if self._running:
            raise FailedPrecondition(
                f"{len(self._running)} requests are in flight; pause with mode='abort' or 'wait' before sleeping"
            )
        async with self._model_lock:
            if "weights" in tags and "weights" not in self._sleeping:
                self._sleep_weights(level)
                self._sleeping.add("weights")
            if "kv_cache" in tags and "kv_cache" not in self._sleeping:
                self.kv.free()
                self._sleeping.add("kv_cache")
            self._sleep_level = max(self._sleep_level, level) if self._sleeping else 0
        self._notify()

    def _sleep_weights(self, level: int) -> None:
        if level == 1:
            # host-side backup (a no-op move on CPU, a pinned copy on GPU), then free the storage
            self._backup = {n: p.detach().to("cpu", copy=True) for n, p in self.model.named_parameters()}
        else:
            self._backup = {}
            self._saved_buffers = {n: b.detach().to("cpu", copy=True) for n, b in self.model.named_buffers()}
            for _, b in self.model.named_buffers():
                b.data = torch.empty(0, dtype=b.dtype, device=b.device)
            self.model.rotary.drop_tables()
            self._weights_loaded = False
        for p in self.model.parameters():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    async def wake_up(self, tags: list[SleepTag]) -> None:
        async with self._model_lock:
            if "weights" in tags and "weights" in self._sleeping:
                params = dict(self.model.named_parameters())
                for name, spec in self._specs.items():
                    if self._backup:
                        params[name].data = self._backup[name]
                    else:
                        params[name].data = torch.zeros(spec.shape, dtype=spec.dtype)
                self._backup = {}
                buffers = dict(self.model.named_buffers())
                for name, saved in self._saved_buffers.items():
                    buffers[name].data = saved
                self._saved_buffers = {}
                self.model.rotary.rebuild()
                self._sleeping.discard("weights")
            if "kv_cache" in tags and "kv_cache" in self._sleeping:
                self.kv.allocate()
                self._sleeping.discard("kv_cache")
            if not self._sleeping:
                self._sleep_level = 0
        self._notify()

    # ---- weights -----------------------------------------------------------------------

    def _module(self, target: UpdateTarget) -> torch.nn.Module:
        if target == "draft":
            raise FailedPrecondition("this engine has no draft model")
        return self.model

    def param_specs(self, target: UpdateTarget) -> Mapping[str, ParamSpec]:
        self._module(target)
        return self._specs

    def parameters_of(self, target: UpdateTarget) -> Mapping[str, torch.Tensor]:
        return {n: p.data for n, p in self._module(target).named_parameters()}

    async def load_weights(
        self, target: UpdateTarget, tensors: Mapping[str, torch.Tensor], written: set[str] | None = None
    ) -> None:
        module = self._module(target)
        async with self._model_lock:
            if "weights" in self._sleeping:
                raise FailedPrecondition("weights are asleep; wake_up(tags=['weights']) before loading")
            params = dict(module.named_parameters())
            for name, t in tensors.items():
                params[name].data.copy_(t)
            covered = set(tensors) | (written or set())
            if target == "main" and covered >= set(self._specs):
                self._weights_loaded = True
        self._notify()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n

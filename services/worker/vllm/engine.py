"""VllmEngine: vLLM's AsyncLLM on the Engine base.

Generation, pause modes, sleep/wake and weight loading all go through vLLM's own RL API
(`pause_generation`/`resume_generation`, `sleep`/`wake_up`, `start_weight_update` /
`start_draft_weight_update` -> `update_weights` -> `finish_weight_update`,
`update_weight_version`). rlbus keeps its guarantees in front of it:

- updates are checked against the model folder's checkpoint (names, dtypes, shapes: what a
  transformers trainer sends), never against vLLM's repacked, renamed live parameters;
- the bytes land in vLLM's own worker process(es): each joins the transfer group as its own
  rank (extension.py, driven from receiver.py), receives and verifies them there, and at
  commit rlbus's transfer engine (transfer.py) loads them from that memory through the model's
  own load_weights, vLLM taking the new version in the same lifecycle (finish_weight_update);
- the last committed weights live once, in checkpoint names, in a shared-memory segment
  (segment.py) that vLLM starts from and its worker writes after each successful load, and
  that this process maps read-only (`parameters_of`: a repair source, hash_weights). A load
  that fails inside vLLM kills vLLM's engine (EngineDeadError): the engine reports itself
  recovering (the worker leaves the generate queue), refuses generation (UNAVAILABLE) and
  restarts vLLM from the segment, so it never serves a half-updated model and comes back on
  the version the fleet last committed;
- every reply names its tokens' weights: vLLM labels each step's tokens with the version it
  was given (given inside each load, before a request frozen by pause(keep) resumes), and
  the adapter maps those labels to (version, seq) spans.

`import vllm` happens only here and in transfer.py, lazily: rlbus works without the extra.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any, Literal

import anyio
import msgspec
import torch
from rlbus.schemas import GenerateReply, GenerateRequest, PauseMode, SleepTag, UpdateTarget
from rlbus.schemas.errors import FailedPrecondition, Internal, InvalidArgument, Unavailable

from ..book import WeightLabel
from ..engine import Engine, ParamSpec, TokenLabels, check_generate_request
from . import checkpoint, segment
from .plugin import BACKEND
from .receiver import VllmReceiver

log = logging.getLogger("rlbus.worker.vllm")

STAGING_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
"""Where the committed segments live (shared memory: both processes map them)."""


class VllmOptions(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    """A local model folder (config.json + *.safetensors), as transformers' save_pretrained writes it."""
    draft_model: str | None = None
    """A draft model folder for speculative decoding (vLLM's `draft_model` method)."""
    num_speculative_tokens: int = 3
    engine_args: dict[str, Any] = {}
    """Any other vllm.AsyncEngineArgs field (e.g. {"max_model_len": 512, "dtype": "bfloat16"});
    they override rlbus's defaults."""
    model_name: str | None = None
    staging: Literal["host", "device"] = "host"
    """Where a staged update's bytes wait for the commit in vLLM's worker process: `host`
    (pinned memory on a GPU host: the copy at load is asynchronous), or `device` (the GPU vLLM
    runs on, when the whole update fits in its free memory beside vLLM's own; else host, logged:
    nothing crosses PCIe until the load, and the load copies on the device)."""


def engine_args(options: VllmOptions, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The AsyncEngineArgs rlbus starts vLLM with: token ids in and out (no tokenizer),
    rlbus's transfer engine, per-request speculative-decoding counters (with a draft), the checkpoint's
    own dtype (vLLM's "auto" would serve a float32 trainer's weights in bf16)."""
    args: dict[str, Any] = {
        "model": options.model,
        "dtype": str(dtype).removeprefix("torch.") if dtype is not None else "auto",
        "skip_tokenizer_init": True,
        "weight_transfer_config": {"backend": BACKEND},
        "worker_extension_cls": EXTENSION,
        "disable_log_stats": True,
    }
    if not torch.cuda.is_available():  # CPU: no torch.compile warm-up (minutes on two cores), a modest batch
        args.update(enforce_eager=True, max_num_seqs=32)
    if options.draft_model:
        args["speculative_config"] = {
            "method": "draft_model",
            "model": options.draft_model,
            "num_speculative_tokens": options.num_speculative_tokens,
        }
        args["per_request_spec_decode_metrics"] = "summary"  # vLLM refuses it without speculation
    args.update(options.engine_args)
    return args


EXTENSION = "rlbus.services.worker.vllm.extension.RlbusWorkerExtension"
"""vLLM's `worker_extension_cls`: rlbus's transfer rank inside each vLLM worker process."""


class _Part:
    """The main model or the draft: its checkpoint specs and the segment of its committed weights."""

    def __init__(self, folder: str, root: Path, name: str) -> None:
        self.folder = folder
        self.specs: dict[str, ParamSpec] = checkpoint.read_specs(folder)
        self.home = segment.create(folder, root / name)
        """The model folder vLLM starts (and restarts) from; its checkpoint is the segment."""
        self.segment = segment.Segment(self.home)

    @property
    def committed(self) -> dict[str, torch.Tensor]:
        """The committed bits, read in place (vLLM's worker writes them after each load)."""
        return self.segment.tensors

    @property
    def dtype(self) -> torch.dtype | None:
        """The checkpoint's floating-point dtype."""
        return next((s.dtype for s in self.specs.values() if s.dtype.is_floating_point), None)

    @property
    def nbytes(self) -> int:
        return self.segment.nbytes


class _Request:
    __slots__ = ("started", "labels", "draft")

    def __init__(self, label: WeightLabel, draft_version: str) -> None:
        self.started = False
        self.labels = [label]
        """The labels vLLM was given while it held this request, in order (the first: at
        submission): vLLM's spans name version strings, these give them their seqs."""
        self.draft = draft_version
        """The draft version at submission (a reply names it when the draft proposed tokens)."""


class _NotStarted:
    """Stands in for vLLM before start() and while it restarts: every use says so."""

    def __getattr__(self, name: str) -> Any:
        raise Unavailable("vLLM is not running on this worker (starting or restarting); retry")


class VllmEngine(Engine):
    """The adapter. Create with `await VllmEngine.start(options)`; `await engine.close()` at the end."""

    sleeps_tags_together = True
    sleep_off_hint = (
        "vLLM refuses enable_sleep_mode on this platform, or the worker was started without it: "
        "--vllm-arg enable_sleep_mode=true on a GPU host"
    )

    def __init__(self, options: VllmOptions) -> None:
        super().__init__(options.model_name or Path(options.model).name, sleep_mode_enabled=False)
        self.options = options
        segment.sweep(STAGING_DIR)  # segments of workers killed before they could remove theirs
        self._root = Path(tempfile.mkdtemp(prefix=f"{segment.PREFIX}{os.getpid()}-", dir=STAGING_DIR))
        self.main = _Part(options.model, self._root, "main")
        self.draft = _Part(options.draft_model, self._root, "draft") if options.draft_model else None
        self.vllm_receiver = VllmReceiver(self)
        self.receiver = self.vllm_receiver
        self.llm: Any = _NotStarted()
        self._vllm_label: WeightLabel | None = None
        """The label vLLM was last given (its get_weight_version() says its version; None: not
        yet, or restarted): see _sync_label."""
        self._restarting = False
        """vLLM failed a load and is restarting from the committed weights: nothing is served."""
        self.vocab_size = 0
        self.max_model_len = 0
        self._kv_bytes = 0
        self._draft_k = 0
        self._requests: set[_Request] = set()
        """Submitted to vLLM and not answered yet."""
        self._loading = False
        """A load is in progress: new requests wait (so no reply mixes two weight versions)."""
        self._discarded = False
        """A level-2 sleep discarded vLLM's weights; generation is refused until a load."""
        self._load_lock = anyio.Lock()
        self._restart: asyncio.Task[None] | None = None
        self.restarts = 0
        self.launches = 0
        """vLLM starts (the first and every restart): a restarted vLLM's workers are in no transfer group."""
        self.loads = 0
        """Loads handed to vLLM (tests: a refused update never reaches it)."""
        self.fail_next_load_after: int | None = None
        """Tests only: the next load raises inside vLLM after this many tensors."""

    # ---- lifecycle ---------------------------------------------------------------------

    @classmethod
    async def start(cls, options: VllmOptions) -> VllmEngine:
        engine = await anyio.to_thread.run_sync(cls, options)  # writes the segments: seconds for a big model
        try:
            await engine._launch()
        except BaseException:
            engine._remove_segments()
            raise
        return engine

    async def _launch(self) -> None:
        """Start vLLM from the committed segments (its engine core runs in child processes)
        without blocking the loop; its workers map the segments."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        draft = str(self.draft.home) if self.draft is not None else None
        opts = msgspec.structs.replace(self.options, model=str(self.main.home), draft_model=draft)
        # vLLM runs the segment folder; it serves (and names, in its OpenAI API) the model folder's name
        args = AsyncEngineArgs(**{"served_model_name": self.model_name, **engine_args(opts, self.main.dtype)})
        # Built off the loop: construction waits tens of seconds for the engine core, and
        # AsyncLLM starts its output handler lazily when built outside a running loop.
        llm = await anyio.to_thread.run_sync(lambda: AsyncLLM.from_engine_args(args), abandon_on_cancel=False)
        cfg = llm.vllm_config
        self.sleep_mode_enabled = bool(cfg.model_config.enable_sleep_mode)
        self.vocab_size = int(cfg.model_config.get_vocab_size())
        self.max_model_len = int(cfg.model_config.max_model_len)
        self.transfer_ranks = int(cfg.parallel_config.world_size)  # one rank per vLLM worker process (TP x PP)
        self._kv_bytes = int(cfg.cache_config.kv_cache_memory_bytes or 0)
        spec = cfg.speculative_config
        self._draft_k = (
            int(spec.num_speculative_tokens or 0) if spec is not None and spec.draft_model_config is not None else 0
        )
        if self.draft is not None and self._draft_k == 0:
            llm.shutdown()
            raise FailedPrecondition("vLLM did not configure the draft model for speculative decoding")
        await llm.collective_rpc("rlbus_attach", args=(str(self.main.home), draft))
        self.llm = llm
        self.launches += 1
        self._vllm_label = None

    async def close(self) -> None:
        if self._restart is not None:
            self._restart.cancel()
        llm, self.llm = self.llm, _NotStarted()
        if not isinstance(llm, _NotStarted):
            await anyio.to_thread.run_sync(llm.shutdown)
        self._remove_segments()

    def _remove_segments(self) -> None:
        for part in (self.main, self.draft):
            if part is not None:
                part.segment.close()
        segment.remove(self._root)

    # ---- identity ----------------------------------------------------------------------

    @property
    def recovering(self) -> bool:
        return self._restarting

    @property
    def has_draft_model(self) -> bool:
        return self.draft is not None and self._draft_k > 0

    @property
    def supports_draft_weight_updates(self) -> bool:
        return self.has_draft_model

    @property
    def num_params(self) -> int:
        return sum(math.prod(s.shape) for s in self.main.specs.values())

    @property
    def weights_loaded(self) -> bool:
        return not self._restarting and not self._discarded

    @property
    def param_bytes(self) -> int:
        return self.main.nbytes + (self.draft.nbytes if self.draft else 0)

    @property
    def kv_cache_bytes(self) -> int:
        return 0 if "kv_cache" in self._sleeping else self._kv_bytes

    def _active(self) -> int:
        return len(self._requests)

    def _in_flight(self) -> int:
        return self._busy()

    def _held_back(self) -> int:
        return len(self._requests) - self.decoding() if self._paused else 0

    # ---- generation --------------------------------------------------------------------

    def _check_request(self, req: GenerateRequest) -> None:
        check_generate_request(
            req, vocab_size=self.vocab_size, max_len=self.max_model_len, max_len_name="vLLM's max_model_len"
        )

    async def generate(self, request: GenerateRequest) -> GenerateReply:
        if self.vocab_size:
            self._check_request(request)
        async with self.admitted() as req:
            out = await self._run(request, req)
        completion = out.outputs[0]
        tokens = list(completion.token_ids)[: request.max_tokens]
        labels = TokenLabels(req.labels[0])
        spans = getattr(completion, "weight_versions", None)  # vLLM labels every step's tokens
        if spans:
            i = 0
            for span in spans:  # in order: each names the next label given with its version string
                i = next((k for k in range(i, len(req.labels)) if req.labels[k].version == span.version), i)
                labels.add(req.labels[i], span.end - span.start)
        else:  # a vLLM without spans: the label it ran under when it was submitted
            labels.add(req.labels[0], len(tokens))
        proposed = accepted = rounds = 0
        metrics = completion.spec_decode_metrics
        if metrics is not None:
            proposed = int(metrics.num_draft_tokens)
            accepted = sum(j * n for j, n in enumerate(metrics.histogram))
            rounds = sum(metrics.histogram)
        self.spec_proposed += proposed
        self.spec_accepted += accepted
        logprobs = None
        if request.return_logprobs and completion.logprobs is not None:
            logprobs = [float(step[tok].logprob) for tok, step in zip(tokens, completion.logprobs)]
        return GenerateReply(
            worker_id="",
            tokens=tokens,
            finish_reason="abort" if completion.finish_reason == "abort" else "length",
            **labels.reply_fields(len(tokens)),
            draft_version=req.draft if rounds else None,
            logprobs=logprobs,
            proposed=proposed,
            accepted=accepted,
            mean_accepted_length=accepted / rounds if rounds else 0.0,
        )

    @contextlib.asynccontextmanager
    async def admitted(self) -> AsyncIterator[_Request]:
        """rlbus's gate in front of vLLM, for rl.generate and the OpenAI server (openai.py) alike:
        refused where nothing may be served, held while paused or loading, then counted in
        flight until it ends (a load waits for it, so no reply mixes two weight versions)."""
        self._refuse_if_unservable()
        await self._wait_until_open(lambda: self._loading)  # new requests wait for resume in every pause mode
        await self._sync_label()
        req = _Request(self._vllm_label or self.book.main, self.book.draft.version)
        self._requests.add(req)
        self._changes.notify()
        try:
            yield req
        finally:
            self._requests.discard(req)
            self._changes.notify()

    def started(self, req: _Request) -> None:
        """vLLM produced the request's first output (it decodes now; a request vLLM queued behind
        a pause, and a load, starts later)."""
        if not req.started:
            req.started = True
            self._changes.notify()

    async def _run(self, request: GenerateRequest, req: _Request) -> Any:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError

        params = SamplingParams(
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            seed=request.seed if request.temperature > 0 else None,
            logprobs=0 if request.return_logprobs else None,
            ignore_eos=True,
            detokenize=False,
        )
        final = None
        try:
            async for out in self.llm.generate(
                TokensPrompt(prompt_token_ids=list(request.prompt_tokens)), params, request_id=uuid.uuid4().hex
            ):
                self.started(req)  # a request vLLM queued behind a pause (and a load) starts later
                final = out
        except EngineDeadError:
            raise Unavailable("vLLM's engine died on this worker; retry on another worker") from None
        if final is None:
            raise Internal("vLLM returned no output")
        return final

    def decoding(self) -> int:
        """Requests vLLM is running (it produced output for them; frozen ones under pause(keep) included)."""
        return sum(r.started for r in self._requests)

    def _busy(self) -> int:
        """Requests vLLM will run without a resume: those it runs, and while it is not
        paused also those submitted and not admitted yet (a paused vLLM queues them)."""
        return len(self._requests) if not self._paused else self.decoding()

    async def _sync_label(self, told: str | None = None) -> None:
        """Give vLLM the books' main label before it runs anything under it: vLLM labels each
        step's tokens with its version string (a reply's weight_versions spans) and
        get_weight_version() reports it. Requests in flight record it, in order, to map
        vLLM's spans back to (version, seq). Called before each new request, after each load
        (before a frozen request resumes on the new weights) and before a resume. Two commits
        that keep one version string are one span to vLLM: the reply names the first."""
        label = self.book.main
        if self._vllm_label == label or isinstance(self.llm, _NotStarted):
            return
        if told != label.version and (self._vllm_label is None or self._vllm_label.version != label.version):
            await self.llm.update_weight_version(label.version)  # told: vLLM took it in its load already
        self._vllm_label = label
        for r in self._requests:
            r.labels.append(label)

    # ---- pause / resume ----------------------------------------------------------------

    async def _on_pause(self, mode: PauseMode) -> None:
        if isinstance(self.llm, _NotStarted):
            return  # restarting: nothing is in flight
        # clear_cache=False: keep mode must keep the frozen requests' KV cache
        await self.llm.pause_generation(mode=mode, clear_cache=False)
        if mode != "keep":
            await self._changes.until(lambda: self.decoding() == 0)  # vLLM drained them; their replies are on their way

    async def _on_resume(self) -> None:
        if not isinstance(self.llm, _NotStarted):
            await self._sync_label()  # a relabel while paused: frozen requests go on under it
            await self.llm.resume_generation()

    # ---- sleep / wake ------------------------------------------------------------------

    async def _on_sleep(self, level: int, tags: list[SleepTag]) -> None:
        await self.llm.sleep(level)

    async def _on_wake(self, tags: list[SleepTag]) -> None:
        await self.llm.wake_up(list(tags))
        if "weights" in tags and self._sleep_level == 2:
            self._discarded = True  # level 2 dropped vLLM's weights: a push must come first

    # ---- weights -----------------------------------------------------------------------

    def _part(self, target: UpdateTarget) -> _Part:
        if target == "draft":
            if self.draft is None or not self.has_draft_model:
                raise FailedPrecondition("this vLLM engine has no draft model; start the worker with --draft-model DIR")
            return self.draft
        return self.main

    async def live_checksum(self, target: UpdateTarget) -> str:
        """vLLM's live main model, hashed in each of its worker processes (its own repacked
        layout: comparable between vLLM replicas of one model, not with the trainer's bits).
        The draft is compared on its committed copy only ("")."""
        if target != "main":
            return ""
        if self._restarting or isinstance(self.llm, _NotStarted):
            raise Unavailable("vLLM is restarting on this worker; verify again once it serves")
        return await self.vllm_receiver.live_digest(target)

    def param_specs(self, target: UpdateTarget) -> Mapping[str, ParamSpec]:
        """The checkpoint's names, dtypes and shapes: what a transformers trainer sends."""
        return self._part(target).specs

    def parameters_of(self, target: UpdateTarget) -> Mapping[str, torch.Tensor]:
        """The last committed weights, in checkpoint names (not vLLM's live, repacked
        parameters), read in place from the segment: a repair source and hash_weights read them."""
        return self._part(target).committed

    async def load_weights(
        self,
        target: UpdateTarget,
        tensors: Mapping[str, torch.Tensor],
        written: set[str] | None = None,
        *,
        loaded: Callable[[], None] = lambda: None,
    ) -> None:
        """Refused: vLLM loads only what its own worker processes received and verified
        (self.receiver); what this process holds never reaches vLLM's model."""
        if written:
            raise FailedPrecondition(
                "a vLLM worker receives into staged buffers only; start it with --update-mode staged"
            )
        problems = _mismatches(self._part(target).specs, tensors)
        if problems:  # never reaches vLLM: a bad load would kill its engine
            raise InvalidArgument(
                f"{len(problems)} tensors do not match the {target} checkpoint: {', '.join(problems[:20])}"
            )
        raise FailedPrecondition(
            "vLLM loads only what its own worker processes received and verified: push through the transfer group"
        )

    async def load_received(
        self, target: UpdateTarget, session_id: str, version: str | None, loaded: Callable[[], None]
    ) -> None:
        """Load the verified session held by vLLM's worker processes through vLLM's lifecycle,
        vLLM taking `version` in it (main only; None keeps its version string).

        New requests wait and in-flight ones finish first (unless frozen by pause(keep)), so
        every reply is produced by one set of weights, and none is stamped by vLLM between
        the load and the version."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._part(target)
        if "weights" in self._sleeping:
            raise FailedPrecondition("weights are asleep; wake_up(tags=['weights']) before loading")
        async with self._load_lock:
            if self._restarting:
                await self._changes.until(lambda: not self._restarting)  # a restart is bringing vLLM back
            self._loading = True
            self._changes.notify()
            try:
                if self._pause_mode != "keep":
                    await self._changes.until(lambda: self._busy() == 0)
                self.loads += 1
                info: dict[str, Any] = {"session_id": session_id}
                if self.fail_next_load_after is not None:
                    info["fail_after"], self.fail_next_load_after = self.fail_next_load_after, None
                told = version if target == "main" else None
                try:
                    if target == "draft":
                        await self.llm.start_draft_weight_update()
                    else:
                        await self.llm.start_weight_update()
                    await self.llm.update_weights(WeightTransferUpdateRequest(update_info=info))
                    await self.llm.finish_weight_update(weight_version=told)
                    await self.llm.reset_prefix_cache()  # cached KV was computed by the old weights
                except Exception as e:
                    self._failed(e)
                    raise Internal(
                        f"vLLM failed to load the {target} weights ({type(e).__name__}: {str(e)[:300]}); this worker serves "
                        f"nothing until vLLM has restarted from the last committed weights ({self.book.main.version})"
                    ) from None
                loaded()  # new requests still wait (and frozen ones stay frozen): none ran on them yet
                if target == "main":
                    try:
                        await self._sync_label(told)  # before a frozen request resumes on these weights
                    except Exception as e:
                        log.warning("could not give vLLM the new weight version: %s", e)
            finally:
                self._loading = False
                self._changes.notify()
            if target == "main":
                self._discarded = False
            self.draft_stale = target == "main" and self.draft is not None

    # ---- failure and recovery ----------------------------------------------------------

    def _failed(self, error: BaseException) -> None:
        """vLLM's engine is dead or half-written: stop serving and restart it from the
        committed weights (kept here), in the background."""
        log.error(
            "vLLM failed a weight load (%s); restarting it from the committed weights (%s)",
            error,
            self.book.main.version,
        )
        self._restarting = True
        self._changes.notify()
        if self._restart is None or self._restart.done():
            self._restart = asyncio.get_running_loop().create_task(self._recover())

    async def _recover(self) -> None:
        old, self.llm = self.llm, _NotStarted()
        try:
            await anyio.to_thread.run_sync(old.shutdown)
        except Exception as e:
            log.warning("shutting the failed vLLM engine down: %s", e)
        try:
            try:
                await self._launch()  # from the segments: the committed weights, untouched by the failed load
            except Exception:
                # it stays recovering: status says so, generation is refused; restart the worker
                log.exception("vLLM did not come back; this worker serves nothing until it is restarted")
                return
            if self._paused:
                await self.llm.pause_generation(mode=self._pause_mode or "abort", clear_cache=False)
            self.restarts += 1
            self._restarting = False
            log.warning("vLLM restarted from the committed weights (%s); serving again", self.book.main.version)
        finally:
            self._changes.notify()

    async def wait_recovered(self) -> None:
        """Return once no restart is pending (tests, and callers that want to wait instead of retrying)."""
        await self._changes.until(lambda: not self._restarting)


def _mismatches(specs: Mapping[str, ParamSpec], tensors: Mapping[str, torch.Tensor]) -> list[str]:
    problems = []
    for name, t in tensors.items():
        spec = specs.get(name)
        if spec is None:
            problems.append(f"{name} (unknown parameter)")
        elif t.dtype != spec.dtype:
            problems.append(f"{name} (dtype {t.dtype}, checkpoint has {spec.dtype})")
        elif tuple(t.shape) != tuple(spec.shape):
            problems.append(f"{name} (shape {list(t.shape)}, checkpoint has {list(spec.shape)})")
    return problems

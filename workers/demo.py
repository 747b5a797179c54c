"""`make demo`: a tiny GRPO loop that learns through hot-loads, on the embedded stack (README.md).

Starts the stack unless it runs, creates a deployment of the embedded model (or ``--model
qwen3-moe``, with routed experts replayed by the trainer), publishes the base as a FULL snapshot,
then per step: samples groups of completions through the gateway, scores them
(``workers.grpo.digits_reward``), takes a GRPO step on the trainer's own copy
(``workers.grpo.Policy``), writes a delta against the previous checkpoint (a FULL once a chain
holds 63 deltas) and hot-loads it, waiting until every replica is READY on it, so the next
rollouts are strictly on-policy. It prints a line per step, writes a plot and its figures under
``HOME/demo/``, deletes the deployment and stops what it started; exit status 0 when every
hot-load completed and the reward rose. With ``--max-replicas`` above ``--replicas`` the
deployment autoscales on the demo's own load.
"""

from __future__ import annotations

import base64
import json
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from tokenizers import Tokenizer

from common.settings import Settings
from rollouts.client import RESET_ALL, ApiError, HotLoad, RolloutsClient
from snapshots.chain import MAX_CHAIN_DELTAS as MAX_DELTAS_IN_CHAIN
from snapshots.writer import write_delta
from workers.families import MOE, write_family
from workers.grpo import Policy, Rollout, digit_token_ids, digits_reward, group_advantages, make_prompts
from workers.stack import Stack, StackError, load_or_create_settings, upload_dir

try:  # the plot is optional: without matplotlib the demo prints its table only
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    plt = None  # type: ignore[assignment]

# The table's before/after sample: a question the policy never trains on, greedy.
SAMPLE_PROMPT = "12 + 34 ="
# How long a hot-load create answered `unavailable` (503) is tried again.
UNAVAILABLE_RETRY_S = 120.0
# How long a hot-load may run before the demo gives up on it.
HOT_LOAD_TIMEOUT_S = 3600.0


@dataclass
class DemoConfig:
    steps: int = 30  # GRPO steps (hot-loads after the initial FULL)
    prompts: int = 8  # prompts per step
    group: int = 8  # completions per prompt (GRPO group)
    max_tokens: int = 16  # tokens per completion
    lr: float = 5e-3
    train: str = "head"  # which tensors the trainer updates: head | last | all (workers.grpo)
    inner_steps: int = 1
    max_loop_s: float = 300.0  # stop starting new steps after this many seconds of loop
    replicas: int = 2  # autoscaling.min
    max_replicas: int | None = None  # autoscaling.max; above `replicas`, the deployment autoscales
    target_in_flight: int = 2  # autoscaling.targetInFlight when it autoscales
    scale_out_after_s: int = 10  # autoscaling.scaleOutAfterSeconds
    scale_in_after_s: int = 20  # autoscaling.scaleInAfterSeconds
    seed: int = 0
    max_deltas: int | None = None  # deltas per chain before a FULL; None: the service's limit (63)
    model: str = "llama"  # the embedded Llama model, or a family of workers.families (MODELS)


# --model: the embedded model, or a small random checkpoint of a family written locally.
MODELS = {"llama": None, "qwen3-moe": "qwen3_moe"}
# --model -> (--prompts, --lr) unless given. The MoE's rollouts carry routes, which vLLM's CPU
# build samples in Triton's interpreter (~40 tokens/s here): half the prompts for twice the
# steps in the loop's time, and a larger step to learn in them.
MODEL_DEFAULTS = {"llama": (8, 5e-3), "qwen3-moe": (4, 1e-2)}


def demo_model(settings: Settings, cfg: DemoConfig) -> tuple[Path, str]:
    """The checkpoint the demo deploys and trains (local directory, path in the bucket): the
    embedded model, or ``cfg.model``'s family checkpoint written once under the home and uploaded."""
    family = MODELS[cfg.model]
    models = settings.home_path / "models"
    if family is None:
        return models / "base", settings.base_model_path
    local = write_family(models, models / "base", family)
    path = f"models/{family}"
    upload_dir(settings.s3_client(), local, settings.bucket, path)
    return local, path


@dataclass
class StepRecord:
    step: int
    identity: str
    kind: str  # "FULL", "DELTA", or "NONE" (no tensor changed in BF16: nothing published)
    reward: float | None  # mean reward of the rollouts this step trained on (None for step 0)
    delta_pct: float | None  # wire bytes as % of the full checkpoint's tensor bytes
    hot_load_s: float
    ready: int
    replicas: int
    state: str
    tokens: int = 0
    rollout_s: float = 0.0
    train_s: float = 0.0
    publish_s: float = 0.0  # export + delta + upload
    mismatch: float | None = None
    sample: str = ""
    pause_ms: float | None = None  # the longest pause (pauseMs) among the hot-load's replicas
    pause_bytes: int | None = None  # the most bytes written into an engine inside its pause (swapBytes)
    routes_agree: float | None = None  # share of replayed routes the trainer's own router picked too

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.rollout_s if self.rollout_s > 0 else 0.0


def reward_summary(rewards: list[float], k: int = 5) -> tuple[float, float]:
    """Mean reward of the first ``k`` and last ``k`` steps (halves when there are < 2k steps)."""
    if not rewards:
        return 0.0, 0.0
    k = max(1, min(k, len(rewards) // 2 or 1))
    return statistics.fmean(rewards[:k]), statistics.fmean(rewards[-k:])


HEADER = (
    f"{'step':>4}  {'identity':<12} {'type':<5} {'reward':>6}  {'delta':>7}  {'hot-load':>8}  {'pause':>7}  "
    f"{'in pause':>8}  "
    f"{'READY':>5}  {'tok/s':>6}  {'train':>6}  {'|Δlogp|':>7}  sample"
)


def format_step(r: StepRecord) -> str:
    reward = f"{r.reward:6.3f}" if r.reward is not None else f"{'—':>6}"
    delta = f"{r.delta_pct:6.2f}%" if r.delta_pct is not None else f"{r.kind.lower():>7}"
    tps = f"{r.tok_per_s:6.0f}" if r.tokens else f"{'—':>6}"
    train = f"{r.train_s:5.2f}s" if r.train_s else f"{'—':>6}"
    mismatch = f"{r.mismatch:7.4f}" if r.mismatch is not None else f"{'—':>7}"
    sample = repr(r.sample) if r.sample else ""
    pause = f"{r.pause_ms:5.0f}ms" if r.pause_ms is not None else f"{'—':>7}"
    moved = f"{r.pause_bytes / 1e6:6.2f}MB" if r.pause_bytes is not None else f"{'—':>8}"
    return (
        f"{r.step:>4}  {r.identity:<12} {r.kind:<5} {reward}  {delta}  {r.hot_load_s:7.2f}s  {pause}  {moved}  "
        f"{r.ready}/{r.replicas:<3}  {tps}  {train}  {mismatch}  {sample}"
    )


def write_plot(records: list[StepRecord], path: Path, subtitle: str = "") -> Path | None:
    """Reward and hot-load seconds per step as a PNG; ``None`` when matplotlib is missing."""
    if plt is None:
        return None
    trained = [r for r in records if r.reward is not None]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    ax1.plot([r.step for r in trained], [r.reward for r in trained], marker="o", ms=3, color="tab:blue")
    ax1.set_ylabel("mean reward\n(fraction of digit tokens)")
    ax1.set_ylim(-0.02, 1.02)
    ax1.grid(alpha=0.3)
    ax1.set_title(
        "rollouts demo: GRPO through hot-loads (2 Dynamo vLLM workers on CPU)" + (f"\n{subtitle}" if subtitle else ""),
        fontsize=10,
    )
    colors = ["tab:orange" if r.kind == "FULL" else "tab:green" for r in records]
    ax2.bar([r.step for r in records], [r.hot_load_s for r in records], color=colors)
    ax2.set_ylabel("hot-load seconds\n(create → COMPLETED)")
    ax2.set_xlabel("step (orange: FULL, green: delta)")
    ax2.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


class Client:
    """The REST API and the gateway, as the trainer calls them."""

    def __init__(self, settings: Settings) -> None:
        self.s = settings
        self.api = f"{settings.api_url}/v1alpha1/inference"
        self.h = {"Authorization": f"Bearer {settings.admin_token}"}
        self.http = httpx.Client(timeout=httpx.Timeout(300, connect=10), limits=httpx.Limits(max_connections=64))
        self.rollouts = RolloutsClient(settings.api_url, settings.admin_token, timeout=300)

    def close(self) -> None:
        self.http.close()
        self.rollouts.close()

    def call(self, method: str, path: str, **kw: Any) -> dict:
        r = self.http.request(method, f"{self.api}{path}", headers=self.h, **kw)
        if r.status_code >= 400:
            raise StackError(f"{method} {path}: HTTP {r.status_code} {r.text}")
        return r.json()

    def complete(
        self, model: str, prompt: str | list[int], *, n: int, max_tokens: int, temperature: float, **extra: Any
    ) -> dict:
        """A completion with each sampled token's id and log-prob (``logprobs.tokens`` as
        ``token_id:N``, ``logprobs.token_logprobs``), as cwtrain asks for rollouts."""
        r = self.http.post(
            f"{self.s.gateway_url}/v1/completions",
            headers=self.h,
            json={
                "model": model,
                "prompt": prompt,
                "n": n,
                "max_tokens": max_tokens,
                "temperature": temperature,
                "logprobs": 1,
                "return_tokens_as_token_ids": True,
                "ignore_eos": True,
                **extra,
            },
        )
        if r.status_code != 200:
            raise StackError(f"gateway /v1/completions: HTTP {r.status_code} {r.text[:300]}")
        return r.json()

    def sample(self, model: str) -> str:
        choice = self.complete(model, SAMPLE_PROMPT, n=1, max_tokens=12, temperature=0, skip_special_tokens=False)[
            "choices"
        ][0]
        return choice["text"]

    def hot_load(self, dep_id: str, identity: str, previous: str | None) -> tuple[HotLoad, list[dict], float]:
        """Create a hot-load (FULL when ``previous`` is None) through ``rollouts.client``, wait for
        its end; returns the operation, its replicas (as the API answers them) and the seconds
        from create to the terminal state."""
        t0 = time.monotonic()
        while True:
            try:
                hl = self.rollouts.create_hot_load(
                    dep_id, identity, previous_identity=previous, prompt_cache_policy=RESET_ALL
                )
                break
            except ApiError as exc:
                # `unavailable` says "try again": the deployment was busy with its replicas (a
                # replica joining after a scale-out takes the snapshot from a peer meanwhile).
                if exc.status != 503 or time.monotonic() - t0 > UNAVAILABLE_RETRY_S:
                    raise StackError(f"POST /hotLoads: {exc}") from None
            time.sleep(2)
        hl = self.rollouts.wait_hot_load(hl.id, timeout=HOT_LOAD_TIMEOUT_S, poll=0.1)
        seconds = time.monotonic() - t0
        return hl, [r.raw for r in self.rollouts.list_replicas(hl.id)], seconds


def token_id(token: str) -> int:
    """A sampled token's id from ``logprobs.tokens`` under ``return_tokens_as_token_ids``."""
    if not token.startswith("token_id:"):
        raise StackError(f"gateway /v1/completions: logprobs token {token!r} is not 'token_id:N'")
    return int(token.removeprefix("token_id:"))


def routed_experts(answer: dict) -> np.ndarray:
    """``nvext.routed_experts`` of an answer as ``[prompt + completion - 1, layers, top_k]``."""
    routed = (answer.get("nvext") or {}).get("routed_experts")
    if not routed:
        raise StackError("gateway /v1/completions: the answer carries no nvext.routed_experts")
    return np.frombuffer(base64.b64decode(routed["data"]), dtype=routed["dtype"]).reshape(routed["shape"])


def rollouts_for(
    client: Client, model: str, prompts: list[list[int]], cfg: DemoConfig, digit_ids, routes: bool = False
) -> tuple[list, int, float]:
    """Sample ``cfg.group`` completions per prompt (token ids) through the gateway, all prompts
    at once; with ``routes``, one request per completion, each with its routed experts."""
    t0 = time.monotonic()
    if routes:
        asks = [(g, p, 1) for g, p in enumerate(prompts) for _ in range(cfg.group)]
        extra: dict[str, Any] = {"nvext": {"extra_fields": ["routed_experts"]}}
    else:
        asks, extra = [(g, p, cfg.group) for g, p in enumerate(prompts)], {}
    with ThreadPoolExecutor(max_workers=len(asks)) as pool:
        responses = list(
            pool.map(
                lambda a: client.complete(model, a[1], n=a[2], max_tokens=cfg.max_tokens, temperature=1.0, **extra),
                asks,
            )
        )
    seconds = time.monotonic() - t0
    rollouts = []
    tokens = 0
    for (g, _, _), resp in zip(asks, responses):
        for choice in resp["choices"]:
            logprobs = choice.get("logprobs") or {}
            ids = [token_id(t) for t in logprobs.get("tokens") or []]
            lps = logprobs.get("token_logprobs")
            rollouts.append(
                Rollout(
                    group=g,
                    prompt_ids=list(prompts[g]),
                    completion_ids=ids,
                    reward=digits_reward(ids, digit_ids),
                    sampler_logprobs=[float(x) for x in lps] if lps and None not in lps else None,
                    routed_experts=routed_experts(resp) if routes else None,
                )
            )
            tokens += len(ids)
    return rollouts, tokens, seconds


def run_demo(
    home: Path, *, port_base: int | None = None, keep_running: bool = False, config: DemoConfig | None = None
) -> int:
    """The demo (module docstring): the stack up, one run of the loop (`Demo`), what it started
    stopped again; returns the exit status."""
    cfg = config or DemoConfig()
    settings = load_or_create_settings(home, port_base)
    stack = Stack(settings)
    was_running = all(stack.status().get(n) for n in ("temporal", "s3", "api", "worker", "gateway"))
    say = lambda line: print(line, flush=True)  # noqa: E731
    t_up = time.monotonic()
    stack.up(say=say)
    demo = Demo(settings, cfg, say, up_s=time.monotonic() - t_up)
    try:
        return demo.run()
    finally:
        demo.close()
        if not was_running and not keep_running:
            stack.down(say=say)


@dataclass
class Trainer:
    """The trainer's side of a run: its policy and what it reads of the model."""

    base_dir: Path
    policy: Policy
    digit_ids: Any
    tokenizer: Tokenizer


class Demo:
    """One run of the loop on a running stack, in its phases: deploy, load the trainer, wait for
    the deployment, publish the base, the GRPO steps (each rollouts, a step, a publish), report;
    `close` deletes the deployment and the run's files."""

    def __init__(self, settings: Settings, cfg: DemoConfig, say: Any, up_s: float) -> None:
        self.settings, self.cfg, self.say, self.up_s = settings, cfg, say, up_s
        self.c = Client(settings)
        self.name = f"grpo-{int(time.time())}"
        self.work = settings.home_path / "demo" / self.name
        self.prefix = f"checkpoints/{self.name}"
        self.dep_id: str | None = None
        self.records: list[StepRecord] = []
        self.routes = MODELS[cfg.model] in MOE  # an MoE returns its routes, which the trainer replays
        self.ready_s = 0.0
        self.s3 = settings.s3_client()

    def run(self) -> int:
        base_dir, model_path = demo_model(self.settings, self.cfg)
        t0 = time.monotonic()
        self.deploy(model_path)
        scale = ScaleLog(self.cfg, self.say) if _autoscales(self.cfg) else None
        trainer = self.load_trainer(base_dir)  # while the replicas start
        self.wait_ready()
        self.ready_s = time.monotonic() - t0
        self.say(f"deployment READY in {self.ready_s:.1f}s")
        before = self.c.sample(self.settings.model_name)
        self.work.mkdir(parents=True, exist_ok=True)
        self.say(
            f"GRPO: {self.cfg.prompts} prompts x {self.cfg.group} completions x {self.cfg.max_tokens} tokens "
            f"per step, reward = fraction of digit tokens, up to {self.cfg.steps} steps / "
            f"{self.cfg.max_loop_s:.0f}s"
        )
        self.say(HEADER)
        self.record(self.publish_full(0, base_dir))
        loop_s = self.loop(trainer, scale)
        after = self.c.sample(self.settings.model_name)
        if scale is not None:
            scale.until_scaled_in(self.deployment)
        return self.report(loop_s, before, after, scale)

    def deployment(self) -> dict:
        assert self.dep_id is not None
        return self.c.call("GET", f"/deployments/{self.dep_id}")["deployment"]

    def deploy(self, model_path: str) -> None:
        settings, cfg = self.settings, self.cfg
        body = {
            "name": self.name,
            "gatewayIds": [settings.gateway_id],
            "runtime": {
                "engine": "dynamo-vllm",
                "version": "0.32.0",
                "engineConfig": {"enable-return-routed-experts": ""} if self.routes else {},
            },
            "resources": {"instanceType": "cpu-local", "gpuCount": 0},
            "model": {"name": settings.model_name, "bucket": settings.bucket, "path": model_path},
            "autoscaling": _autoscaling(cfg),
            "traffic": {"weight": 100},
            "hotLoad": {
                "bucket": settings.bucket,
                "pathPrefix": self.prefix,
                "transitionMode": "TRANSITION_MODE_ASYNC",
            },
        }
        self.dep_id = self.c.call("POST", "/deployments", json=body)["deployment"]["spec"]["id"]
        self.say(
            f"deployment {self.dep_id}: starting {cfg.replicas} Dynamo vLLM workers on CPU (about a minute on "
            f"2 cores)..."
        )

    def load_trainer(self, base_dir: Path) -> Trainer:
        t_load = time.monotonic()
        cfg = self.cfg
        policy = Policy(base_dir, lr=cfg.lr, inner_steps=cfg.inner_steps, train=cfg.train, seed=cfg.seed)
        trainer = Trainer(
            base_dir, policy, digit_token_ids(base_dir), Tokenizer.from_file(str(base_dir / "tokenizer.json"))
        )
        n_train = sum(p.numel() for p in policy.model.parameters() if p.requires_grad)
        self.say(
            f"trainer: {sum(p.numel() for p in policy.model.parameters()) / 1e6:.2f}M parameters, "
            f"{n_train / 1e6:.2f}M trained ({cfg.train}: {len(policy.trainable)} of {len(policy.names)} "
            f"tensors), FP32 masters, BF16 export; loaded in {time.monotonic() - t_load:.1f}s"
        )
        return trainer

    def wait_ready(self) -> None:
        while True:
            status = self.deployment()["status"]
            if status["status"] == "STATUS_READY":
                return
            if status["status"] == "STATUS_FAILED":
                raise StackError(f"deployment failed: {status['conditions']}")
            time.sleep(2)

    def record(self, rec: StepRecord, note: str = "") -> None:
        """Keep and print a step's record; a hot-load that did not complete stops the run."""
        self.records.append(rec)
        self.say(format_step(rec) + note)
        _check(rec)

    def publish_full(self, step: int, ckpt: Path) -> StepRecord:
        identity = f"step-{step:06d}"
        t_pub = time.monotonic()
        upload_dir(self.s3, ckpt, self.settings.bucket, f"{self.prefix}/{identity}")
        publish_s = time.monotonic() - t_pub
        return self._hot_load_record(step, identity, None, "FULL", None, publish_s)

    def publish_delta(self, step: int, prev_dir: Path, prev_id: str, new_dir: Path) -> StepRecord | None:
        """The step's delta against the previous checkpoint, uploaded and hot-loaded; None when
        no tensor changed in BF16 (nothing published)."""
        identity = f"step-{step:06d}"
        t_pub = time.monotonic()
        delta_dir = self.work / identity
        dstats = write_delta(prev_dir, new_dir, delta_dir, version=identity, base_version=prev_id)
        if dstats.is_empty:
            return None
        upload_dir(self.s3, delta_dir, self.settings.bucket, f"{self.prefix}/{identity}")
        publish_s = time.monotonic() - t_pub
        rec = self._hot_load_record(step, identity, prev_id, "DELTA", 100.0 * dstats.ratio, publish_s)
        shutil.rmtree(delta_dir, ignore_errors=True)
        return rec

    def _hot_load_record(
        self, step: int, identity: str, previous: str | None, kind: str, delta_pct: float | None, publish_s: float
    ) -> StepRecord:
        """Hot-load ``identity`` (on ``previous`` for a delta) and record the step's figures."""
        assert self.dep_id is not None
        hl, reps, secs = self.c.hot_load(self.dep_id, identity, previous)
        return StepRecord(
            step,
            identity,
            kind,
            None,
            delta_pct,
            secs,
            _ready(reps, identity),
            len(reps),
            hl.state,
            publish_s=publish_s,
            pause_ms=_longest_pause(reps),
            pause_bytes=_most_moved(reps),
        )

    def loop(self, trainer: Trainer, scale: ScaleLog | None) -> float:
        """The GRPO steps, until ``cfg.steps`` or the loop's time budget; returns its seconds."""
        cfg = self.cfg
        prev_dir, prev_id, deltas_in_chain = trainer.base_dir, self.records[-1].identity, 0
        loop_t0 = time.monotonic()
        for step in range(1, cfg.steps + 1):
            if time.monotonic() - loop_t0 > cfg.max_loop_s:
                self.say(f"loop budget of {cfg.max_loop_s:.0f}s reached after {step - 1} steps")
                break
            new_dir, trained = self.train(step, trainer)
            full = deltas_in_chain >= (cfg.max_deltas or MAX_DELTAS_IN_CHAIN)
            rec = self.publish_full(step, new_dir) if full else self.publish_delta(step, prev_dir, prev_id, new_dir)
            if rec is None:  # nothing changed in BF16 (e.g. every group scored alike): no publish
                last = self.records[-1]
                self.record(
                    replace(
                        trained,
                        identity=prev_id,
                        kind="NONE",
                        ready=last.ready,
                        replicas=last.replicas,
                        state=last.state,
                    ),
                    "  (no tensor changed in BF16: nothing published)",
                )
                shutil.rmtree(new_dir, ignore_errors=True)
                continue
            deltas_in_chain = 0 if full else deltas_in_chain + 1
            self.record(
                replace(
                    rec,
                    reward=trained.reward,
                    tokens=trained.tokens,
                    rollout_s=trained.rollout_s,
                    train_s=trained.train_s,
                    mismatch=trained.mismatch,
                    sample=trained.sample,
                    routes_agree=trained.routes_agree,
                )
            )
            if scale is not None:
                scale.seen(self.deployment(), step, time.monotonic() - loop_t0)
            if prev_dir != trainer.base_dir:
                shutil.rmtree(prev_dir, ignore_errors=True)
            prev_dir, prev_id = new_dir, rec.identity
        return time.monotonic() - loop_t0

    def train(self, step: int, trainer: Trainer) -> tuple[Path, StepRecord]:
        """Rollouts through the gateway, their rewards, a GRPO step, the BF16 export; returns the
        checkpoint and the step's figures (a record of what it trained on, not yet published)."""
        cfg = self.cfg
        prompts = [trainer.tokenizer.encode(p).ids for p in make_prompts(cfg.prompts, seed=cfg.seed * 100_003 + step)]
        rollouts, tokens, rollout_s = rollouts_for(
            self.c, self.settings.model_name, prompts, cfg, trainer.digit_ids, self.routes
        )
        for r, a in zip(rollouts, group_advantages([r.reward for r in rollouts], [r.group for r in rollouts])):
            r.advantage = a
        t_train = time.monotonic()
        stats = trainer.policy.step(rollouts)
        train_s = time.monotonic() - t_train
        new_dir = trainer.policy.export(self.work / f"ckpt-{step:06d}")
        trained = StepRecord(
            step,
            f"step-{step:06d}",
            "",
            statistics.fmean(r.reward for r in rollouts),
            None,
            0.0,
            0,
            0,
            "",
            tokens=tokens,
            rollout_s=rollout_s,
            train_s=train_s,
            mismatch=stats.sampler_mismatch,
            sample=_decode(rollouts[0].completion_ids, trainer.base_dir)[:24],
            routes_agree=stats.extra.get("routes_agree"),
        )
        return new_dir, trained

    def report(self, loop_s: float, before: str, after: str, scale: ScaleLog | None) -> int:
        """The figures (JSON), the plot (PNG) and the table; 0 when every hot-load completed and
        the reward rose."""
        records = self.records
        trained = [r for r in records if r.reward is not None]
        first5, last5 = reward_summary([r.reward for r in trained])  # type: ignore[misc]  # rewards, not None
        deltas = [r for r in records if r.kind == "DELTA"]
        stamp = time.strftime("%Y%m%d-%H%M%S")
        figures = self.settings.home_path / "demo" / f"grpo-{stamp}.json"
        figures.write_text(
            json.dumps(
                {
                    "config": asdict(self.cfg),
                    "deployment": self.dep_id,
                    "steps": [{**asdict(r), "tok_per_s": r.tok_per_s} for r in records],
                    "first5_reward": first5,
                    "last5_reward": last5,
                },
                indent=2,
            )
            + "\n"
        )
        plot = write_plot(
            records,
            self.settings.home_path / "demo" / f"grpo-{stamp}.png",
            f"reward first 5 steps {first5:.3f} → last 5 {last5:.3f}; delta mean "
            f"{_mean(r.delta_pct for r in deltas):.1f}% of full; delta hot-load mean "
            f"{_mean(r.hot_load_s for r in deltas):.2f}s",
        )
        rows = self.rows(loop_s, before, after, scale, first5, last5) + [
            ("plot", str(plot) if plot else "matplotlib is not installed: no PNG (pip install matplotlib)"),
            ("figures", str(figures)),
            ("Temporal UI", f"{self.settings.temporal_ui_url}/namespaces/{self.settings.temporal_namespace}/workflows"),
        ]
        width = max(len(k) for k, _ in rows)
        print()
        for k, v in rows:
            print(f"  {k:<{width}}  {v}")
        print(flush=True)
        rose = last5 > first5 + 0.05
        if not rose:
            self.say("the reward did not rise: try more --steps (or a larger --lr)")
        return 0 if rose and all(r.state == "HOT_LOAD_STATE_COMPLETED" for r in records) else 1

    def rows(
        self, loop_s: float, before: str, after: str, scale: ScaleLog | None, first5: float, last5: float
    ) -> list[tuple[str, str]]:
        records = self.records
        trained = [r for r in records if r.reward is not None]
        deltas = [r for r in records if r.kind == "DELTA"]
        last = records[-1]
        pauses = [r.pause_ms for r in deltas if r.pause_ms is not None]
        agreed = [r.routes_agree for r in trained if r.routes_agree is not None]
        return [
            (
                "steps",
                f"{len(trained)} GRPO steps in {loop_s:.0f}s of loop ({len(deltas)} deltas, "
                f"{sum(1 for r in records if r.kind == 'FULL')} full)",
            ),
            ("reward first 5 → last 5", f"{first5:.3f} → {last5:.3f}"),
            ("last identity", f"{last.identity} ({last.state}, replicas READY {last.ready}/{last.replicas})"),
            ("delta size (mean)", f"{_mean(r.delta_pct for r in deltas):.2f}% of full" if deltas else "—"),
            (
                "hot-load create → COMPLETED",
                f"full {records[0].hot_load_s:.2f}s; deltas mean "
                f"{_mean(r.hot_load_s for r in deltas):.2f}s, max "
                f"{max((r.hot_load_s for r in deltas), default=0):.2f}s",
            ),
            (
                "pause per delta (longest replica)",
                f"median {statistics.median(pauses):.0f} ms, max {max(pauses):.0f} ms" if pauses else "—",
            ),
            ("bytes into the engine per pause", _moved_summary(records[0], deltas)),
            *(
                [
                    (
                        "routes replayed (trainer's router agreed)",
                        f"{100 * _mean(agreed):.2f}% of (token, layer) rows, lowest step {100 * min(agreed):.2f}%",
                    )
                ]
                if agreed
                else []
            ),
            ("rollout tokens/s (median)", f"{statistics.median(r.tok_per_s for r in trained):.0f}" if trained else "—"),
            ("before", f"{SAMPLE_PROMPT!r} → {before!r}"),
            ("after", f"{SAMPLE_PROMPT!r} → {after!r}"),
            *([("autoscaling", scale.summary())] if scale is not None else []),
            ("stack up", f"{self.up_s:.1f} s"),
            ("deployment ready", f"{self.ready_s:.1f} s"),
        ]

    def close(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)
        if self.dep_id:
            try:
                self.c.call("DELETE", f"/deployments/{self.dep_id}")
                time.sleep(3)  # let the worker stop the replicas before the stack goes down
            except (StackError, httpx.HTTPError) as exc:
                print(f"warning: {exc}")
        self.c.close()


def _autoscales(cfg: DemoConfig) -> bool:
    return cfg.max_replicas is not None and cfg.max_replicas > cfg.replicas


def _autoscaling(cfg: DemoConfig) -> dict[str, int | None]:
    """The deployment's `autoscaling` section: a fixed size, or (`--max-replicas` above
    `--replicas`) thresholds the demo's own load crosses: its rollouts keep `prompts` requests in
    flight for a few seconds per step, then training and the hot-load send none."""
    if not _autoscales(cfg):
        return {"min": cfg.replicas, "max": cfg.replicas}
    return {
        "min": cfg.replicas,
        "max": cfg.max_replicas,
        "targetInFlight": cfg.target_in_flight,
        "scaleOutAfterSeconds": cfg.scale_out_after_s,
        "scaleInAfterSeconds": cfg.scale_in_after_s,
    }


class ScaleLog:
    """What the demo shows of autoscaling: each change of the deployment's serving replicas
    (`readyReplicas`), with the step and the loop's seconds, and the scale-in once the load stops."""

    def __init__(self, cfg: DemoConfig, say: Any) -> None:
        self.cfg, self.say = cfg, say
        self.serving = cfg.replicas
        self.events: list[str] = []

    def _note(self, dep: dict, when: str) -> int:
        """Tell (and keep) a change of the serving replicas; returns how many serve now."""
        serving = int(dep["status"].get("readyReplicas", 0))
        if serving != self.serving:
            what = f"{self.serving} → {serving} serving replicas {when}"
            self.events.append(what)
            self.say(f"autoscaling: {what}")
            self.serving = serving
        return serving

    def seen(self, dep: dict, step: int, loop_s: float) -> None:
        self._note(dep, f"after step {step} ({loop_s:.0f} s into the loop)")

    def until_scaled_in(self, get: Any) -> None:
        """After the loop, no request is sent: wait for the deployment to come back to `min`."""
        if self.serving <= self.cfg.replicas:
            return
        self.say(
            f"autoscaling: the load stopped; waiting for the scale-in (idle for {self.cfg.scale_in_after_s} s "
            f"per replica removed)..."
        )
        t0 = time.monotonic()
        deadline = t0 + (self.serving - self.cfg.replicas) * (self.cfg.scale_in_after_s + 30) + 30
        while time.monotonic() < deadline:
            if self._note(get(), f"{time.monotonic() - t0:.0f} s after the load stopped") <= self.cfg.replicas:
                return
            time.sleep(1)
        self.say(
            f"autoscaling: still {self.serving} serving replicas {time.monotonic() - t0:.0f} s after the load stopped"
        )

    def summary(self) -> str:
        bounds = f"min {self.cfg.replicas}, max {self.cfg.max_replicas}"
        return f"{bounds}: " + ("; ".join(self.events) if self.events else "no scale step")


def _ready(reps: list[dict], identity: str) -> int:
    return sum(1 for r in reps if r.get("state") == "READY" and r.get("currentSnapshotIdentity") == identity)


def _longest_pause(reps: list[dict]) -> float | None:
    return max((float(r["pauseMs"]) for r in reps if r.get("pauseMs") is not None), default=None)


def _most_moved(reps: list[dict]) -> int | None:
    """The most bytes any replica wrote into its engine inside the pause (its ``swapBytes``)."""
    return max(
        (int(r["swapBytes"]["pause_bytes"]) for r in reps if (r.get("swapBytes") or {}).get("pause_bytes") is not None),
        default=None,
    )


def _moved_summary(full: StepRecord, deltas: list[StepRecord]) -> str:
    moved = [r.pause_bytes for r in deltas if r.pause_bytes is not None]
    if not moved or full.pause_bytes is None:
        return "—"
    return (
        f"deltas median {statistics.median(moved) / 1e6:.2f} MB "
        f"({100 * statistics.median(moved) / full.pause_bytes:.1f}% of the full's {full.pause_bytes / 1e6:.1f} MB)"
    )


def _check(rec: StepRecord) -> None:
    if rec.state != "HOT_LOAD_STATE_COMPLETED" or rec.ready != rec.replicas:
        raise StackError(f"hot-load of {rec.identity} ended {rec.state} with {rec.ready}/{rec.replicas} replicas READY")


def _mean(values) -> float:
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if vals else 0.0


_TOKENIZERS: dict[Path, Any] = {}


def _decode(ids: list[int], model_dir: Path) -> str:
    tok = _TOKENIZERS.get(model_dir)
    if tok is None:
        tok = _TOKENIZERS[model_dir] = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return tok.decode(ids, skip_special_tokens=False)

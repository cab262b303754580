"""`ParallelConfig`: how many worker processes a multi-rank engine runs, and how they split the
model: DEP (attention data parallel on every rank, experts over `ep` ranks, projections over `tp`
subgroups, ranks stepping in lockstep), optionally with decode context parallelism (`dcp`
consecutive ranks running the same requests, each holding 1/dcp of every request's MLA rows),
or TEP (plain tensor parallelism of attention and experts over every rank: every rank runs
every request), or DWDP prefill ranks (every rank runs its own batches independently, routed
expert weights stored split over `dwdp` ranks and fetched as needed); and which host tier (L2)
the ranks use: each its own, or one Mooncake store they share. See docs/parallel.md and
docs/guide.md.

    LLM("tiny", parallel=ParallelConfig(world_size=4, tp=2))   # 4 workers, DEP 4, TP pairs
    LLM("tiny", parallel=ParallelConfig(world_size=4, dcp=2))  # 2 DCP pairs, DEP 4
    LLM("tiny", parallel=ParallelConfig(world_size=4, tep=4))  # TEP over the 4 workers
    LLM("tiny", parallel=ParallelConfig(world_size=2, dwdp=2, l2="mooncake"))  # DWDP, shared L2

Validated when built (`ParallelError` naming the numbers), and against the model's heads and
experts (`check_model`) and the machine (`check_environment`) before any worker process starts.
"""

from __future__ import annotations

import math
import socket
from pathlib import Path

import attrs

from tokenspeed.model import PRESETS, ModelConfig, from_hf_config, get_preset
from tokenspeed.parallel import ParallelDims, ParallelError

__all__ = ["L2_BACKENDS", "ParallelConfig", "ParallelError", "model_config_of"]

# "local": every rank its own in-process host tier (EngineConfig.l2 decides, as for one engine);
# "mooncake": one Mooncake store every rank reads and writes (a later turn placed on another rank
# than its earlier turns still finds their prefix).
L2_BACKENDS = ("local", "mooncake")


def _count(instance, attribute, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ParallelError(f"ParallelConfig.{attribute.name} must be an int >= 1, got {value!r}")


def _optional_count(instance, attribute, value) -> None:
    if value is not None:
        _count(instance, attribute, value)


def _seconds(instance, attribute, value) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise ParallelError(
            f"ParallelConfig.{attribute.name} must be a positive number of seconds, got {value!r}"
        )


def _optional_address(instance, attribute, value) -> None:
    if value is None:
        return
    host, _, port = str(value).rpartition(":") if isinstance(value, str) else ("", "", "")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ParallelError(f"ParallelConfig.{attribute.name} must be 'host:port', got {value!r}")


def _optional_backend(instance, attribute, value) -> None:
    if value is not None and value not in L2_BACKENDS:
        raise ParallelError(
            f"ParallelConfig.{attribute.name} must be one of {list(L2_BACKENDS)} or None, "
            f"got {value!r}"
        )


def _bytes(instance, attribute, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1 << 20:
        raise ParallelError(
            f"ParallelConfig.{attribute.name} must be an int of at least 1 MiB, got {value!r}"
        )


@attrs.frozen(kw_only=True)
class ParallelConfig:
    """world_size: worker processes, one rank each (one GPU each on CUDA; gloo on the CPU).
    tp: TP subgroup size (projections and shared experts column parallel over `tp` consecutive
        ranks; attention and its cache stay data parallel). 1: none.
    ep: expert-parallel size of the routed experts (None: world_size, DEP over every rank;
        1 with dwdp).
    dcp: decode context parallelism: groups of `dcp` consecutive ranks each serve one share of
        the requests (the front end places a request on a group: every member runs it, the same
        tokens at the same steps), every member holding 1/dcp of each request's MLA latent rows
        (position p on member p % dcp) and merging the members' partial attention exactly;
        weights, KDA state and outputs are replicated in the group. The cache's pages stay
        EngineConfig.page_size tokens (which dcp must divide) with page_size / dcp MLA rows on
        each member, so one cache budget holds dcp times the tokens. Attention data parallel
        over world_size / dcp groups; combines with ep and tp (DEP), not with dwdp, and not
        with a shared l2="mooncake" (members' hits must agree, and a shared store evicts each
        member's objects on its own). 1: none.
    tep: plain tensor parallelism (TEP, `tokenspeed.parallel.apply_tp`) over every rank: each
        rank holds 1/tep of the attention heads and of every expert's intermediate columns
        (two all-reduces per layer), and every rank runs every request (one replica group
        spanning the world, placed and kept in step as a DCP group is). tep must equal
        world_size (attention data parallel over TEP groups is not offered: DEP is the
        data-parallel layout); it does not combine with tp, ep > 1, dcp or dwdp, nor with a
        shared l2="mooncake" (a rank's KDA checkpoints hold its heads only). A rank's cache
        holds its heads' KDA state (1/tep of each layer's conv and recurrent state) and whole
        MLA latent rows (per token, shared by every head). 1: none.
    dwdp: DWDP prefill ranks instead of DEP (None: DEP): the routed experts are stored split over
        groups of `dwdp` consecutive ranks and each rank fetches the others' blocks as it runs;
        every rank runs its own batches with no per-layer synchronisation (no lockstep, no empty
        forwards). Refused with ep > 1 and with tp > 1 (TP subgroups gather every layer).
    l2: the host tier: "local" (each rank its own; EngineConfig.l2 decides), "mooncake" (one
        Mooncake store shared by every rank: the engine starts a master and a segment owner on
        loopback free ports and stops them on close, or joins `l2_master`), None: "mooncake"
        when l2_master is given, else "local".
    l2_master: "host:port" of a running Mooncake master to join (its segment owners hold the
        data); None: with l2="mooncake", the engine starts its own.
    l2_segment_bytes: memory of the segment owner the engine starts (the shared tier's size).
    l2_buffer_bytes: every rank's registered Mooncake staging buffer (holds one object).
    l2_namespace: prefix of every object name in the store (deployments sharing a master).
    timeout_s: deadline of every collective (a rank that stops answering makes its peers fail
        instead of waiting forever).
    start_timeout_s: deadline for every worker to build its model and engine.
    stop_grace_s: how long a stopping worker may take to exit before it is killed.
    """

    world_size: int = attrs.field(validator=_count)
    tp: int = attrs.field(default=1, validator=_count)
    ep: int | None = attrs.field(default=None, validator=_optional_count)
    dcp: int = attrs.field(default=1, validator=_count)
    tep: int = attrs.field(default=1, validator=_count)
    timeout_s: float = attrs.field(default=60.0, validator=_seconds)
    start_timeout_s: float = attrs.field(default=120.0, validator=_seconds)
    stop_grace_s: float = attrs.field(default=5.0, validator=_seconds)
    dwdp: int | None = attrs.field(default=None, validator=_optional_count)
    l2: str | None = attrs.field(default=None, validator=_optional_backend)
    l2_master: str | None = attrs.field(default=None, validator=_optional_address)
    l2_segment_bytes: int = attrs.field(default=256 << 20, validator=_bytes)
    l2_buffer_bytes: int = attrs.field(default=64 << 20, validator=_bytes)
    l2_namespace: str = "tokenspeed"

    def __attrs_post_init__(self) -> None:
        if self.tep > 1:
            self._check_tep()
        if self.dwdp is not None:
            if self.ep is not None and self.ep > 1:
                raise ParallelError(
                    f"ParallelConfig.dwdp={self.dwdp} runs every expert on every rank (prefill) "
                    f"and ep={self.ep} dispatches tokens to the experts' ranks (DEP): give one"
                )
            if self.tp > 1:
                raise ParallelError(
                    f"ParallelConfig.dwdp={self.dwdp} ranks run independently, and tp={self.tp} "
                    "subgroups gather tokens at every layer: DWDP takes tp=1"
                )
        if self.dcp > 1:
            self._check_dcp()
        if self.l2 == "local" and self.l2_master is not None:
            raise ParallelError(
                f"ParallelConfig.l2_master={self.l2_master!r} is a shared Mooncake tier, but "
                "l2='local' keeps a tier per rank: give l2='mooncake' (or leave l2 out)"
            )
        self.dims()  # the degrees against each other (ParallelDims names the numbers)

    def _check_dcp(self) -> None:
        if self.dwdp is not None:
            raise ParallelError(
                f"ParallelConfig.dcp={self.dcp} members run the same tokens in lockstep, and "
                f"dwdp={self.dwdp} ranks run independently: DCP takes DEP ranks (leave dwdp out)"
            )
        if self.l2_backend == "mooncake":
            raise ParallelError(
                f"ParallelConfig.dcp={self.dcp} members must see the same prefix hits, but a "
                "shared Mooncake tier evicts each member's objects on its own: use l2='local' "
                "(each member its own tier, which holds its share of the rows)"
            )

    def _check_tep(self) -> None:
        tep = self.tep
        if tep != self.world_size:
            raise ParallelError(
                f"ParallelConfig.tep={tep} must equal world_size={self.world_size}: TEP runs "
                "every request on every rank of one group spanning the world (attention data "
                "parallel over several TEP groups is not offered; DEP, ep / tp / dcp, is the "
                "data-parallel layout)"
            )
        others = [f"{k}={v}" for k, v in (("tp", self.tp), ("dcp", self.dcp)) if v > 1]
        if self.ep is not None and self.ep > 1:
            others.append(f"ep={self.ep}")
        if others:
            raise ParallelError(
                f"ParallelConfig.tep={tep} shards attention by heads and every expert by "
                f"intermediate columns over all {self.world_size} ranks; it does not combine "
                f"with {', '.join(others)} (those split data-parallel attention's work: DEP)"
            )
        if self.dwdp is not None:
            raise ParallelError(
                f"ParallelConfig.tep={tep} ranks run the same tokens in lockstep, and "
                f"dwdp={self.dwdp} ranks run independently, whole experts stored split: give one"
            )
        if self.l2_backend == "mooncake":
            raise ParallelError(
                f"ParallelConfig.tep={tep}: a rank's KDA checkpoints hold only its 1/{tep} of "
                "the heads, and its ranks must see the same prefix hits, but a shared Mooncake "
                "tier would name every rank's share alike and evict each on its own: use "
                "l2='local' (each rank its own tier, holding its share)"
            )

    @property
    def replicas(self) -> int:
        """Ranks of a replica group: consecutive ranks that run the same requests (a DCP group,
        or the TEP group spanning the world); 1 when every rank runs its own."""
        return max(self.dcp, self.tep)

    @property
    def attention_dp(self) -> int:
        """Groups that run attention on their own requests (each with its own cache): every
        rank, every DCP group of `dcp` ranks, or the one TEP group."""
        return self.world_size // self.replicas

    def replica_ranks(self, rank: int) -> tuple[int, ...]:
        """The ranks of `rank`'s replica group (DCP or TEP: consecutive, the first its leader,
        whose outputs the front end takes); (rank,) when every rank runs its own requests."""
        size = self.replicas
        start = rank // size * size
        return tuple(range(start, start + size))

    def dcp_ranks(self, rank: int) -> tuple[int, ...]:
        """The ranks of `rank`'s DCP group (consecutive; the first is its leader, whose outputs
        the front end takes); (rank,) without DCP."""
        start = rank // self.dcp * self.dcp
        return tuple(range(start, start + self.dcp))

    @property
    def independent(self) -> bool:
        """Whether the ranks step independently (DWDP) rather than in lockstep (DEP)."""
        return self.dwdp is not None

    @property
    def expert_parallel(self) -> int:
        if self.dwdp is not None or self.tep > 1:
            return 1 if self.ep is None else self.ep
        return self.world_size if self.ep is None else self.ep

    @property
    def l2_backend(self) -> str:
        """The host tier: "local" or "mooncake" (l2, or what l2=None means)."""
        if self.l2 is not None:
            return self.l2
        return "mooncake" if self.l2_master is not None else "local"

    @property
    def starts_l2(self) -> bool:
        """Whether the engine starts (and stops) the Mooncake master and segment owner."""
        return self.l2_backend == "mooncake" and self.l2_master is None

    def dims(self) -> ParallelDims:
        """The layout of the ranks (validated)."""
        try:
            return ParallelDims(
                world_size=self.world_size,
                tp=self.tp,
                ep=self.expert_parallel,
                dcp=self.dcp,
                tep=self.tep,
                dwdp=self.dwdp or 1,
            )
        except ParallelError as exc:
            raise ParallelError(str(exc).replace("ParallelDims.", "ParallelConfig.")) from None

    def check_environment(self, connect_timeout_s: float = 2.0) -> None:
        """Refuse a shared L2 this machine cannot run (Mooncake missing: the reason), or a
        given master nobody answers at. Starts nothing."""
        if self.l2_backend != "mooncake":
            return
        from tokenspeed.cache.l2.mooncake_services import environment_ready

        reason = environment_ready()
        if reason is not None:
            raise ParallelError(f"ParallelConfig.l2='mooncake' cannot run here: {reason}")
        if self.l2_master is not None:
            host, _, port = self.l2_master.rpartition(":")
            try:
                with socket.create_connection((host, int(port)), timeout=connect_timeout_s):
                    pass
            except OSError as exc:
                raise ParallelError(
                    f"ParallelConfig.l2_master={self.l2_master!r}: no Mooncake master answers "
                    f"there ({exc})"
                ) from None

    def check_model(self, config: ModelConfig) -> None:
        """Refuse degrees the model cannot be split by (its heads, hidden size, experts, with
        TEP the expert and dense MLP intermediate widths; DCP splits the MLA cache, so the
        model needs MLA layers)."""
        self.dims().check_model(config)
        if self.dcp > 1 and not config.mla_layers:
            raise ParallelError(
                f"ParallelConfig.dcp={self.dcp} splits the MLA latent cache, but model "
                f"{config.name} has no MLA layers"
            )

    def rank_model_config(self, config: ModelConfig) -> ModelConfig:
        """The configuration a rank's model has once split (what its cache is sized from):
        with TEP its local heads and intermediate widths (`tokenspeed.parallel.tp`), else
        `config` (DEP and DCP keep every head; DCP's MLA share is the cache's `mla_share`)."""
        if self.tep == 1:
            return config
        from tokenspeed.parallel.tp import local_config

        return local_config(config, self.tep)

    def check_engine(self, config) -> None:
        """Refuse an `EngineConfig` the layout cannot run: with DCP, pages whose tokens do not
        split evenly over the members (each keeps page_size / dcp MLA rows of every page)."""
        if config.page_size % self.dcp:
            raise ParallelError(
                f"ParallelConfig.dcp={self.dcp} gives each member page_size / {self.dcp} MLA "
                f"rows of every page, but EngineConfig.page_size={config.page_size} is not a "
                f"multiple of {self.dcp}"
            )


def model_config_of(model: str | Path) -> ModelConfig:
    """The configuration of a preset (by name) or of a checkpoint directory (its config.json),
    read without building the model."""
    if isinstance(model, str) and model in PRESETS:
        return get_preset(model)
    path = Path(model)
    if not path.is_dir():
        raise ValueError(f"model {model!r} is neither a preset {sorted(PRESETS)} nor a directory")
    return from_hf_config(path)

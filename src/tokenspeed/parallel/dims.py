"""`ParallelDims`: the degrees of every parallel strategy of one deployment, validated.

Ranks are laid out so that every group is a run of consecutive ranks: rank r belongs to the
`tp` subgroup `r // tp`, the expert-parallel group `r // ep`, and so on. Attention runs data
parallel over every rank unless plain tensor parallelism (`tep`) shards it; each rank then keeps
its own requests and its own cache.
"""

from __future__ import annotations

import attrs

# The strategies a `ParallelDims` sizes, in the order `ParallelGroups` builds their groups.
KINDS = ("tp", "ep", "tep", "dcp", "dwdp")


class ParallelError(ValueError):
    """A parallel layout that cannot work; the message names the numbers."""


def _degree(instance, attribute, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ParallelError(f"ParallelDims.{attribute.name} must be an int >= 1, got {value!r}")


@attrs.frozen(kw_only=True)
class ParallelDims:
    """How `world_size` ranks share one model.

    tp: TP subgroup size for the selected projections and the shared experts (attention and its
        cache stay data parallel: tokens are gathered in the group, the GEMM is column parallel,
        and an all-to-all returns every rank the complete outputs of its own tokens).
    ep: expert-parallel size of the routed experts (DEP: attention data parallel, experts split
        over `ep` ranks, tokens dispatched to the ranks holding their experts).
    tep: plain tensor parallelism of attention and experts (the two-all-reduce baseline); every
        rank of a group sees every token of the group.
    dcp: decode context parallelism: one request's MLA cache split over `dcp` ranks.
    dwdp: prefill with expert weights stored split over `dwdp` ranks and fetched ahead.
    """

    world_size: int = attrs.field(validator=_degree)
    tp: int = attrs.field(default=1, validator=_degree)
    ep: int = attrs.field(default=1, validator=_degree)
    tep: int = attrs.field(default=1, validator=_degree)
    dcp: int = attrs.field(default=1, validator=_degree)
    dwdp: int = attrs.field(default=1, validator=_degree)

    def __attrs_post_init__(self) -> None:
        for kind in KINDS:
            degree = getattr(self, kind)
            if self.world_size % degree:
                raise ParallelError(
                    f"ParallelDims.{kind}={degree} does not divide world_size={self.world_size}"
                )
        if self.tep > 1 and (self.tp > 1 or self.ep > 1 or self.dcp > 1):
            raise ParallelError(
                f"tep={self.tep} shards attention and experts by heads and columns; it does not "
                f"combine with tp={self.tp}, ep={self.ep} or dcp={self.dcp} (use tp + ep for "
                "attention data parallelism with sharded projections and experts)"
            )
        if self.tep > 1 and self.dwdp > 1:
            raise ParallelError(
                f"tep={self.tep} shards every expert by intermediate columns and dwdp={self.dwdp} "
                "stores whole experts split over ranks: one model takes one of them"
            )
        if self.dwdp > 1 and self.ep > 1:
            raise ParallelError(
                f"dwdp={self.dwdp} runs every expert on every rank (prefill) and ep={self.ep} "
                "dispatches tokens to the experts' ranks (decode): one model takes one of them"
            )

    @property
    def attention_dp(self) -> int:
        """Ranks that run attention on their own requests (each with its own cache)."""
        return self.world_size // self.tep

    def group_of(self, kind: str, rank: int) -> tuple[int, ...]:
        """The ranks of `rank`'s group of `kind` (consecutive ranks)."""
        degree = getattr(self, kind)
        start = rank // degree * degree
        return tuple(range(start, start + degree))

    def check_model(self, config) -> None:
        """Refuse degrees the model cannot be split by (a `tokenspeed.model.ModelConfig`)."""
        kda, mla, moe = config.kda, config.mla, config.moe
        for kind in ("tp", "tep"):
            degree = getattr(self, kind)
            if degree == 1:
                continue
            for what, count in (
                ("KDA heads", kda.num_heads if config.kda_layers else degree),
                ("MLA heads", mla.num_heads if config.mla_layers else degree),
                ("hidden size", config.hidden_size),
            ):
                if count % degree:
                    raise ParallelError(f"{kind}={degree} does not divide the {what} ({count})")
        if moe is not None:
            if moe.num_experts % self.ep:
                raise ParallelError(
                    f"ep={self.ep} does not divide the routed experts ({moe.num_experts})"
                )
            if moe.num_experts % self.dwdp:
                raise ParallelError(
                    f"dwdp={self.dwdp} does not divide the routed experts ({moe.num_experts})"
                )
            if moe.expert_intermediate_size % self.tep:
                raise ParallelError(
                    f"tep={self.tep} does not divide the expert intermediate size "
                    f"({moe.expert_intermediate_size})"
                )
        dense = "dense" in config.mlp_kinds
        if dense and config.dense_intermediate_size % self.tep:
            raise ParallelError(
                f"tep={self.tep} does not divide the dense MLP's intermediate size "
                f"({config.dense_intermediate_size})"
            )

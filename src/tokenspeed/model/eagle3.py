"""The EAGLE3 drafter: one Llama-style decoder layer over the target's hidden states.

EAGLE3 (as SGLang's `LlamaForCausalLMEagle3` and vLLM's `Eagle3LlamaForCausalLM` run it) drafts
tokens for a target model from three of the target's hidden states (a low, a middle and a high
capture point, `AuxCapture` in `kimi.py`), concatenated [T, 3 * Ht]:

    h      = fc(aux)                                    3 * Ht -> H, no bias (first step only)
    x      = cat(input_layernorm(embed(token)), hidden_norm(h))              [T, 2H]
    r      = h + o_proj(attention(q_proj(x), k_proj(x), v_proj(x)))          rotary, GQA
    out    = r + down_proj(silu(gate_proj(y)) * up_proj(y)),  y = post_attention_layernorm(r)
    logits = lm_head(norm(out))                                              [T, draft_vocab]

`out` (before the final norm) is the next drafting step's `h` (steps 2..k run without `fc`). The
head scores a reduced draft vocabulary; draft id d is target id d + d2t[d], and t2d [vocab]
marks the target ids the draft vocabulary holds. A drafter whose checkpoint has no
`embed_tokens` shares the target's embedding.

Alignment. The drafter row at position p reads the token at p + 1 and the target's hidden state
at p (the state that predicted that token): after the target's prefill of x_0..x_{L-1} (sampling
x_L) the drafter extends over ids x_1..x_L with hidden states h_0..h_{L-1} at positions
0..L-1, and its logits at the last row predict x_{L+1}. Its own KV then holds as many rows as
the target's state has tokens; a drafting chain writes k - 1 rows beyond that, which the next
round's extend overwrites (rows are addressed by position: nothing to roll back).

The drafter's KV (`PagedDraftKv`) is one attention layer's keys and values in a page pool, laid
out like the MLA pages (`PagedMla`): the engine can give it the same page ids and page table as
the target's MLA rows. The attention here is the torch reference (CPU first); a paged GPU
kernel goes where `_attend` is marked.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch
from attrs import field, frozen
from torch import nn

from .batch import BatchError, ForwardBatch
from .config import ActivationConfig, ConfigError
from .layers.mlp import GluMlp
from .layers.norm import RMSNorm

ROPE_TYPES = ("default", "linear", "llama3")


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE3's default capture points for a target of `num_layers` layers: the inputs of layers
    2, num_layers // 2 and num_layers - 3 (SGLang's and vLLM's default)."""
    if num_layers < 4:
        raise ConfigError(
            f"EAGLE3's default capture points need >= 4 target layers, got {num_layers}"
        )
    return (2, num_layers // 2, num_layers - 3)


def _positive(instance, attribute, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(
            f"Eagle3Config.{attribute.name} must be a positive integer, got {value!r}"
        )


def _positive_float(instance, attribute, value) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise ConfigError(
            f"Eagle3Config.{attribute.name} must be a finite positive number, got {value!r}"
        )


@frozen(kw_only=True)
class RopeScaling:
    """Rotary frequency scaling: "linear" divides every frequency by `factor`; "llama3" is Llama
    3.1's (`low_freq_factor`, `high_freq_factor`, `original_max_position_embeddings`)."""

    rope_type: str = field(validator=attrs.validators.in_(("linear", "llama3")))
    factor: float = field(validator=_positive_float)
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __attrs_post_init__(self) -> None:
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise ConfigError(
                "rope_scaling (llama3) needs high_freq_factor > low_freq_factor > 0, got "
                f"{self.high_freq_factor} and {self.low_freq_factor}"
            )


def _rope_scaling(instance, attribute, value) -> None:
    if value is not None and not isinstance(value, RopeScaling):
        raise ConfigError(f"Eagle3Config.rope_scaling must be a RopeScaling or None, got {value!r}")


def _bool(instance, attribute, value) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"Eagle3Config.{attribute.name} must be True or False, got {value!r}")


@frozen(kw_only=True)
class Eagle3Config:
    """One EAGLE3 drafter.

    vocab_size: the target's vocabulary (embedding rows, t2d's length); draft_vocab_size: the
    head's. target_hidden_size: the width of each captured target state (fc reads
    num_aux * target_hidden_size). aux_layer_ids: the checkpoint's
    `eagle_aux_hidden_state_layer_ids`, in its convention (the *output* of layer j, SGLang's
    reading: capture point j + 1); None: EAGLE3's defaults (`default_aux_layers`).
    norm_before_residual: the residual after fc is hidden_norm(h) rather than h (some drafters).
    """

    hidden_size: int = field(validator=_positive)
    intermediate_size: int = field(validator=_positive)
    num_heads: int = field(validator=_positive)
    num_kv_heads: int = field(validator=_positive)
    head_dim: int = field(validator=_positive)
    vocab_size: int = field(validator=_positive)
    draft_vocab_size: int = field(validator=_positive)
    target_hidden_size: int = field(validator=_positive)
    rms_norm_eps: float = field(default=1e-5, validator=_positive_float)
    rope_theta: float = field(default=10000.0, validator=_positive_float)
    rope_scaling: RopeScaling | None = field(default=None, validator=_rope_scaling)
    max_position_embeddings: int = field(default=1 << 20, validator=_positive)
    aux_layer_ids: tuple[int, ...] | None = field(
        default=None, converter=lambda v: None if v is None else tuple(v)
    )
    norm_before_residual: bool = field(default=False, validator=_bool)

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.draft_vocab_size > self.vocab_size:
            raise ConfigError(
                f"draft_vocab_size ({self.draft_vocab_size}) exceeds vocab_size ({self.vocab_size})"
            )
        if self.aux_layer_ids is not None:
            ids = self.aux_layer_ids
            if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise ConfigError(
                    f"eagle_aux_hidden_state_layer_ids must be a non-empty list of layer ids, "
                    f"got {list(ids)!r}"
                )
            if min(ids) < 0 or len(set(ids)) != len(ids):
                raise ConfigError(
                    f"eagle_aux_hidden_state_layer_ids must be distinct and >= 0, got {list(ids)}"
                )

    @property
    def num_aux(self) -> int:
        """How many target states fc fuses (3 unless the config lists other layers)."""
        return 3 if self.aux_layer_ids is None else len(self.aux_layer_ids)

    def capture_points(self, num_target_layers: int) -> tuple[int, ...]:
        """The target's `aux_hidden_layers` (`AuxCapture` points) for this drafter: its layer
        ids + 1 (their outputs are the next layers' inputs), else EAGLE3's defaults."""
        if self.aux_layer_ids is None:
            return default_aux_layers(num_target_layers)
        points = tuple(i + 1 for i in self.aux_layer_ids)
        if max(points) > num_target_layers:
            raise ConfigError(
                f"eagle_aux_hidden_state_layer_ids {list(self.aux_layer_ids)} name layers past the "
                f"target's {num_target_layers}"
            )
        return points

    def evolve(self, **changes) -> Eagle3Config:
        return attrs.evolve(self, **changes)


@attrs.define(eq=False)
class PagedDraftKv:
    """The drafter's keys and values (its one attention layer) in a page pool, written in place.

    k, v: [NP, P, Hkv, Dh] (model dtype); page_table: [B, MP] int, the pages of each request in
    order (padding rows and unused entries may point at a sink page). The row of position t of
    request i is row t % P of page page_table[i, t // P] (the MLA pages' layout).
    """

    k: torch.Tensor
    v: torch.Tensor
    page_table: torch.Tensor

    @classmethod
    def pool(
        cls,
        config: Eagle3Config,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """An empty (k, v) pool of `num_pages` pages of `page_size` rows."""
        shape = (num_pages, page_size, config.num_kv_heads, config.head_dim)
        return (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )

    @classmethod
    def contiguous(
        cls,
        config: Eagle3Config,
        batch_size: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> PagedDraftKv:
        """A simple per-request cache: one page of `max_len` rows for each of `batch_size`
        requests (request i owns page i)."""
        k, v = cls.pool(config, batch_size, max_len, dtype, device)
        table = torch.arange(batch_size, dtype=torch.int64, device=device).unsqueeze(1)
        return cls(k, v, table)

    def select(self, rows: Sequence[int] | torch.Tensor) -> PagedDraftKv:
        """The same pool seen by a batch of some of the requests (their page-table rows)."""
        index = torch.as_tensor(rows, dtype=torch.int64, device=self.page_table.device)
        return PagedDraftKv(self.k, self.v, self.page_table[index])


@attrs.frozen(eq=False)
class DraftOutput:
    """logits: [N, draft_vocab] for the selected rows (all T by default); hidden: [T, H] every
    row's output before the final norm (the next drafting step's input hidden state)."""

    logits: torch.Tensor
    hidden: torch.Tensor


@attrs.frozen(eq=False)
class Proposal:
    """One drafting round for B requests: tokens [B, k] target ids; probs [B, k, draft_vocab]
    fp32 the distributions they were drawn from (a greedy row's: a point mass at its token),
    or None when every row drafted greedily (all point masses); hidden [B, H] the last step's
    output hidden state. `Eagle3Drafter.to_target_probs` maps probs onto the target's ids."""

    tokens: torch.Tensor
    probs: torch.Tensor | None
    hidden: torch.Tensor


def _rope_inv_freq(config: Eagle3Config, device) -> torch.Tensor:
    """[Dh / 2] fp32 rotary frequencies, with the config's scaling (as transformers computes
    them for Llama)."""
    dim = config.head_dim
    inv = 1.0 / (
        config.rope_theta
        ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim)
    )
    scaling = config.rope_scaling
    if scaling is None:
        return inv
    if scaling.rope_type == "linear":
        return inv / scaling.factor
    old = scaling.original_max_position_embeddings
    low_wavelen = old / scaling.low_freq_factor
    high_wavelen = old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (old / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Llama's rotary embedding (rotate-half form) in fp32. x: [T, heads, Dh]; positions: [T];
    inv_freq: [Dh / 2]. Returns x's dtype."""
    freqs = positions.float().unsqueeze(1) * inv_freq.unsqueeze(0)  # [T, Dh / 2]
    emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)  # [T, 1, Dh]
    cos, sin = emb.cos(), emb.sin()
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class Eagle3Attention(nn.Module):
    """Llama attention whose projections read the [T, 2H] concatenation, over `PagedDraftKv`."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        c = config
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq:
            self._inv_freq[device] = _rope_inv_freq(self.config, device)
        return self._inv_freq[device]

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv: PagedDraftKv) -> torch.Tensor:
        """x: [T, 2H] -> [T, H]; writes this step's keys and values into `kv` first."""
        c = self.config
        tokens = x.shape[0]
        inv_freq = self.inv_freq(x.device)
        q = apply_rotary(
            self.q_proj(x).view(tokens, c.num_heads, c.head_dim), batch.positions, inv_freq
        )
        k = apply_rotary(
            self.k_proj(x).view(tokens, c.num_kv_heads, c.head_dim), batch.positions, inv_freq
        )
        v = self.v_proj(x).view(tokens, c.num_kv_heads, c.head_dim)
        page_size = kv.k.shape[1]
        page = kv.page_table[batch.token_request, batch.positions // page_size].long()
        row = page * page_size + batch.positions % page_size
        kv.k.view(-1, c.num_kv_heads, c.head_dim).index_copy_(0, row, k.to(kv.k.dtype))
        kv.v.view(-1, c.num_kv_heads, c.head_dim).index_copy_(0, row, v.to(kv.v.dtype))
        o = self._attend(q, batch, kv)
        return self.o_proj(o.reshape(tokens, c.num_heads * c.head_dim).to(x.dtype))

    def _attend(self, q: torch.Tensor, batch: ForwardBatch, kv: PagedDraftKv) -> torch.Tensor:
        """Causal attention of the step's queries over each request's rows [0, total_len).

        Torch reference, request by request, fp32 softmax. GPU: a paged attention kernel
        (decode: one query row per request; extend: a few) goes here, picked by
        `ops/dispatch.py` like the MLA kernels; the page layout is already the one they read.
        """
        c = self.config
        group = c.num_heads // c.num_kv_heads
        page_size = kv.k.shape[1]
        out = q.new_empty(q.shape, dtype=torch.float32)
        scale = c.head_dim**-0.5
        totals = batch.total_lens
        for i, seg in batch.segments():
            total = totals[i]
            pages = kv.page_table[i, : -(-total // page_size)].long()
            keys = kv.k[pages].reshape(-1, c.num_kv_heads, c.head_dim)[:total].float()
            values = kv.v[pages].reshape(-1, c.num_kv_heads, c.head_dim)[:total].float()
            keys = keys.repeat_interleave(group, dim=1)  # [L, H, Dh]: head h reads kv head h // g
            values = values.repeat_interleave(group, dim=1)
            query = q[seg].float()  # [n, H, Dh]
            scores = torch.einsum("nhd,lhd->hnl", query, keys) * scale
            key_pos = torch.arange(total, device=q.device)
            mask = key_pos.unsqueeze(0) > batch.positions[seg].unsqueeze(1)  # [n, L]
            scores = scores.masked_fill(mask.unsqueeze(0), float("-inf"))
            out[seg] = torch.einsum("hnl,lhd->nhd", scores.softmax(-1), values)
        return out


class Eagle3Layer(nn.Module):
    """The drafter's one decoder layer (`midlayer` in checkpoints)."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Eagle3Attention(config)
        self.mlp = GluMlp(h, config.intermediate_size, ActivationConfig(kind="silu"))
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch, kv: PagedDraftKv
    ) -> torch.Tensor:
        """embeds, hidden: [T, H] -> the layer's output [T, H] (before the final norm)."""
        if self.config.norm_before_residual:
            hidden = self.hidden_norm(hidden)
            residual, normed = hidden, hidden
        else:
            residual, normed = hidden, self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        residual = residual + self.self_attn(x, batch, kv)
        return residual + self.mlp(self.post_attention_layernorm(residual))


class Eagle3Drafter(nn.Module):
    """The EAGLE3 head (module names as in checkpoints: fc, midlayer, norm, lm_head, d2t, t2d,
    embed_tokens).

    embed_tokens: the target's embedding to share (`KimiForCausalLM.model.embed_tokens`); None
    builds the drafter's own. d2t / t2d start as the identity mapping onto the first
    draft_vocab_size target ids; `set_vocab` or a checkpoint sets them.
    """

    def __init__(self, config: Eagle3Config, embed_tokens: nn.Embedding | None = None):
        super().__init__()
        self.config = config
        c = config
        self.shares_embedding = False
        if embed_tokens is None:
            self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        else:
            self.share_embedding(embed_tokens)
        self.fc = nn.Linear(c.num_aux * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[: c.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

    def share_embedding(self, embed_tokens: nn.Embedding) -> None:
        """Use the target's embedding (the module itself: one copy of the weights)."""
        rows, width = embed_tokens.weight.shape
        c = self.config
        if (rows, width) != (c.vocab_size, c.hidden_size):
            raise ConfigError(
                f"the shared embedding is [{rows}, {width}] but the drafter needs "
                f"[{c.vocab_size}, {c.hidden_size}] (vocab_size, hidden_size)"
            )
        self.embed_tokens = embed_tokens
        self.shares_embedding = True

    # -------------------------------------------------------------- vocabulary mapping
    @torch.no_grad()
    def set_vocab(self, target_ids: Sequence[int] | torch.Tensor) -> None:
        """Set d2t and t2d from the target ids of draft ids 0..draft_vocab_size-1 (distinct)."""
        ids = torch.as_tensor(target_ids, dtype=torch.int64, device=self.d2t.device)
        problem = vocab_map_problem(ids, self.config.vocab_size, self.config.draft_vocab_size)
        if problem:
            raise ValueError(problem)
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids (any shape) -> target ids: d + d2t[d]."""
        return draft_ids + self.d2t[draft_ids]

    def target_ids(self) -> torch.Tensor:
        """[draft_vocab] the target id of every draft id."""
        return self.to_target(torch.arange(self.config.draft_vocab_size, device=self.d2t.device))

    def to_target_probs(self, probs: torch.Tensor) -> torch.Tensor:
        """[..., draft_vocab] distributions -> [..., vocab] over the target's ids (0 outside the
        draft vocabulary), as the rejection sampler reads them."""
        out = probs.new_zeros(*probs.shape[:-1], self.config.vocab_size)
        index = self.target_ids().expand(*probs.shape[:-1], -1)
        return out.scatter_(-1, index, probs)

    # ------------------------------------------------------------------- forwards
    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's concatenated capture-point states [T, num_aux * Ht] -> [T, H]."""
        if aux.shape[-1] != self.fc.in_features:
            raise BatchError(
                f"aux hidden states are {aux.shape[-1]} wide but fc reads "
                f"{self.fc.in_features} ({self.config.num_aux} x {self.config.target_hidden_size})"
            )
        return self.fc(aux.to(self.fc.weight.dtype))

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        kv: PagedDraftKv,
        logits_indices: torch.Tensor | None = None,
    ) -> DraftOutput:
        """input_ids: [T] target ids (see the module's alignment); hidden: [T, H] fused target
        states (`fuse`) or the previous step's `DraftOutput.hidden` rows; batch: the layout,
        with prefix_lens the rows each request's drafter KV already holds. Writes the step's
        rows into `kv` (in place)."""
        self._check(input_ids, hidden, batch, kv)
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        out = self.midlayer(embeds, hidden, batch, kv)
        selected = out if logits_indices is None else out[logits_indices]
        return DraftOutput(logits=self.lm_head(self.norm(selected)), hidden=out)

    def _check(self, input_ids, hidden, batch: ForwardBatch, kv: PagedDraftKv) -> None:
        c = self.config
        if input_ids.dim() != 1 or input_ids.numel() != batch.num_tokens:
            raise BatchError(
                f"input_ids has shape {tuple(input_ids.shape)} but the batch has "
                f"{batch.num_tokens} tokens"
            )
        if tuple(hidden.shape) != (batch.num_tokens, c.hidden_size):
            raise BatchError(
                f"hidden has shape {tuple(hidden.shape)} but the batch needs "
                f"({batch.num_tokens}, {c.hidden_size}); fuse target states with fc first"
            )
        if kv.page_table.dim() != 2 or kv.page_table.shape[0] != batch.batch_size:
            raise BatchError(
                f"kv.page_table has shape {tuple(kv.page_table.shape)} but the batch needs one "
                f"row per request: ({batch.batch_size}, pages)"
            )
        if batch.prefix_lens is not None and batch.batch_size:
            capacity = kv.page_table.shape[1] * kv.k.shape[1]
            longest = max(batch.total_lens)
            if capacity < longest:
                raise BatchError(
                    f"kv.page_table holds {capacity} rows per request but a request reaches "
                    f"{longest} after the step"
                )

    def extend(
        self,
        input_ids: torch.Tensor,
        aux: torch.Tensor,
        batch: ForwardBatch,
        kv: PagedDraftKv,
        logits_indices: torch.Tensor | None = None,
    ) -> DraftOutput:
        """`forward` from the target's capture-point states [T, num_aux * Ht] (after a target
        prefill chunk or a verify step: the rows of the accepted tokens)."""
        return self(input_ids, self.fuse(aux), batch, kv, logits_indices)

    @torch.no_grad()
    def propose(
        self,
        input_ids: torch.Tensor,
        aux: torch.Tensor,
        batch: ForwardBatch,
        kv: PagedDraftKv,
        num_steps: int,
        temperatures: Sequence[float] | None = None,
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> Proposal:
        """One drafting round: the extend over each request's new rows (`extend`), whose last
        row gives draft token 1, then num_steps - 1 single-row steps at the next positions
        (their input hidden: the previous step's output). kv must have room for
        batch.total_lens[i] + num_steps - 1 rows.

        temperatures: per request (None, or <= 0: greedy, the argmax); a sampled row draws
        from softmax(logits / t) with generators[i] (None: torch's default generator)."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        size = batch.batch_size
        temps = [0.0] * size if temperatures is None else [float(t) for t in temperatures]
        if len(temps) != size:
            raise ValueError(f"{len(temps)} temperatures for {size} requests")
        gens = [None] * size if generators is None else list(generators)
        sampled = any(t > 0 for t in temps)
        out = self.extend(input_ids, aux, batch, kv, batch.last_token_indices)
        hidden = out.hidden[batch.last_token_indices]
        tokens, probs = [], []
        totals = batch.total_lens
        for step in range(num_steps):
            if step:
                ids = tokens[-1]
                step_batch = ForwardBatch.build(
                    [1] * size, [t + step - 1 for t in totals], device=input_ids.device
                )
                out = self(ids, hidden, step_batch, kv)
                hidden = out.hidden
            draft, dist = _draw(out.logits.float(), temps, gens, sampled)
            tokens.append(self.to_target(draft))
            if dist is not None:
                probs.append(dist)
        return Proposal(
            tokens=torch.stack(tokens, dim=1),
            probs=torch.stack(probs, dim=1) if sampled else None,
            hidden=hidden,
        )


def _draw(
    logits: torch.Tensor,
    temps: list[float],
    gens: list[torch.Generator | None],
    sampled: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft ids [B] (argmax, or drawn at the row's temperature) and, when any row samples,
    the distributions [B, Vd] they came from (a greedy row's: a point mass at its argmax)."""
    tokens = logits.argmax(-1)
    if not sampled:
        return tokens, None
    scale = torch.tensor([t if t > 0 else 1.0 for t in temps], device=logits.device)
    probs = (logits / scale.unsqueeze(1)).softmax(-1)
    for i, t in enumerate(temps):
        if t > 0:
            tokens[i] = torch.multinomial(probs[i], 1, generator=gens[i])[0]
        else:
            probs[i] = 0.0
            probs[i, tokens[i]] = 1.0
    return tokens, probs


def vocab_map_problem(target_ids: torch.Tensor, vocab_size: int, draft_vocab_size: int) -> str:
    """Why `target_ids` (the target id of each draft id) cannot be a draft vocabulary, or ""."""
    if tuple(target_ids.shape) != (draft_vocab_size,):
        return f"the draft vocabulary maps {target_ids.numel()} ids, expected {draft_vocab_size}"
    if target_ids.numel() == 0:
        return ""
    low, high = int(target_ids.min()), int(target_ids.max())
    if low < 0 or high >= vocab_size:
        return f"d2t maps draft ids to target ids in [{low}, {high}], outside [0, {vocab_size})"
    if torch.unique(target_ids).numel() != target_ids.numel():
        return "d2t maps two draft ids to one target id"
    return ""

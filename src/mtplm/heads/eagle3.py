"""EAGLE-3 (`head_form=eagle3`): one Llama-style decoder layer that drafts from the target's inner features.

At row t of the text the drafter reads the target's features f_t (the residual stream entering three of its
decoder layers, low / middle / high: `feature_layers`, concatenated) and the embedding of token t+1:

    g      = fc(f_t)                                          3D -> D
    x      = [input_layernorm(emb(x_{t+1})) ; hidden_norm(g)]  2D: q, k and v read both halves
    y      = g + o_proj(attention(x))                         causal over the rows before it
    out    = y + mlp(post_attention_layernorm(y))             the layer's output, before the final norm
    logits = lm_head(norm(out))                               over the draft vocabulary (N tokens)

and predicts token t+2. Drafting step j >= 1 replaces g by the drafter's own `out` of step j-1 and the token
by step j-1's draft, one position further on; its query sees the committed rows' keys and the keys of its own
chain's earlier steps. Training unrolls exactly that ("training-time test", `unroll`): step j at row t attends
to step 0's keys at rows <= t and to its chain's keys (steps 1..j at row t). In decoding each sequence keeps
the keys of its committed rows in its own small cache (`Eagle3Sequence`); a chain's keys sit past them and are
overwritten by the next pass.

Parameter names are speculators' (Eagle3Speculator: fc, layers.0.*, norm, lm_head), so export.py writes the
state dict as it is. The draft vocabulary: d2t[i] is an offset (target id = i + d2t[i]), t2d a mask over the
target vocabulary; both are buffers. The LM head starts as the target's rows for the draft vocabulary and,
as in speculators, stays frozen; the target's token embedding is shared (not part of the drafter).

Shapes: B batch, T rows, R committed rows, D hidden, H query heads, G key/value heads, d head dim,
S key positions, N draft vocabulary, V target vocabulary.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from mtplm.errors import UserError
from mtplm.heads.forms import RMSNorm
from mtplm.registry import HEAD_FORMS


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's rotary embedding (rotate-half layout) of x [..., R, d] at positions [R]."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)  # [d/2]
    angles = positions.float()[:, None] * inv_freq  # [R, d/2]
    cos, sin = (
        torch.cat([angles, angles], -1).cos().to(x.dtype),
        torch.cat([angles, angles], -1).sin().to(x.dtype),
    )
    first, second = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-second, first], -1) * sin


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    allowed: torch.Tensor,
    own: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """Attention of q [B, H, Q, d] over keys/values [B, G, S, d] where allowed [B, Q, S], plus each query
    row's own extra keys (`own`: per chain step, [B, G, Q, d] each, key i of row r seen by row r only).
    [B, H, Q, d]."""
    repeat = q.shape[1] // keys.shape[1]  # grouped-query attention: G heads serve H
    keys, values = keys.repeat_interleave(repeat, 1), values.repeat_interleave(repeat, 1)
    scale = q.shape[-1] ** -0.5
    scores = (q @ keys.transpose(-1, -2)) * scale  # [B, H, Q, S]
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    extra = [(k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)) for k, v in own or []]
    scores = torch.cat([scores] + [(q * k).sum(-1, keepdim=True) * scale for k, _ in extra], -1)
    weights = F.softmax(scores, -1, dtype=torch.float32).to(q.dtype)  # softmax in fp32, as Llama's eager path
    span = keys.shape[2]
    out = weights[..., :span] @ values
    for i, (_, v) in enumerate(extra):
        out = out + weights[..., span + i : span + i + 1] * v
    return out


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(2 * dim, heads * head_dim, bias=False)  # EAGLE-3: q, k, v read [emb; g]
        self.k_proj = nn.Linear(2 * dim, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * dim, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, dim, bias=False)

    def project(self, x: torch.Tensor, positions: torch.Tensor, theta: float):
        """q [B, H, R, d], k and v [B, G, R, d] of x [B, R, 2D] at positions [R]."""

        def split(t: torch.Tensor, heads: int) -> torch.Tensor:
            return t.view(*t.shape[:2], heads, self.head_dim).transpose(1, 2)

        q = rope(split(self.q_proj(x), self.heads), positions, theta)
        k = rope(split(self.k_proj(x), self.kv_heads), positions, theta)
        return q, k, split(self.v_proj(x), self.kv_heads)


class MLP(nn.Module):
    def __init__(self, dim: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, intermediate, bias=False)
        self.up_proj = nn.Linear(dim, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    """The one decoder layer; speculators' names (layers.0.input_layernorm, .hidden_norm, .self_attn.*,
    ...)."""

    def __init__(
        self, dim: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, eps: float
    ) -> None:
        super().__init__()
        self.input_layernorm, self.hidden_norm = RMSNorm(dim, eps), RMSNorm(dim, eps)
        self.self_attn = Attention(dim, heads, kv_heads, head_dim)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.mlp = MLP(dim, intermediate)

    def qkv(self, g: torch.Tensor, emb: torch.Tensor, positions: torch.Tensor, theta: float):
        """q, k, v of rows whose state is g [B, R, D] and token embedding emb [B, R, D]."""
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(g)], -1)  # [B, R, 2D]: embedding first
        return self.self_attn.project(x, positions, theta)

    def finish(self, g: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The layer's output [B, R, D] from the attention's [B, H, R, d]; the residual is g (raw, not
        normed)."""
        y = g + self.self_attn.o_proj(attended.transpose(1, 2).flatten(2))
        return y + self.mlp(self.post_attention_layernorm(y))


class Eagle3Drafter(nn.Module):
    """fc -> one decoder layer -> norm -> LM head over the draft vocabulary (see the module docstring)."""

    d2t: torch.Tensor  # buffers (registered in __init__)
    t2d: torch.Tensor

    def __init__(
        self,
        k: int,
        dim: int,
        intermediate: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        eps: float,
        rope_theta: float,
        layers: list[int],
        vocab: int,
        draft_vocab: int,
        max_positions: int = 8192,
    ) -> None:
        super().__init__()
        self.k, self.dim, self.theta = k, dim, float(rope_theta)
        self.feature_layers = tuple(int(i) for i in layers)
        self.settings = dict(
            k=k,
            dim=dim,
            intermediate=intermediate,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            eps=float(eps),
            rope_theta=float(rope_theta),
            layers=list(self.feature_layers),
            vocab=vocab,
            draft_vocab=draft_vocab,
            max_positions=max_positions,
        )
        self.fc = nn.Linear(len(self.feature_layers) * dim, dim, bias=False)
        self.layers = nn.ModuleList([Layer(dim, intermediate, heads, kv_heads, head_dim, eps)])
        self.norm = RMSNorm(dim, eps)
        self.lm_head = nn.Linear(dim, draft_vocab, bias=False)
        self.lm_head.weight.requires_grad_(False)  # the target's rows, frozen (speculators does the same)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(vocab, dtype=torch.bool))
        self.set_vocabulary(list(range(draft_vocab)))
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)

    def config(self) -> dict:
        """What the checkpoint records (mtplm.json "heads"): enough to build it again (`Eagle3Form.build`)."""
        return {"form": "eagle3", **self.settings}

    @property
    def layer(self) -> Layer:
        return cast(Layer, self.layers[0])

    @property
    def draft_ids(self) -> torch.Tensor:
        """[N]: the target id of each draft token."""
        return torch.arange(len(self.d2t)) + self.d2t

    def set_vocabulary(self, target_ids: list[int]) -> None:
        """Draft token i is target token target_ids[i] (ascending, distinct, N of them)."""
        ids = torch.tensor(sorted(target_ids), dtype=torch.long)
        if len(ids) != len(self.d2t) or len(set(target_ids)) != len(target_ids):
            raise ValueError(f"a draft vocabulary needs {len(self.d2t)} distinct ids, got {len(target_ids)}")
        with torch.no_grad():
            self.d2t.copy_(ids - torch.arange(len(ids)))
            self.t2d.zero_()
            self.t2d[ids] = True

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., N] in float32 of layer outputs [..., D]."""
        return self.lm_head(self.norm(out)).float()

    def to_target(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V]: draft logits placed at their target ids; every other token -inf (never drafted)."""
        full = logits.new_full((*logits.shape[:-1], len(self.t2d)), float("-inf"))
        full[..., self.draft_ids] = logits
        return full

    def unroll(
        self, features: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor, steps: int, embed
    ) -> list[torch.Tensor]:
        """Training: the layer outputs [B, T, D] of drafting steps 0..steps-1 at every row (training-time
        test).

        features [B, T, 3D] of the text, tokens [B, T]; step j at row t reads token t+1+j (the text's; past
        the end, the last token) and step j-1's output, at position t+j; `embed` maps ids to [.., D]
        embeddings.
        """
        width = tokens.shape[1]
        rows = torch.arange(width)
        allowed = (rows[None, :] <= rows[:, None])[None] & (rows < lengths[:, None])[:, None, :]  # [B, T, T]
        g = self.fc(features)  # [B, T, D]
        k0 = v0 = None
        own: list[tuple[torch.Tensor, torch.Tensor]] = []
        outs = []
        for j in range(steps):
            ahead = torch.cat([tokens[:, 1 + j :], tokens[:, -1:].expand(-1, min(width, 1 + j))], 1)[
                :, :width
            ]
            q, k, v = self.layer.qkv(g, embed(ahead), rows + j, self.theta)
            if k0 is None:
                k0, v0 = k, v
            else:
                own.append((k, v))
            assert k0 is not None and v0 is not None
            g = self.layer.finish(g, attend(q, k0, v0, allowed, own))
            outs.append(g)
        return outs

    def drafter(self, embed: nn.Module, lm_head=None) -> Eagle3Sequence:
        """A sequence's drafter (decode.protocol.Drafter) with its own KV cache; the target's LM head is
        unused."""
        return Eagle3Sequence(self, embed)


class Eagle3Sequence:
    """One sequence's EAGLE-3 drafting: the KV of its committed rows, extended every pass, and the chain."""

    keeps_state = True  # commit() extends its KV every pass

    def __init__(self, drafter: Eagle3Drafter, embed: nn.Module) -> None:
        self.drafter, self.embed = drafter, embed
        layer = drafter.layer.self_attn
        self.keys = torch.zeros(
            1, layer.kv_heads, 64, layer.head_dim, dtype=drafter.fc.weight.dtype
        )  # [1, G, C, d]
        self.values = torch.zeros_like(self.keys)
        self.length = 0  # committed rows cached
        self.extended: tuple[int, tuple[int, ...]] | None = None  # (start, tokens) of the last extension
        self.last: torch.Tensor | None = None  # [D]: the layer's output at the last committed row

    def commit(self, start: int, rows: torch.Tensor, tokens: list[int]) -> None:
        self._extend(start, rows, tokens)

    def block(
        self, start: int, rows: torch.Tensor, tokens: list[int], n: int, chain: list[int] | None = None
    ) -> torch.Tensor:
        """[n, V]: step 0 from the last committed row, then n-1 chained steps, each fed the previous step's
        greedy draft (or `chain`'s tokens, for tests)."""
        out = self._extend(start, rows, tokens)
        drafts = []
        for j in range(n):
            logits = self.drafter.logits(out)  # [N]
            drafts.append(logits)
            if j + 1 < n:
                token = chain[j] if chain is not None else int(self.drafter.draft_ids[logits.argmax()])
                out = self._rows(out[None], [token], self.length + j)[0]  # the chain's keys sit past the text
        return self.drafter.to_target(torch.stack(drafts))

    def _extend(self, start: int, rows: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        """Cache the committed rows at positions start.. (once per pass); the last one's output [D]."""
        key = (start, tuple(tokens))
        if key == self.extended and self.last is not None:
            return self.last
        if start > self.length:
            raise RuntimeError(f"the drafter holds {self.length} rows and was given rows from {start}")
        features = rows[:, self.drafter.dim :].to(self.keys.dtype)  # [R, 3D]
        out = self._rows(self.drafter.fc(features), tokens, start)
        self.length, self.extended, self.last = start + len(tokens), key, out[-1]
        return out[-1]

    def _rows(self, g: torch.Tensor, tokens: list[int], at: int) -> torch.Tensor:
        """Run rows with states g [R, D] and the given tokens at cache index / position at..at+R-1, attending
        to everything cached before them and causally among themselves; their keys stay cached. [R, D]."""
        count = len(tokens)
        self._fit(at + count)
        emb = self.embed(torch.tensor(tokens)).to(g.dtype)
        positions = torch.arange(at, at + count)
        q, k, v = self.drafter.layer.qkv(g[None], emb[None], positions, self.drafter.theta)
        self.keys[:, :, at : at + count], self.values[:, :, at : at + count] = k, v
        span = at + count
        allowed = torch.arange(span)[None, :] <= positions[:, None]  # [R, S]
        attended = attend(q, self.keys[:, :, :span], self.values[:, :, :span], allowed[None])
        return self.drafter.layer.finish(g[None], attended)[0]

    def _fit(self, size: int) -> None:
        if size > self.keys.shape[2]:
            grown = max(size, 2 * self.keys.shape[2])
            for name in ("keys", "values"):
                old = getattr(self, name)
                new = old.new_zeros(*old.shape[:2], grown, old.shape[3])
                new[:, :, : old.shape[2]] = old
                setattr(self, name, new)


def resolve_layers(spec: str, num_layers: int) -> list[int]:
    """Feature layer ids: "auto" = speculators' default (2, L // 2, L - 3), or "a,b,c"; each a decoder layer
    whose input is read (0 = the embeddings' output), so 0 <= id < L, distinct."""
    try:
        ids = [2, num_layers // 2, num_layers - 3] if spec == "auto" else [int(i) for i in spec.split(",")]
    except ValueError:
        raise UserError(f"eagle3_layers must be auto or three layer ids like 2,15,27, got {spec!r}") from None
    if len(ids) != 3 or len(set(ids)) != 3 or min(ids) < 0 or max(ids) >= num_layers:
        raise UserError(
            f"eagle3_layers: {ids} are not three distinct layer ids in [0, {num_layers}) for a target "
            f"with {num_layers} layers; give them explicitly, e.g. eagle3_layers=0,1,2"
        )
    return ids


def draft_vocabulary(counts: torch.Tensor, size: int) -> list[int]:
    """The `size` most frequent target ids (ties and unused ids by lowest id), ascending (speculators'
    rule)."""
    order = sorted(range(len(counts)), key=lambda i: (-int(counts[i]), i))
    return sorted(order[:size])


def for_target(hf, k: int, layers: list[int], draft_ids: list[int]) -> Eagle3Drafter:
    """A drafter shaped like one decoder layer of the target `hf`, its LM head and final norm copied from
    it."""
    config = hf.config
    heads = config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    drafter = Eagle3Drafter(
        k=k,
        dim=config.hidden_size,
        intermediate=config.intermediate_size,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        eps=config.rms_norm_eps,
        rope_theta=rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)),
        layers=layers,
        vocab=hf.get_input_embeddings().weight.shape[0],
        draft_vocab=len(draft_ids),
        max_positions=getattr(config, "max_position_embeddings", 8192),
    )
    drafter.set_vocabulary(draft_ids)
    with torch.no_grad():
        drafter.lm_head.weight.copy_(hf.get_output_embeddings().weight[drafter.draft_ids].float())
        norm = getattr(hf.get_decoder(), "norm", None)
        if norm is not None and getattr(norm, "weight", None) is not None:
            drafter.norm.weight.copy_(norm.weight.float())
    return drafter


@HEAD_FORMS.register(
    "eagle3",
    "EAGLE-3: one decoder layer over three target layers' features, own KV cache, "
    "reduced draft vocabulary; exports to speculators / vLLM / llama.cpp",
)
class Eagle3Form:
    @staticmethod
    def build(config: dict) -> nn.Module:
        return Eagle3Drafter(**{key: value for key, value in config.items() if key != "form"})

"""A DeepSeek-V3-style MoE feed-forward (router, fine-grained routed experts, shared experts), dropless, with
expert parallelism, and a pre-norm residual block around it."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from duplexpipe.moe.dispatch import CountsExchange, ExpertGroup, all_to_all, expert_major
from duplexpipe.moe.linear import linear
from duplexpipe.moe.router import Router, Routing, balance_loss
from duplexpipe.runtime.comm_points import CommSlot, current_slot

EXPERT_KINDS = ("swiglu", "mlp")
ExpertFactory = Callable[[int], nn.Module]
"""factory(e) -> routed expert e (global index): any module mapping [rows, dim] to [rows, dim]."""


class Expert(nn.Module):
    """One expert: SwiGLU (w2(silu(w1 x) * w3 x)) or a plain MLP (w2(gelu(w1 x))). Its weight gradients may be
    formed later, inside an F&B pair, to fill the waits for the pair's exchanges."""

    def __init__(self, dim: int, hidden: int, kind: str = "swiglu") -> None:
        super().__init__()
        if kind not in EXPERT_KINDS:
            raise ValueError(f"expert kind must be one of {EXPERT_KINDS}, got {kind!r}")
        self.kind = kind
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False) if kind == "swiglu" else None

    def forward(self, x: Tensor) -> Tensor:
        slot = current_slot()
        if self.w3 is None:
            return linear(F.gelu(linear(x, self.w1, slot)), self.w2, slot)
        return linear(F.silu(linear(x, self.w1, slot)) * linear(x, self.w3, slot), self.w2, slot)


def _check(dim: int, hidden: int, num_experts: int, top_k: int, shared_experts: int, aux_loss_coef: float,
           bias_update_speed: float) -> None:
    for name, value, low in (("dim", dim, 1), ("hidden", hidden, 1), ("num_experts", num_experts, 1),
                             ("top_k", top_k, 1), ("shared_experts", shared_experts, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"MoELayer {name} must be an int >= {low}, got {value!r}")
    if top_k > num_experts:
        raise ValueError(f"MoELayer top_k={top_k} is more than num_experts={num_experts}")
    for name, number in (("aux_loss_coef", aux_loss_coef), ("bias_update_speed", bias_update_speed)):
        if not number >= 0:
            raise ValueError(f"MoELayer {name} must be >= 0, got {number!r}")


class MoELayer(nn.Module):
    """Routed experts (+ always-on shared experts): y = sum_k w_k expert_{e_k}(x) + shared(x), per token.

    Dropless: every token reaches its top_k experts. `router`: "softmax" or "sigmoid" (normalised top-k
    weights), or a `Router` (a family's exact routing). `expert`: a kind of `Expert`, or a factory of routed
    expert e; `shared`: the shared experts as a module (else `shared_experts` x `shared_hidden` wide
    `Expert`s). Balance: `aux_loss_coef` > 0 adds coef x the balance loss of each forward's tokens to the
    objective (as the microbatch's loss is added); `bias_update_speed` > 0 moves the buffer
    `router.expert_bias` (which changes only which experts are selected) after each optimizer step by
    speed x sign(mean load - expert load), from the step's token counts (`update_bias`).
    The experts live in `experts`, keyed by their global index: with expert parallelism
    (`shard_experts`) a rank keeps only its own, and checkpoints name every expert the same on any layout.
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, *, shared_experts: int = 0,
                 router: str | Router = "softmax", aux_loss_coef: float = 0.0, bias_update_speed: float = 0.0,
                 expert: str | ExpertFactory = "swiglu", shared_hidden: int | None = None,
                 normalize: bool | None = None, shared: nn.Module | None = None) -> None:
        super().__init__()
        _check(dim, hidden, num_experts, top_k, shared_experts, aux_loss_coef, bias_update_speed)
        self.dim, self.num_experts, self.top_k = dim, num_experts, top_k
        self.aux_loss_coef, self.bias_update_speed = float(aux_loss_coef), float(bias_update_speed)
        self.router = router if isinstance(router, Router) else Router(dim, num_experts, top_k, router, normalize)
        if (self.router.num_experts, self.router.top_k) != (num_experts, top_k):
            raise ValueError(f"MoELayer: the router routes to top {self.router.top_k} of "
                             f"{self.router.num_experts} experts, the layer has top_k={top_k} of {num_experts}")
        if bias_update_speed and self.router.expert_bias is None:
            raise ValueError(f"MoELayer bias_update_speed={bias_update_speed}: the router has no expert bias")
        kind = expert if isinstance(expert, str) else "swiglu"
        self.experts = nn.ModuleDict({str(e): expert(e) if callable(expert) else Expert(dim, hidden, kind)
                                      for e in range(num_experts)})
        if shared is None and shared_experts:
            shared = Expert(dim, (shared_hidden or hidden) * shared_experts, kind)
        self.shared = shared
        self.load: Tensor
        self.register_buffer("load", torch.zeros(num_experts, dtype=torch.float64), persistent=False)
        self.ep = ExpertGroup(None, 0, 1)
        self.label = "moe"
        """Names this layer's exchanges (`Pipeline` sets "stage s moe j")."""

    @property
    def local_experts(self) -> list[int]:
        """The global indices of the experts this rank holds."""
        return [int(k) for k in self.experts]

    def sequence_parallel_error(self) -> str | None:
        """Why this layer cannot run on a sequence shard under sequence parallelism (None: it can), which tensor
        parallelism asks before it shards a stage (`tp.parallelize.SequenceParallelCheck`)."""
        if not self.aux_loss_coef:
            return None
        return (f"MoE layers with aux_loss_coef={self.aux_loss_coef} under sequence parallelism: each TP rank "
                "routes only its sequence shard, and the balance loss of a shard (a product of its token fractions "
                "and mean scores) is not a part of the sequence's; use bias_update_speed (loss-free balancing, "
                "exact under SP) or sequence_parallel=False")

    def shard_experts(self, ep: ExpertGroup) -> None:
        """Keep only this rank's experts: num_experts / ep.size of them, rank-major. A layer already sharded the
        same way (on the meta device, before its weights were read) only takes the group."""
        if self.num_experts % ep.size:
            raise ValueError(f"num_experts={self.num_experts} is not divisible by the expert-parallel size "
                             f"ep={ep.size}")
        local = self.num_experts // ep.size
        keep = range(ep.rank * local, (ep.rank + 1) * local)
        if self.local_experts == list(keep) and self.ep.size == ep.size:
            self.ep = ep
            return
        if len(self.experts) != self.num_experts:
            raise ValueError("shard_experts: this layer's experts are already sharded")
        self.experts = nn.ModuleDict({str(e): self.experts[str(e)] for e in keep})
        self.ep = ep

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        tokens = x.reshape(-1, self.dim)
        slot = current_slot()
        routing = self.router(tokens)
        counts = torch.bincount(routing.experts.reshape(-1), minlength=self.num_experts)
        if torch.is_grad_enabled() and self.training:
            self.load += counts.to(self.load)
            if self.aux_loss_coef:
                slot.losses.append(self.aux_loss_coef * balance_loss(routing, counts))
        routed, shared = self._routed(tokens, routing, counts, slot)
        out = routed if shared is None else routed + shared
        return out.reshape(shape)

    def _routed(self, tokens: Tensor, routing: Routing, counts: Tensor,
                slot: CommSlot) -> tuple[Tensor, Tensor | None]:
        """(sum_k w_k expert_{e_k}(token), shared(token)): permute by expert, send to the experts' ranks, compute,
        bring back. The shared experts run while the token counts are exchanged, before the dispatch: inside an
        F&B pair their forward joins the attention's piece and their backward the one after the dispatch's
        backward, which evens the pieces the exchanges hide behind."""
        k = self.top_k
        order = torch.argsort(routing.experts.reshape(-1), stable=True)
        source = order // k
        sent = tokens[source]
        exchange = CountsExchange(counts, self.ep, slot, f"{self.label} counts") if self.ep.size > 1 else None
        shared = self.shared(tokens) if self.shared is not None else None
        if exchange is None:
            done = self._compute(sent, counts.tolist())
        else:
            recv = exchange.received()
            local = len(self.experts)
            send = [int(v) for v in counts.view(self.ep.size, local).sum(1).tolist()]
            back = [sum(row) for row in recv]
            arrived = all_to_all(sent, send, back, self.ep, slot, f"{self.label} dispatch")
            perm = expert_major(recv)
            grouped = arrived if perm is None else arrived[perm]
            per_expert = [sum(recv[s][e] for s in range(self.ep.size)) for e in range(local)]
            result = self._compute(grouped, per_expert)
            if perm is not None:
                result = result[torch.argsort(perm)]
            done = all_to_all(result, back, send, self.ep, slot, f"{self.label} combine")
        weighted = done * routing.weights.reshape(-1)[order].unsqueeze(-1).to(done.dtype)
        return torch.zeros_like(tokens).index_add(0, source, weighted), shared

    def _compute(self, rows: Tensor, sizes: list[int]) -> Tensor:
        """Each local expert on its run of `rows` (every expert runs, on zero rows too)."""
        chunks = rows.split(sizes)
        return torch.cat([expert(chunk) for expert, chunk in zip(self.experts.values(), chunks, strict=True)])

    def reset_load(self) -> None:
        """Forget the token counts (after they were used)."""
        self.load.zero_()

    def update_bias(self, load: Tensor) -> None:
        """expert_bias += bias_update_speed x sign(mean load - load) for the step's total `load` per expert."""
        bias = self.router.expert_bias
        if self.bias_update_speed and bias is not None:
            delta = torch.sign(load.mean() - load) * self.bias_update_speed
            bias += delta.to(bias)


class CausalSelfAttention(nn.Module):
    """Causal multi-head self-attention over [batch, seq, dim]: a mixer for MoEBlock (its projections' weight
    gradients, like the experts', may fill an F&B pair's waits). The projections are separate (`q`, `k`, `v`, `out`)
    and heads are read as `view(b, t, -1, head_dim)`, so tensor parallelism can shard them (`moe_tp_plan`)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if heads < 1 or dim % heads:
            raise ValueError(f"CausalSelfAttention: heads must be >= 1 and divide dim {dim}, got {heads}")
        self.heads = heads
        self.head_dim = dim // heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        slot = current_slot()
        q, k, v = (linear(x, m, slot).view(b, t, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return linear(y.transpose(1, 2).reshape(b, t, -1), self.out, slot)


class MoEBlock(nn.Module):
    """A pre-norm residual block: h = x + mixer(norm1(x)); out = h + moe(norm2(h)).

    `mixer` is attention or any module mapping [..., dim] to [..., dim] (None: no mixer, only the MoE).
    """

    def __init__(self, dim: int, moe: MoELayer, mixer: nn.Module | None = None,
                 norm: Callable[[int], nn.Module] = nn.LayerNorm) -> None:
        super().__init__()
        self.mixer = mixer
        self.norm1 = norm(dim) if mixer is not None else None
        self.norm2 = norm(dim)
        self.moe = moe

    def forward(self, x: Tensor) -> Tensor:
        if self.mixer is not None and self.norm1 is not None:
            x = x + self.mixer(self.norm1(x))
        return x + self.moe(self.norm2(x))

"""Expert parallelism (EP) of a mixture-of-experts model as transformers 5.24 runs it for training
(``transformers.distributed``: ``DistributedConfig(fsdp_size=world, ep_size=ep)``). Pure standard library.

What a rank holds, read from the framework's code:

* Experts (``MoEParamShard``, ``grouped_gemm`` on each experts module's ``gate_up_proj`` / ``down_proj``): dim 0 of
  every routed expert tensor split over the ep mesh, num_experts / ep whole experts per rank, a contiguous range.
  ``apply_fully_sharded_data_parallelism`` then ``fully_shard``s each experts module on the ``efsdp`` mesh
  (world / ep ranks holding the same experts), so a rank stores 1 / world of the expert parameters, gradients and
  optimizer states, as plain FSDP would, but gathers only its num_experts / ep experts for compute.
* Dispatch and combine (``AllToAllEP``, the ``auto`` choice whenever gradients flow): the T x top_k (token, expert)
  pairs are sorted by expert (``argsort``: int64, kept for the combine), the T x top_k rows gathered (indices kept
  for backward) and sent with ``all_to_all_single_autograd``; the experts run on the R rows this rank receives as
  top-1 with unit weights (``_is_expert_parallel``: a bool sentinel mask per row, kept by ``masked_fill``); a
  second all-to-all returns the T x top_k rows, which are put back in token order into a new tensor (kept by the
  routing-weight product) and summed per token.
* Balanced routing: R = T x top_k, the same rows as on one device, and what backward keeps differs from the
  unsharded run only by the int64 sort order and the bool mask per row. Skewed routing: R follows the load of the
  experts the rank owns. With the busiest expert at F times the balanced load, the rank owning it receives at most
  F x T x top_k rows (every expert of the rank at that load), and no more than its group's tokens can send it
  (ep x T x min(top_k, experts per rank)): ``EpLayout.received_rows_factor``. It keeps each extra row's activations
  in its experts (the routed row, the gate/up projection, its activation and their product, its routing weight, its
  sort indices and mask: ``EpLayout.row_bytes``), and its experts' forward and backward run on those rows
  (``forward_transient_bytes``, ``backward_bumps``). Frozen experts (LoRA on other modules) keep less per row:
  ``grouped_mm`` saves its input only for its weight's gradient, so the routed row and the product are not kept;
  the experts function still holds the routed rows in forward until it returns, and backward makes the product's
  gradient without having saved it (``experts_trainable``).

Where it enters the estimate: ``estimator.methods.state.fsdp`` (the expert shard, sharded over efsdp ranks; the
experts' own FSDP2 unit, ``fsdp_replay.ExpertsUnit``: gathered with the layer, resharded and reduce-scattered when
the experts' backward is over, its all-gather output held through forward) and ``estimator.methods.expert_parallel``
(``ep_segments``: each MoE layer's extra from its forward to its experts' backward, the backward bumps;
``forward_peak``: the busiest rank's last MoE layer in forward). Checked against transformers' own EP on gloo ranks:
``benchmarks/moe_ep_table.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

INT64 = 8
BOOL = 1


def received_rows_factor(imbalance: float, ep: int, experts: int, top_k: int) -> float:
    """Rows the busiest EP rank's experts run on, relative to its own T x top_k, when the busiest expert gets
    ``imbalance`` x its balanced load: at most every row its EP group can send it."""
    if ep == 1 or not top_k:
        return 1.0  # one device runs every expert dropless: the same rows however the router spreads them
    per_token = min(top_k, experts // ep)  # rows one token can send to one rank
    return min(imbalance, ep * per_token / top_k)


@dataclass(frozen=True)
class EpLayout:
    ep: int
    world: int
    experts: int                # routed experts per MoE layer
    top_k: int
    moe_layers: int
    hidden: int
    expert_ffn: int             # one expert's intermediate size
    imbalance: float = 1.0
    experts_trainable: bool = True  # False: frozen experts (LoRA on other modules)
    router_fp32: bool = False       # the router computes its logits in fp32 (DeepSeek's ``.type(torch.float32)``)
    block_input_saved: bool = True  # something in the MoE block that trains saves its input (the router, a
                                    # shared expert); False: frozen, the input lives only while the block runs

    @property
    def experts_per_rank(self) -> int:
        return self.experts // self.ep

    @property
    def efsdp(self) -> int:
        """Ranks that hold the same experts and FSDP-shard them between each other."""
        return self.world // self.ep

    def received_rows_factor(self) -> float:
        """Rows the busiest rank's experts run on, relative to its own T x top_k."""
        return received_rows_factor(self.imbalance, self.ep, self.experts, self.top_k)

    def row_bytes(self, act_bytes: int) -> float:
        """Bytes backward keeps per received row in one MoE layer's experts (``grouped_mm_experts_forward`` under
        EP): the routed row (saved by the up grouped_mm), the gate/up projection (2 x ffn: its halves saved by the
        activation and the product), the activation (ffn, saved by the product), the product (ffn, saved by the
        down grouped_mm), the row's unit weight, the int64 gather and un-permute indices, the bool sentinel
        mask.

        Frozen experts (``experts_trainable`` False): ``grouped_mm`` saves its input only when its weight needs a
        gradient (autograd's ``GroupedMmBackward0``), so neither the routed row nor the product is kept."""
        kept = self.hidden + 4 * self.expert_ffn if self.experts_trainable else 3 * self.expert_ffn
        return act_bytes * (kept + 1) + 2 * INT64 + BOOL

    def skew_bytes(self, tokens: int, act_bytes: int) -> float:
        """What the busiest rank keeps through backward above balanced routing, every MoE layer."""
        return self.moe_layers * self.layer_skew_bytes(tokens, act_bytes)

    def layer_skew_bytes(self, tokens: int, act_bytes: int) -> float:
        """The same for one MoE layer: its extra rows, from its experts' forward to their backward."""
        extra_rows = (self.received_rows_factor() - 1.0) * tokens * self.top_k
        return extra_rows * self.row_bytes(act_bytes)

    def layer_saved_bytes(self, tokens: int, act_bytes: int) -> float:
        """What one MoE layer keeps for backward beyond the one-device experts the profile traced: the dispatch's
        sort order and sentinel mask, and under skew the extra rows."""
        return self.dispatch_bytes(tokens) / self.moe_layers + self.layer_skew_bytes(tokens, act_bytes)

    def backward_bumps(self, tokens: int, act_bytes: int) -> tuple[float, float, float]:
        """What the experts' backward holds above the trace's (S rows) for the busiest rank's extra rows, per MoE
        layer, at three stages (``grouped_mm_experts_forward`` run backwards):

        * before its first expert gradient, at the trace's highest moment there (the combine's backward, on the S
          rows this rank sent, whatever the skew): less the S rows of down-projection output the one-device
          experts still hold there (their routing-weight product saves them; under EP the weights are applied in
          the combine). The un-permute's backward comes later, on the rows received: ``unpermute_bump``;
        * between the two: the down projection's backward (the gradient of its output and of its input,
          (h + ffn) a) or the activation-product's (the gradients of the product and of both factors, the product
          itself freed: 2 ffn a), the un-permute indices and unit weights released (int64 + a);
        * with both: the up projection's backward, whose row gradients replace what the rows saved (the indices
          and unit weights released: - (int64 + a)).

        Frozen experts make no gradient, so backward has no expert moment to tell these stages apart: the first
        bump is their highest, the down projection's backward (the gradient of its output and of its input) or
        the product's (the gradient of the product, never saved, and of both factors: 3 ffn a), the indices and
        unit weights released. The one-device trace's down-projection output is released by then too.
        """
        extra_rows = (self.received_rows_factor() - 1.0) * tokens * self.top_k
        h, f, a = self.hidden, self.expert_ffn, act_bytes
        released = INT64 + a
        if not self.experts_trainable:
            during = extra_rows * (max(h + f, 3 * f) * a - released)
            return (during, during, -extra_rows * released)
        sent = tokens * self.top_k
        return (-sent * h * a, extra_rows * (max(h + f, 2 * f) * a - released), -extra_rows * released)

    def unpermute_bump(self, tokens: int, act_bytes: int) -> float:
        """The un-permute's backward in the experts (R rows received, S sent), above the trace's level just before
        the experts' first gradient: the rows' gradient from the returning all-to-all, the zeros it is scattered
        into and the scattered copy (3 R h a), less the S rows of gradient the one-device trace holds there; the
        indices and unit weights of the S rows not yet released (they are at the trace's moment: S (int64 + a)).
        Checked against the CPU oracle's per-operator storage counts (docs/LOG.md, session 21)."""
        rows = self.received_rows_factor() * tokens * self.top_k
        sent = tokens * self.top_k
        h, a = self.hidden, act_bytes
        return 3 * rows * h * a - sent * h * a + sent * (INT64 + a)

    def recompute_bytes(self, tokens: int, act_bytes: int, weights_bytes: int, continues: bool) -> float:
        """Checkpointing: what a MoE layer's recomputation in backward holds above the one-device profile's level at
        its experts' entry, at the larger of two moments (R rows received, S = T x top_k sent, hidden h, expert ffn
        f, dtype a, routing weights w, their product's dtype p = max(a, w)).

        When nothing after the experts saves a tensor (not ``continues``), the experts' own tail starts the layer's
        backward before the recomputation: on one device the per-token sum's gradient is expanded and copied to S
        rows (``view``'s backward, S h p; the cast of the layer's gradient to p, T h p when p is not a, is freed
        by then), which the profile's level holds; EP's combine sums a product whose backward needs no copy, and
        holds the cast until it runs: that level is S h p - T h p (p != a) lower here.
        Before either, the dispatch: the sort order and the gather indices (S int64 each), the received rows, their
        local expert ids and unit weights. Kept by the experts' forward until the layer's backward: the gather
        indices, the permuted rows and weights, the sentinel mask, the gate/up projection (2 f), the activation and
        the product (f each), the un-permute indices, the experts' output (R h a), the int32 group offsets.

        * the experts' un-permute (``grouped_mm_experts_forward``): the sort's values and permutation, ``histc``'s
          float ids, the down projection, the weighted rows and their un-permuted copy, the output not yet made;
        * the combine (``_combine_tokens``): the returned rows twice (the collective's output and its autograd
          wrapper) and the rows put back in token order (3 S h a). Non-reentrant checkpointing stops recomputing
          once the last tensor backward needs is saved: the routing-weight product saves its inputs before it
          runs, so the product (S h) and the per-token sum (T h), in the weights' dtype promoted, exist only when
          the layer saves something after its experts (``continues``: a shared expert, a gate).

        Checked against the CPU oracle's per-operator storages (docs/LOG.md, session 22)."""
        rows = self.received_rows_factor() * tokens * self.top_k
        sent = tokens * self.top_k
        h, f, a = self.hidden, self.expert_ffn, act_bytes
        groups = self.experts_per_rank * 4  # int32 group offsets; histc's float32 counts
        dispatch = 2 * sent * INT64 + rows * (h * a + INT64 + a)
        kept = rows * (2 * h * a + 4 * f * a + a + 2 * INT64 + BOOL) + groups
        unpermute = rows * (2 * h * a + 2 * INT64 + 4) + groups
        product = max(a, weights_bytes)
        combine = 3 * sent * h * a + (sent * h * product + tokens * h * product if continues else 0.0)
        cast = tokens * h * product if product != a else 0.0
        one_device_copy = 0.0 if continues else sent * h * product - cast
        return dispatch + kept + max(unpermute, combine) - one_device_copy

    def forward_transient_bytes(self, tokens: int, act_bytes: int) -> float:
        """The busiest rank's last MoE layer in forward, above that layer's end-of-forward level (its experts
        resharded), at the larger of two moments (R received rows, S = T x top_k sent, hidden h, dtype a):

        * the experts' un-permuted weighted rows (``grouped_mm_experts_forward``): the received rows (held by
          ``AllToAllEP.__call__``), the masked down projection, the weighted rows and their un-permuted copy
          (4 R h a); the sorted expert ids, the sort permutation, the received expert ids (int64), ``histc``'s
          float ids and the unit weights per row, ``histc``'s float counts per local expert; less the rows put
          back in token order, which come later (S h a). The layer's output replaces its post-attention residual,
          live here, so it adds nothing at the end;
        * the combine's per-token sum: the received rows and the experts' output (2 R h a), the received expert ids
          and unit weights, the returned rows (S h a), the routing-weighted product (S h p) and the sum (T h p), in
          the routing weights' dtype p promoted (fp32 from an fp32 router). The collective's autograd wrapper
          (``AsyncCollectiveTensor``) holds no storage of its own: the S h a the oracle once counted for it is
          gone since the unwrapping oracle (docs/error_matrix/README.md, helper asyncwrap).

        At both, the MoE block still holds what it made or took and nothing saved (``block_held_bytes``): the
        router's logits, and the block's input where nothing that trains in the block saved it.
        Frozen experts: at the first moment the routed rows (``selected_hidden_states_g``) are still held by the
        experts function, though nothing saved them (``row_bytes``): R h a more; gone by the combine.
        Checked against the busiest rank's live storages, op by op (Qwen3-MoE, docs/error_matrix/README.md).
        """
        return (max(self.unpermute_forward_bytes(tokens, act_bytes), self.combine_forward_bytes(tokens, act_bytes))
                + self.block_held_bytes(tokens, act_bytes))

    def unpermute_forward_bytes(self, tokens: int, act_bytes: int) -> float:
        """``forward_transient_bytes``' first moment, the block's held bytes aside."""
        rows = self.received_rows_factor() * tokens * self.top_k
        sent = tokens * self.top_k
        h, a = self.hidden, act_bytes
        routed = 0 if self.experts_trainable else rows * h * a
        counts = self.experts_per_rank * 4  # histc's float32 counts
        return 4 * rows * h * a + routed + rows * (3 * INT64 + 4 + a) + counts - sent * h * a

    def combine_forward_bytes(self, tokens: int, act_bytes: int) -> float:
        """``forward_transient_bytes``' second moment, the block's held bytes aside."""
        rows = self.received_rows_factor() * tokens * self.top_k
        sent = tokens * self.top_k
        h, a = self.hidden, act_bytes
        p = 4 if self.router_fp32 else a
        return 2 * rows * h * a + rows * (INT64 + a) + sent * h * a + sent * h * p + tokens * h * p

    def block_held_bytes(self, tokens: int, act_bytes: int) -> float:
        """What the MoE block holds while its experts run and not after it returns, nothing having saved it: the
        router's logits (T x experts, bound to ``_`` in the block's frame: fp32 where the router computes in fp32)
        and, where nothing in the block trains (LoRA on other modules), the block's input (T h a; else the router
        or a shared expert saves it, and the layer's end-of-forward level has it)."""
        logits = tokens * self.experts * (4 if self.router_fp32 else act_bytes)
        return logits + (0 if self.block_input_saved else tokens * self.hidden * act_bytes)

    def dispatch_bytes(self, tokens: int) -> float:
        """What the all-to-all path keeps per rank above the one-device experts, every MoE layer, at balanced
        routing: the int64 sort order of the (token, expert) pairs and the bool sentinel mask per row."""
        return self.moe_layers * tokens * self.top_k * (INT64 + BOOL)


_FFN_KEYS = ("moe_intermediate_size", "intermediate_size")
# routers that cast the block's input and their weight to fp32 before the logits (transformers 5.24's
# ``DeepseekV2TopkRouter`` / ``DeepseekV3TopkRouter``: ``F.linear(hidden_states.type(torch.float32), ...)``);
# the others compute them in the activations' dtype
FP32_ROUTER_FAMILIES = ("deepseek_v2", "deepseek_v3")


def ep_layout(config: dict, facts, world: int, ep: int, imbalance: float, experts_trainable: bool = True,
              block_input_saved: bool = True) -> EpLayout:
    """``facts``: ``estimator.models.moe.MoeFacts``; ``experts_trainable``: whether the routed experts get
    gradients (False under LoRA on other modules); ``block_input_saved``: whether anything in the MoE block that
    trains saves its input (``EpLayout.block_held_bytes``). Raises ValueError (one line) for a layout
    transformers refuses."""
    if facts is None:
        raise ValueError("ep: expert parallelism needs a mixture-of-experts model; this one has no routed experts")
    if facts.experts % ep:
        raise ValueError(f"ep: {facts.experts} routed experts cannot be split evenly over ep={ep} ranks")
    if world % ep:
        raise ValueError(f"ep: world size {world} is not divisible by ep {ep}")
    ffn = next((config[k] for k in _FFN_KEYS if isinstance(config.get(k), int)), 0)
    return EpLayout(ep=ep, world=world, experts=facts.experts, top_k=facts.top_k or 1, moe_layers=facts.moe_layers,
                    hidden=int(config["hidden_size"]), expert_ffn=int(ffn), imbalance=float(imbalance),
                    experts_trainable=experts_trainable,
                    router_fp32=config.get("model_type") in FP32_ROUTER_FAMILIES,
                    block_input_saved=block_input_saved)


def ep_notes(layout: EpLayout | None, tokens: int, grad_ckpt: bool = False) -> list[str]:
    if layout is None or layout.ep == 1:
        return []
    ckpt = (["ep: with checkpointing, each MoE layer's recomputation in backward runs its dispatch, experts and "
             "combine again from the level the profile marks at its experts' entry (EpLayout.recompute_bytes; "
             "docs/error_matrix/moe_ep_ckpt.csv)"]
            if grad_ckpt else [])
    factor = layout.received_rows_factor()
    return [f"ep: {layout.ep} expert-parallel ranks, {layout.experts_per_rank} of {layout.experts} experts each, "
            f"FSDP2-sharded over {layout.efsdp} rank(s) holding the same experts; tokens dispatched and combined "
            f"all-to-all (transformers' AllToAllEP)",
            f"ep routing: busiest expert at {layout.imbalance:g}x the balanced load -> the busiest rank's experts run "
            f"{factor:g}x its own {tokens * layout.top_k} (token, expert) rows per MoE layer"
            + ("" if factor > 1 else " (balanced)"), *ckpt]


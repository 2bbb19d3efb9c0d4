"""DeepSpeed ZeRO-3's parameter gathers on its allgather stream, as the caching allocator sees them: an emulation of
``PartitionedParameterCoordinator`` (DeepSpeed 0.19, ``deepspeed/runtime/zero/partitioned_param_coordinator.py``)
over the modules that hold parameters, in forward order and then in reverse for backward.

* Each module's fetch gathers its parameters that are not available in one call (``__all_gather_params``) on
  the allgather stream: one parameter into its own padded storage (``_all_gather_sequential``: the parameter is a
  view of it), several into one flat tensor per dtype of ``partition numel x world`` elements each
  (``_all_gather_coalesced``; peft's fp32 adapters beside 16-bit base weights make two). At the first wait for any
  of the call's parameters, every one of them is copied out into storage of its own
  (``AllGatherCoalescedHandle.wait``: ``torch.cat`` of its partitions, under the allgather stream); the flat
  tensors go once the last of the call's parameters has been waited for.
* The first step records the module trace (every module whose forward runs, parameter-less ones too, then the
  backward's): nothing is prefetched and every parameter is released after its module, persistent ones
  (``stage3_param_persistence_threshold``) included; from then on those stay gathered.
* Checkpointed layers (``with_recomputation``): backward's first fetch in the layer (the MLP's last projection)
  triggers the recomputation, whose forward modules are fetched, released and traced like forward's; it stops
  early, so that projection stays gathered until its backward release. The frozen parameters it fetches are
  held for that projection and released with its backward release (``update_recompute_parameters``); a
  trainable one it releases keeps its storage to its module's backward (the checkpoint saved a detached alias).
  Where the layer drops out its hidden states after the MLP (OPT, GPT-2) the mask is unpacked first, so the
  recomputation runs before that projection's fetch and releases every module as forward does
  (``recomputed_before_fetch``).
  Where that projection is a peft LoRA wrapper, its ``lora_B`` triggers the recomputation, which stops inside the
  wrapper: the recomputed wrapper never releases.
* Reentrant checkpointing (``use_reentrant=True``: ``torch.utils.checkpoint``'s ``CheckpointFunction``) is one
  autograd node on the layer's output, so its backward runs before any of the layer's modules' pre-backward
  hooks: it runs the layer's whole forward again (no early stop: every recomputed module fetched and released
  as in forward, and recorded in the trace), then backward through that new graph, each module fetched again.
  The new graph saves the gathered parameters themselves, not detached aliases, so a release frees their
  storage at once (the pre-backward fetch gathers them again): ``recomputed_before_fetch``'s trace with no
  parameter saved. Real DeepSpeed runs on CPU of a tiny Llama (``docs/error_matrix/zero3_reentrant_cpu.csv``).
* Later steps prefetch: after each fetch, parameters are popped off the trace's queue (those of the module just
  fetched, then up to ``stage3_prefetch_bucket_size`` elements, within ``stage3_max_live_parameters``) and
  gathered in one call; a release keeps what a module within ``stage3_max_reuse_distance`` elements of the trace
  uses, and what a prefetch fetched for a later use. Backward's end releases everything
  (``release_and_reset_all``).

Checked against the coordinator's own calls (a 1/64-scale Llama-3.2-1B with the knobs scaled alike, on CPU:
every gather and release of three steps) and the H100 snapshots of Llama-3.2-1B at 2 and 4 ranks: every
allocation and free of the allgather stream, in order (``tests/estimator/test_zero3_snapshots.py``).
Only the allgather stream's own requests matter for its pool: no other stream reuses its blocks, and its
``record_stream`` frees complete at once (``benchmarks/zero3_trace_anatomy.py``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace

from estimator.models.params import ParamInfo
from estimator.reserved.timeline import model_order


@dataclass(frozen=True)
class _Param:
    key: str
    numel: int
    elem_bytes: int
    persistent: bool
    trainable: bool = True


@dataclass(frozen=True)
class Module:
    name: str
    params: tuple[str, ...]
    # whether backward releases it (its post-backward hook hangs on inputs that need a gradient; an embedding's
    # parameters stay to release_and_reset_all): known from a recorded trace (``recorded_modules``)
    released_in_backward: bool = True


@dataclass
class GatherOps:
    """(+1, buffer id, bytes) allocations and (-1, buffer id, bytes) frees on the allgather stream, per step."""

    steps: list[list[tuple[int, int, int]]] = field(default_factory=list)
    # per step: ("G", parameter names) for each gather call, ("R", name) for each release (checks against a run)
    calls: list[list[tuple]] = field(default_factory=list)


def modules_of(table: list[ParamInfo], recorded: tuple | None = None, inputs_need_grad: bool = False
               ) -> tuple[list[Module], list[Module]]:
    """(forward, backward) module traces of a Hugging Face decoder, as DeepSpeed's hooks see them: every module
    whose forward runs, parameter-less ones included (each fetch may prefetch). Forward, in pre-forward order: the
    wrappers down to the base model (the causal-LM one; under peft also ``PeftModel`` and ``LoraModel``), the
    modules before the layers (the embedding), the rotary embedding; per decoder layer the layer, then its blocks
    each after its norm (``input_layernorm``, attention with its projections, ``post_attention_layernorm``, MLP
    with its projections and the activation after the first), the modules after the layers, a tied head. A peft
    LoRA projection is its wrapper, then ``base_layer``, then per adapter ``lora_dropout``, ``lora_A``, ``lora_B``
    (``LoraLayer.forward``; the ``ModuleDict`` containers never run). Backward (pre-backward hooks, registered only
    on outputs that require grad: ``parameter_offload._apply_forward_and_backward_to_tensors_only``): the reverse
    of the post-forward order, less the rotary embedding and the modules whose output needs no gradient (under
    LoRA: the frozen embedding, and in the first layer what reads its input before an adapter:
    ``_projection_modules``). ``inputs_need_grad``: the embedding's output requires a gradient whatever the
    embedding's own (transformers' ``enable_input_require_grads``, which peft turns on under checkpointing), so
    every module from it on is in backward.

    ``recorded``: a profile's recorded module trace at full depth (``ParamTable.module_trace``), taken instead
    (``recorded_modules``; ``estimator.reserved.zero3.recorded_trace`` says when)."""
    if recorded is not None:
        return recorded_modules(recorded)
    order = model_order(table)
    trainable = {p.name: p.trainable for p in table}
    direct: dict[str, list[str]] = {}
    seen: list[str] = []
    for p in order:
        owner = p.name.rsplit(".", 1)[0]
        if owner not in direct:
            direct[owner] = []
            seen.append(owner)
        direct[owner].append(p.name)

    def needs_grad(module: str) -> bool:
        return any(trainable[n] for n in direct.get(module, ()))

    tied = [(other.rsplit(".", 1)[0], p.name) for p in order for other in p.tied_names]
    layers: dict[int, list[str]] = {}
    for m in seen:
        layer = _layer_of(m)
        if layer is not None:
            layers.setdefault(layer, []).append(m)
    first_layer_at = next((i for i, m in enumerate(seen) if _layer_of(m) is not None), len(seen))
    head = [m for m in seen[:first_layer_at] if _layer_of(m) is None]
    tail = [m for m in seen[first_layer_at:] if _layer_of(m) is None]
    base = head[0].rsplit(".", 1)[0] if head and "." in head[0] else "model"
    wrappers = [""] + [".".join(base.split(".")[:k]) for k in range(1, base.count(".") + 2)]
    forward: list[tuple[str, tuple[str, ...]]] = [(w, ()) for w in wrappers]
    post: list[str] = []
    no_grad: set[str] = set()
    flows = False  # whether the hidden states need a gradient (a trainable tensor upstream)
    for m in head:
        forward.append((m, tuple(direct[m])))
        post.append(m)
        flows = flows or needs_grad(m) or inputs_need_grad
        if not flows:
            no_grad.add(m)
    forward.append((f"{base}.rotary_emb", ()))
    post.append(f"{base}.rotary_emb")
    for layer in sorted(layers):
        prefix = layers[layer][0].split(f".{layer}.")[0] + f".{layer}"
        forward.append((prefix, ()))
        blocks: dict[str, dict[str, list[str]]] = {}  # block -> projection -> its modules with parameters
        norms: list[str] = []
        for m in layers[layer]:
            rest = m[len(prefix) + 1:]
            if "." in rest:
                block, projection = rest.split(".")[:2]
                blocks.setdefault(f"{prefix}.{block}", {}).setdefault(f"{prefix}.{block}.{projection}", []).append(m)
            else:
                norms.append(m)
        for k, (block, projections) in enumerate(blocks.items()):
            block_input = flows
            if k < len(norms):
                forward.append((norms[k], tuple(direct[norms[k]])))
                post.append(norms[k])
                block_input = flows or needs_grad(norms[k])
                if not block_input:
                    no_grad.add(norms[k])
            forward.append((block, ()))
            # every projection but the last reads the block's input; the last reads what the others made
            # (o_proj: the attention of q, k, v; down_proj: act_fn(gate) * up)
            made = False
            names = list(projections)
            for j, projection in enumerate(names):
                reads = block_input if j < len(names) - 1 else made
                entries, after, silent, out = _projection_modules(projection, projections[projection], direct,
                                                                  needs_grad, reads)
                forward += entries
                post += after
                no_grad |= silent
                made = made or out
                if j == 0 and len(names) == 3:  # gated MLP: act_fn(gate(x)) * up(x)
                    forward.append((f"{block}.act_fn", ()))
                    post.append(f"{block}.act_fn")
                    if not out:
                        no_grad.add(f"{block}.act_fn")
            post.append(block)
            if not made:
                no_grad.add(block)
            flows = flows or made
        for norm in norms[len(blocks):]:
            forward.append((norm, tuple(direct[norm])))
            post.append(norm)
        post.append(prefix)
        if not flows:
            no_grad.add(prefix)
    for m in tail:
        forward.append((m, tuple(direct[m])))
        post.append(m)
    post.append(base)
    for owner, name in tied:
        forward.append((owner, (name,)))
        post.append(owner)
    post += list(reversed(wrappers[:-1]))
    params_of = dict(forward)
    backward = [(m, params_of.get(m, ())) for m in reversed(post)
                if not m.endswith("rotary_emb") and m not in no_grad]
    return [Module(n, ps) for n, ps in forward], [Module(n, ps) for n, ps in backward]


def recorded_modules(recorded: tuple) -> tuple[list[Module], list[Module]]:
    """(forward, backward) module traces from a profile's recorded trace at full depth
    (``estimator.models.modules.module_trace_at_depth``): every module in pre-forward order with its direct
    parameters, then each pre-backward hook as backward ran it (a module whose output needs no gradient, such
    as a rotary embedding, has none), each fetching the module's direct parameters; a backward module none of
    whose inputs needs a gradient is not released there (``Module.released_in_backward``)."""
    forward, backward = recorded
    params_of = {n: ps for n, ps, _ in forward}
    grad_inputs = {n: k for n, _, k in forward}
    return ([Module(n, ps) for n, ps, _ in forward],
            [Module(n, params_of.get(n, ()), grad_inputs.get(n, 0) > 0) for n in backward])


def with_leaves(forward: list[Module], backward: list[Module], leaves: tuple[str, ...]
                ) -> tuple[list[Module], list[Module]]:
    """The module traces as DeepSpeed hooks them when some modules are ZeRO-3 leaves
    (``estimator.models.zero3_leaf``): no module inside a leaf is hooked (``_register_deepspeed_module`` stops
    at it), and the leaf fetches and releases every parameter under it (``iter_params(recurse=True)``)."""
    if not leaves:
        return forward, backward

    def inside(name: str) -> bool:
        return any(name.startswith(f"{leaf}.") for leaf in leaves)
    under: dict[str, list[str]] = {}
    for m in forward:
        leaf = m.name if m.name in leaves else next((x for x in leaves if m.name.startswith(f"{x}.")), None)
        if leaf is not None:
            under.setdefault(leaf, []).extend(p for p in m.params if p not in under[leaf])

    def collapsed(modules: list[Module]) -> list[Module]:
        return [replace(m, params=tuple(under[m.name])) if m.name in under else m
                for m in modules if not inside(m.name)]
    return collapsed(forward), collapsed(backward)


def _projection_modules(projection: str, owners: list[str], direct: dict, needs_grad, reads_grad: bool
                        ) -> tuple[list[tuple[str, tuple[str, ...]]], list[str], set[str], bool]:
    """One projection's (forward entries, post-forward order, modules whose output needs no gradient, whether its
    output needs one). A plain Linear is one module; a peft LoRA wrapper runs ``base_layer``, then per adapter
    ``lora_dropout`` (an ``Identity`` at dropout 0: its output is its input), ``lora_A``, ``lora_B``, and sums
    them; an output needs a gradient when the input does or the module (or what feeds it) is trainable."""
    if owners == [projection]:
        out = reads_grad or needs_grad(projection)
        return [(projection, tuple(direct[projection]))], [projection], set() if out else {projection}, out
    base = f"{projection}.base_layer"
    adapters = list(dict.fromkeys(m.split(".lora_A.")[1] for m in owners if ".lora_A." in m))
    entries: list[tuple[str, tuple[str, ...]]] = [(projection, ()), (base, tuple(direct.get(base, ())))]
    after = [base]
    out = reads_grad or needs_grad(base)
    silent = set() if out else {base}
    for adapter in adapters:
        dropout, a, b = (f"{projection}.{part}.{adapter}" for part in ("lora_dropout", "lora_A", "lora_B"))
        a_out = reads_grad or needs_grad(a)
        b_out = a_out or needs_grad(b)
        entries += [(dropout, ()), (a, tuple(direct[a])), (b, tuple(direct[b]))]
        after += [dropout, a, b]
        silent |= {m for m, grad in ((dropout, reads_grad), (a, a_out), (b, b_out)) if not grad}
        out = out or b_out
    after.append(projection)
    if not out:
        silent.add(projection)
    return entries, after, silent, out


def external_params(forward: list[Module]) -> dict[str, tuple[str, ...]]:
    """Per peft LoRA wrapper, the adapter weights its forward reads before their modules run: ``LoraLayer``'s
    forward casts its input to ``lora_A.weight.dtype``; in the first forward that read finds the weight not
    gathered, and ``ZeROOrderedDict.__getitem__`` gathers it at once (``param.all_gather()``, on the default
    stream) and registers it as an external parameter of the running module, the wrapper. From then on the
    wrapper's fetch gathers it, and it stays gathered until the wrapper's release."""
    out: dict[str, tuple[str, ...]] = {}
    for m in forward:
        if ".lora_A." in m.name and m.params:
            wrapper = m.name.split(".lora_A.")[0]
            out[wrapper] = out.get(wrapper, ()) + m.params
    return out


def _wrappers_released_last(releases_after: dict[int, list[int]], trace: list[Module], backward_at: int,
                            external: dict[str, tuple[str, ...]], moved: dict[int, int | None] | None = None
                            ) -> None:
    """A wrapper's post-backward release (``PostBackwardFunctionModule`` on its inputs) runs once its input's
    gradient is complete, after its children's backward (the last: ``base_layer``); it matters only where the
    wrapper holds parameters (``external_params``). ``moved``: ``with_recomputation``'s; a recomputation that
    one of the children triggers (``lora_B``) runs among them, the wrapper's release after it."""
    moved = moved or {}
    for at in range(backward_at, len(trace)):
        name = trace[at].name
        if name not in external or at not in releases_after.get(at, ()):
            continue
        end = at
        while end + 1 < len(trace) and trace[end + 1].name.startswith(name + "."):
            end += 1
            if moved.get(end) is not None:  # a child triggered a recomputation: skip over it
                end = moved[end]
        releases_after[at].remove(at)
        if end in moved and moved[end] is None:
            continue  # the recomputation stopped inside the wrapper: its release never runs
        releases_after.setdefault(end, []).append(at)


def _with_external(modules: list[Module], external: dict[str, tuple[str, ...]]) -> list[Module]:
    return [Module(m.name, m.params + external.get(m.name, ()), m.released_in_backward) for m in modules]


def _dtype_name(elem_bytes: int) -> str:
    """The ``str`` of a parameter dtype of this size, as ``sort_dtypes`` orders a coalesced gather's groups
    (one 16-bit dtype per model)."""
    return {1: "torch.int8", 2: "torch.bfloat16", 4: "torch.float32", 8: "torch.float64"}[elem_bytes]


def ds_id_order(table: list[ParamInfo]) -> dict[str, int]:
    """Each parameter's ``ds_id`` rank: ``zero.Init`` numbers the model's tensors as it builds them; peft's
    adapters, made after the model, are converted when the engine starts (``_convert_to_zero_parameters``), so
    they come last."""
    adapters = [p for p in table if is_adapter(p)]
    return {p.name: i for i, p in enumerate([p for p in table if not is_adapter(p)] + adapters)}


def is_adapter(p: ParamInfo) -> bool:
    """A peft LoRA tensor (``lora_A`` / ``lora_B``)."""
    return ".lora_A." in p.name or ".lora_B." in p.name


def _layer_of(module: str) -> int | None:
    parts = module.split(".")
    for a, b in zip(parts, parts[1:]):
        if a in ("layers", "h", "layer", "blocks") and b.isdigit():
            return int(b)
    return None


def with_recomputation(forward: list[Module], backward: list[Module], checkpointed: frozenset[int],
                       external: dict[str, tuple[str, ...]] | None = None
                       ) -> tuple[list[Module], dict[int, int | None]]:
    """The backward trace with each checkpointed layer's recomputation, and where releases move: {fetch index:
    the index of the fetch after which its module's release runs, None for never}.

    Non-reentrant checkpointing recomputes a layer when backward first unpacks one of its saved tensors: at the
    layer's first backward module with parameters (the MLP's last projection), right after that module's fetch.
    The recomputation runs the layer's forward again, its modules' hooks firing (not the layer's own: transformers
    calls the checkpoint from the layer's ``__call__``), so the coordinator fetches and releases each module as in
    forward and records them in the trace. It stops early (``torch.utils.checkpoint``'s early stop) once that last
    module has packed its inputs: its forward release never runs, and the projection stays gathered until its
    backward release, after the recomputation. Frozen parameters the recomputation fetches are tied to that
    first module (``emulate``'s ``tie``: ``recompute_owners``).

    ``external``: peft LoRA wrappers' external parameters (``external_params``). A wrapper fetches them but its
    own backward (the sum of the base output and the scaled adapter's) unpacks no saved tensor, so where the MLP's
    last projection is a wrapper the recomputation starts at its ``lora_B``'s backward, the next module
    (real CPU runs with ``all-linear`` adapters: docs/error_matrix/zero3_lora_mlp_ckpt_cpu.csv)."""
    if not checkpointed:
        return backward, {}
    out: list[Module] = []
    moved: dict[int, int | None] = {}
    base = len(forward)
    recomputed: set[int] = set()
    for m in backward:
        out.append(m)
        layer = _layer_of(m.name)
        if (layer is None or layer not in checkpointed or layer in recomputed
                or not set(m.params) - set((external or {}).get(m.name, ()))):
            continue
        recomputed.add(layer)
        prefix = m.name.split(f".{layer}.")[0] + f".{layer}."
        recompute = [f for f in forward if f.name.startswith(prefix)]
        first_fetch = base + len(out) - 1
        out.extend(recompute)
        last_fetch = base + len(out) - 1
        moved[first_fetch], moved[last_fetch] = last_fetch, None
    return out, moved


def recomputed_before_fetch(forward: list[Module], backward: list[Module], checkpointed: frozenset[int]
                            ) -> tuple[list[Module], dict[int, int]]:
    """The backward trace with each checkpointed layer's recomputation where the layer drops out its hidden
    states after the MLP (OPT, GPT-2), and {a recomputation's fetch: the backward fetch it runs for}.

    The first tensor backward unpacks in such a layer is the dropout's mask, and the dropout's backward runs
    before the MLP output projection's pre-backward hook (hung on that projection's output, under the dropout):
    so the recomputation comes right before the layer's first backward module with parameters, after the
    parameter-less ones (the layer, GPT-2's ``mlp.dropout``). It stops once the mask is packed, past every
    module's forward: each recomputed module is released as in forward, none moves (a trainable parameter keeps
    its storage to its backward all the same: ``emulate``'s ``saved``), and the output projection is gathered
    again for its backward. Real DeepSpeed runs on CPU of tiny OPT and GPT-2
    (``docs/error_matrix/zero3_arch_ckpt_cpu.csv``)."""
    out: list[Module] = []
    owners: dict[int, int] = {}
    base = len(forward)
    recomputed: set[int] = set()
    for m in backward:
        layer = _layer_of(m.name)
        if layer is not None and layer in checkpointed and m.params and layer not in recomputed:
            recomputed.add(layer)
            prefix = m.name.split(f".{layer}.")[0] + f".{layer}."
            start = base + len(out)
            out.extend(f for f in forward if f.name.startswith(prefix))
            owners.update({at: base + len(out) for at in range(start, base + len(out))})
        out.append(m)
    return out, owners


def recompute_owners(moved: dict[int, int | None]) -> dict[int, int]:
    """{a recomputation's fetch: the backward fetch that triggered the recomputation}, from
    ``with_recomputation``'s moved releases (the trigger's release moves to the recomputation's last fetch, whose
    own release never runs)."""
    out: dict[int, int] = {}
    for first, last in moved.items():
        if last is not None and last in moved and moved[last] is None:
            out.update({at: first for at in range(first + 1, last + 1)})
    return out


def emulate(table: list[ParamInfo], world: int, steps: int = 3, prefetch_bucket: int = 50_000_000,
            max_live: int = 1_000_000_000, max_reuse: int = 1_000_000_000, persistence: int = 100_000,
            checkpointed: frozenset[int] = frozenset(), accumulate: int = 1, recorded: tuple | None = None,
            dropped_out: bool = False, unsaved: frozenset[str] = frozenset(), reentrant: bool = False,
            leaves: tuple[str, ...] = ()
            ) -> GatherOps:
    """The allgather stream's allocations and frees of ``steps`` training steps (module docstring);
    ``checkpointed``: the decoder layers recomputed in backward (``with_recomputation``); ``accumulate``: the
    steps are micro-steps, an optimizer step after every that many (``_micro_step_start``); ``recorded``: the
    profile's module trace, where it stands for the derived one (``modules_of``); ``dropped_out``: the layers
    drop out their hidden states after the MLP, so their recomputation runs before its fetch
    (``recomputed_before_fetch``); ``unsaved``: trainable parameters a recomputation does not save
    (``zero3.unsaved_by_recomputation``), released as in forward; ``reentrant``: the checkpoints re-enter
    (``use_reentrant=True``), so each recomputation runs the layer's whole forward before its first backward
    fetch and saves the parameters themselves (module docstring); ``leaves``: ZeRO-3 leaf modules, each fetched
    whole (``with_leaves``)."""
    if reentrant and checkpointed:
        dropped_out, unsaved = True, frozenset(p.name for p in table)
    index = ds_id_order(table)
    params = {p.name: _Param(p.name, p.numel, p.elem_bytes, p.numel < persistence, p.trainable) for p in table}
    forward, backward = with_leaves(*modules_of(table, recorded, inputs_need_grad=bool(checkpointed)), leaves)
    external = external_params(forward)
    if dropped_out:
        moved: dict[int, int | None] = {}
        backward, owner_of = recomputed_before_fetch(_with_external(forward, external),
                                                     _with_external(backward, external), checkpointed)
    else:
        backward, moved = with_recomputation(_with_external(forward, external), _with_external(backward, external),
                                             checkpointed, external)
        owner_of = recompute_owners(moved)
    first_trace = forward + backward  # the first forward registers the external parameters
    trace = _with_external(forward, external) + backward
    holders: dict[str, set[str]] = {n: set() for ps in external.values() for n in ps}  # ds_active_sub_modules
    releases_after: dict[int, list[int]] = {}
    for at in range(len(trace)):
        if at >= len(forward) and not trace[at].released_in_backward:
            continue  # released by release_and_reset_all, at backward's end
        if at not in moved:
            releases_after.setdefault(at, []).append(at)
        elif moved[at] is not None:
            releases_after.setdefault(moved[at], []).append(at)
    _wrappers_released_last(releases_after, trace, len(forward), external, moved)
    tied: dict[int, dict[str, None]] = {}  # owner's fetch -> the frozen parameters tied to it (ds_recompute_parameters)
    tied_to: dict[str, set[int]] = {}     # parameter -> the owners holding it (in ds_active_sub_modules)

    def tie(at: int, names) -> None:
        """``update_recompute_parameters``: a frozen parameter a recomputation fetches is held for the backward
        module that triggered it (the latest active one), trainable ones are not."""
        if at in owner_of:
            for n in names:
                if not params[n].trainable:
                    tied.setdefault(owner_of[at], {})[n] = None
                    tied_to.setdefault(n, set()).add(owner_of[at])

    def untie(owner: int) -> list[str]:
        """The owner's backward release drops its hold on every tied parameter and releases the non-persistent
        ones, however soon the trace uses them again (``release_sub_module``: ``ds_recompute_parameters``)."""
        names = list(tied.pop(owner, {}))
        for n in names:
            tied_to[n].discard(owner)
        return [n for n in names if not params[n].persistent]

    ops = GatherOps()
    next_buffer = [0]
    state: dict[str, str] = {n: "none" for n in params}  # none | inflight | available
    storage: dict[str, tuple[int, int]] = {}  # parameter -> (buffer, bytes) it owns
    registry: dict[str, dict] = {}            # parameter -> its gather's handle, until its module waits for it

    def alloc(out: list, nbytes: int) -> tuple[int, int]:
        b = next_buffer[0]
        next_buffer[0] += 1
        out.append((1, b, nbytes))
        return b, nbytes

    def aligned_bytes(n: str) -> int:
        return math.ceil(params[n].numel / world) * world * params[n].elem_bytes

    def gather(out: list, names: list[str]) -> None:
        """``__all_gather_params``: one parameter gathers into its own (padded) storage
        (``_all_gather_sequential``), several into one flat tensor per dtype (``_all_gather_coalesced``:
        ``_all_gather_dtype`` for each, in ``sort_dtypes`` order, one parameter alone too)."""
        todo = sorted((n for n in dict.fromkeys(names) if state[n] == "none"), key=index.__getitem__)
        if not todo:
            return
        calls.append(("G", tuple(todo)))
        if len(todo) == 1:
            storage[todo[0]] = alloc(out, aligned_bytes(todo[0]))
            handle = {"groups": [(todo, None)], "complete": False}
        else:
            groups = [[n for n in todo if params[n].elem_bytes == e]
                      for e in sorted({params[n].elem_bytes for n in todo}, key=_dtype_name)]
            handle = {"groups": [(group, alloc(out, sum(aligned_bytes(n) for n in group))) for group in groups],
                      "complete": False}
        for n in todo:
            state[n], registry[n] = "inflight", handle

    def wait(out: list, names) -> None:
        """``MultipleAllGatherHandles.wait`` at the first of the handle's parameters a module needs: each dtype's
        ``AllGatherCoalescedHandle.wait`` in turn copies its parameters out of its flat tensor (``torch.cat`` of
        their partitions, storage of their own, under the allgather stream); the flat tensors go, in dtype
        order, once the last of the handle's parameters has been waited for."""
        for n in names:
            handle = registry.pop(n, None)
            if handle is None:
                continue
            if not handle["complete"]:
                handle["complete"] = True
                for group, flat in handle["groups"]:
                    for m in group:
                        if flat is not None:
                            storage[m] = alloc(out, params[m].numel * params[m].elem_bytes)
                        state[m] = "available"
            if not any(registry.get(m) is handle for group, _ in handle["groups"] for m in group):
                out.extend((-1, *flat) for _, flat in handle["groups"] if flat is not None)
                handle["groups"] = [(group, None) for group, _ in handle["groups"]]

    releasing = [-1]  # the trace index of the module whose release runs (-1: a step's start or end)
    saved: dict[str, tuple[int, int]] = {}  # trainable parameters' gathered storage a recomputation saved

    def release(out: list, name: str) -> bool:
        """``__release_param``. A trainable parameter released by a recomputed module keeps its gathered storage:
        the recomputation saved it for backward as a detached alias (``torch.utils.checkpoint``'s pack hook
        detaches what requires grad; a frozen parameter is saved as itself and follows its release), unless
        the recomputation does not save it (``unsaved``)."""
        if state[name] != "available":
            return False
        state[name] = "none"
        calls.append(("R", name))
        if name in storage:
            if releasing[0] in owner_of and params[name].trainable and name not in unsaved:
                saved[name] = storage.pop(name)
            else:
                out.append((-1, *storage.pop(name)))
        return True

    def free_saved(out: list, module: int) -> None:
        """A backward module's saved tensors go once its backward ran, right before its release."""
        releasing[0] = module
        if module >= len(forward) and module not in owner_of:
            for n in trace[module].params:
                if n in saved:
                    out.append((-1, *saved.pop(n)))

    def step_end(out: list) -> None:
        releasing[0] = -1
        for n in list(saved):
            out.append((-1, *saved.pop(n)))

    def release_module(out: list, module: int, now: int) -> int:
        """The release of ``trace[module]`` at ``now`` (the step id, past the latest fetch): what it or a module
        within max_reuse elements of the trace uses again stays, and what another running module holds. The
        elements released."""
        names = trace[module].params
        forced = untie(module)
        holding = {n for n in names if held(n, module, False)}  # every holder dropped, whatever stays
        holding |= {n for n in (*names, *forced) if tied_to.get(n)}
        keep = {n for n in names if fetched_for.get(n, -10**10) > now} | holding
        traversed = 0
        for later in trace[now:]:
            if traversed >= max_reuse:
                break
            for n in later.params:
                keep.add(n)
                traversed += params[n].numel
        # __params_to_release leaves ds_persist parameters out: gathered by a fetch, they stay to the next
        # release_and_reset_all (a micro-step after one without an optimizer step fetches them: _micro_step_start)
        chosen = [n for n in names if n not in keep and not params[n].persistent]
        chosen += [n for n in forced if n not in holding and n not in chosen]
        return sum(params[n].numel for n in chosen if release(out, n))

    def held(name: str, module: int, fetched: bool) -> bool:
        """Whether an external parameter stays gathered for another module still running (``__release_param``
        releases only a parameter no active module holds); ``fetched``: ``module`` fetched it, else releases.
        A module holds by its identity (``ds_active_sub_modules``), so a recomputed wrapper's hold is its
        backward's, dropped by the backward release."""
        if name not in holders:
            return False
        (holders[name].add if fetched else holders[name].discard)(trace[module].name)
        return not fetched and bool(holders[name])

    def reset_all(out: list) -> None:
        """The optimizer step's ``release_and_reset_all``, right after backward: every parameter still gathered
        (in the trace-recording step only those backward does not release: ``Module.released_in_backward``),
        in ``model.parameters()`` order."""
        for n in reset_order:
            wait(out, [n])
            release(out, n)
        for modules in holders.values():
            modules.clear()

    reset_order = [p.name for p in model_order(table)]
    # step 1: the trace is recorded, nothing prefetched, every parameter released after its module; an adapter
    # the wrapper reads before its own fetch is gathered on the default stream (``estimator.reserved.zero3``)
    out: list = []
    calls: list = []
    read_early = {n for ps in external.values() for n in ps}
    for at, m in enumerate(first_trace):
        if at < len(forward):
            for n in read_early.intersection(m.params):
                state[n] = "available"
        gather(out, list(m.params))
        wait(out, m.params)
        for n in m.params:
            held(n, at, True)
        tie(at, m.params)
        for released in releases_after.get(at, ()):
            free_saved(out, released)
            forced = untie(released)
            for n in dict.fromkeys((*first_trace[released].params, *forced)):
                if not held(n, released, False) and not tied_to.get(n):
                    release(out, n)
    step_end(out)
    if accumulate == 1:  # the optimizer step's release_and_reset_all (what the recomputation ties kept too)
        reset_all(out)
    ops.steps.append(out)
    ops.calls.append(calls)
    queue_order = [(n, step_id) for step_id, m in enumerate(trace) for n in m.params]
    for micro in range(1, steps):
        out = []
        calls = []
        _micro_step_start(out, params, state, registry, micro % accumulate == 0, wait, release)
        queue = deque(queue_order)
        fetched_for: dict[str, int] = {}
        n_available = 0
        for step_id, m in enumerate(trace):
            names = list(m.params)
            before = sum(params[n].numel for n in dict.fromkeys(names) if state[n] == "none")
            gather(out, names)
            n_available += before
            wait(out, names)
            for n in names:
                held(n, step_id, True)
            tie(step_id, names)
            not_yet = {n for n in names if fetched_for.get(n, -10**10) < step_id}
            discarded: set[str] = set()
            while queue and len(discarded) < len(not_yet):
                n, used_at = queue.popleft()
                fetched_for[n] = used_at
                discarded.add(n)
            limit = min(max_live - n_available, prefetch_bucket)
            prefetch: list[str] = []
            numel = 0
            while queue and numel < limit:
                n, used_at = queue.popleft()
                fetched_for[n] = max(fetched_for.get(n, -10**10), used_at)
                if state[n] == "none" and n not in prefetch:
                    prefetch.append(n)
                    numel += params[n].numel
            if prefetch:
                gather(out, prefetch)
                n_available += numel
            for released in releases_after.get(step_id, ()):
                free_saved(out, released)
                n_available -= release_module(out, released, step_id + 1)
            releasing[0] = -1
        step_end(out)
        if (micro + 1) % accumulate == 0:
            reset_all(out)
        ops.steps.append(out)
        ops.calls.append(calls)
    return ops


def _micro_step_start(out: list, params: dict, state: dict, registry: dict, after_optimizer: bool, wait,
                      release) -> None:
    """A (micro-)step's forward start (``reset_step``: ``_clean_inflight_param_registry`` waits for and releases
    what is still in flight). After an optimizer step, whose ``release_and_reset_all`` released everything, the
    persistent parameters are the ones ``_post_step`` gathered (on the default stream: ``zero3``); after a
    micro-step without one (gradient accumulation) nothing was released at its end: what its backward left
    gathered stays, and persistent parameters the trace-recording first step released are fetched like any
    other (on this stream), then kept to the cycle's optimizer step."""
    for n in [n for n in registry]:
        wait(out, [n])
        release(out, n)
    if after_optimizer:
        for n, p in params.items():
            if p.persistent:
                state[n] = "kept"


def pool_requests(ops: GatherOps, stream: int = 1) -> list[tuple]:
    """The gathers as ``estimator.allocator.requests`` tuples (one key per buffer and step)."""
    out: list[tuple] = []
    for k, step in enumerate(ops.steps):
        for sign, b, nbytes in step:
            out.append(("alloc", (k, b), nbytes, stream) if sign > 0 else ("free", (k, b)))
    return out


def reduction_flushes(table: list[ParamInfo], bucket_numel: int) -> list[int]:
    """Bytes of each IPG flush's concatenation on the reduction stream, in backward order (stage 3's
    ``__reduce_and_partition_ipg_grads``: a gradient that would overflow ``reduce_bucket_size`` elements flushes the
    bucket first; a flush of one tensor reduces it in place, 0 here). Backward order: the profile's
    ``backward_index`` where it has one, else the reverse of ``model.parameters()`` with a tied embedding last."""
    trainable = [p for p in model_order(table) if p.trainable]
    if all(p.backward_index is not None for p in trainable):
        order = sorted(trainable, key=lambda p: p.backward_index)
    else:
        tied = [p for p in trainable if p.tied_names]
        order = [p for p in reversed(trainable) if not p.tied_names] + tied
    flushes: list[int] = []
    pending: list[ParamInfo] = []
    elements = 0

    def flush() -> None:
        flushes.append(sum(p.numel * p.elem_bytes for p in pending) if len(pending) > 1 else 0)

    for p in order:
        if elements + p.numel > bucket_numel and elements:
            flush()
            pending, elements = [], 0
        pending.append(p)
        elements += p.numel
    if pending:
        flush()
    return flushes

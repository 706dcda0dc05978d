"""Tensor parallelism's feasibility, from what block 0's code does on meta tensors.

Tensor parallelism runs the model's own attention / MLP code on each rank's shards: column projections produce
out/tp features, row projections read in/tp. Whether that code still works, and which of its attributes must shrink
(a head count, GPT-2's ``split_size``, litgpt's ``config.n_head``), is found by running block 0's modules once on
meta tensors with those local shapes (a dry run, ``profile.trace.meta_forward``), not by guessing from names; how a
fused qkv / gate_up output is cut comes from the ops the analysis' trace saw on it (``fused_layout``).
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch
from torch import nn

from lightning_autopar.profile.records import AttentionInfo, BlockInfo, MLPInfo, _join, one_class_children
from lightning_autopar.profile.trace import Dataflow, Trace, meta_forward


def _last_dim(dim: Any, ndim: int) -> bool:
    return isinstance(dim, int) and dim in (-1, ndim - 1)


def _pieces_of(name: str, shape: tuple[int, ...], args: Any, kwargs: Any, width: int) -> list[int] | None:
    """The widths one op cuts the last dim of a projection output into (split / chunk / view into pieces)."""
    ndim = len(shape)
    if name in ("split", "split_with_sizes"):
        size = args[0] if args else kwargs.get("split_size_or_sections", kwargs.get("split_size"))
        if not _last_dim(args[1] if len(args) > 1 else kwargs.get("dim", 0), ndim):
            return None
        if isinstance(size, int):
            return [size] * (width // size) if size and width % size == 0 else None
        return list(size) if isinstance(size, (list, tuple)) and sum(size) == width else None
    if name == "chunk":
        n = args[0] if args else kwargs.get("chunks")
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        return [width // n] * n if isinstance(n, int) and _last_dim(dim, ndim) and width % n == 0 else None
    return None


def _view_tail(name: str, shape: tuple[int, ...], args: Any, width: int) -> list[int] | None:
    """For a view/reshape/unflatten of the last dim: the sizes it becomes (-1 resolved)."""
    ndim = len(shape)
    if name == "unflatten":
        if len(args) < 2 or not _last_dim(args[0], ndim):
            return None
        tail = list(args[1])
    elif name in ("view", "reshape"):
        sizes = list(args[0]) if len(args) == 1 and isinstance(args[0], (list, tuple)) else list(args)
        if not all(isinstance(v, int) for v in sizes) or len(sizes) <= ndim:
            return None
        tail = sizes[ndim - 1 :]
    else:
        return None
    known = 1
    for v in tail:
        known *= v if v != -1 else 1
    tail = [width // known if v == -1 else v for v in tail]
    product = 1
    for v in tail:
        product *= v
    return tail if product == width else None


def _slice_pieces(consumers: list, width: int) -> list[int] | None:
    """Slices of the last dim (Phi-3: ``qkv[..., :q]``, ``qkv[..., q:q+kv]``, ``qkv[..., q+kv:]``) tiling it."""
    bounds = []
    for name, shape, args, _ in consumers:
        if name != "__getitem__" or not args:
            continue
        index = args[0] if isinstance(args[0], tuple) else (args[0],)
        if not index or not isinstance(index[-1], slice) or not (index[0] is Ellipsis or len(index) == len(shape)):
            continue
        piece = index[-1]
        if piece.step not in (None, 1):
            return None
        start, stop = piece.start or 0, width if piece.stop is None else piece.stop
        start, stop = (start + width if start < 0 else start), (stop + width if stop < 0 else stop)
        bounds.append((start, min(stop, width)))
    bounds.sort()
    if not bounds or bounds[0][0] != 0 or bounds[-1][1] != width:
        return None
    if any(a[1] != b[0] for a, b in zip(bounds, bounds[1:])):
        return None
    return [b - a for a, b in bounds]


def fused_layout(consumers: list, width: int, pieces: int, groups: int = 0, per_group: int = 0
                 ) -> tuple[str, list[int]] | None:
    """How the model's code splits a fused projection's output of ``width`` features, from the ops the trace saw:
    ("sequential", piece widths) for [a | b | c] (split, chunk, slices, or a view into (pieces, ...)); ("grouped",
    [groups, per_group, ...]) for a view into one group per kv head (q heads of the group, then its k and v), or
    into one row per group that the code splits afterwards (GPT-NeoX: ``view(..., heads, 3 * head_dim)``, then
    ``chunk(3, -1)``: q, k and v interleaved per head).
    None when not recognised (or ambiguous: ``groups == pieces``)."""
    for name, shape, args, kwargs in consumers:
        found = _pieces_of(name, shape, args, kwargs, width)
        if found:
            return "sequential", found
        tail = _view_tail(name, shape, args, width)
        if tail and len(tail) >= 2:
            if tail[0] == pieces and groups != pieces:
                return "sequential", [width // pieces] * pieces
            if len(tail) >= 3 and groups and tail[0] == groups and tail[1] == per_group and groups != pieces:
                return "grouped", tail
            if len(tail) == 2 and groups and tail[0] == groups and groups != pieces and per_group \
                    and tail[1] % per_group == 0:  # one row per group, split within it (GPT-NeoX's [q_h|k_h|v_h])
                return "grouped", [groups, per_group, tail[1] // per_group]
    sliced = _slice_pieces(consumers, width)
    return ("sequential", sliced) if sliced else None


# projection (relative to the unit) -> ("col" | "row", weight stored [in, out]); a per-head parameter -> ("heads", _)
Shards = dict[str, tuple[str, bool]]


def _local_params(unit: nn.Module, shards: Shards, tp: int) -> dict[str, torch.Tensor]:
    """Meta tensors with one TP rank's shapes: a column projection holds out/tp outputs (bias too), a row
    projection in/tp inputs (its bias whole: added once, after the sum)."""
    local: dict[str, torch.Tensor] = {}
    for name, p in unit.named_parameters():
        proj, _, leaf = name.rpartition(".")
        shape = list(p.shape)
        if shards.get(name, ("",))[0] == "heads":  # a per-head parameter: its local heads
            shape[0] //= tp
        elif proj in shards:
            kind, transposed = shards[proj]
            if leaf == "weight":
                dim = (1 if transposed else 0) if kind == "col" else (0 if transposed else 1)
                shape[dim] //= tp
            elif leaf == "bias" and kind == "col":
                shape[0] //= tp
        local[name] = torch.empty(shape, dtype=p.dtype, device="meta")
    for name, b in unit.named_buffers():
        local[name] = torch.empty_like(b, device="meta")
    return local


def leaf_width_attributes(mod: nn.Module, out_features: int) -> list[str]:
    """Integer attributes of a column projection that is not an nn.Linear and equal its full output width: GPT-2's
    Conv1D keeps it in ``nf`` and reshapes its output with it, so on a TP rank they must hold the local width."""
    if isinstance(mod, nn.Linear):
        return []
    return [a for a, v in vars(mod).items() if isinstance(v, int) and not isinstance(v, bool) and v == out_features]


def local_width_attributes(unit: nn.Module, shards: Shards, tp: int) -> list[tuple[nn.Module, str, int]]:
    """(module, attribute, local value) for every column projection of ``unit`` (``leaf_width_attributes``)."""
    found = []
    for name, (kind, transposed) in shards.items():
        if kind != "col":
            continue
        mod = unit.get_submodule(name)
        out = mod.weight.shape[1] if transposed else mod.weight.shape[0]
        found += [(mod, attr, out // tp) for attr in leaf_width_attributes(mod, out)]
    return found


def divide_attributes(module: nn.Module, paths: list[str], tp: int) -> Any:
    """Divide the integer attributes at ``paths`` by ``tp``: "n_heads", "config.n_head", or below a submodule
    ("self.num_attention_heads", "self.config.num_attention_heads": HF BERT's heads sit in ``attention.self``
    while TP treats ``attention`` as the attention module). A ``config`` step goes to the owning module's own
    shallow copy of its config (never the config other modules share). Returns a callable that undoes it."""
    undo: list[tuple[Any, str, Any]] = []
    copied: set[int] = set()
    for path in paths:
        *steps, attr = path.split(".")
        owner: Any = module
        for step in steps:
            if step == "config" and isinstance(owner, nn.Module):
                if id(owner) not in copied:
                    undo.append((owner, "config", owner.config))
                    owner.config = copy.copy(owner.config)
                    copied.add(id(owner))
                owner = owner.config
            else:
                owner = getattr(owner, step)
        undo.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, getattr(owner, attr) // tp)

    def restore() -> None:
        for owner, attr, value in reversed(undo):
            setattr(owner, attr, value)

    return restore


def _dry_run(unit: nn.Module, call: tuple[tuple, dict], out_shape: tuple[int, ...], shards: Shards,
             attrs: list[str], tp: int, expected: list[tuple[int, int, int]] | None) -> str | None:
    """Run ``unit`` once on meta tensors with one rank's shards and ``attrs`` divided: None when its own code
    runs, produces the full run's output shape and (attention) attends over its local heads; else why not."""
    restore = divide_attributes(unit, attrs, tp)
    widths = local_width_attributes(unit, shards, tp)
    previous = [(mod, attr, getattr(mod, attr)) for mod, attr, _ in widths]
    try:
        for mod, attr, value in widths:
            setattr(mod, attr, value)
        trace = meta_forward(unit, call, [Dataflow()], grad=False, state=_local_params(unit, shards, tp))
    except Exception as err:  # noqa: BLE001 -- setting the local widths failed: the answer too
        trace = Trace(error=err)
    finally:
        for mod, attr, value in previous:
            setattr(mod, attr, value)
        restore()
    if trace.error is not None:  # the model's own code refusing local shapes is the answer, not a failure
        err = trace.error
        message = str(err).splitlines()[0][:160] if str(err) else ""
        return f"{type(err).__name__}: {message}"
    if trace.output_shape != out_shape:
        return f"output shape {trace.output_shape} instead of {out_shape}"
    seen = [(h, kvh, hd) for _, h, kvh, hd in trace.attention]
    if expected is not None and seen != expected:
        return f"attention over (heads, kv_heads, head_dim) {seen} instead of {expected}"
    return None


MAX_DRY_RUNS = 64


def _width_attributes(unit: nn.Module, values: set[int], exclude: set[int]) -> list[str]:
    """Integer attributes of ``unit``, of its submodules but the projections and other leaves with weights (an
    nn.Linear's ``out_features`` is TP's business, not the code's) and of their ``config`` objects, whose value
    is a head count or projection width; ``unit``'s own first."""

    def wanted(owner: Any) -> list[str]:
        return [a for a, v in vars(owner).items() if isinstance(v, int) and not isinstance(v, bool)
                and v in values and v not in exclude]

    paths: list[str] = []
    for name, mod in unit.named_modules():
        if name and isinstance(getattr(mod, "weight", None), torch.Tensor) and not list(mod.children()):
            continue
        paths += [_join(name, a) for a in wanted(mod)]
        config = getattr(mod, "config", None)
        if config is not None and hasattr(config, "__dict__"):
            paths += [_join(name, "config", a) for a in wanted(config)]
    return paths


def _search_attributes(unit: nn.Module, call: tuple[tuple, dict], out_shape: tuple[int, ...], shards: Shards,
                       candidates: list[str], tp: int, expected: list[tuple[int, int, int]] | None
                       ) -> tuple[list[str] | None, str]:
    """The smallest set of ``candidates`` whose division lets the dry run pass, or (None, the first error)."""
    from itertools import combinations

    first_error, runs = "", 0
    for size in range(len(candidates) + 1):
        for subset in combinations(candidates, size):
            runs += 1
            if runs > MAX_DRY_RUNS:
                return None, first_error
            error = _dry_run(unit, call, out_shape, shards, list(subset), tp, expected)
            if error is None:
                return list(subset), ""
            first_error = first_error or error
    return None, first_error


def _attention_tp(block0: str, attn_mod: nn.Module, info: AttentionInfo, traced: Trace, tp: int) -> None:
    """Fill ``info``'s TP fields: the fused layout, a structural refusal (q/k norm over the full width), and the
    attributes the dry run needs divided."""
    site = _join(block0, info.fqn)
    q_width, kv_width = info.heads * info.head_dim, info.kv_heads * info.head_dim
    probe = traced.probe
    projections = [p for p in (info.q, info.k, info.v, info.qkv) if p]
    per_head = _module_per_head(attn_mod, {info.heads, info.kv_heads}, info.fqn)
    if per_head:
        info.tp_refusal = per_head
        return
    info.head_norms = []
    for norm, (source, width, numel) in probe.norm_inputs.items():
        if not (norm.startswith(site + ".") and source in {f"{site}.{p}" for p in projections} and numel == width):
            continue
        if width > info.head_dim:
            info.tp_refusal = (f"{_join(info.fqn, norm[len(site) + 1:])} is a q/k norm over the full projection width "
                               f"({width}): on a TP rank's local heads its statistics would differ")
            return
        info.head_norms.append(norm[len(site) + 1:])
    if info.qkv:
        found = fused_layout(traced.consumers.get(f"{site}.{info.qkv}", []), q_width + 2 * kv_width, 3,
                             info.kv_heads, info.heads // max(info.kv_heads, 1) + 2)
        if found is None:
            info.tp_refusal = f"{_join(info.fqn, info.qkv)}: how the model splits this fused qkv output was not " \
                              "recognised"
            return
        info.qkv_layout, info.qkv_pieces = found
        if info.qkv_layout == "sequential" and info.qkv_pieces != [q_width, kv_width, kv_width]:
            info.tp_refusal = f"{_join(info.fqn, info.qkv)}: fused pieces {info.qkv_pieces} are not q, k, v"
            return
        # GQA's unequal [q | k | v]: parallel.row_order stores the weight row-permuted (RowOrder), so no refusal
    if site not in probe.calls or site not in probe.out_shapes:
        return
    transposed = set(info.transposed)
    shards: Shards = {p: ("col", p in transposed) for p in projections}
    shards[info.o] = ("row", info.o in transposed)
    shards.update({table: ("col", True) for table in info.head_tables})  # [n, heads]: the heads are its columns
    shards.update({param: ("heads", False) for param in info.head_params})  # [heads]
    expected = [(h // tp, kvh // tp, hd) for s, h, kvh, hd in traced.attention if s == site or s.startswith(site + ".")]
    values = {info.heads, info.kv_heads, q_width, kv_width}
    candidates = _width_attributes(attn_mod, values, {info.head_dim})
    attrs, error = _search_attributes(attn_mod, probe.calls[site], probe.out_shapes[site], shards, candidates, tp,
                                      expected)
    info.tp_validated = True
    if attrs is None:
        info.tp_refusal = f"{info.fqn}: its code does not run on a TP rank's local heads ({error})"
    else:
        info.tp_attrs = attrs


def _mlp_tp(block0: str, mlp_mod: nn.Module, info: MLPInfo, traced: Trace, tp: int) -> None:
    """Fill the MLP's TP refusal: a fused gate_up must be cut in [gate | up]; its code must run on local widths."""
    site = _join(block0, info.fqn)
    probe = traced.probe
    if info.gate_up:
        found = fused_layout(traced.consumers.get(f"{site}.{info.gate_up}", []), 2 * info.ffn_hidden, 2)
        if found is None or found[0] != "sequential" or found[1] != [info.ffn_hidden] * 2:
            info.tp_refusal = (f"{_join(info.fqn, info.gate_up)}: how the model splits this fused gate/up output "
                               "was not recognised")
            return
    if site not in probe.calls or site not in probe.out_shapes:
        return
    transposed = set(info.transposed)
    shards: Shards = {p: ("col", p in transposed) for p in (info.up, info.gate) if p}
    shards[info.down] = ("row", info.down in transposed)
    error = _dry_run(mlp_mod, probe.calls[site], probe.out_shapes[site], shards, [], tp, None)
    if error is not None:
        info.tp_refusal = f"{info.fqn}: its code does not run on a TP rank's local width ({error})"


def _other_attention(block: nn.Module, attn_fqn: str, traced: Trace | None, block_fqn: str) -> list[str]:
    """Attention in ``block`` besides the module at ``attn_fqn``: modules of its class elsewhere in the block (T5,
    BART, Whisper: the decoder's cross-attention, which a trace on token ids alone does not run) and attention
    calls the trace saw outside it."""
    kind = type(block.get_submodule(attn_fqn))
    found = {n for n, m in block.named_modules() if type(m) is kind}
    if traced is not None:
        found |= {s[len(block_fqn) + 1:] for s, *_ in traced.attention if s.startswith(block_fqn + ".")}
    return sorted(n for n in found if n != attn_fqn and not n.startswith(attn_fqn + ".")
                  and not attn_fqn.startswith(n + "."))


def _module_per_head(attention: nn.Module, counts: set[int], prefix: str) -> str:
    """Why TP cannot split an attention that holds one module of 1-D parameters per head (StableLM's q/k
    LayerNorms: a ModuleList of ``heads`` norms zipped with the heads in its forward): on a rank's local heads the
    forward would pair them with the first modules of the list, not their own. "" when it holds none; ``prefix``:
    the attention's path in its block."""
    for name, m in attention.named_modules():
        children = one_class_children(m)
        if name and children and len(children) in counts and all(
                any(True for _ in c.parameters()) and all(p.dim() == 1 for p in c.parameters())
                for c in children):  # norms, say; never the projections (2-D weights)
            return (f"{_join(prefix, name)} holds one {type(children[0]).__name__} per head ({len(children)}): "
                    "on a TP rank's local heads its forward would pair them with the wrong heads")
    return ""


def head_tables(attention: nn.Module, heads: int) -> list[str]:
    """The per-head tables of an attention module: embeddings of a value per head (T5's relative position bias,
    [buckets, heads]), sharded along the heads under TP."""
    return [n for n, m in attention.named_modules() if isinstance(m, nn.Embedding) and m.embedding_dim == heads]


def head_params(attention: nn.Module, heads: int) -> list[str]:
    """The per-head parameters of an attention module: 1-D, one value per head, held by a module with children
    (the attention itself, not a layer such as a norm whose width may equal the head count): GPT-OSS's sinks."""
    return [_join(owner, leaf) for owner, m in attention.named_modules() if list(m.children())
            for leaf, p in m.named_parameters(recurse=False) if p.dim() == 1 and p.shape[0] == heads]


def _smallest_split(*sizes: int) -> int:
    """The smallest tp > 1 dividing all ``sizes`` (what the dry run checks), or 0 when none does."""
    return next((t for t in range(2, min(sizes) + 1) if all(s % t == 0 for s in sizes)), 0) if sizes else 0


def _tp_feasibility(blocks: Sequence[nn.Module], infos: list[BlockInfo], traced: Trace | None) -> None:
    """Block 0's TP layout checks (fused layouts, q/k norms, the dry run) apply to every block (same class).
    Without a trace, fused projections are refused (their layout is unknown) and the head-count attributes found
    by name are used unvalidated, as before."""
    if not infos:
        return
    for block, info in zip(blocks, infos):
        if info.attention is not None and info.attention.heads:
            attention = block.get_submodule(info.attention.fqn)
            info.attention.head_tables = head_tables(attention, info.attention.heads)
            info.attention.head_params = head_params(attention, info.attention.heads)
    first, block0 = infos[0], blocks[0]
    attn, mlp = first.attention, first.mlp
    if attn is not None and attn.fqn:
        others = _other_attention(block0, attn.fqn, traced, first.fqn)
        for info in infos:
            info.other_attention = list(others)
    if traced is None:
        if attn is not None and attn.qkv:
            attn.tp_refusal = f"{_join(attn.fqn, attn.qkv)}: the layout of a fused qkv needs the meta trace, which " \
                              "failed"
        if mlp is not None and mlp.gate_up:
            mlp.tp_refusal = f"{_join(mlp.fqn, mlp.gate_up)}: the layout of a fused gate/up needs the meta trace, " \
                             "which failed"
    else:
        if attn is not None and attn.o and (attn.q or attn.qkv):
            tp = _smallest_split(attn.heads, attn.kv_heads)
            if tp:
                _attention_tp(first.fqn, block0.get_submodule(attn.fqn), attn, traced, tp)
        if mlp is not None:
            tp = _smallest_split(mlp.ffn_hidden)
            if tp:
                _mlp_tp(first.fqn, block0.get_submodule(mlp.fqn) if mlp.fqn else block0, mlp, traced, tp)
    for info in infos:
        if attn is not None and info.attention is not None and info is not first:
            for name in ("qkv_layout", "qkv_pieces", "tp_attrs", "tp_refusal", "tp_validated", "head_norms"):
                setattr(info.attention, name, getattr(attn, name))
        if attn is not None and info.attention is not None and not attn.tp_validated:
            info.attention.tp_attrs = info.attention.heads_attrs + info.attention.kv_heads_attrs
        if mlp is not None and info.mlp is not None and info is not first:
            info.mlp.tp_refusal = mlp.tp_refusal


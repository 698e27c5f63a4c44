"""nn.Module + example batch → OpGraph, on fake tensors (no parameter or activation memory).

One training iteration (forward, loss, backward) is recorded at the example batch b and at
2b; every per-node quantity is then the line through the two (Affine.fit), so a single
capture serves any batch share. Parameters are replaced by fake tensors for the duration of
the capture and restored afterwards, so a real model is left exactly as it was.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map

from heterog.capture.limits import check_batch_inputs, check_seq_len, input_limits
from heterog.capture.recorder import Recorder
from heterog.capture.zoo import get_zoo_model
from heterog.errors import ModelError
from heterog.ir.affine import Affine
from heterog.ir.opgraph import OpEdge, OpGraph, OpNode, Tie


@contextmanager
def fake_parameters(model: nn.Module, fake_mode: FakeTensorMode) -> Iterator[None]:
    """Swap every parameter and buffer for a fake tensor of the same shape, dtype and stride
    on CPU (meta-device models included); ties between modules are kept; restored on exit."""
    memo: dict[int, torch.Tensor] = {}
    originals: list[tuple[dict, str, Any]] = []

    def fake_of(t: torch.Tensor, is_param: bool) -> Any:  # a fake tensor, or a Parameter of one
        if id(t) not in memo:
            with fake_mode:
                f = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
            memo[id(t)] = nn.Parameter(f, requires_grad=t.requires_grad) if is_param else f
        return memo[id(t)]

    for module in model.modules():
        for table, is_param in ((module._parameters, True), (module._buffers, False)):
            for key, value in list(table.items()):
                if value is not None:
                    originals.append((table, key, value))
                    table[key] = fake_of(value, is_param)
    try:
        yield
    finally:
        for table, key, value in originals:
            table[key] = value


def _to_fake(fake_mode: FakeTensorMode, value: Any) -> Any:
    def conv(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or fake_mode.is_our_fake(t):
            return t
        with fake_mode:
            f = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
        return f.requires_grad_(t.requires_grad)

    return tree_map(conv, value)


def _double_batch(value: Any, batch: int, fake_mode: FakeTensorMode) -> Any:
    """The same example with the batch dimension (dim 0 of size `batch`) twice as long."""

    def double(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch:
            with fake_mode:
                return torch.cat([t, t], dim=0).detach().requires_grad_(t.requires_grad)
        return t

    return tree_map(double, value)


def _default_loss(output: Any) -> torch.Tensor:
    logits = getattr(output, "logits", None)
    tensors = (
        [logits]
        if isinstance(logits, torch.Tensor)
        else [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    )
    if not tensors:
        raise ModelError(
            "the model returned no floating-point tensor to build a loss from; pass loss_fn=... to capture()."
        )
    return cast(torch.Tensor, sum(t.float().sum() for t in tensors))


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))


@contextmanager
def _quiet_fake_tensor_log() -> Iterator[None]:
    """FakeTensorMode logs a traceback for every failing op before raising; the error we
    raise from it already says what failed, so keep the user's terminal to one paragraph."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _record(
    model: nn.Module, inputs: tuple, targets: Any, loss_fn: Callable | None, fake_mode: FakeTensorMode, name: str
) -> Recorder:
    flat_inputs = [t for t in tree_flatten((inputs, targets))[0] if isinstance(t, torch.Tensor)]
    rec = Recorder(model, input_tensors=flat_inputs)
    with _quiet_fake_tensor_log(), fake_mode, rec:
        try:
            output = model(*inputs)
        except ModelError:
            raise
        except Exception as e:  # noqa: BLE001 - any model failure is a user-facing ModelError
            if "DataDependent" in type(e).__name__:
                raise ModelError(
                    f"model {name!r} reads tensor values in its forward ({e}); capture runs on "
                    f"fake tensors, which have shapes but no values. Move value-dependent logic "
                    f"(.item(), data-dependent branches) out of forward or give it constants."
                ) from e
            shapes = ", ".join(str(tuple(t.shape)) for t in flat_inputs)
            raise ModelError(
                f"model {name!r} failed on example inputs of shape(s) {shapes}: "
                f"{type(e).__name__}: {str(e).rstrip('.')}. Check that the example batch matches what the "
                f"model's forward expects (shape, dtype, number of arguments)."
            ) from e
        rec.start_loss()
        try:
            if loss_fn is None:
                loss = _default_loss(output)
            elif targets is None:
                loss = loss_fn(output)
            else:
                loss = loss_fn(output, targets)
        except ModelError:
            raise
        except Exception as e:  # noqa: BLE001
            raise ModelError(
                f"the loss of model {name!r} failed: {type(e).__name__}: {str(e).rstrip('.')}. "
                f"Check loss_fn and the targets' shape."
            ) from e
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ModelError(f"the loss of model {name!r} must be a scalar tensor, found {type(loss).__name__}.")
        rec.start_backward()
        params = [p for p in model.parameters() if p.requires_grad]
        if loss.requires_grad and params:
            torch.autograd.grad(loss, params, allow_unused=True)
    return rec


def _assign_unused(rec: Recorder) -> None:
    """Parameters the forward never touched still live on a device: give each to the node
    of its closest enclosing module (else the first node), so parameter totals stay exact."""
    for pname, p in rec.unowned_params():
        owner = pname.rsplit(".", 1)[0] if "." in pname else ""
        best = None
        for node in rec.nodes:
            if owner == node.module_path or owner.startswith(node.module_path + ".") or node.module_path == "":
                if best is None or len(node.module_path) > len(best.module_path):
                    best = node
        best = best or rec.nodes[0]
        best.param_names.append(pname)
        best.param_count += p.numel()
        best.param_bytes += p.numel() * p.element_size()


def _fit_graph(
    a: Recorder,
    b: Recorder,
    batch_a: int,
    batch_b: int,
    *,
    name: str,
    seq_len: int | None,
    input_bytes: Affine,
    num_parameters: int,
    dtype: str,
    meta: dict,
) -> OpGraph:
    names_a = [n.name for n in a.nodes]
    names_b = [n.name for n in b.nodes]
    if names_a != names_b:
        diff = next((x, y) for x, y in zip(names_a + [None], names_b + [None]) if x != y)
        raise ModelError(
            f"model {name!r} runs different ops at batch {batch_a} and {batch_b} (first "
            f"difference: {diff[0]!r} vs {diff[1]!r}), so its costs cannot be fitted as a "
            f"function of the batch. Capture at the batch size you will train with."
        )

    def fit(x: float, y: float) -> Affine:
        f = Affine.fit(batch_a, x, batch_b, y)
        if f.fixed < 0 or f.per_sample < 0:  # not affine (rounding, padding): keep it proportional
            return Affine(0.0, max(x / batch_a, y / batch_b))
        return f

    nodes = _fitted_nodes(a, b, fit)
    edges = []
    for (src, dst), storages in a.edges.items():
        other = b.edges.get((src, dst), {})
        edges.append(
            OpEdge(
                src=nodes[src].name,
                dst=nodes[dst].name,
                bytes=fit(float(sum(storages.values())), float(sum(other.values()))),
            )
        )
    ties = tuple(
        Tie(param=pname, nodes=tuple(nodes[i].name for i in users), param_bytes=nbytes)
        for pname, users, nbytes in a.ties()
    )
    conv = {nodes[i].name: na.conv for i, na in enumerate(a.nodes) if na.conv is not None}
    graph = OpGraph(
        model=name,
        batch_size=batch_a,
        seq_len=seq_len,
        dtype=dtype,
        nodes=tuple(nodes),
        edges=tuple(edges),
        input_bytes=input_bytes,
        num_parameters=num_parameters,
        meta={**meta, "conv": conv} if conv else meta,
        ties=ties,
    )
    return graph.validate()


def _fitted_nodes(a: Recorder, b: Recorder, fit: Callable[[float, float], Affine]) -> list[OpNode]:
    """The OpGraph nodes: each recorded node's costs fitted as affine in the batch between
    the two captures (a and b record the same ops)."""
    nodes: list[OpNode] = []
    for na, nb in zip(a.nodes, b.nodes):
        fwd_flops = fit(na.fwd_flops, nb.fwd_flops)
        out_a = float(sum(na.consumed.values()))
        out_b = float(sum(nb.consumed.values()))
        output_bytes = fit(out_a, out_b)
        fwd_bytes = fit(na.fwd_bytes, nb.fwd_bytes)
        nodes.append(
            OpNode(
                name=na.name or f"{na.module_path or 'root'}::op@{len(nodes)}",
                module_path=na.module_path,
                module_type=na.module_type,
                kind=a.node_kind(na),
                fwd_flops=fwd_flops,
                bwd_flops=fit(na.bwd_flops, nb.bwd_flops),
                fwd_bytes=fwd_bytes,
                bwd_bytes=fit(na.bwd_bytes, nb.bwd_bytes),
                saved_bytes=fit(na.saved_bytes, nb.saved_bytes),
                output_bytes=output_bytes,
                workspace_bytes=fit(a.workspace_bytes(na), b.workspace_bytes(nb)),
                param_names=tuple(na.param_names),
                param_count=na.param_count,
                param_bytes=na.param_bytes,
                batch_splittable=(fwd_flops.per_sample > 0 or output_bytes.per_sample > 0 or fwd_bytes.per_sample > 0),
                fwd_kernels=na.fwd_kernels,
                bwd_kernels=na.bwd_kernels,
                tensor_core_flops_fraction=Recorder.tensor_core_fraction(na),
            )
        )
    return nodes


def _batch_of(inputs: tuple) -> int:
    for t in tree_flatten(inputs)[0]:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    raise ModelError(
        "the example inputs hold no tensor with a batch dimension; pass at least "
        "one tensor whose first dimension is the batch."
    )


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied weight counts once)."""
    return sum(p.numel() for p in model.parameters())


def capture(
    model: nn.Module,
    example_inputs: tuple | torch.Tensor,
    *,
    loss_fn: Callable | None = None,
    name: str = "model",
    targets: Any = None,
    seq_len: int | None = None,
) -> OpGraph:
    """Record one training iteration of `model` on fake tensors and return its OpGraph.

    `example_inputs` is the positional-argument tuple of forward (dim 0 = batch); they may be
    real, meta-free fake, or CPU tensors — only shapes and dtypes are used. `loss_fn(output)`
    (or `loss_fn(output, targets)` when `targets` is given) makes the scalar loss; by default
    the sum of the floating outputs (`.logits` for Hugging Face outputs).
    """
    if not isinstance(model, nn.Module):
        raise ModelError(f"capture() needs an nn.Module, found {type(model).__name__}.")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    return _capture(
        model, tuple(example_inputs), targets, loss_fn, name, seq_len, FakeTensorMode(allow_non_fake_inputs=True)
    )


def _capture(
    model: nn.Module,
    example_inputs: tuple,
    targets: Any,
    loss_fn: Callable | None,
    name: str,
    seq_len: int | None,
    fake_mode: FakeTensorMode,
) -> OpGraph:
    started = time.perf_counter()
    was_training = model.training
    model.train()
    try:
        with fake_parameters(model, fake_mode):
            inputs = _to_fake(fake_mode, example_inputs)
            tgt = _to_fake(fake_mode, targets)
            batch = _batch_of(inputs)
            rec_a = _record(model, inputs, tgt, loss_fn, fake_mode, name)
            inputs2 = _double_batch(inputs, batch, fake_mode)
            tgt2 = _double_batch(tgt, batch, fake_mode)
            rec_b = _record(model, inputs2, tgt2, loss_fn, fake_mode, name)
            _assign_unused(rec_a)
            _assign_unused(rec_b)
            input_bytes = Affine.fit(batch, _nbytes((inputs, tgt)), 2 * batch, _nbytes((inputs2, tgt2)))
            dtypes = {p.dtype for p in model.parameters()}
            dtype = str(next(iter(dtypes))).replace("torch.", "") if len(dtypes) == 1 else "mixed"
            meta = {
                "torch_version": torch.__version__,
                "capture_time_s": 0.0,
                "batch_sizes_fitted": [batch, 2 * batch],
                "model_class": type(model).__name__,
            }
            graph = _fit_graph(
                rec_a,
                rec_b,
                batch,
                2 * batch,
                name=name,
                seq_len=seq_len,
                input_bytes=input_bytes,
                num_parameters=count_parameters(model),
                dtype=dtype,
                meta=meta,
            )
            rec_a.finish()
            rec_b.finish()
    finally:
        model.train(was_training)
    graph.meta["capture_time_s"] = round(time.perf_counter() - started, 3)
    return graph


def capture_model(
    name: str, model_args: dict[str, Any] | None = None, *, batch_size: int, seq_len: int | None = None
) -> OpGraph:
    """Capture a zoo model (or 'path/file.py:factory') at `batch_size`, built on the meta
    device so that no parameter memory is allocated at any model size."""
    entry = get_zoo_model(name)
    args = dict(model_args or {})
    if batch_size <= 0:
        raise ModelError(f"batch size must be positive, found {batch_size}.")
    seq: int | None
    if entry.default_seq_len is not None:
        seq = seq_len or entry.default_seq_len
    else:  # image / vector models take no sequence; a user file's example_batch may
        seq = seq_len if getattr(entry, "family", "user") == "user" else None
    with torch.device("meta"):
        model = entry.build(**args)
    _check_inputs(entry, model, name, args, batch_size, seq)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        try:
            inputs, targets = entry.example_batch(batch_size, seq, device="cpu", **args)
        except ModelError:
            raise
        except Exception as e:  # noqa: BLE001
            raise ModelError(
                f"model {name!r}: example_batch({batch_size}, {seq}) failed: {type(e).__name__}: {e}."
            ) from e
    graph = _capture(model, tuple(inputs), targets, entry.loss, name, seq, fake_mode)
    graph.meta["model_args"] = args
    return graph


_POSITION_ARGS = ("positions", "n_positions", "max_positions", "max_position_embeddings", "block_size", "max_seq_len")


def _check_inputs(entry: Any, model: nn.Module, name: str, args: dict[str, Any], batch_size: int, seq: int | None):
    """Before capturing: the sequence length within the model's limit, and a user model's
    example token ids within its vocabulary (capture/limits.py). The ids are drawn for real
    (the capture's are fake), only for a user model with a vocabulary."""

    limits = input_limits(model)
    builder = getattr(entry, "builder", None)
    accepted = inspect.signature(builder).parameters if callable(builder) else {}
    check_seq_len(limits, seq, model_name=name, positions_arg=next((a for a in _POSITION_ARGS if a in accepted), None))
    if getattr(entry, "family", "user") != "user" or limits.vocab_size is None:
        return
    with torch.random.fork_rng(devices=[]):
        try:
            inputs, _ = entry.example_batch(batch_size, seq, device="cpu", **args)
        except Exception:  # noqa: BLE001 - the capture below reports a failing example_batch
            return
    check_batch_inputs(limits, tuple(inputs), model_name=name, source=f"model {name!r}: example_batch({batch_size})")

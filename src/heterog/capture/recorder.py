"""Records one training iteration (forward, loss, backward) op by op, at one batch size.

A TorchDispatchMode sees every aten op with its (fake) tensors. Global module hooks keep a
stack of running modules; an op belongs to the outermost *leaf* module on that stack (a module
with no child modules), or else to a "loose run": consecutive ops a container module executes
itself between its children's calls (a residual add, attention reshapes). Naming (shared with
the executor, which maps fx call_module targets to these names):

- leaf call: its module path, "#k" appended for the k-th repeated call (k ≥ 1);
- loose run: "<parent path or 'root'>::<first aten op>@<k>", k counting that parent's runs;
- ops after the model returns (the loss): "loss::<first aten op>@<k>".

Backward ops are attributed to the node whose forward created their autograd node: every
autograd Node carries a sequence number, and each forward op's outputs get their grad_fn
right after the op leaves the dispatcher, so we read it at the next dispatch and map
sequence_nr → node; during backward, torch._C._current_autograd_node() names the running one.

Tensors are identified by their storage; every tensor seen stays referenced until the end of
the capture so that a freed storage's address is never reused under a different producer.

A value's producer is the node whose op last *returned* that tensor, as torch.export sees it
(its tracer binds each tensor object to the latest traced op that returned it): so a call
that returns its input object unchanged — dropout with p = 0, `.to()` or `.contiguous()`
that have nothing to do — makes the calling node the producer, although no aten op reaches
the dispatcher (such composite ops return before it). A TorchFunctionMode (_AliasWatch) sees
those calls; the node reads the tensor (an edge from its previous producer) and produces it
from then on. A module that returns its input without calling torch (nn.Identity) is not a
producer, for the export sees no op there either. The executor cuts the exported graph at
the groups the capture's edges connect, so the two must agree (test_capture_graph.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from heterog._signals import signals_deferred as _signals_deferred
from heterog.capture.flops import is_view_op, op_cost, op_kind, op_name, tensor_nbytes


def conv_geometry(args: tuple) -> dict[str, Any]:
    """What the cost model needs to know of aten.convolution(input, weight, bias, stride,
    padding, dilation, transposed, output_padding, groups) to pick cuDNN's algorithm: kernel
    size, channels, groups, stride, and whether the input is channels-last (NHWC)."""
    x, w = args[0], args[1]
    return {
        "kernel": [int(k) for k in w.shape[2:]],
        "in_channels": int(x.shape[1]),
        "out_channels": int(w.shape[0]),
        "groups": int(args[8]),
        "stride": max(int(v) for v in args[3]),
        "channels_last": x.dim() == 4
        and x.shape[1] > 1
        and not x.is_contiguous()
        and x.is_contiguous(memory_format=torch.channels_last),
    }


def is_leaf_module(module: nn.Module) -> bool:
    """A placeable unit: a module with no child modules. The executor's fx tracer uses the
    same rule (is_leaf_module) so that its call_module targets match OpGraph node names."""
    return next(iter(module.children()), None) is None


_LOSS_CONTEXT = object()  # ops run after the model returned: the loss


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


@dataclass(slots=True)
class NodeStats:
    """Raw totals of one node at one batch size (plain numbers; the fit makes them Affine)."""

    name: str | None
    module_path: str
    module_type: str
    is_leaf: bool
    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    tc_flops: float = 0.0  # matrix-class FLOPs, forward + backward
    fwd_bytes: float = 0.0
    bwd_bytes: float = 0.0
    saved_bytes: float = 0.0
    bwd_workspace_bytes: float = 0.0
    fwd_kernels: int = 0
    bwd_kernels: int = 0
    kinds: set[str] = field(default_factory=set)
    param_names: list[str] = field(default_factory=list)
    param_count: int = 0
    param_bytes: int = 0
    fwd_outputs: dict[int, int] = field(default_factory=dict)  # storage → largest nbytes written
    consumed: dict[int, int] = field(default_factory=dict)  # storage → nbytes read by others
    conv: dict[str, Any] | None = None  # its convolution's geometry (conv_geometry), if it runs one


@dataclass(slots=True)
class _Frame:
    module: nn.Module
    path: str
    is_leaf: bool


class _AliasWatch(TorchFunctionMode):
    """Tells the recorder of every torch call that returns one of its input tensors as is."""

    def __init__(self, recorder: Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and self.recorder.phase == "fwd":
            if any(a is out for a in tree_flatten((args, kwargs))[0]):
                self.recorder.returned_input(func, out)
        return out


class Recorder(TorchDispatchMode):
    """Use as: `with fake_mode, Recorder(model, input_tensors=...) as rec:` run the forward,
    `rec.start_loss()`, compute the loss, `rec.start_backward()`, run autograd; then read
    rec.nodes / rec.edges and call rec.finish() to drop the tensors it kept alive."""

    def __init__(self, model: nn.Module, *, input_tensors: list[torch.Tensor]):
        super().__init__()
        self.names: dict[int, str] = {}
        self.params: dict[int, tuple[str, nn.Parameter]] = {}  # storage → (name, param)
        self.buffer_storages: set[int] = set()
        for mod_name, mod in model.named_modules(remove_duplicate=False):
            self.names.setdefault(id(mod), mod_name)
        for pname, p in model.named_parameters(remove_duplicate=True):
            self.params.setdefault(_storage_key(p), (pname, p))
        for _, b in model.named_buffers(remove_duplicate=True):
            self.buffer_storages.add(_storage_key(b))
        self.nodes: list[NodeStats] = []
        self.edges: dict[tuple[int, int], dict[int, int]] = {}  # (src, dst) → storage → bytes
        self.phase = "fwd"  # fwd | loss | bwd
        self._stack: list[_Frame] = []
        self._context: object | None = None
        self._current: int = -1
        self._leaf_calls: dict[str, int] = {}
        self._loose_runs: dict[str, int] = {}
        self._producer: dict[int, int] = {}  # storage → node of its last (non-view) writer
        self._producer_of: dict[int, int] = {}  # id(tensor) → node whose op returned it
        self._saved: set[int] = set()
        self._seq_to_node: dict[int, int] = {}
        self._pending: list[tuple[list[torch.Tensor], int]] = []
        self._keepalive: list[Any] = []
        self._last_bwd: int = -1
        self._owned_params: set[int] = set()
        self._param_users: dict[int, list[int]] = {}  # storage → nodes reading it
        self._hooks: list[Any] = []
        self._saved_hooks: Any = None
        self._alias_watch = _AliasWatch(self)
        self._signals: Any = None
        self._alias_opened: dict[int, Any] = {}  # unnamed loose node → the call that opened it
        self._input_storages = {_storage_key(t) for t in input_tensors}

    # -- lifecycle ----------------------------------------------------------------------------
    def __enter__(self):
        self._hooks = [
            nn.modules.module.register_module_forward_pre_hook(self._pre_hook),
            nn.modules.module.register_module_forward_hook(self._post_hook, always_call=True),
        ]
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._saved_hooks.__enter__()
        self._signals = _signals_deferred()
        self._signals.__enter__()
        self._alias_watch.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._alias_watch.__exit__(*exc)
            self._saved_hooks.__exit__(*exc)
            for h in self._hooks:
                h.remove()
            self._hooks = []
            self._signals.__exit__(None, None, None)  # held signals are delivered here

    def start_loss(self) -> None:
        self._resolve_pending()
        self._settle_name()
        self.phase = "loss"
        self._context = None

    def start_backward(self) -> None:
        self._resolve_pending()
        self.phase = "bwd"
        self._context = None

    # -- module stack -------------------------------------------------------------------------
    def _pre_hook(self, module: nn.Module, args: Any) -> None:
        path = self.names.get(id(module))
        if path is None:  # a module outside the model (e.g. a loss module): not a placement unit
            path = f"<{type(module).__name__}>"
        frame = _Frame(module, path, is_leaf_module(module))
        self._stack.append(frame)
        if (
            self.phase == "fwd"
            and frame.is_leaf
            and not path.startswith("<")
            and not any(f.is_leaf for f in self._stack[:-1])
        ):
            # A node per leaf call even if it runs no op (nn.Identity), so that the nodes
            # match the executor's fx call_module targets one for one.
            self._forward_owner()

    def _post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._stack and self._stack[-1].module is module:
            self._stack.pop()

    # -- attribution --------------------------------------------------------------------------
    def _new_node(self, name: str | None, path: str, mtype: str, is_leaf: bool) -> int:
        self.nodes.append(NodeStats(name=name, module_path=path, module_type=mtype, is_leaf=is_leaf))
        return len(self.nodes) - 1

    def _forward_owner(self) -> int:
        """The node of the op (or saved tensor) happening now in forward or loss."""
        frame: _Frame | None = None
        if self.phase == "fwd":
            frame = next((f for f in self._stack if f.is_leaf and not f.path.startswith("<")), None)
            if frame is None:
                inner = [f for f in self._stack if not f.path.startswith("<")]
                frame = inner[-1] if inner else None
        context: object = frame if frame is not None else _LOSS_CONTEXT
        if context is self._context:
            return self._current
        self._settle_name()
        self._context = context
        if frame is not None and frame.is_leaf:
            k = self._leaf_calls.get(frame.path, 0)
            self._leaf_calls[frame.path] = k + 1
            base = frame.path or "root"
            name = base if k == 0 else f"{base}#{k}"
            self._current = self._new_node(name, frame.path, type(frame.module).__name__, True)
        elif frame is not None:
            self._current = self._new_node(None, frame.path, type(frame.module).__name__, False)
        else:
            self._current = self._new_node(None, "", "loss", False)
        return self._current

    def _settle_name(self) -> None:
        """Name the current node before leaving it if only an aliasing call ran in it."""
        func = self._alias_opened.pop(self._current, None)
        if func is not None and self.nodes[self._current].name is None:
            self._name_loose(self._current, func)

    def _name_loose(self, idx: int, func: Any) -> None:
        node = self.nodes[idx]
        parent = "loss" if node.module_type == "loss" else (node.module_path or "root")
        k = self._loose_runs.get(parent, 0)
        self._loose_runs[parent] = k + 1
        node.name = f"{parent}::{op_name(func)}@{k}"

    def _backward_owner(self) -> int:
        grad_fn = torch._C._current_autograd_node()
        idx = self._seq_to_node.get(grad_fn._sequence_nr()) if grad_fn is not None else None
        if idx is None:
            # Seeding the gradient, or an autograd node made outside aten dispatch (a custom
            # autograd.Function): charge the neighbour in backward order.
            idx = self._last_bwd if self._last_bwd >= 0 else len(self.nodes) - 1
        self._last_bwd = idx
        return idx

    def _resolve_pending(self) -> None:
        for tensors, idx in self._pending:
            for t in tensors:
                gf = t.grad_fn
                if gf is not None:
                    self._seq_to_node.setdefault(gf._sequence_nr(), idx)
        self._pending = []

    # -- saved tensors ------------------------------------------------------------------------
    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.phase == "bwd" or not isinstance(t, torch.Tensor):
            return t
        key = _storage_key(t)
        if key in self._saved or key in self.params or key in self.buffer_storages:
            return t
        self._saved.add(key)
        self._keepalive.append(t)
        self.nodes[self._forward_owner()].saved_bytes += t.untyped_storage().nbytes()
        return t

    # -- ops ----------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "namespace", "aten") == "prim":
            # prim.device & co. are queried inside autograd kernels, before the output's
            # grad_fn is set; they are metadata, not work.
            return func(*args, **kwargs)
        if self.phase != "bwd":
            self._resolve_pending()
        out = func(*args, **kwargs)
        flops, is_tc, traffic = op_cost(func, args, kwargs, out)
        view = is_view_op(func)
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self._keepalive.append(outs)
        if self.phase == "bwd":
            node = self.nodes[self._backward_owner()]
            node.bwd_flops += flops
            node.bwd_bytes += traffic
            node.bwd_kernels += 0 if view else 1
            if not view:
                node.bwd_workspace_bytes = max([node.bwd_workspace_bytes] + [tensor_nbytes(t) for t in outs])
        else:
            idx = self._forward_owner()
            node = self.nodes[idx]
            if node.name is None:
                self._name_loose(idx, func)
            node.fwd_flops += flops
            node.fwd_bytes += traffic
            node.fwd_kernels += 0 if view else 1
            node.kinds.add(op_kind(func))
            if op_name(func) in ("_softmax", "_safe_softmax", "softmax"):
                node.kinds.add("softmax")
            if op_name(func) == "convolution" and node.conv is None:
                node.conv = conv_geometry(args)
            self._track_inputs(idx, ins)
            for t in outs:
                # A view (or an in-place op) returns a tensor the current node produced; its
                # storage's data was written by whoever wrote it last.
                self._producer_of[id(t)] = idx
                if not view:
                    key = _storage_key(t)
                    self._producer[key] = idx
                    node.fwd_outputs[key] = max(node.fwd_outputs.get(key, 0), tensor_nbytes(t))
            self._pending.append((outs, idx))
        node.tc_flops += flops if is_tc else 0.0
        return out

    def returned_input(self, func: Any, t: torch.Tensor) -> None:
        """A forward torch call returned its input `t` itself (no aten op ran): the calling
        node reads t and is its producer from now on (see the module docstring)."""
        key = _storage_key(t)
        if key in self.params or key in self.buffer_storages:
            return
        self._resolve_pending()
        idx = self._forward_owner()
        if self.nodes[idx].name is None:  # a loose run is named by its first aten op,
            self._alias_opened[idx] = func  # or by this call when no aten op follows
        if self._producer_of.get(id(t), self._producer.get(key)) != idx:
            self._track_inputs(idx, [t])
            self._producer_of[id(t)] = idx

    def _track_inputs(self, idx: int, ins: list[torch.Tensor]) -> None:
        node = self.nodes[idx]
        for t in ins:
            key = _storage_key(t)
            param = self.params.get(key)
            if param is not None:
                users = self._param_users.setdefault(key, [])
                if idx not in users:
                    users.append(idx)
                if key not in self._owned_params:  # a shared/tied parameter: first user owns it
                    self._owned_params.add(key)
                    name, p = param
                    node.param_names.append(name)
                    node.param_count += p.numel()
                    node.param_bytes += tensor_nbytes(p)
                continue
            src = self._producer_of.get(id(t), self._producer.get(key))
            if src is None or src == idx:
                continue
            nbytes = tensor_nbytes(t)
            per_storage = self.edges.setdefault((src, idx), {})
            per_storage[key] = max(per_storage.get(key, 0), nbytes)
            producer = self.nodes[src]
            producer.consumed[key] = max(producer.consumed.get(key, 0), nbytes)

    def unowned_params(self) -> list[tuple[str, nn.Parameter]]:
        """Parameters no op touched (unused in this forward); the caller assigns them."""
        return [v for k, v in self.params.items() if k not in self._owned_params]

    def ties(self) -> list[tuple[str, list[int], int]]:
        """(parameter name, its user nodes in first-use order, bytes) for every parameter read
        by more than one node: tied weights, or a module called twice. The first user owns it."""
        out = []
        for key, users in self._param_users.items():
            if len(users) > 1:
                name, p = self.params[key]
                out.append((name, list(users), tensor_nbytes(p)))
        return out

    def finish(self) -> None:
        self._keepalive.clear()
        self._pending = []

    def workspace_bytes(self, node: NodeStats) -> float:
        """Largest transient: an op output that neither leaves the node nor is saved."""
        fwd = [nb for key, nb in node.fwd_outputs.items() if key not in node.consumed and key not in self._saved]
        return float(max(fwd + [node.bwd_workspace_bytes]))

    def node_kind(self, node: NodeStats) -> str:
        if node.module_type == "loss":
            return "loss"
        if node.module_type.endswith("Norm") or node.module_type.endswith("Norm2d"):
            return "norm"
        if "matmul" in node.kinds and "softmax" in node.kinds and node.param_count == 0:
            return "attention"  # unfused attention: QK^T, softmax, PV between projections
        for kind in (
            "attention",
            "conv",
            "matmul",
            "embedding",
            "loss",
            "norm",
            "pool",
            "reduction",
            "elementwise",
            "memory",
            "other",
        ):
            if kind in node.kinds:
                return kind
        return "other"

    @staticmethod
    def tensor_core_fraction(node: NodeStats) -> float:
        total = node.fwd_flops + node.bwd_flops
        return min(1.0, node.tc_flops / total) if total > 0 else 0.0


__all__ = ["Recorder", "NodeStats", "is_leaf_module"]

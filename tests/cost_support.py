"""A synthetic transformer-like OpGraph with hand-computed costs, for the cost tests (they must
not depend on the capture stage)."""

from __future__ import annotations

from heterog.ir.affine import Affine
from heterog.ir.opgraph import OpEdge, OpGraph, OpNode

F32 = 4


def linear(name: str, path: str, fin: int, fout: int, seq: int) -> OpNode:
    tokens = seq
    flops = 2.0 * tokens * fin * fout
    act_in, act_out = tokens * fin * F32, tokens * fout * F32
    params = fin * fout + fout
    return OpNode(
        name=name,
        module_path=path,
        module_type="Linear",
        kind="matmul",
        fwd_flops=Affine(0, flops),
        bwd_flops=Affine(0, 2 * flops),
        fwd_bytes=Affine(params * F32, act_in + act_out),
        bwd_bytes=Affine(2 * params * F32, 2 * (act_in + act_out)),
        saved_bytes=Affine(0, act_in),
        output_bytes=Affine(0, act_out),
        param_names=(f"{path}.weight", f"{path}.bias"),
        param_count=params,
        param_bytes=params * F32,
        fwd_kernels=1,
        bwd_kernels=3,
        tensor_core_flops_fraction=1.0,
    )


def elementwise(name: str, path: str, kind: str, numel: int, params: int = 0) -> OpNode:
    b = numel * F32
    return OpNode(
        name=name,
        module_path=path,
        module_type="GELU" if kind == "elementwise" else "LayerNorm",
        kind=kind,
        fwd_flops=Affine(0, 8.0 * numel),
        bwd_flops=Affine(0, 16.0 * numel),
        fwd_bytes=Affine(0, 2 * b),
        bwd_bytes=Affine(0, 3 * b),
        saved_bytes=Affine(0, b),
        output_bytes=Affine(0, b),
        param_names=(f"{path}.weight",) if params else (),
        param_count=params,
        param_bytes=params * F32,
        fwd_kernels=1,
        bwd_kernels=1,
    )


def transformer_graph(*, layers: int = 2, hidden: int = 256, seq: int = 64, batch: int = 4) -> OpGraph:
    nodes: list[OpNode] = []
    for i in range(layers):
        p = f"blocks.{i}"
        nodes += [
            elementwise(f"{p}.ln1", f"{p}.ln1", "norm", seq * hidden, params=2 * hidden),
            linear(f"{p}.attn.qkv", f"{p}.attn.qkv", hidden, 3 * hidden, seq),
            OpNode(
                name=f"{p}.attn::matmul@0",
                module_path=f"{p}.attn",
                module_type="Attention",
                kind="attention",
                fwd_flops=Affine(0, 4.0 * seq * seq * hidden),
                bwd_flops=Affine(0, 8.0 * seq * seq * hidden),
                fwd_bytes=Affine(0, 4 * seq * hidden * F32),
                bwd_bytes=Affine(0, 8 * seq * hidden * F32),
                saved_bytes=Affine(0, 4 * seq * hidden * F32),
                output_bytes=Affine(0, seq * hidden * F32),
                workspace_bytes=Affine(0, seq * seq * F32),
                fwd_kernels=3,
                bwd_kernels=6,
                tensor_core_flops_fraction=1.0,
            ),
            linear(f"{p}.attn.proj", f"{p}.attn.proj", hidden, hidden, seq),
            elementwise(f"{p}.ln2", f"{p}.ln2", "norm", seq * hidden, params=2 * hidden),
            linear(f"{p}.mlp.fc1", f"{p}.mlp.fc1", hidden, 4 * hidden, seq),
            elementwise(f"{p}.mlp.act", f"{p}.mlp.act", "elementwise", seq * 4 * hidden),
            linear(f"{p}.mlp.fc2", f"{p}.mlp.fc2", 4 * hidden, hidden, seq),
        ]
    nodes.append(linear("head", "head", hidden, 1000, 1))
    nodes.append(
        OpNode(
            name="root::cross_entropy@0",
            module_path="",
            module_type="Model",
            kind="loss",
            fwd_flops=Affine(0, 5000.0),
            bwd_flops=Affine(0, 5000.0),
            fwd_bytes=Affine(0, 8000.0),
            bwd_bytes=Affine(0, 8000.0),
            saved_bytes=Affine(0, 4000.0),
            output_bytes=Affine(4, 0),
            fwd_kernels=2,
            bwd_kernels=2,
        )
    )
    edges = tuple(OpEdge(src=a.name, dst=b.name, bytes=a.output_bytes) for a, b in zip(nodes, nodes[1:]))
    return OpGraph(
        model="synthetic-transformer",
        batch_size=batch,
        seq_len=seq,
        nodes=tuple(nodes),
        edges=edges,
        num_parameters=sum(n.param_count for n in nodes),
    ).validate()


def conv_graph() -> OpGraph:
    """One convolution followed by a ReLU (a stem), for the cuDNN host-cost tests."""
    act = 64 * 56 * 56 * 4
    conv = OpNode(
        name="conv1",
        module_path="conv1",
        module_type="Conv2d",
        kind="conv",
        fwd_flops=Affine(0, 2.0 * 64 * 64 * 9 * 56 * 56),
        bwd_flops=Affine(0, 4.0 * 64 * 64 * 9 * 56 * 56),
        fwd_bytes=Affine(64 * 64 * 9 * 4, 2 * act),
        bwd_bytes=Affine(2 * 64 * 64 * 9 * 4, 4 * act),
        saved_bytes=Affine(0, act),
        output_bytes=Affine(0, act),
        param_names=("conv1.weight",),
        param_count=64 * 64 * 9,
        param_bytes=64 * 64 * 9 * 4,
        fwd_kernels=1,
        bwd_kernels=2,
        tensor_core_flops_fraction=1.0,
    )
    relu = OpNode(
        name="relu",
        module_path="relu",
        module_type="ReLU",
        kind="elementwise",
        fwd_flops=Affine(0, act / 4),
        bwd_flops=Affine(0, act / 4),
        fwd_bytes=Affine(0, 2 * act),
        bwd_bytes=Affine(0, 3 * act),
        saved_bytes=Affine(0, act),
        output_bytes=Affine(0, act),
        fwd_kernels=1,
        bwd_kernels=1,
    )
    return OpGraph(
        model="conv-stem",
        nodes=(conv, relu),
        edges=(OpEdge(src="conv1", dst="relu", bytes=Affine(0, act)),),
        input_bytes=Affine(0, act),
        batch_size=1,
    )

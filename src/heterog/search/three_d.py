"""The Megatron/DeepSpeed-style 3D plan of a transformer: tensor × pipeline × data parallelism.

`megatron_3d` writes the plan a Megatron-LM user runs (Narayanan et al., "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC'21): the model's
transformer blocks (its layers) cut into `pp` contiguous stages (`stage_layers` of them each,
else an even split as Megatron's --num-layers / --pipeline-model-parallel-size), each stage
replicated `dp` times with equal shares, each replica a `tp`-way tensor-parallel set. Ranks
follow Megatron's default order (megatron/core/parallel_state.py, order "tp-dp-pp"): the
tensor rank fastest, then the data-parallel rank, then the stage — rank = (stage · dp +
replica) · tp + tensor rank — over `devices` (default: the cluster's first tp·pp·dp devices).
Nodes before the first block (the embeddings) join the first stage, nodes after the last
block's end (final norm, head, loss) the last, as Megatron's pre_process / post_process do.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from heterog.cost.tensor_parallel import DEGREES, megatron_layout
from heterog.errors import GraphError, PlanError
from heterog.hardware.cluster import Cluster
from heterog.ir.kinds import PipelineSchedule, Precision, ShardStage, SyncMethod
from heterog.ir.opgraph import OpGraph
from heterog.ir.plan import Group, ModelSpec, Plan, Replica
from heterog.lower.context import SimCache
from heterog.simulate.result import SimResult
from heterog.simulate.simulator import simulate

STRATEGY = "3d"
REGIONS_PER_BLOCK = 2  # Megatron splits a block's attention and its MLP: two regions


def block_starts(graph: OpGraph) -> list[int]:
    """Graph index of each transformer block's first node (its first norm), in order."""
    try:
        regions = megatron_layout(graph, vocab_parallel=False).regions
    except GraphError as e:
        raise PlanError(f"a 3d plan cuts a transformer into its blocks, but {e}") from None
    if len(regions) % REGIONS_PER_BLOCK:
        raise PlanError(
            f"{graph.model}: {len(regions)} split regions found, not two per block (attention, MLP); "
            f"the blocks cannot be told apart for a 3d plan."
        )
    index = graph.index
    return [index[r.norm] for r in regions[::REGIONS_PER_BLOCK]]


def attention_heads(spec: ModelSpec) -> dict[str, int]:
    """The zoo model's attention heads (and key/value heads) as its builder receives them;
    {} for a user model (the capture does not record them)."""
    from heterog.capture.zoo import ZOO  # the zoo's builders load torch: only a 3d plan asks for heads

    entry = ZOO.get(spec.name)
    if entry is None:
        return {}
    params = inspect.signature(entry.builder).parameters
    out = {}
    for key in ("heads", "kv_heads"):
        value = spec.args.get(key, params[key].default if key in params else None)
        if isinstance(value, int):
            out[key] = value
    return out


def check_divides(graph: OpGraph, spec: ModelSpec, tp: int) -> None:
    """tp must divide the heads and every split linear's output features (Megatron asserts both)."""
    if tp not in DEGREES:
        raise PlanError(f"--tp {tp} is not supported; use one of {DEGREES} (devices of one node).")
    if tp == 1:
        return
    for key, value in attention_heads(spec).items():
        if value % tp:
            raise PlanError(
                f"{spec.name}: --tp {tp} does not divide its {value} attention {key.replace('_', '-')}; "
                f"Megatron gives each tensor rank whole heads. Use a tp that divides {value}."
            )
    try:
        layout = megatron_layout(graph)
    except GraphError as e:
        raise PlanError(f"{e} Use --tp 1 (pipeline and data parallelism only).") from None
    per_token = 4.0 * (graph.seq_len or 1)  # fp32 capture sizes (cost/tensor_parallel.py)
    for r in layout.regions:
        for c in r.column:
            features = graph.node(c).output_bytes.per_sample / per_token
            if round(features) % tp:
                raise PlanError(
                    f"{spec.name}: --tp {tp} does not divide the {round(features)} output features of {c!r}; "
                    f"use a tp that divides them."
                )


def _stage_layers(blocks: int, pp: int, stage_layers: Sequence[int] | None) -> list[int]:
    if pp < 1:
        raise PlanError(f"--pp must be ≥ 1, found {pp}.")
    if stage_layers is None:
        if blocks % pp:
            raise PlanError(
                f"the model has {blocks} blocks, which --pp {pp} does not divide; give --stage-layers "
                f"(e.g. {','.join(str(blocks // pp + (i < blocks % pp)) for i in range(pp))})."
            )
        return [blocks // pp] * pp
    layers = list(stage_layers)
    if len(layers) != pp or any(n < 1 for n in layers) or sum(layers) != blocks:
        raise PlanError(
            f"--stage-layers {','.join(map(str, layers))}: give {pp} positive counts (one per stage) "
            f"summing to the model's {blocks} blocks (they sum to {sum(layers)})."
        )
    return layers


def _devices(cluster: Cluster, n: int, devices: Sequence[str] | None) -> list[str]:
    names = [d.name for d in cluster.devices]
    if devices is None:
        if len(names) < n:
            raise PlanError(f"tp·pp·dp = {n} devices, but cluster {cluster.name!r} has {len(names)}.")
        return names[:n]
    given = list(devices)
    if len(given) != n:
        raise PlanError(f"--devices names {len(given)} devices, but tp·pp·dp = {n}; name exactly {n}.")
    unknown = [d for d in given if d not in cluster.device_index]
    if unknown:
        raise PlanError(f"--devices: {unknown} not in cluster {cluster.name!r}; its devices are {names}.")
    if len(set(given)) != n:
        raise PlanError(f"--devices names a device twice ({given}); every rank needs its own device.")
    return given


def _stage_of_node(graph: OpGraph, pp: int, stage_layers: Sequence[int] | None) -> list[int]:
    """The stage of every node in graph order: nodes before block 0 with stage 0."""
    if pp == 1 and stage_layers is None:
        return [0] * len(graph.nodes)  # no blocks needed (any model)
    starts = block_starts(graph)
    layers = _stage_layers(len(starts), pp, stage_layers)
    stage_start = [starts[sum(layers[:s])] for s in range(pp)]
    out, s = [], 0
    for i in range(len(graph.nodes)):
        while s + 1 < pp and i >= stage_start[s + 1]:
            s += 1
        out.append(s)
    return out


def _schedule(name: str) -> PipelineSchedule:
    try:
        return PipelineSchedule(name)
    except ValueError:
        raise PlanError(f"--schedule {name!r} is not one of {', '.join(PipelineSchedule)}.") from None


def megatron_3d(
    graph: OpGraph,
    cluster: Cluster,
    *,
    model_spec: ModelSpec,
    tp: int | Sequence[int],
    pp: int,
    dp: int,
    stage_layers: Sequence[int] | None = None,
    microbatches: int = 1,
    schedule: str = PipelineSchedule.ONE_F_ONE_B,
    zero: int = ShardStage.NONE,
    devices: Sequence[str] | None = None,
    precision: str = Precision.FP32,
    optimizer: str = "sgd",
) -> Plan:
    """The 3d plan (module docstring), validated against graph and cluster. `tp`: one degree,
    or one per stage (stages on different GPU types); a stage's ranks follow the earlier
    stages' in the same order."""
    if dp < 1:
        raise PlanError(f"--dp must be ≥ 1, found {dp}.")
    tps = [tp] * pp if isinstance(tp, int) else list(tp)
    if len(tps) != pp:
        raise PlanError(f"tp gives {len(tps)} degrees for {pp} stages; give one degree, or one per stage.")
    for t in sorted(set(tps)):
        check_divides(graph, model_spec, t)
    if model_spec.batch_size % (microbatches * dp):
        raise PlanError(
            f"batch size {model_spec.batch_size} is not a multiple of microbatches × dp = {microbatches} × {dp}; "
            f"Megatron's global batch is micro-batch size × microbatches × dp."
        )
    if zero and dp < 2:
        raise PlanError(f"--zero {zero} shards state across data-parallel replicas; it needs --dp ≥ 2.")
    names = _devices(cluster, sum(tps) * dp, devices)
    stages = _stage_of_node(graph, pp, stage_layers)
    groups = []
    for s, t in enumerate(tps):
        first = dp * sum(tps[:s])  # the stage's first rank: earlier stages fill dp · tp each
        replicas = tuple(
            Replica(
                device=names[first + j * t],
                share=1.0 / dp,
                shard=1.0 / dp if zero else None,
                tp_devices=tuple(names[first + j * t + 1 : first + (j + 1) * t]),
            )
            for j in range(dp)
        )
        groups.append(
            Group(
                name=f"stage{s}",
                nodes=tuple(n.name for n, st in zip(graph.nodes, stages, strict=True) if st == s),
                replicas=replicas,
                sync=SyncMethod.RING if dp > 1 else SyncMethod.NONE,
                shard_stage=zero,
            )
        )
    plan = Plan(
        strategy=STRATEGY,
        model=model_spec,
        precision=Precision(precision),
        optimizer=optimizer,
        groups=tuple(groups),
        num_microbatches=microbatches,
        schedule=_schedule(schedule),
        graph_fingerprint=graph.fingerprint(),
        cluster_fingerprint=cluster.fingerprint(),
        notes=(
            f"Megatron-style 3d plan: tp {tp if isinstance(tp, int) else tps} × pp {pp} × dp {dp} on "
            f"{len(names)} devices, ranks in order "
            f"tensor, data, pipeline; {microbatches} micro-batch(es), {schedule}"
            + (f", ZeRO stage {zero}" if zero else "")
            + ".",
        ),
    )
    return plan.validate(graph, cluster)


def simulated_3d(
    graph: OpGraph, cluster: Cluster, costs, *, score: Callable[[Plan], SimResult] | None = None, **options: Any
) -> tuple[Plan, SimResult]:
    """`megatron_3d(graph, cluster, **options)` with the simulator's prediction in it (`score`:
    the simulator with the caller's caches; a plain simulation by default)."""
    made = megatron_3d(graph, cluster, **options)
    sim = score(made) if score is not None else simulate(graph, cluster, made, costs, timeline=False)
    fits = "fits" if sim.feasible else f"does not fit: {sim.overflow_device} over by {sim.overflow_bytes} bytes"
    made = replace(made, notes=(*made.notes, f"simulated: it {fits}."))
    return made.with_prediction(sim.iteration_time_s, sim.peak_memory_bytes), sim


@dataclass(frozen=True, kw_only=True, slots=True)
class GridPoint:
    """One uniform Megatron configuration of the grid and its simulated iteration."""

    tp: int
    pp: int
    dp: int
    microbatches: int
    plan: Plan
    iteration_time_s: float
    feasible: bool


def grid(
    graph: OpGraph, cluster: Cluster, spec: ModelSpec, *, degrees: Sequence[int] = DEGREES
) -> list[tuple[int, int, int, int]]:
    """Every uniform (tp, pp, dp, micro-batches) on all the cluster's devices as Megatron
    allows it: tp one of `degrees` (1, 2, 4, 8) dividing the heads and features and a node's
    devices (a tensor-parallel set never leaves a node), pp dividing the blocks, dp the rest,
    and a number of micro-batches (a power of two; 1 without a pipeline) dividing batch / dp."""
    n = len(cluster.devices)
    per_node = min(len(node.devices) for node in cluster.nodes)
    try:
        blocks = len(block_starts(graph))
    except PlanError:
        blocks = 1
    out = []
    for tp in degrees:
        if per_node % tp or n % tp:
            continue
        try:
            check_divides(graph, spec, tp)
        except (PlanError, GraphError):
            continue
        for pp in (p for p in range(1, blocks + 1) if blocks % p == 0 and n % (tp * p) == 0):
            dp = n // (tp * pp)
            if spec.batch_size % dp:
                continue
            m = 1
            while spec.batch_size % (m * dp) == 0 and (m == 1 or pp > 1):
                out.append((tp, pp, dp, m))
                m *= 2
    return out


def _state_fits(graph: OpGraph, cluster: Cluster, costs) -> Callable[[tuple[int, int, int, int]], bool]:
    """Whether a configuration's model state (parameters, gradients, optimizer state: 1/(tp·pp)
    of the whole on each device, as Megatron divides it) fits the smallest device's memory."""
    smallest = min(cluster.devices, key=lambda d: cluster.memory_bytes(d.name)).name
    state = costs.persistent_bytes([n.name for n in graph.nodes], smallest)
    memory = cluster.memory_bytes(smallest)
    return lambda c: state / (c[0] * c[1]) < memory


def best_uniform(
    graph: OpGraph,
    cluster: Cluster,
    costs,
    spec: ModelSpec,
    *,
    deadline_s: float,
    precision: str,
    optimizer: str,
    degrees: Sequence[int] = DEGREES,
    score: Callable[[Plan], SimResult] | None = None,
) -> list[GridPoint]:
    """The grid's configurations scored by the simulator before `deadline_s`, each started only
    where the last one's time is left (those whose model
    state fits the devices first; then the cheapest-looking: fewest pipeline stages and
    micro-batches, the way a Megatron user tries them), best first: fitting ones by iteration
    time, then the others. At least one is scored, whatever the deadline. `score`: the
    simulator with the caller's caches (default: one SimCache for the whole grid, which its
    configurations of one shape and another number of micro-batches share)."""
    if score is None:
        cache = SimCache()
        score = lambda plan: simulate(graph, cluster, plan, costs, timeline=False, cache=cache)  # noqa: E731
    scored: list[GridPoint] = []
    fits = _state_fits(graph, cluster, costs)
    configurations = sorted(grid(graph, cluster, spec, degrees=degrees), key=lambda c: (not fits(c), c[1], c[3], c[0]))
    last_s = 0.0  # the last configuration's scoring: the next one is not started unless as much is left
    for tp, pp, dp, m in configurations:
        start = time.perf_counter()
        if scored and start + last_s > deadline_s:
            break
        made, sim = simulated_3d(
            graph,
            cluster,
            costs,
            model_spec=spec,
            tp=tp,
            pp=pp,
            dp=dp,
            microbatches=m,
            precision=precision,
            optimizer=optimizer,
            score=score,
        )
        point = GridPoint(
            tp=tp,
            pp=pp,
            dp=dp,
            microbatches=m,
            plan=replace(made, strategy="megatron-3d"),
            iteration_time_s=sim.iteration_time_s,
            feasible=sim.feasible,
        )
        scored.append(point)
        last_s = time.perf_counter() - start
    return sorted(scored, key=lambda g: (not g.feasible, g.iteration_time_s))

"""`heterog check PLAN --device meta|cpu|cuda`: the preflight a user runs before renting a cluster.

For every rank of a lowered Program it does what the rank's worker does before step 1 —
split the model for the Program, place the rank's stages on the device and check them
(placement.py), derive the wire table (wire.py) — and then runs the rank's compute
instructions (forward and backward of every micro-batch, sample ranges from the Program)
on that device without communication: a receive yields zeros of the wire table's shape and
dtype, a send and a collective do nothing. It reports per rank the stages built, the compute
instructions run and the first problem, naming the graph node (and the model module it
came from) where one failed.

On `meta` it needs no GPU and no memory: the model is built on the meta device when
torch.export can trace it there (else on the CPU, as the worker does, with a note), and
every tensor is a shape. On `cuda` each rank's stages go to the GPU in turn and back, so one
GPU checks every rank of a plan whose ranks would not fit it together; the peak memory each
rank reached is reported. The check never plans and never lowers: the caller gives the
Program (heterog.orchestrate.check lowers the plan first).
"""

from __future__ import annotations

import dataclasses
import json
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from heterog.cut.dataflow import Dataflow
from heterog.cut.partition import build_dataflow, export_plan_model, program_group_order
from heterog.cut.split_export import ExportedModel, copy_exported
from heterog.errors import HeterogError, PlanError
from heterog.execute.device import RankDevice
from heterog.execute.emulation import Pacer
from heterog.execute.placement import misplaced, place_rank, place_stages, rewrite_stage_devices
from heterog.execute.runtime import Interpreter
from heterog.execute.stage_map import crossing_values
from heterog.execute.tp_ops import NO_COMMUNICATION
from heterog.execute.tp_split import Regions, TensorParallelRank, split_model
from heterog.execute.wire import WireSpec, wire_table
from heterog.ir.kinds import Phase
from heterog.ir.plan import Plan
from heterog.lower.program import Compute, Program, Recv, Send
from heterog.lower.tensor_parallel import member_view, sibling_maps
from heterog.workload import Workload, build_model, global_batch, resolve_workload, to_device

KIND = "heterog.CheckResult"
DEVICES = ("meta", "cpu", "cuda")


@dataclass(frozen=True, kw_only=True, slots=True)
class RankCheck:
    rank: int
    device: str  # the plan device the rank runs
    stages: int  # stages built and placed
    computes: int  # compute instructions in its program
    computes_run: int  # of them, run without error
    problem: str | None = None  # the first problem, naming the node where one failed
    peak_memory_bytes: int | None = None  # on cuda: the rank's peak allocated memory
    time_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.problem is None

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "device": self.device,
            "stages": self.stages,
            "computes": self.computes,
            "computes_run": self.computes_run,
            "ok": self.ok,
            "problem": self.problem,
            "peak_memory_bytes": self.peak_memory_bytes,
            "time_s": self.time_s,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckResult:
    strategy: str
    model: str
    target: str  # meta | cpu | cuda[:i]
    ranks: tuple[RankCheck, ...]
    notes: tuple[str, ...] = ()
    time_s: float = 0.0

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.ranks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": KIND,
            "strategy": self.strategy,
            "model": self.model,
            "device": self.target,
            "ok": self.ok,
            "ranks": [r.to_dict() for r in self.ranks],
            "notes": list(self.notes),
            "time_s": self.time_s,
        }


class NodeError(RuntimeError):
    """A stage failed at one node of its graph."""

    def __init__(self, node: fx.Node, module: str, error: BaseException):
        self.node, self.module, self.error = node, module, error
        where = f" (model module {module!r})" if module else ""
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        super().__init__(f"node {node.name!r} ({node.target}){where}: {type(error).__name__}: {first[:300]}")


class _NodeRunner(fx.Interpreter):
    """Runs a stage node by node, so a failure names its node."""

    def run_node(self, n: fx.Node) -> Any:
        try:
            return super().run_node(n)
        except NodeError:
            raise
        except Exception as e:  # noqa: BLE001 - any op failure: say which node
            stack = n.meta.get("nn_module_stack") or {}
            paths = [v[0] for v in stack.values() if isinstance(v, tuple) and isinstance(v[0], str) and v[0]]
            raise NodeError(n, paths[-1] if paths else "", e) from e


def _call_by_node(module: nn.Module, *args: Any) -> Any:
    if isinstance(module, fx.GraphModule):
        return _NodeRunner(module).run(*args)
    return module(*args)


# -- what a rank does without peers ------------------------------------------------------------------
@dataclass(kw_only=True)
class _LocalTransport:
    """Receives yield zeros shaped by the wire table; sends go nowhere."""

    crossing: dict[tuple[int, int], list[str]]
    no_grad: frozenset[str]
    wire: dict[str, WireSpec]
    device: torch.device
    sent_bytes: int = 0

    def messages(self, ins: Send | Recv) -> list[tuple[int, str]]:
        values = self.crossing.get((ins.src_block, ins.dst_block), ())
        return [(k, v) for k, v in enumerate(values) if not (ins.phase == Phase.BACKWARD and v in self.no_grad)]

    def send(self, ins: Send, tensors: Any, key: Any = None) -> None:
        for (_, v), t in zip(self.messages(ins), tensors, strict=True):
            spec = self.wire[v]
            if tuple(t.shape) != spec.shape(ins.hi - ins.lo) or t.dtype != spec.dtype:
                raise PlanError(
                    f"the transfer of {v!r} (tag {ins.tag}) would carry a {t.dtype} tensor of shape "
                    f"{tuple(t.shape)}, but its receiver expects {spec.dtype} "
                    f"{spec.shape(ins.hi - ins.lo)}."
                )

    def recv(self, ins: Recv) -> list[torch.Tensor]:
        return [
            torch.zeros(self.wire[v].shape(ins.hi - ins.lo), dtype=self.wire[v].dtype, device=self.device)
            for _, v in self.messages(ins)
        ]

    def release(self, key: Any) -> None:
        pass

    def wait_all(self) -> None:
        pass

    def in_flight(self) -> list[torch.Tensor]:
        return []

    def new_step(self, *, forward_only: bool = False) -> None:
        pass


@dataclass(kw_only=True)
class _NoRunner:
    runs: list = field(default_factory=list)
    servers: dict = field(default_factory=dict)
    schedulers: list = field(default_factory=list)  # the servers' learning-rate schedules: none here

    def kept_buffers(self) -> list[torch.Tensor]:
        return []

    def unscale_and_check_servers(self, found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
        pass

    def pull_deferred(self, apply: bool) -> None:
        pass


@dataclass(kw_only=True)
class _NoSync:
    """Collectives that move nothing (each rank is checked alone)."""

    runner: _NoRunner = field(default_factory=_NoRunner)

    def launch(self, ins: Any, index: int | None = None) -> None:
        pass

    def finish(self) -> None:
        pass

    def sum_tied_gradients(self) -> None:
        pass


# -- building ------------------------------------------------------------------------------------------
META_BUILD_BYTES = 1 << 30  # on meta, larger models are built without weights


@dataclass(kw_only=True)
class BuildCache:
    """Models and their exports by model spec, for several checks in one process (export
    takes seconds; each check cuts its own copy)."""

    built: dict[str, tuple[nn.Module, ExportedModel, str | None]] = field(default_factory=dict)


def _build(
    work: Workload,
    plan: Plan,
    target: torch.device,
    cache: BuildCache | None,
    tp: TensorParallelRank | None = None,
    regions: Regions = (),
) -> tuple[nn.Module, ExportedModel, str | None]:
    """The model, its export and a note: built and exported on the CPU, exactly as a rank
    does (so the check proves the rank's own placement); when checking on meta a model of
    more than META_BUILD_BYTES of parameters is built and exported on meta instead, which
    needs no memory, if torch.export can trace it there. tp: split for that member first."""
    key = json.dumps([plan.to_dict()["model"], target.type == "meta", str(tp), regions], sort_keys=True, default=str)
    if cache is not None and key in cache.built:
        model, exported, note = cache.built[key]
        return model, copy_exported(exported), note
    note = None
    built = None
    if target.type == "meta":
        with torch.device("meta"):
            meta_model = work.build()
        if tp is not None:
            split_model(meta_model, tp, regions)
        nbytes = sum(p.numel() * p.element_size() for p in meta_model.parameters())
        if nbytes > META_BUILD_BYTES:
            meta_model.train()
            try:
                inputs, _ = global_batch(work, max(2, min(plan.batch_size, 4)), seed=0, step=0)
                built = (meta_model, export_plan_model(meta_model, plan, to_device(inputs, target)))
                note = f"built on meta ({nbytes / 2**30:.1f} GiB of parameters, no memory used)"
            except PlanError as e:
                note = f"built on the CPU: torch.export could not trace the model on meta ({str(e)[:160]})"
    if built is None:
        model = build_model(work, seed=0)
        if tp is not None:
            split_model(model, tp, regions)
        built = (model, export_plan_model(model, plan))
    if cache is not None:
        cache.built[key] = (built[0], built[1], note)
        return built[0], copy_exported(built[1]), note
    return built[0], built[1], note


def check_program(
    plan: Plan, program: Program, *, device: str = "meta", cache: BuildCache | None = None
) -> CheckResult:
    """Check every rank of `program` on `device` (module docstring). `cache`: reuse models
    and exports across checks of one process."""
    if device.split(":")[0] not in DEVICES:
        raise PlanError(f"--device {device!r}: choose one of {', '.join(DEVICES)} (e.g. cuda:0).")
    target = torch.device(device)
    if target.type == "cuda" and not torch.cuda.is_available():
        raise PlanError("--device cuda: this machine has no CUDA device; check on meta (no GPU needed) or on cpu.")
    if target.type == "cuda" and target.index is None:  # tensors made on "cuda" say cuda:<n>, and an
        target = torch.device("cuda", torch.cuda.current_device())  # export's guards compare the names
    t0 = time.perf_counter()
    if plan.tensor_parallel:  # each sibling with its members' split (lower/tensor_parallel.py)
        maps = sibling_maps(plan)
        parts = []
        for k, m in enumerate(maps):
            view, sibling, place = member_view(program, next(iter(m.values())))
            tp = TensorParallelRank(index=k, degree=len(maps), group=NO_COMMUNICATION)
            ranks = [r for r, d in enumerate(program.devices) if d in set(m.values())]
            parts.append(_check_sibling(sibling, view, target, cache, tp, ranks))
        ranks_checked = tuple(sorted((r for part in parts for r in part.ranks), key=lambda r: r.rank))
        notes = tuple(dict.fromkeys(n for part in parts for n in part.notes))
        return dataclasses.replace(parts[0], strategy=plan.strategy, ranks=ranks_checked, notes=notes,
                                   time_s=time.perf_counter() - t0)  # fmt: skip
    return _check_sibling(plan, program, target, cache, None, range(len(program.devices)))


def _check_sibling(
    plan: Plan, program: Program, target: torch.device, cache: BuildCache | None, tp, ranks
) -> CheckResult:
    """check_program on `ranks` of a Program, the model split for `tp` (a member index) or whole."""
    t0 = time.perf_counter()
    work = resolve_workload(plan.model)
    model, exported, note = _build(work, plan, target, cache, tp, program.tp_regions)
    inputs, targets = global_batch(work, plan.batch_size, seed=0, step=0)
    inputs, targets = to_device(inputs, target), to_device(targets, target)
    flow = build_dataflow(model, plan, len(inputs), group_order=program_group_order(program), exported=exported)
    crossing = crossing_values(program, flow)
    rdev = RankDevice(kind=target.type, index=target.index or 0)
    rewrite_stage_devices(flow.stages, target)
    # a node the rewrite could not move is the rank's problem before anything runs
    problems = {r: _pinned_nodes(plan, program, flow, r, target) for r in ranks}
    try:
        wire = wire_table(
            flow,
            inputs,
            {v for vs in crossing.values() for v in vs},
            device=target,
            autocast=rdev.autocast(plan.precision),
        )
    except Exception as e:  # noqa: BLE001 - shapes cannot be derived: every rank that moves tensors says so
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        wire = None
        for r in problems:
            problems[r] = (
                problems[r]
                or f"the shapes of the tensors that cross between blocks could not be "
                f"derived on {target}: {type(e).__name__}: {first[:300]}"
            )
    ranks = tuple(
        _check_rank(plan, program, flow, work, rank, rdev, wire, crossing, inputs, targets)
        if problems[rank] is None
        else _refused(plan, program, flow, rank, str(problems[rank]))
        for rank in ranks
    )
    return CheckResult(
        strategy=plan.strategy,
        model=plan.model.name,
        target=str(target),
        ranks=ranks,
        notes=tuple(([note] if note else []) + flow.warnings),
        time_s=time.perf_counter() - t0,
    )


def _rank_stages(
    plan: Plan, program: Program, flow: Dataflow, rank: int
) -> tuple[set[int], list[tuple[str, nn.Module]]]:
    device = program.devices[rank]
    held = {gi for gi, g in enumerate(plan.groups) if device in g.devices}
    return held, [(s.value, s.module) for s in flow.stages if set(s.groups or (s.group,)) & held]


def _pinned_nodes(plan: Plan, program: Program, flow: Dataflow, rank: int, target: torch.device) -> str | None:
    _, stages = _rank_stages(plan, program, flow, rank)
    bad = [m for m in misplaced(stages, target) if m.what == "node"]
    if not bad:
        return None
    more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
    return "; ".join(m.describe() for m in bad[:3]) + more


def _refused(plan: Plan, program: Program, flow: Dataflow, rank: int, problem: str) -> RankCheck:
    device = program.devices[rank]
    _, stages = _rank_stages(plan, program, flow, rank)
    computes = sum(1 for ins in program.instructions[device] if isinstance(ins, Compute))
    return RankCheck(rank=rank, device=device, stages=len(stages), computes=computes, computes_run=0, problem=problem)


def _check_rank(
    plan: Plan,
    program: Program,
    flow: Dataflow,
    work: Workload,
    rank: int,
    rdev: RankDevice,
    wire: dict[str, WireSpec] | None,
    crossing: dict[tuple[int, int], list[str]],
    inputs: Any,
    targets: Any,
) -> RankCheck:
    t0 = time.perf_counter()
    device = program.devices[rank]
    held, stages = _rank_stages(plan, program, flow, rank)
    computes = [ins for ins in program.instructions[device] if isinstance(ins, Compute)]
    base: dict[str, Any] = dict(rank=rank, device=device, computes=len(computes))
    target = rdev.torch_device
    if target.type == "cuda":
        torch.cuda.reset_peak_memory_stats(target)
    try:
        place_rank(flow, held, target, rank=rank)
    except PlanError as e:
        return RankCheck(**base, stages=len(stages), computes_run=0, problem=str(e), time_s=time.perf_counter() - t0)
    ex = Interpreter(
        program=program,
        device=device,
        flow=flow,
        work=work,
        transport=_LocalTransport(
            crossing=crossing,
            no_grad=flow.no_grad,
            wire=wire or {},  # type: ignore[arg-type]
            device=target,
        ),
        pacer=Pacer(1.0),
        sync=_NoSync(),
        batch_size=plan.batch_size,
        rank_of=program.rank_of(),
        rank_device=rdev,
        precision=plan.precision,
        crossing=crossing,
    )
    ex.call_stage = _call_by_node
    problem = None
    try:
        ex.step(inputs, targets)
    except (NodeError, HeterogError) as e:
        problem = f"{_where(ex, program, device)}: {e}"
    except Exception as e:  # noqa: BLE001 - report any failure of the rank's compute, with its place
        last = traceback.extract_tb(e.__traceback__)[-1]
        problem = (
            f"{_where(ex, program, device)}: {type(e).__name__}: {str(e).strip()[:300]} "
            f"(at {last.filename}:{last.lineno})"
        )
    run = sum(1 for t in ex.trace if t[0] == "compute") - (
        1 if problem and ex.trace and ex.trace[-1][0] == "compute" else 0
    )
    peak = int(torch.cuda.max_memory_allocated(target)) if target.type == "cuda" else None
    if target.type == "cuda":  # back to the host, so that the next rank has the GPU
        place_stages([m for _, m in stages], torch.device("cpu"))
        for g in held:
            for _, p in flow.params_of_group.get(g, []):
                p.data = p.data.to("cpu")
                p.grad = None
        torch.cuda.empty_cache()
    leftovers = misplaced(stages, target) if problem is None and target.type != "cuda" else []
    if leftovers:
        problem = "; ".join(m.describe() for m in leftovers[:3])
    return RankCheck(
        **base,
        stages=len(stages),
        computes_run=run,
        problem=problem,
        peak_memory_bytes=peak,
        time_s=time.perf_counter() - t0,
    )


def _where(ex: Interpreter, program: Program, device: str) -> str:
    """The instruction a failure happened in, from what the interpreter recorded last."""
    if not ex.trace:
        return "before the first instruction"
    kind, *rest = ex.trace[-1]
    if kind == "compute":
        block, phase, mb, _ = rest
        return f"{phase} of block {block} ({program.blocks[block].label}), micro-batch {mb}"
    return f"{kind} {rest}"

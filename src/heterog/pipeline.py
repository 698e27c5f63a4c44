"""Orchestration: inputs → lower → simulate → run, in one place for the CLI and the API.

Stages import only downward; this module is the one that calls them in sequence. Every
function that takes a plan takes anything `inputs.as_plan` accepts (a Plan, a plan dict such
as a plan result's "best", a plan result, a Program, or a plan / program / `plan --json` file),
and builds the plan's graph, cluster and costs with `inputs.model_inputs`, as `heterog plan`
does, so that they all predict the same time:
- `lower(plan)` → Program: the per-device instructions (heterog.lower);
- `simulate(plan)` → SimResult: the simulator's prediction (also `simulate(graph, cluster,
  plan, costs)`, the simulator itself);
- `run(plan, steps=…)` → {"measured_iteration_time_s", "predicted_iteration_time_s", "per_rank",
  "losses", "link_shaping", "notes", …}: lowers the plan, has the executor carry out the
  Program on local processes, and puts the simulator's prediction of the same schedule beside
  the measurement;
- `run_many(plans, steps=…)` → one PlanRun per plan (run's dict, or the error): the plans one
  after the other in one launch of the rank processes, for sweeps;
- `run_interleaved(plans, steps=…, repetitions=…)` → one PlanRepetitions per plan: plans of
  one emulated cluster measured side by side (A B C C B A …) in one launch with shaped links.
The executor (torch.distributed, the launcher) is imported only by the functions that run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from heterog.capture.cache import capture_cached
from heterog.errors import PlanError
from heterog.execute.netns import LinkShaping, ShapingUnavailable
from heterog.hardware.cluster import Cluster
from heterog.hardware.spec import cluster_from_dict
from heterog.inputs import PlanInputs, as_plan, device_view
from heterog.inputs import plan_inputs as _inputs_of_plan
from heterog.ir.plan import Plan
from heterog.lower.lowering import lower as lower_schedule
from heterog.lower.lowering import program_devices
from heterog.lower.program import Program
from heterog.lower.schedule import cover_graph
from heterog.simulate.simulator import simulate as simulate_schedule

if TYPE_CHECKING:
    from heterog.execute.launcher import PlanLaunch, ProcessLayout

MAX_LOCAL_RANKS = 16


def plan_cluster(plan: Plan) -> Cluster | None:
    if not plan.cluster:
        return None
    return cluster_from_dict(plan.cluster)


def local_cpu_cluster(plan: Plan) -> Cluster:
    """For a plan that records no cluster (written by hand): its devices as equal CPU ranks on
    one emulated node, which is what the local launcher runs them as."""
    names = rank_devices(plan, None)
    return cluster_from_dict(
        {
            "name": "local-cpu",
            "kind": "emulated",
            "nodes": [
                {"name": "local", "nic_bandwidth_gbps": 10, "devices": [{"type": "cpu", "name": d} for d in names]}
            ],
        }
    )


def rank_devices(plan: Plan, cluster: Cluster | None) -> tuple[str, ...]:
    """Rank → device: the plan's devices (and parameter servers) in the cluster's order."""
    if cluster is None:
        return tuple(dict.fromkeys([*plan.devices(), *(g.ps_device for g in plan.groups if g.ps_device)]))
    return program_devices(plan, cluster)


def read_plan(path: str | os.PathLike) -> Plan:
    """A Plan from a plan file, the plan a Program file was lowered from, or the best plan of
    `heterog plan --json` output."""
    return as_plan(path)


def plan_inputs(plan: Plan, cluster: Cluster, *, profile: bool = False, graph=None) -> PlanInputs:
    """(graph, cluster as its ranks see it, cost model) for `plan` on `cluster`, built as
    `heterog plan` builds them (inputs.model_inputs). profile: per-node times measured on this
    CPU first (one thread, as the ranks run; a few seconds), for emulated clusters."""
    prof = None
    if profile:
        # the executor and torch load only to run: `heterog lower`/`simulate` start without them
        from heterog.profile.measure import measure_profile, profile_batch_sizes
        from heterog.workload import resolve_workload

        device_view(cluster)  # one thread, as the ranks measure
        if graph is None:
            graph = capture_cached(
                plan.model.name, plan.model.args or None, batch_size=plan.batch_size, seq_len=plan.model.seq_len
            )
        prof = measure_profile(
            resolve_workload(plan.model), graph=graph, batch_sizes=profile_batch_sizes(plan.batch_size)
        )
    return _inputs_of_plan(plan, cluster=cluster, graph=graph, profile=prof)


def _cluster_of(plan: Plan) -> Cluster:
    return plan_cluster(plan) or local_cpu_cluster(plan)


def lower(plan: Any) -> Program:
    """The Program of a plan (anything inputs.as_plan takes): every device's instructions,
    validated."""
    plan = as_plan(plan)
    return _lower_for_run(plan, _cluster_of(plan), False)[0]


def simulate(plan: Any, *simulator_args: Any, **options: Any):
    """The simulator's prediction of one iteration of `plan` (anything inputs.as_plan takes) on
    the cluster it records, from the inputs `heterog plan` used: the time it predicted.

    simulate(graph, cluster, plan, costs, timeline=…, cache=…), with the inputs given, is the
    simulator itself (heterog.simulate.simulator.simulate)."""
    if simulator_args or "costs" in options:
        return simulate_schedule(plan, *simulator_args, **options)
    plan = as_plan(plan)
    graph, seen, costs = plan_inputs(plan, _cluster_of(plan))
    return simulate_schedule(graph, seen, cover_graph(plan, graph), costs, **options)


def check(plan: Plan | str | os.PathLike, *, device: str = "meta", cache=None):
    """heterog check: lower the plan, then build every rank's stages for `device` and run
    their compute without communication (execute/check.py); a CheckResult."""
    # the executor and torch load only to run: `heterog lower`/`simulate` start without them
    from heterog.execute.check import check_program

    if not isinstance(plan, Plan):
        plan = read_plan(plan)
    return check_program(plan, lower(plan), device=device, cache=cache)


def emulated_slowdowns(
    plan: Plan, cluster: Cluster | None, devices: tuple[str, ...], emulated: bool
) -> dict[str, float]:
    """Each rank's compute slowdown: declared on emulated clusters; from peak FLOP/s when a
    real cluster is emulated (the fastest device runs at this CPU's speed)."""
    if cluster is None:
        return {}
    if cluster.kind == "emulated":
        return {d: cluster.device(d).slowdown for d in devices}
    if not emulated:
        if local_gpus() >= len(devices):
            return {}  # real GPUs: one rank per visible GPU, no pacing
        raise PlanError(
            f"the plan's cluster {cluster.name!r} is a real GPU cluster of {len(devices)} device(s) "
            f"({', '.join(sorted({cluster.device(d).gpu_type for d in devices}))}) and this machine has "
            f"{local_gpus()} visible GPU(s). Run it where its GPUs are (--torchrun prints the per-node "
            f"commands), or use --emulated to emulate it here with CPU processes (each device paced "
            f"by its speed relative to the fastest)."
        )
    key = "fp32" if plan.precision == "fp32" else "bf16"
    peak = {d: cluster.gpu(d).peak_flops_per_s.get(key) or cluster.gpu(d).peak_flops_per_s["fp32"] for d in devices}
    top = max(peak.values())
    return {d: top / peak[d] for d in devices}


def local_gpus() -> int:
    """CUDA devices visible to this process (0 without a CUDA build of torch)."""
    # the executor and torch load only to run: `heterog lower`/`simulate` start without them
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def on_gpus(cluster: Cluster, devices: tuple[str, ...], emulated: bool) -> bool:
    """A local run goes on GPUs when the plan's cluster is real, not emulated, and this
    machine shows a GPU for every rank (rank r on cuda:r)."""
    return cluster.kind != "emulated" and not emulated and local_gpus() >= len(devices) > 0


def gpu_layout(
    cluster: Cluster, devices: tuple[str, ...], *, share: bool = False
) -> tuple[tuple[int, ...], bool, str | None]:
    """(each rank's GPU index on this machine, whether ranks share GPUs through host copies,
    a note). Devices of one node run on the GPUs they name (their positions in the node,
    launcher.local_gpu_indices); devices of several nodes run one per GPU in rank order;
    with `share`, more ranks than GPUs take the GPUs in turn (gloo, host staging)."""
    # the executor and torch load only to run: `heterog lower`/`simulate` start without them
    from heterog.execute.launcher import local_gpu_indices

    visible = local_gpus()
    nodes = {cluster.node_of[d] for d in devices}
    if len(nodes) == 1:
        node = cluster.node_index[next(iter(nodes))]
        indices = local_gpu_indices(node.devices, devices)
        if max(indices) < visible:
            return tuple(indices), False, None
    if len(devices) <= visible:
        return (
            tuple(range(len(devices))),
            False,
            ("the plan's devices span several nodes: rank r runs on this machine's cuda:r" if len(nodes) > 1 else None),
        )
    if not share:
        raise PlanError(f"the plan has {len(devices)} ranks and this machine {visible} GPU(s).")
    return (
        tuple(r % visible for r in range(len(devices))),
        True,
        f"{len(devices)} ranks share {visible} GPU(s): NCCL refuses two ranks on one GPU, so they talk "
        f"through gloo with host copies (correct, not fast)",
    )


def predict_iteration_time(
    plan: Plan, cluster: Cluster, graph, costs, per_device: dict[str, dict] | None = None
) -> tuple[float, str]:
    """The simulator's iteration time for the schedule the run carries out; per_device, when
    given, receives the simulator's per-device breakdown."""
    sim = simulate_schedule(graph, cluster, plan, costs, timeline=False)
    if per_device is not None:
        per_device.update(sim.to_dict().get("devices", {}))
    return float(sim.iteration_time_s), "simulator"


def _lower_for_run(plan: Plan, cluster: Cluster, profile: bool, graph=None, inputs: tuple | None = None):
    """(program, graph, costs, cluster as seen here, the plan as lowered): the run and its
    prediction share one schedule, lowered with the costs of this machine's ranks
    (inputs.device_view). `graph`: the model's capture, when the caller has it; `inputs`: the
    (graph, cluster, costs) the caller predicts with (a profiled cost model), to lower with."""
    graph, local, costs = inputs if inputs is not None else plan_inputs(plan, cluster, profile=profile, graph=graph)
    plan = cover_graph(plan, graph)
    return lower_schedule(graph, local, plan, costs), graph, costs, local, plan


def _local_ranks(plan: Plan) -> tuple[Cluster, tuple[str, ...]]:
    """(the plan's cluster, the devices of its ranks), refused when this machine's launcher
    cannot start that many processes."""
    cluster = _cluster_of(plan)
    devices = rank_devices(plan, cluster)
    if len(devices) > MAX_LOCAL_RANKS:
        raise PlanError(
            f"the plan uses {len(devices)} devices; the local launcher runs at most "
            f"{MAX_LOCAL_RANKS} processes on one machine. Use --torchrun on a real cluster."
        )
    return cluster, devices


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM → KeyboardInterrupt, so cleanup in finally blocks runs (main thread only)."""
    try:
        old = signal.signal(signal.SIGTERM, signal.default_int_handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def summarize(results: list[dict], warmup_steps: int) -> dict[str, Any]:
    steps = len(results[0]["steps"])
    first = warmup_steps if steps > warmup_steps else 0
    per_step = [max(r["steps"][k]["step_time_s"] for r in results) for k in range(first, steps)]
    per_rank = []
    for r in results:
        measured = r["steps"][first:]

        def med(key: str, measured: list = measured) -> float:
            return statistics.median(s[key] for s in measured)

        per_rank.append(
            {
                "rank": r["rank"],
                "device": r["device"],
                "slowdown": r["slowdown"],
                "cores": r["cores"],
                "groups": r["groups"],
                "step_time_s": med("step_time_s"),
                "compute_s": med("compute_s"),
                "cpu_s": med("cpu_s"),
                "paced_s": med("paced_s"),
                "recv_wait_s": med("recv_wait_s"),
                "sync_s": med("sync_s"),
                "other_s": med("other_s"),
                "sent_bytes_total": r["sent_bytes"],
                "max_rss_bytes": r["max_rss_bytes"],
                "torch_device": r.get("torch_device", "cpu"),
                "peak_allocated_bytes": r.get("memory", {}).get("peak_allocated_bytes"),
                "peak_reserved_bytes": r.get("memory", {}).get("peak_reserved_bytes"),
                # an emulated device with a memory cap: its live tensors' peak
                "peak_live_bytes": r.get("peak_live_bytes"),
                "memory_cap_bytes": r.get("memory_cap_bytes"),
                "backend": r.get("backend", "gloo"),
                "skipped_steps": r["steps"][-1].get("skipped", 0),
            }
        )
    losses = [sum(r["steps"][k]["loss"] for r in results) for k in range(steps)]
    out = {
        "measured_iteration_time_s": statistics.median(per_step),
        "measured_steps": len(per_step),
        "per_rank": per_rank,
        "losses": losses,
    }
    first_rank = results[0]
    if first_rank.get("training") is not None:  # the training options that ran (execute/train_loop.py)
        out["training"] = first_rank["training"]
        out["learning_rates"] = [s.get("lr") for s in first_rank["steps"]]
        out["grad_norms"] = [s.get("grad_norm") for s in first_rank["steps"]]
        out["evaluations"] = first_rank.get("evaluations", [])
    if results[0]["steps"][0].get("loss_scale") is not None:  # fp16: the scale after each step
        out["loss_scales"] = [s["loss_scale"] for s in results[0]["steps"]]
    return out


def run(
    plan: Plan | str | os.PathLike,
    *,
    steps: int = 5,
    emulated: bool = False,
    timeout_s: float = 60.0,
    seed: int = 0,
    warmup_steps: int = 1,
    shape_links: bool | None = None,
    pin_cores: bool = False,
    predict: bool = True,
    out_dir: str | os.PathLike | None = None,
    dump_params: bool = False,
    fault: dict[str, Any] | None = None,
    data: str | None = None,
    profile: bool = False,
    checkpoint: dict[str, Any] | None = None,
    force: bool = False,
    nccl_override: dict[str, str] | None = None,
    share_gpus: bool = False,
    training: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train `steps` steps of `plan` on local processes; measured vs predicted iteration time.
    A real GPU cluster's plan runs one rank per visible GPU, each on the GPU its device names
    (gpu_layout; NCCL; one NCCL algorithm and protocol on every rank when the GPU types
    differ, nccl_override to choose another). share_gpus: with fewer GPUs than ranks, ranks
    share them through gloo with host copies (NCCL refuses two ranks on one GPU) — for
    checking a multi-rank plan on one GPU, not for speed.

    profile: predict from per-node times measured on this CPU (see predict_iteration_time).
    data: 'path/file.py:fn', fn(batch_size, step) → the global batch (inputs tuple, targets)
    of that step, instead of the zoo's synthetic batches (every rank calls it).
    shape_links: None → shape NIC bandwidths with netns + tc when running as root on an
    emulated cluster, else not; False → never. out_dir keeps the ranks' logs and, with
    dump_params, their final parameters (params_rank<R>.pt). checkpoint: a
    checkpoint.CheckpointConfig as a dict (save every N steps, resume); force: start even
    when the plan's memory per rank exceeds this machine's free memory. training: the
    training options (heterog/training.py TrainingConfig as a dict: learning rate, schedule,
    clipping, accumulation, evaluation, metrics), checked with the inputs before any rank
    starts (execute/preflight.py check_training).
    """
    # the executor and torch load only to run: `heterog lower`/`simulate` start without them
    from heterog.execute.device import nccl_env
    from heterog.execute.launcher import LaunchConfig, launch_local

    plan = as_plan(plan)
    if steps < 1:
        raise PlanError(f"steps must be ≥ 1, found {steps}.")
    cluster, devices = _local_ranks(plan)
    training = checked_training(plan, training, steps, data)

    # the executor and torch load only to run: `heterog lower`/`simulate` start without them
    from heterog.execute.preflight import check_inputs

    check_inputs(plan, data)  # the first batch within the model's sequence limit and vocabulary
    shared = share_gpus and not emulated and cluster.kind != "emulated" and 0 < local_gpus() < len(devices)
    slowdowns = {} if shared else emulated_slowdowns(plan, cluster, devices, emulated)
    notes: list[str] = []
    if emulated and cluster is not None and cluster.kind != "emulated":
        notes.append(
            f"{cluster.name} emulated with CPU processes paced by relative peak FLOP/s; the "
            f"prediction is for the real devices, so compare speed ratios, not times"
        )
    shaping: dict[str, Any] = {"enabled": False}
    program, graph, costs, local, covered = _lower_for_run(plan, cluster, profile)
    if out_dir is not None:
        program.save(Path(out_dir) / "program.json")
    with contextlib.ExitStack() as stack:
        stack.enter_context(_sigterm_as_interrupt())
        cfg_net: dict[str, Any] = {}
        want = shape_links if shape_links is not None else (cluster is not None and cluster.kind == "emulated")
        if want and cluster is not None and len({cluster.node_of[d] for d in devices}) == 1:
            shaping = {"enabled": False, "reason": "the plan's devices share one node: no link to shape"}
        elif want and cluster is not None:
            try:
                links = stack.enter_context(LinkShaping(cluster=cluster, devices=devices))
                cfg_net = {"wrap": links.wrap, "env": links.env, "master_addr": links.master_addr}
                shaping = {"enabled": True, "method": "netns+veth+tc-tbf", "nic_bandwidth_bytes_per_s": links.links}
            except ShapingUnavailable as e:
                shaping = {"enabled": False, "reason": str(e)}
                notes.append(f"links not shaped: {e}")
        cuda = shared or on_gpus(cluster, devices, emulated)
        if cuda:
            env, note = nccl_env({cluster.device(d).gpu_type for d in devices}, nccl_override)
            cfg_net["env"] = {r: env for r in range(len(devices))}
            indices, staging, layout_note = gpu_layout(cluster, devices, share=shared)
            cfg_net.update(
                cuda_indices=indices, host_staging=staging, gpu_types={d: cluster.device(d).gpu_type for d in devices}
            )
            notes += [n for n in (note, layout_note) if n]
        cfg = LaunchConfig(
            devices=devices,
            steps=steps,
            timeout_s=timeout_s,
            seed=seed,
            slowdowns=slowdowns,
            pin_cores=pin_cores,
            dump_params=dump_params,
            fault=fault,
            data=data,
            checkpoint=checkpoint,
            force=force,
            training=training,
            cuda=cuda,
            **cfg_net,
        )
        results = launch_local(plan.to_dict(), cfg, Path(out_dir) if out_dir else None, program_doc=program.to_dict())
    return _outcome(
        plan,
        covered,
        cluster,
        local,
        graph,
        costs,
        devices,
        results,
        steps=steps,
        warmup_steps=warmup_steps,
        predict=predict,
        notes=notes,
        shaping=shaping,
    )


def checked_training(
    plan: Plan, training: dict[str, Any] | None, steps: int, data: str | None = None
) -> dict[str, Any] | None:
    """The training options as the ranks get them (the schedule's horizon: the run's steps),
    after the checks that need no rank (execute/preflight.py)."""
    if not training:
        return None

    # the executor and torch load only to run: `heterog lower`/`simulate` start without them
    from heterog.execute.preflight import check_training

    return check_training(plan, training, steps=steps)


def _outcome(
    plan: Plan,
    covered: Plan,
    cluster: Cluster | None,
    local: Cluster,
    graph,
    costs,
    devices: tuple[str, ...],
    results: list[dict],
    *,
    steps: int,
    warmup_steps: int,
    predict: bool,
    notes: list[str],
    shaping: dict[str, Any],
) -> dict[str, Any]:
    """run's result: the ranks' measurements summarised, beside the simulator's prediction
    of the schedule that ran (covered: the plan as lowered)."""
    for r in results:
        for w in r["warnings"]:
            if w not in notes:
                notes.append(w)
    out: dict[str, Any] = {
        "strategy": plan.strategy,
        "model": plan.model.name,
        "cluster": cluster.name if cluster else None,
        "devices": list(devices),
        "steps": steps,
        "warmup_steps": warmup_steps,
        **summarize(results, warmup_steps),
    }
    sim_devices: dict[str, dict] = {}
    predicted, source = (
        predict_iteration_time(covered, local, graph, costs, per_device=sim_devices)
        if predict
        else (None, "not requested")
    )
    for r in out["per_rank"]:  # the simulator's view of each device, next to the measurement
        d = sim_devices.get(r["device"], {})
        r["predicted_compute_s"] = d.get("compute_time_s")
        r["predicted_communication_s"] = d.get("communication_time_s")
        r["predicted_peak_memory_bytes"] = d.get("peak_memory_bytes")
    out["predicted_iteration_time_s"] = predicted
    out["prediction_source"] = source
    measured = out["measured_iteration_time_s"]
    out["relative_error"] = (measured - predicted) / predicted if predicted else None
    out["link_shaping"] = shaping
    out["notes"] = notes
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanRun:
    """One plan's outcome in run_many: `result` is what `run` returns for it, or `error` is
    what stopped it (lowering, a rank's failure, a refusal)."""

    index: int
    strategy: str
    result: dict[str, Any] | None = None
    error: Exception | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class _Prepared:
    plan: Plan
    covered: Plan
    cluster: Cluster
    local: Cluster
    graph: Any
    costs: Any
    devices: tuple[str, ...]
    launch: PlanLaunch


def _prepare(
    plan: Plan,
    index: int,
    graphs: dict[str, Any],
    fault: dict[str, Any] | None,
    dump_params: bool,
    out_dir: Path | None,
    inputs: tuple | None = None,
    training: dict[str, Any] | None = None,
) -> _Prepared:
    """Lower plan `index` of run_many (the model captured once per model spec: `graphs`;
    with `inputs`, the caller's graph, cluster and costs); its Program saved in its folder, as
    `run` saves it."""
    # the executor and torch load only to run: `heterog lower`/`simulate` start without them
    from heterog.execute.launcher import PlanLaunch

    cluster, devices = _local_ranks(plan)
    if cluster.kind != "emulated":
        raise PlanError(
            f"run_many runs emulated clusters' plans on CPU processes; the plan's cluster "
            f"{cluster.name!r} is a real one: run it with heterog.run."
        )
    key = json.dumps(plan.to_dict()["model"], sort_keys=True, default=str)
    program, graph, costs, local, covered = _lower_for_run(plan, cluster, False, graph=graphs.get(key), inputs=inputs)
    graphs[key] = graph
    folder = f"plan{index}"
    if out_dir is not None:
        (out_dir / folder).mkdir(parents=True, exist_ok=True)
        program.save(out_dir / folder / "program.json")
    launch = PlanLaunch(
        plan_doc=plan.to_dict(),
        program_doc=program.to_dict(),
        devices=devices,
        slowdowns=emulated_slowdowns(plan, cluster, devices, False),
        fault=fault,
        dump_params=dump_params,
        folder=folder,
        training=training,
    )
    return _Prepared(
        plan=plan,
        covered=covered,
        cluster=cluster,
        local=local,
        graph=graph,
        costs=costs,
        devices=devices,
        launch=launch,
    )


def run_many(
    plans: list[Plan | str | os.PathLike],
    *,
    steps: int = 5,
    timeout_s: float = 60.0,
    seed: int = 0,
    warmup_steps: int = 1,
    predict: bool = True,
    out_dir: str | os.PathLike | None = None,
    force: bool = False,
    faults: dict[int, dict[str, Any]] | None = None,
    dump_params: bool = False,
    training: dict[str, Any] | None = None,
) -> list[PlanRun]:
    """Train `steps` steps of each plan, one after the other, in one launch of local rank
    processes (launcher.launch_local_many): the processes start, import torch and export each
    model once for all the plans, instead of once per plan as `run` does. For sweeps of many
    short runs (every candidate of a planner). Plans of emulated clusters only, their links
    not shaped; a plan that fails does not stop the others: each PlanRun holds its result (the
    dict `run` returns) or its error, in the order given. out_dir keeps plan i's files (its
    Program, its ranks' results) in `plan<i>/`. faults: a test hook, plan index → run's
    `fault`. dump_params: each rank also writes what `run(dump_params=True)` writes (its
    parameters after the last step, the instructions it executed) into its plan's folder.
    training: the training options of every plan (as run's)."""
    # the executor and torch load only to run: `heterog lower`/`simulate` start without them
    from heterog.execute.launcher import launch_local_many

    loaded = [as_plan(p) for p in plans]
    if steps < 1:
        raise PlanError(f"steps must be ≥ 1, found {steps}.")
    graphs: dict[str, Any] = {}
    prepared: list[_Prepared | Exception] = []
    for i, plan in enumerate(loaded):
        try:
            prepared.append(
                _prepare(
                    plan,
                    i,
                    graphs,
                    (faults or {}).get(i),
                    dump_params,
                    Path(out_dir) if out_dir else None,
                    training=checked_training(plan, training, steps),
                )
            )
        except Exception as e:  # noqa: BLE001 - reported in that plan's PlanRun; the others run
            prepared.append(e)
    ready = [p for p in prepared if isinstance(p, _Prepared)]
    with _sigterm_as_interrupt():
        launched = iter(
            launch_local_many(
                [p.launch for p in ready],
                steps=steps,
                timeout_s=timeout_s,
                seed=seed,
                out_dir=Path(out_dir) if out_dir else None,
                force=force,
            )
            if ready
            else []
        )
    out = []
    for i, (plan, prep) in enumerate(zip(loaded, prepared)):
        got = next(launched) if isinstance(prep, _Prepared) else prep
        if isinstance(got, Exception):
            out.append(PlanRun(index=i, strategy=plan.strategy, error=got))
            continue
        assert isinstance(prep, _Prepared)
        shaping = {"enabled": False, "reason": "run_many does not shape links"}
        out.append(
            PlanRun(
                index=i,
                strategy=plan.strategy,
                result=_outcome(
                    plan,
                    prep.covered,
                    prep.cluster,
                    prep.local,
                    prep.graph,
                    prep.costs,
                    prep.devices,
                    got,
                    steps=steps,
                    warmup_steps=warmup_steps,
                    predict=predict,
                    notes=[],
                    shaping=shaping,
                ),
            )
        )
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanRepetitions:
    """One plan's outcome in run_interleaved: per repetition the dict `run` returns for it (in
    the order measured), or `error`, what stopped the plan (its later repetitions not run)."""

    index: int
    strategy: str
    repetitions: tuple[dict[str, Any], ...] = ()
    error: Exception | None = None


def _shaped_layout(
    stack: contextlib.ExitStack, cluster: Cluster, devices: tuple[str, ...], shape_links: bool | None, notes: list[str]
) -> tuple[ProcessLayout, dict[str, Any]]:
    """One process per device, in network namespaces with the cluster's NIC bandwidths when
    wanted and possible (as `run` shapes them); (the layout, the shaping record)."""
    # the executor and torch load only to run: `heterog lower`/`simulate` start without them
    from heterog.execute.launcher import ProcessLayout

    want = shape_links if shape_links is not None else cluster.kind == "emulated"
    if not want:
        return ProcessLayout(devices=devices), {"enabled": False, "reason": "not requested"}
    if len({cluster.node_of[d] for d in devices}) == 1:
        return (
            ProcessLayout(devices=devices),
            {"enabled": False, "reason": "the plans' devices share one node: no link to shape"},
        )
    try:
        links = stack.enter_context(LinkShaping(cluster=cluster, devices=devices))
    except ShapingUnavailable as e:
        notes.append(f"links not shaped: {e}")
        return ProcessLayout(devices=devices), {"enabled": False, "reason": str(e)}
    return (
        ProcessLayout(devices=devices, wrap=links.wrap, env=links.env, master_addr=links.master_addr),
        {"enabled": True, "method": "netns+veth+tc-tbf", "nic_bandwidth_bytes_per_s": links.links},
    )


def run_interleaved(
    plans: list[Plan | str | os.PathLike],
    *,
    steps: int = 5,
    repetitions: int = 3,
    timeout_s: float = 60.0,
    seed: int = 0,
    warmup_steps: int = 1,
    predict: bool = True,
    shape_links: bool | None = None,
    out_dir: str | os.PathLike | None = None,
    force: bool = False,
    faults: dict[int, dict[str, Any]] | None = None,
    inputs: tuple | None = None,
) -> list[PlanRepetitions]:
    """Measure plans of one emulated cluster side by side: `repetitions` rounds, each training
    every plan `steps` steps in turn (A B C, then C B A, …), all in one launch of one process per
    device. On a shared machine whose speed drifts, consecutive plans then run seconds apart
    instead of a launch (~10 s of imports and export) apart, so the per-round ratio of two
    plans compares like with like; the start-up and the namespaces (links shaped as `run`
    shapes them) are paid once. A plan that fails is reported in its PlanRepetitions and not
    run again; the others go on. out_dir keeps round r of plan i in `rep<r>/plan<i>/`. inputs:
    the (graph, cluster, costs) the caller predicts with, so the Programs that run are the
    schedules it predicts (default: the plans' analytic costs). faults: a test hook, plan
    index → run's `fault` (every round of that plan)."""
    # the executor and torch load only to run: `heterog lower`/`simulate` start without them
    from heterog.execute.launcher import launch_local_many

    loaded = [as_plan(p) for p in plans]
    if steps < 1 or repetitions < 1:
        raise PlanError(f"steps and repetitions must be ≥ 1, found {steps} and {repetitions}.")
    if not loaded:
        return []
    prints = {p.cluster_fingerprint for p in loaded}
    if len(prints) > 1:
        raise PlanError(
            "run_interleaved measures plans of one cluster side by side; the plans were made "
            "for different clusters (their cluster fingerprints differ): run each group apart."
        )
    graphs: dict[str, Any] = {}
    prepared = [_prepare(plan, i, graphs, (faults or {}).get(i), False, None, inputs) for i, plan in enumerate(loaded)]
    cluster = prepared[0].cluster
    used = {d for p in prepared for d in p.devices}
    devices = tuple(d.name for d in cluster.devices if d.name in used)
    # odd rounds run the plans in reverse order (A B C C B A A B C …), so a drift of the machine's
    # speed within a round does not always fall on the same plans
    order = [
        (r, i)
        for r in range(repetitions)
        for i in (range(len(prepared)) if r % 2 == 0 else reversed(range(len(prepared))))
    ]
    entries = [dataclasses.replace(prepared[i].launch, folder=f"rep{r}/plan{i}", key=f"plan{i}") for r, i in order]
    notes: list[str] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(_sigterm_as_interrupt())
        layout, shaping = _shaped_layout(stack, cluster, devices, shape_links, notes)
        launched = launch_local_many(
            entries,
            steps=steps,
            timeout_s=timeout_s,
            seed=seed,
            out_dir=Path(out_dir) if out_dir else None,
            force=force,
            layout=layout,
        )
    out = []
    for i, (plan, prep) in enumerate(zip(loaded, prepared)):
        got = [launched[k] for k, (_, j) in enumerate(order) if j == i]  # plan i's rounds, in order
        error = next((g for g in got if isinstance(g, Exception)), None)
        reps: list[dict[str, Any]] = []
        for k, results in enumerate(got if error is None else ()):
            reps.append(
                _outcome(
                    plan,
                    prep.covered,
                    prep.cluster,
                    prep.local,
                    prep.graph,
                    prep.costs,
                    prep.devices,
                    results,
                    steps=steps,
                    warmup_steps=warmup_steps,
                    predict=predict and k == 0,
                    notes=list(notes),
                    shaping=shaping,
                )
            )
            if k:  # one prediction per plan: every round ran the same schedule
                for key in ("predicted_iteration_time_s", "prediction_source"):
                    reps[-1][key] = reps[0][key]
                m = reps[-1]["measured_iteration_time_s"]
                pred = reps[0]["predicted_iteration_time_s"]
                reps[-1]["relative_error"] = (m - pred) / pred if pred else None
        out.append(PlanRepetitions(index=i, strategy=plan.strategy, repetitions=tuple(reps), error=error))
    return out

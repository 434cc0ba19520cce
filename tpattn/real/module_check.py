"""The five-measure check for any ``nn.Module`` and any tensor-parallel sharding, on real ranks:
``check_module(module, plan, x)`` takes one step (MSE, backward, SGD) with a whole copy and a
sharded copy on every rank, and compares them and the ranks' replicated tensors."""
from __future__ import annotations

import copy
import pickle
import warnings
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tpattn.block.sgd import sgd_step
from tpattn.check.core import LR, MEASURES, TOLERANCE, five_measures, max_abs_diff
from .launch import DEFAULT_TIMEOUT, default_backend, run_on_ranks

__all__ = ["ModuleCheck", "check_module", "check_plans", "full_value", "DEFAULT_TIMEOUT"]

#: The regression target is drawn from this seed (the same on every rank).
TARGET_SEED = 0


@dataclass
class ModuleCheck:
    """``check_module``'s findings: ``measures``, ``ledger`` (``{"forward": {kind: n},
    "backward": ...}``), ``replica_disagreement`` (per replicated tensor, vs rank 0),
    ``sharded`` (placements), ``timings`` (not deterministic)."""

    world_size: int
    backend: str
    tolerance: float
    measures: dict
    ledger: dict
    replica_disagreement: dict
    sharded: dict
    timings: dict = field(default_factory=dict, compare=False)

    @property
    def passed(self) -> bool:
        """Every measure below ``tolerance`` and every replica identical."""
        return self.measures["passed"] and not any(self.replica_disagreement.values())


@dataclass(frozen=True)
class _Job:
    module: torch.nn.Module
    plans: tuple[tuple[str, object], ...]  # (label, plan dict or sharding function)
    x: torch.Tensor
    target: torch.Tensor | None
    tolerance: float


def _counts(mode) -> dict[str, int]:
    """``{kind: n}`` of ``mode``'s collectives, sorted (``c10d_functional.all_reduce``:
    ``"all_reduce"``)."""
    counts = Counter()
    for op, n in mode.get_comm_counts().items():
        name = str(op).split(".")[-1].removesuffix("_")
        counts[{"allreduce": "all_reduce"}.get(name, name)] += n
    return dict(sorted(counts.items()))


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (an all-gather), or a plain tensor as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


#: torch's warnings about CommDebugMode's hook that ``_rank_step`` silences (regexes).
COMM_HOOK_WARNING = (r"Full backward hook is firing when gradients are computed with respect "
                     r"to module outputs since no inputs require gradients")
COMM_OUTPUT_WARNING = r"For backward hooks to be called, module output should be a Tensor"


def _is_replicated(t: torch.Tensor) -> bool:
    placements = getattr(t, "placements", None)
    return placements is None or all(p.is_replicate() for p in placements)


def _rank_main(rank: int, job: _Job, device: torch.device, on_progress) -> list[dict]:
    """Every rank: every sharding of ``job`` in turn, in one process group."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    results = []
    for index, (label, sharding) in enumerate(job.plans):
        results.append(_rank_step(rank, job, label, sharding, mesh, device))
        on_progress(index)
    return results


def _shard(module: torch.nn.Module, sharding, mesh) -> torch.nn.Module:
    """``module`` sharded over ``mesh``: ``parallelize_module`` with a plan dict, or the
    sharding function's own result (``sharding(module, mesh)``)."""
    if isinstance(sharding, dict):
        from torch.distributed.tensor.parallel import parallelize_module

        return parallelize_module(module, mesh, sharding)
    sharded = sharding(module, mesh)
    if not isinstance(sharded, torch.nn.Module):
        raise ValueError(f"the sharding function must return the sharded torch.nn.Module "
                         f"(got {type(sharded).__name__})")
    return sharded


def _module_step(module: torch.nn.Module, names: list[str], x0: torch.Tensor,
                 target: torch.Tensor, forward_comms: list | None = None) -> dict:
    """One step of ``module`` on its own parameters (a TP runtime's gradient hooks run): MSE
    against ``target``, backward, SGD on ``names``. Returns ``one_step``'s dict (a DTensor stays
    one); ``forward_comms`` receives the forward's ``CommDebugMode``."""
    from torch.distributed.tensor.debug import CommDebugMode

    params = dict(module.named_parameters())
    module.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_(True)
    if forward_comms is None:
        y = module(x)
    else:
        with CommDebugMode() as comms:
            y = module(x)
        forward_comms.append(comms)
    y = _local(y) if _is_replicated(y) else full_value(y)
    loss = F.mse_loss(y, target)
    loss.backward()
    grads = {k: params[k].grad for k in names}
    weights = sgd_step({k: params[k].detach() for k in names}, grads, LR)
    return {"output": y.detach(), "loss": loss.detach(), "input_grad": x.grad,
            "grads": grads, "weights": weights}


def _ledger(forward_comms, step_comms) -> dict:
    fwd = _counts(forward_comms[0])
    return {"forward": fwd, "backward": dict(Counter(_counts(step_comms)) - Counter(fwd))}


def _rank_step(rank: int, job: _Job, label: str, sharding, mesh, device: torch.device) -> dict:
    """One sharding on every rank: both steps and their comparisons (rank 0 returns them)."""
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    whole = copy.deepcopy(job.module).to(device)
    sharded = _shard(copy.deepcopy(job.module).to(device), sharding, mesh)
    x0 = job.x.to(device)
    # the parameters the forward uses (an HF decoder layer also holds an MLP this block skips)
    y = whole(x0.clone().requires_grad_(True))
    y.sum().backward()
    used = [k for k, v in whole.named_parameters() if v.grad is not None]
    sharded_params = dict(sharded.named_parameters())
    missing = [k for k in used if k not in sharded_params]
    if missing:
        raise ValueError(f"the sharded module must keep the module's parameter names; "
                         f"it has no {', '.join(missing[:3])}")
    if job.target is not None:
        target = job.target.to(device)
    else:
        g = torch.Generator().manual_seed(TARGET_SEED)
        target = torch.randn(y.shape, generator=g, dtype=torch.float64).to(x0.dtype).to(device)
    reference = _module_step(whole, used, x0, target)

    forward_comms = []
    # CommDebugMode's global backward hook warns on submodules without grad inputs or tensor
    # outputs: about this check's hook, not the user's module
    with CommDebugMode() as step_comms, warnings.catch_warnings():
        for message in (COMM_HOOK_WARNING, COMM_OUTPUT_WARNING):
            warnings.filterwarnings("ignore", message=message, category=UserWarning)
        tp = _module_step(sharded, used, x0, target, forward_comms)
    ledger = _ledger(forward_comms, step_comms)

    replicated = {k for k in used if _is_replicated(sharded_params[k])}
    shard_info = {k: [str(p) for p in sharded_params[k].placements] for k in used
                  if k not in replicated}
    mine = {"output": tp["output"], "input_grad": tp["input_grad"],
            **{"grad:" + k: _local(tp["grads"][k]) for k in sorted(replicated)},
            **{"weight:" + k: _local(tp["weights"][k]) for k in sorted(replicated)}}
    # full sizes (an all-gather per sharded tensor), then every rank's replicated copies
    tp_full = {**tp, "grads": {k: full_value(v) for k, v in tp["grads"].items()},
               "weights": {k: full_value(v) for k, v in tp["weights"].items()}}
    flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in mine.values()])
    parts = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, flat)
    if rank != 0:
        return {}
    sizes = [t.numel() for t in mine.values()]
    ranks = [dict(zip(mine, part.split(sizes))) for part in parts]
    disagreement = {name: max(max_abs_diff(r[name], ranks[0][name]) for r in ranks)
                    for name in mine}
    measures = five_measures(None, label, reference, tp_full)
    measures["passed"] = all(measures[m] < job.tolerance for m in MEASURES)
    return {"measures": measures, "ledger": ledger, "replica_disagreement": disagreement,
            "sharded": shard_info}


def check_module(module: torch.nn.Module, plan, x: torch.Tensor, *,
                 target: torch.Tensor | None = None, world_size: int = 2,
                 label: str = "plan", tolerance: float = TOLERANCE,
                 timeout: float = DEFAULT_TIMEOUT, backend: str | None = None) -> ModuleCheck:
    """Shard ``module`` (picklable, one tensor in, one out) over ``world_size`` real ranks with
    ``plan`` (``parallelize_module``'s, or a picklable ``fn(module, mesh) -> sharded module``
    keeping the parameter names), take one step with it and with the whole module, compare.
    ``target``: the MSE target (default a fixed random one). Only parameters the forward uses
    take part; ``launch.RankFailure`` when a rank fails."""
    return check_plans(module, {label: plan}, x, target=target, world_size=world_size,
                       tolerance=tolerance, timeout=timeout, backend=backend)[0]


def _check_plan(label: str, plan, names: set[str]) -> None:
    """``ValueError`` unless ``plan`` is a plan of the module's modules or a picklable function."""
    if callable(plan) and not isinstance(plan, dict):
        try:
            pickle.dumps(plan)
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            raise ValueError(f"plan {label!r}: a sharding function must be picklable (a "
                             f"module-level function or a functools.partial of one): "
                             f"{e}") from None
        return
    if not isinstance(plan, dict) or not plan:
        raise ValueError(f"plan {label!r} must be a non-empty dict of module name -> "
                         f"ParallelStyle, or a sharding function fn(module, mesh) -> module "
                         f"(got {type(plan).__name__})")
    from torch.distributed.tensor.parallel import ParallelStyle

    odd = sorted(k for k, v in plan.items() if not isinstance(v, ParallelStyle))
    if odd:
        raise ValueError(f"plan {label!r} must map module names to ParallelStyle objects "
                         f"(ColwiseParallel() ...); not: {', '.join(odd)}")
    unknown = sorted(k for k in plan if "*" not in k and k not in names)
    if unknown:
        raise ValueError(f"plan {label!r} names modules the module does not have: "
                         f"{', '.join(unknown)}")


def check_plans(module: torch.nn.Module, plans: dict, x: torch.Tensor, *,
                target: torch.Tensor | None = None, world_size: int = 2,
                tolerance: float = TOLERANCE, timeout: float = DEFAULT_TIMEOUT,
                backend: str | None = None) -> list[ModuleCheck]:
    """``check_module`` for each of ``{label: plan}`` in one set of rank processes, in order."""
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"module must be a torch.nn.Module (got {type(module).__name__})")
    if not isinstance(plans, dict) or not plans:
        raise ValueError("plans must be a non-empty dict of label -> plan")
    names = {name for name, _ in module.named_modules()}
    for label, plan in plans.items():
        _check_plan(label, plan, names)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError("x must be a floating-point torch.Tensor (the module's input)")
    if target is not None and not isinstance(target, torch.Tensor):
        raise ValueError("target must be a torch.Tensor shaped like the module's output, or None")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"world_size must be an integer >= 2 (got {world_size!r})")
    if not isinstance(tolerance, (int, float)) or isinstance(tolerance, bool) or not tolerance > 0:
        raise ValueError(f"tolerance must be a number > 0 (got {tolerance!r})")
    backend = backend or default_backend(world_size)
    job = _Job(module=module,
               plans=tuple((str(k), dict(v) if isinstance(v, dict) else v)
                           for k, v in plans.items()),
               x=x.detach().cpu(), target=None if target is None else target.detach().cpu(),
               tolerance=float(tolerance))
    preload = ("tpattn.real.module_check",) + tuple(sorted(
        {type(m).__module__ for m in module.modules()} - {"__main__"}))
    results, timings = run_on_ranks(_rank_main, world_size, job, timeout=timeout, backend=backend,
                                    preload=preload)
    return [ModuleCheck(world_size, backend, float(tolerance), **r, timings=timings)
            for r in results[0]]

"""Pipeline parallelism as ``torch.distributed.pipelining`` runs it (issue 18): stages, schedules and the memory
of each pipeline rank.

Stages (torchtitan's split): the decoder layers divided evenly over ``pp x virtual`` stages (the first
``L mod stages`` stages one layer more), the embedding on the first stage, the final norm + LM head (and the loss)
on the last. Rank r holds stages r, r + pp, ... (torchtitan's "loop" placement of virtual stages).

Schedules: the order of each rank's forward (F) and backward (B) actions, ported from torch 2.13's
``schedules.py`` (``Schedule1F1B._step_microbatches`` / ``_get_pipeline_order``, ``ScheduleGPipe``,
``ScheduleInterleaved1F1B._calculate_single_rank_operations`` with ``_get_warmup_ops`` and
``_get_1f1b_rank_ops``); ``tests/estimator/test_pipeline.py`` checks the port against torch's own action lists.
Pure standard library: the predict path imports no torch.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def default_virtual(schedule: str) -> int:
    """Virtual stages per rank when the spec leaves ``pp_virtual`` at 0: 2 for interleaved, else 1."""
    return 2 if schedule == "interleaved_1f1b" else 1


def stage_layers(num_layers: int, num_stages: int) -> list[range]:
    """The decoder layers of each stage: even, the first ``num_layers mod num_stages`` stages one more."""
    if num_stages > num_layers:
        raise ValueError(f"pp: {num_stages} pipeline stages need at least as many decoder layers, the model has "
                         f"{num_layers}")
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for stage in range(num_stages):
        n = base + (1 if stage < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def stages_of_rank(rank: int, pp: int, virtual: int) -> list[int]:
    return [rank + k * pp for k in range(virtual)]


@dataclass(frozen=True)
class Action:
    kind: str          # "F" forward, "B" full backward
    stage: int
    microbatch: int


def rank_actions(schedule: str, rank: int, pp: int, microbatches: int, virtual: int = 1) -> list[Action]:
    """The compute actions of ``rank`` in the order torch runs them (idle slots dropped)."""
    if schedule == "gpipe":
        return ([Action("F", rank, m) for m in range(microbatches)]
                + [Action("B", rank, m) for m in range(microbatches)])
    if schedule == "1f1b":
        # Schedule1F1B._step_microbatches: min(M, pp - stage) warm-up forwards, then backward / forward pairs
        warmup = min(microbatches, pp - rank)
        out = [Action("F", rank, m) for m in range(warmup)]
        forward = warmup
        for m in range(microbatches):
            out.append(Action("B", rank, m))
            if forward < microbatches:
                out.append(Action("F", rank, forward))
                forward += 1
        return out
    if schedule == "interleaved_1f1b":
        return _interleaved(rank, pp, microbatches, virtual)
    raise ValueError(f"pp_schedule: {schedule!r} is not one of {', '.join(SCHEDULES)}")


def interleaved_rounds(pp: int, microbatches: int) -> tuple[int, int]:
    """(rounds, micro-batches per round) of ScheduleInterleaved1F1B; ValueError where torch refuses the count."""
    rounds = max(1, microbatches // pp)
    if microbatches % rounds:
        raise ValueError(f"pp_microbatches: interleaved 1F1B needs the micro-batches to be a multiple of its rounds "
                         f"({rounds} = max(1, {microbatches} // pp {pp})), got {microbatches}")
    return rounds, microbatches // rounds


def _interleaved(rank: int, pp: int, microbatches: int, virtual: int) -> list[Action]:
    _, per_round = interleaved_rounds(pp, microbatches)
    # _get_warmup_ops(multiply_factor=2)
    warmup = min((virtual - 1) * per_round + 2 * (pp - 1 - rank), microbatches * virtual)
    total = virtual * microbatches
    fwd_bwd = total - warmup

    def forward_stage(step: int) -> int:
        return ((step // per_round) % virtual) * pp + rank

    def backward_stage(step: int) -> int:
        return (virtual - 1 - ((step - warmup) // per_round) % virtual) * pp + rank

    fwd_mb: dict[int, int] = defaultdict(int)
    bwd_mb: dict[int, int] = defaultdict(int)
    out: list[Action] = []
    for op in range(warmup + fwd_bwd + warmup):  # cooldown ops = warmup ops (torch: microbatch_ops - fwd_bwd)
        if op < warmup + fwd_bwd:
            stage = forward_stage(op)
            out.append(Action("F", stage, fwd_mb[stage]))
            fwd_mb[stage] += 1
        if op >= warmup:
            stage = backward_stage(op)
            out.append(Action("B", stage, bwd_mb[stage]))
            bwd_mb[stage] += 1
    return out


def max_in_flight(actions: list[Action]) -> int:
    """The most forwards whose backward has not run yet, at any point of the rank's order."""
    live = best = 0
    for action in actions:
        live += 1 if action.kind == "F" else -1
        best = max(best, live)
    return best

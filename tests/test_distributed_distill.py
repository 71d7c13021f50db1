"""comera_fx.distill_ under torch.distributed (gloo, 2 CPU processes), the ranks on different data.

Each rank calls ``distill_`` on its own half of every global batch. The reference is one process calling it on
the whole global batches (float64, loss = plain MSE, so the mean of the ranks' losses and gradients is exactly the
global one up to float summation): the calibration must have been all-reduced (else the TT-SVDs, and the
allocated ranks, differ from the reference's), and the gradients averaged (else the parameters do). One spawned
group runs the scenarios; the processes meet through a FileStore in the test's temporary directory and every
collective times out, so a hang fails.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import comera_fx
from comera_fx.tt.inventory import tt_matrices
from helpers_distributed import run_scenarios, scenario_results

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch built without gloo"),
    pytest.mark.usefixtures("one_thread"),
]

WORLD = 2
SMALL = comera_fx.TensorizeConfig(min_numel=1, min_dim=1)
QUIET = comera_fx.DistillConfig(hidden_modules=(), calibration_batches=8, progress=False)
WIDTH = 16


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 8)
        self.pool = nn.Linear(WIDTH, WIDTH)  # like BERT's pooler: computed, but not in the matched output

    def forward(self, x):
        hidden = x + self.down(torch.tanh(self.up(x)))
        return self.head(hidden), self.pool(hidden)  # distill_ matches the first tensor


def make_teacher() -> Net:
    torch.manual_seed(0)
    return Net().double()


def global_batch(step: int, n: int = 48) -> torch.Tensor:
    # inputs of unequal scale per feature: the whitened TT-SVD then differs visibly from the plain one
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, WIDTH, generator=gen, dtype=torch.float64) * torch.linspace(
        0.1, 3.0, WIDTH, dtype=torch.float64
    )


def local_batch(step: int, rank: int) -> torch.Tensor:
    x = global_batch(step)
    per = x.shape[0] // WORLD
    return x[rank * per : (rank + 1) * per]


def mse(student, teacher):
    return (student - teacher).pow(2).mean()


DIRECT = dict(size_target=0.5, steps=3, calibration_batches=2, lr=1e-2)
SHRINK = dict(size_target=0.4, start_ratio=0.9, steps=5, calibration_batches=2, lr=1e-2)


def run_distill(batches, lr: float, calibration_batches: int, clock=None, **kwargs):
    """distill_ with these settings (the rest: size_target, budget, start_ratio, refit) on a fresh teacher."""
    teacher = make_teacher()
    student = copy.deepcopy(teacher)
    config = QUIET.replace(loss_fn=mse, lr=lr, calibration_batches=calibration_batches, clock=clock)
    summary = comera_fx.distill_(student, teacher, batches, tensorize_config=SMALL, config=config, **kwargs)
    return {
        "params": {k: v.detach().clone() for k, v in student.state_dict().items()},
        "ranks": {e.name: e.tt.ranks for e in tt_matrices(student)},
        "losses": summary.losses,
        "steps": summary.steps,
        "seconds": summary.seconds,
        "setup_seconds": summary.setup_seconds,
        "strategy": summary.strategy,
        "ratio": summary.ratio,
        "notes": summary.notes,
        "bare": type(student) is Net,
    }


def tensorized(calibration_batches, ratio):
    """The student right after distill_'s tensorization with a calibration on these batches (no training)."""
    from comera_fx.pretrained.distill import _tensorize_at

    student = make_teacher()
    cal = comera_fx.calibrate(student, calibration_batches, config=SMALL)
    _tensorize_at(student, ratio, SMALL, None, "energy", cal)
    return {"params": dict(student.state_dict()), "ranks": {e.name: e.tt.ranks for e in tt_matrices(student)}}


# --------------------------------------------------------------------------------------- scenarios (per rank)


def scenario_direct(rank, world):
    return run_distill([local_batch(s, rank) for s in range(4)], **DIRECT)


def scenario_shrink(rank, world):
    return run_distill([local_batch(s, rank) for s in range(6)], **SHRINK)


def scenario_clock(rank, world):
    """A clock that runs three times faster on rank 1, then an iterator that runs out on rank 1 only."""
    now = [0.0]

    def clock():
        now[0] += 1.0 + 2.0 * rank
        return now[0]

    out = {
        "budget": run_distill(
            [local_batch(s, rank) for s in range(4)],
            size_target=0.5,
            budget_seconds=4.5,
            clock=clock,
            calibration_batches=2,
            lr=1e-2,
        )
    }
    batches = [local_batch(s, rank) for s in range(6 if rank == 0 else 3)]
    out["ran_out"] = run_distill(
        batches if rank == 0 else iter(batches), size_target=0.5, steps=6, calibration_batches=2, lr=1e-2
    )
    return out


def scenario_own_calibration(rank, world):
    """Each rank passes its own calibration (not all-reduced): the ranks' TT shapes differ, refused on both."""
    teacher = make_teacher()
    cal = comera_fx.calibrate(teacher, [local_batch(s, rank) for s in range(2)], config=SMALL)
    try:
        comera_fx.distill_(
            copy.deepcopy(teacher),
            teacher,
            [local_batch(0, rank)],
            0.5,
            steps=1,
            calibration=cal,
            tensorize_config=SMALL,
            config=QUIET,
        )
    except ValueError as err:
        return {"refusal": str(err)}
    return {"refusal": None}


# lr ~ 0: the one training step (distill_ needs >= 1) leaves the refit cores as they are; Adam's first step is
# lr·sign(g) and would turn last-bit gradient differences into lr-sized ones
REFIT = dict(size_target=0.5, steps=1, calibration_batches=3, lr=1e-12, refit=True)


def scenario_refit(rank, world):
    return run_distill([local_batch(s, rank) for s in range(4)], **REFIT)


def scenario_validation(rank, world):
    """match_teacher(validation=) under DDP with rank 1's clock three times faster and a learning rate that only
    hurts: the checks fall at rank 0's steps on both ranks (their loss is all-reduced) and both keep the start."""
    from comera_fx.pretrained import match_teacher

    now = [0.0]

    def clock():
        now[0] += 1.0 + 2.0 * rank
        return now[0]

    teacher = make_teacher()
    student = copy.deepcopy(teacher)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in student.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    start = {k: v.detach().clone() for k, v in student.state_dict().items()}
    curve = []
    losses, _, notes = match_teacher(
        student,
        teacher,
        [local_batch(s, rank) for s in range(4)],
        100.0,  # rank 0's clock: 1 s a reading, about 50 steps, a check every 5 % (each rank alone: other steps)
        config=QUIET.replace(loss_fn=mse, lr=0.5, clock=clock),
        validation=[local_batch(10 + v, rank) for v in range(2)],
        validation_curve=curve,
    )
    return {"params": dict(student.state_dict()), "start": start, "curve": curve, "notes": notes, "steps": len(losses)}


SCENARIOS = {
    "validation": scenario_validation,
    "direct": scenario_direct,
    "shrink": scenario_shrink,
    "clock": scenario_clock,
    "own_calibration": scenario_own_calibration,
    "refit": scenario_refit,
}

# --------------------------------------------------------------------------------------------------- harness


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return run_scenarios(__name__, tuple(SCENARIOS), tmp_path_factory.mktemp("dist_distill"), WORLD)


def assert_params(got: dict, want: dict, tol: float, what: str):
    assert got.keys() == want.keys(), what
    for k in want:
        assert got[k].shape == want[k].shape, f"{what} {k}: {tuple(got[k].shape)} vs {tuple(want[k].shape)}"
        torch.testing.assert_close(got[k], want[k], rtol=tol, atol=tol, msg=lambda m: f"{what} {k}: {m}")


def differs(a: dict, b: dict, by: float) -> bool:
    """Other ranks, or a parameter off by more than ``by``."""
    return a["ranks"] != b["ranks"] or any(
        float((a["params"][k] - b["params"][k]).abs().max()) > by for k in b["params"]
    )


# ------------------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("name, kwargs, n", [("direct", DIRECT, 4), ("shrink", SHRINK, 6)])
def test_ranks_agree_and_equal_one_process_on_the_global_batches(group, name, kwargs, n):
    res = scenario_results(group, name)
    want = run_distill([global_batch(s) for s in range(n)], **kwargs)
    # without the all-reduced calibration the ranks would start from other TT-SVDs: check that they would differ
    ratio = kwargs.get("start_ratio") or kwargs["size_target"]
    starts = [tensorized([local_batch(s, rank) for s in range(2)], ratio) for rank in range(WORLD)]
    assert differs(starts[0], starts[1], 1e-4)
    # the tolerance: C differs from the reference's in the last bits (summed in another order), and a TT-SVD with
    # close singular values turns that into ~1e-8 on some cores; training on one rank's data alone (no gradient
    # averaging) is off by far more
    alone = run_distill([local_batch(s, 0) for s in range(n)], **kwargs)
    assert differs(alone, want, 1e-4)
    for rank, r in enumerate(res):
        assert r["bare"], "the student the caller holds stays the bare (tensorized) module"
        assert r["ranks"] == want["ranks"], f"rank {rank}: ranks {r['ranks']} vs one process {want['ranks']}"
        assert r["steps"] == want["steps"] == kwargs["steps"] and r["strategy"] == want["strategy"]
        # mean of the ranks' MSE on equal halves = the MSE on the global batch
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(want["losses"]), rtol=1e-6, atol=1e-12)
        assert_params(r["params"], want["params"], tol=1e-6, what=f"{name} rank {rank} vs one process")
    assert_params(res[1]["params"], res[0]["params"], tol=0.0, what=f"{name} rank 1 vs rank 0")
    if name == "shrink":  # RankAdaptive pruned under DDP (rebuilding the wrapper) down to the target
        assert want["strategy"] == "shrink" and not want["notes"] and res[0]["ratio"] <= kwargs["size_target"]
    assert res[0]["losses"] == res[1]["losses"] and res[0]["setup_seconds"] == res[1]["setup_seconds"]


def test_budget_seconds_rank0_clock_decides_and_iterator_end_stops_all(group):
    res = scenario_results(group, "clock")
    # rank 0's clock advances 1 s per reading: elapsed k + 1 s before step k, so steps 0..3 run within 4.5 s and
    # the final reading is 6 s after the start; rank 1's clock (3 s per reading) alone would allow 1 step
    for rank, r in enumerate(res):
        assert r["budget"]["steps"] == 4, f"rank {rank} ran {r['budget']['steps']} steps"
        assert r["budget"]["seconds"] == 6.0, "the summary holds rank 0's seconds"
    assert_params(res[1]["budget"]["params"], res[0]["budget"]["params"], tol=0.0, what="budget rank 1 vs 0")
    # rank 1's one-shot iterator holds 3 batches: both ranks stop after 3 of the 6 steps, with the same note
    for r in res:
        assert r["ran_out"]["steps"] == 3 and any("ran out after 3 steps" in n for n in r["ran_out"]["notes"])
    assert_params(res[1]["ran_out"]["params"], res[0]["ran_out"]["params"], tol=0.0, what="ran out rank 1 vs 0")


def test_other_shapes_per_rank_refused_on_every_rank(group):
    for r in scenario_results(group, "own_calibration"):
        assert r["refusal"] is not None and "other TT ranks" in r["refusal"] and "all_reduce_" in r["refusal"]


def refit_outputs(result) -> torch.Tensor:
    """The distilled student of ``result`` (its state dict loaded into a tensorized skeleton) on a fresh batch."""
    student = make_teacher()
    comera_fx.tensorize_(student, SMALL.replace(max_rank=2))  # load_state_dict adopts the checkpoint's ranks
    student.load_state_dict(result["params"])
    with torch.no_grad():
        return student(global_batch(99))[0]


def test_refit_statistics_are_summed_over_the_ranks(group):
    """distill_(refit=True) on each rank's halves = one process on the global batches; one rank's data alone
    refits to another model (so the agreement is what makes them equal). Compared by the outputs: the whitened
    TT-SVD is sensitive to the last bits of its statistics (the same batches with their rows in another order
    move single cores by ~1e-4 in float64), the refit model's outputs by ~1e-5 relative."""
    res = scenario_results(group, "refit")
    want = run_distill([global_batch(s) for s in range(4)], **REFIT)
    alone = run_distill([local_batch(s, 0) for s in range(4)], **REFIT)
    reference = refit_outputs(want)
    scale = float(reference.abs().max())
    assert float((refit_outputs(alone) - reference).abs().max()) > 0.05 * scale
    for rank, r in enumerate(res):
        assert any("refit_sequential_: 4 layers" in n for n in r["notes"]), r["notes"]
        assert r["ranks"] == want["ranks"]
        assert float((refit_outputs(r) - reference).abs().max()) < 1e-3 * scale, f"rank {rank} vs one process"
    assert_params(res[1]["params"], res[0]["params"], tol=0.0, what="refit rank 1 vs rank 0")


def test_all_reduce_without_a_group_is_a_no_op():
    cal = comera_fx.calibrate(make_teacher(), [global_batch(0)], config=SMALL)
    before = {k: (s.second_moment.clone(), s.tokens) for k, s in cal.items()}
    assert cal.all_reduce_() is cal
    for k, (c, n) in before.items():
        assert torch.equal(cal[k].second_moment, c) and cal[k].tokens == n


def test_validation_checks_at_the_same_steps_on_every_rank(group):
    res = scenario_results(group, "validation")
    assert res[0]["steps"] == res[1]["steps"] > 5
    assert res[0]["curve"] == res[1]["curve"] and res[0]["curve"][0][0] == 0 and 10 < len(res[0]["curve"]) < 30
    assert res[0]["notes"] == res[1]["notes"] and any("kept the weights after step 0" in n for n in res[0]["notes"])
    assert_params(res[1]["params"], res[0]["params"], tol=0.0, what="validation rank 1 vs 0")
    assert_params(res[0]["params"], res[0]["start"], tol=0.0, what="validation: the start kept")

"""The learning-rate schedule's notes state the learning rate the log shows (its step ``s`` trains
at ``lr_at(s - 1)``), also where the run ends inside its warmup or the decay ends inside it."""

import argparse
import re

import pytest

from tensorpar.training.schedule import lr_at, schedule_note


def _args(*, steps, warmup, decay, lr=3e-3, min_lr=3e-4):
    return argparse.Namespace(steps=steps, warmup=warmup, lr_decay_steps=decay, lr=lr, min_lr=min_lr)


def _logged(args, step: int) -> float:
    return lr_at(step - 1, lr=args.lr, min_lr=args.min_lr, warmup=args.warmup, total=args.lr_decay_steps)


@pytest.mark.parametrize("steps, warmup, decay, start", [(20, 30, 20, 0), (40, 30, 20, 20), (8, 1, 6, 4),
                                                          (1000, 30, 600, 600), (31, 30, 30, 0)])
def test_every_note_states_the_lr_the_log_shows_at_the_steps_it_names(steps, warmup, decay, start):
    args = _args(steps=steps, warmup=warmup, decay=decay)
    note = schedule_note(args, start=start)
    claimed = re.search(r"steps (\d+)-(\d+) train at ([\d.e-]+)", note) or re.search(
        r"the lr reaches ([\d.e-]+) at step (\d+)", note)
    if "train at" in note:
        first, last, lr = int(claimed[1]), int(claimed[2]), float(claimed[3])
        assert all(_logged(args, s) == pytest.approx(lr, rel=1e-12) for s in range(first, last + 1)), note
        assert first == max(start, warmup if decay <= warmup else decay) + 1 and last == steps
    else:
        assert _logged(args, int(claimed[2])) == pytest.approx(float(claimed[1]), rel=1e-3)


def test_a_fresh_run_shorter_than_its_warmup_says_it_never_reaches_its_lr():
    """A --steps 20 --lr 3e-5 fine-tune peaked at 2e-5, silently."""
    assert schedule_note(_args(steps=20, warmup=30, decay=20, lr=3e-5, min_lr=3e-6)) == (
        "the run ends inside its warmup of 30 steps: the lr reaches 2e-05 at step 20, never --lr 3e-05; pass "
        "--warmup below 20 to reach it")


def test_a_run_as_long_as_its_warmup_says_it_never_decays():
    """--steps 30 with the default warmup of 30 said "steps 31-30 train at 0.003; to decay over
    the run, pass --lr-decay-steps 30", the value it already had."""
    args = _args(steps=30, warmup=30, decay=30)
    assert schedule_note(args) == ("the run ends with its warmup of 30 steps: the lr reaches 0.003 at step 30 and "
                                   "never decays; pass --warmup below 30 for a decay")
    assert _logged(args, 30) == 3e-3 and _logged(args, 29) < 3e-3


def test_a_decay_inside_the_warmup_says_nothing_decays():
    """docs/context-parallel.md's resume of a 20-step run to 40 said steps 21-40 train at 0.0003; the
    log showed 2.1e-03 at step 21 and the 3e-3 peak at steps 30 and 40."""
    assert schedule_note(_args(steps=40, warmup=30, decay=20), start=20) == (
        "--lr-decay-steps 20 ends inside the warmup of 30 steps, so nothing decays: steps 31-40 train at 0.003; to "
        "decay over the run, pass --lr-decay-steps 40")


def test_a_schedule_that_runs_its_course_says_nothing():
    assert schedule_note(_args(steps=600, warmup=30, decay=600)) is None


def test_the_default_floor_is_the_decimal_a_person_writes():
    """Printed configs said min-lr = 0.00030000000000000003 (3e-3 x 0.1)."""
    from tensorpar.training.schedule import settle_run

    args = argparse.Namespace(steps=10, lr=3e-3, min_lr=None, warmup=None, lr_decay_steps=None, micro_batch=None,
                              global_batch=None, grad_accum=None, interleave=1)
    settle_run(args, meta=None, dp_size=1)
    assert repr(args.min_lr) == "0.0003"

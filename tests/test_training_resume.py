"""What a resume keeps: every setting left out is the checkpoint's (also a tensorpar 0.2 one's),
and each value given that differs is named."""

from tensorpar.cli.training_cli import parse_train_args
from tensorpar.training.resume import continue_settings, resume_header, setting_changes

META_0_2 = {"step": 600, "steps": 600, "global_batch": 32, "micro_batch": 16, "dtype": "bf16",
            "schedule": {"lr": 3e-3, "min_lr": 3e-4, "warmup": 30, "decay_steps": 600},
            "data": {"position": 600, "seed": 7, "source": "/data/corpus.bin"}, "world": {"tp": 2, "dp": 2}}


def test_a_0_2_checkpoint_keeps_its_data_seed_and_dtype():
    args = parse_train_args(["--resume", "run", "--steps", "1000"])
    continue_settings(args, META_0_2)
    assert (args.data, args.seed, args.dtype, args.eval_every, args.tensorboard) == \
        ("/data/corpus.bin", 7, "bf16", 100, False)
    args.lr, args.min_lr, args.warmup, args.lr_decay_steps, args.global_batch, args.micro_batch = \
        3e-3, 3e-4, 30, 600, 32, 16
    assert setting_changes(args, META_0_2) == []
    header, note = resume_header(args, META_0_2, ckpt="run/step_600", tp=4, dp=1, data="--data /data/corpus.bin")
    assert header == ("resuming run/step_600 at step 600 of 1000: TP 2->4, DP 2->1; data: --data /data/corpus.bin "
                      "from step 600; schedule lr 0.003, warmup 30, cosine to 0.0003 at step 600; no setting changed")
    assert note == ("the schedule reaches --min-lr 0.0003 at step 601, so steps 601-1000 train at 0.0003; to decay "
                    "over the whole run instead, pass --lr-decay-steps 1000")


def test_values_given_that_differ_are_named_and_left_out_ones_are_not():
    meta = {**META_0_2, "settings": {"data": None, "seq_len": 128, "seed": 7, "dtype": "fp32", "sp": True,
                                     "eval_every": 100, "tensorboard": True}}
    args = parse_train_args(["--resume", "run", "--data", "/data/other.txt", "--seq-len", "64", "--no-sp",
                             "--lr", "1e-3", "--eval-every", "100"])
    continue_settings(args, meta)
    args.min_lr, args.warmup, args.lr_decay_steps, args.global_batch, args.micro_batch = 3e-4, 30, 600, 32, 16
    assert (args.tensorboard, args.seed) == (True, 7)
    assert setting_changes(args, meta) == ["--data embedded -> /data/other.txt", "--seq-len 128 -> 64",
                                           "--sp on -> off", "--lr 0.003 -> 0.001"]

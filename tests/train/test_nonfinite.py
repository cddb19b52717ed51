"""The non-finite policy: stop by default, skip when asked, fp16 overflows skipped, max_skipped in a row stops."""

import math

from gpipe_cli.train.nonfinite import NonFinitePolicy, skipped_line, stop_line, what_went_wrong


def decisions(policy, finite):
    return [policy.decide(f) for f in finite]


def test_stop_is_the_default_in_fp32_and_bf16():
    assert decisions(NonFinitePolicy(), [True, True, False]) == ["ok", "ok", "stop"]


def test_skip_counts_and_max_skipped_in_a_row_stops():
    policy = NonFinitePolicy(mode="skip", max_skipped=3)
    assert decisions(policy, [False, False, True, False, False, False]) == ["skip", "skip", "ok", "skip", "skip",
                                                                            "stop"]
    assert policy.total == 5 and policy.consecutive == 3


def test_fp16_skips_overflows_whatever_the_mode():
    policy = NonFinitePolicy(mode="stop", max_skipped=2, loss_scaling=True)
    assert decisions(policy, [False, True, False, False]) == ["skip", "ok", "skip", "stop"]


def test_the_message_names_the_values_the_stage_and_the_layer():
    names = ["embed", "block-0", "block-1", "softmax"]
    what = what_went_wrong(math.nan, math.inf, (1, 3), names)
    assert "loss nan" in what and "gradient norm inf" in what and "stage 1, layer 3 'softmax'" in what
    assert "every gradient is finite" in what_went_wrong(math.inf, 2.0, None, names)
    assert "loss" not in what_went_wrong(1.0, math.nan, (0, 0), names).split(",")[0]


def test_the_lines_say_why_and_where_the_last_good_checkpoint_is():
    stop = NonFinitePolicy()
    stop.decide(False)
    line = stop_line(7, "non-finite gradient norm nan", stop, "run/checkpoints/step-00000006")
    assert line.startswith("stopped at step 7 (train.on_nonfinite: stop)") and "step-00000006" in line
    assert "\n" not in line
    skip = NonFinitePolicy(mode="skip", max_skipped=2)
    skip.decide(False)
    assert "step 3/9 skipped" in skipped_line(3, 9, "x", skip, None) and "1 in a row" in skipped_line(3, 9, "x", skip,
                                                                                                       None)
    assert "loss scale now 32768" in skipped_line(3, 9, "x", skip, 32768.0)
    skip.decide(False)
    assert "2 steps in a row skipped, train.max_skipped: 2" in stop_line(4, "x", skip, None)
    assert "no checkpoint was written" in stop_line(4, "x", skip, None)


def test_one_skipped_step_is_said_in_the_singular():
    skip = NonFinitePolicy(mode="skip", max_skipped=1)
    assert skip.decide(False) == "stop"
    assert "(1 step in a row skipped, train.max_skipped: 1)" in stop_line(4, "x", skip, None)


def test_an_fp16_stop_says_the_loss_scale_it_had_come_down_to():
    skip = NonFinitePolicy(max_skipped=2, loss_scaling=True)
    skip.decide(False)
    skip.decide(False)
    assert stop_line(2, "x", skip, None, 16384.0) == ("stopped at step 2 (2 steps in a row skipped, train.max_skipped: "
                                                     "2): x; loss scale now 16384, halved at each skip; no checkpoint "
                                                     "was written")

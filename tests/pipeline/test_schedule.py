import pytest

from gpipe_cli.pipeline import placement
from gpipe_cli.pipeline import schedule as S
from gpipe_cli.pipeline.schedule import Kind


def text(actions):
    return " ".join(str(a) for a in actions)


def test_gpipe_fill_drain_k2_m3_by_hand():
    stage0, stage1 = S.build_all("gpipe", 2, 3, "always")
    assert text(stage0) == "F0 sf0 F1 sf1 F2 sf2 R2 rb2 B2 R1 rb1 B1 R0 rb0 B0"
    assert text(stage1) == "rf0 F0 rf1 F1 rf2 F2 R2 B2 sb2 R1 B1 sb1 R0 B0 sb0"


def test_except_last_keeps_the_last_microbatch_in_gpipe():
    stage0, stage1 = S.build_all("gpipe", 2, 3, "except_last")
    assert text(stage0) == "F0 sf0 F1 sf1 F2 sf2 rb2 B2 R1 rb1 B1 R0 rb0 B0"
    assert "R2" not in text(stage1)


def test_never_has_no_recompute():
    assert all(a.kind != Kind.RECOMPUTE for s in S.build_all("1f1b", 3, 5, "never") for a in s)


def test_1f1b_k3_m4_by_hand():
    s0, s1, s2 = S.build_all("1f1b", 3, 4, "never")
    assert text(s0) == "F0 sf0 F1 sf1 F2 sf2 rb0 B0 F3 sf3 rb1 B1 rb2 B2 rb3 B3"
    assert text(s1) == "rf0 F0 sf0 rf1 F1 sf1 rb0 B0 sb0 rf2 F2 sf2 rb1 B1 sb1 rf3 F3 sf3 rb2 B2 sb2 rb3 B3 sb3"
    assert text(s2) == "rf0 F0 B0 sb0 rf1 F1 B1 sb1 rf2 F2 B2 sb2 rf3 F3 B3 sb3"


def test_single_stage_has_no_messages():
    (only,) = S.build_all("gpipe", 1, 2, "except_last")
    assert text(only) == "F0 F1 B1 R0 B0"


def sent(plan, kind):
    """(receiving chunk, micro-batch) of each message a stage sends, in order."""
    return [(a.chunk + (1 if kind == Kind.SEND_FWD else -1), a.microbatch) for a in plan if a.kind == kind]


def taken(plan, kind):
    return [(a.chunk, a.microbatch) for a in plan if a.kind == kind]


CASES = [(name, k, m, 1) for name in ("gpipe", "1f1b", "zero-bubble")
         for k, m in [(2, 1), (2, 5), (3, 4), (4, 8), (8, 3)]] + \
    [("interleaved", k, m, v) for k, m, v in [(2, 2, 2), (2, 8, 2), (3, 6, 2), (4, 8, 3), (2, 3, 1)]]


@pytest.mark.parametrize("name,stages,mbs,virtual", CASES)
def test_every_send_meets_its_receive_in_order(name, stages, mbs, virtual):
    plans = S.build_all(name, stages, mbs, "except_last", virtual)
    for s in range(stages):
        nxt = (s + 1) % stages
        assert sent(plans[s], Kind.SEND_FWD) == taken(plans[nxt], Kind.RECV_FWD)
        assert sent(plans[nxt], Kind.SEND_BWD) == taken(plans[s], Kind.RECV_BWD)
    for s, plan in enumerate(plans):
        chunks = {a.chunk for a in plan}
        assert chunks == {v * stages + s for v in range(virtual)}
        for c in chunks:
            forwards = [a.microbatch for a in plan if a.kind == Kind.FWD and a.chunk == c]
            assert sorted(forwards) == list(range(mbs))
            # every micro-batch gets its input and weight gradients exactly once, W after its Bi
            whole = [a.microbatch for a in plan if a.kind == Kind.BWD and a.chunk == c]
            inputs = [a.microbatch for a in plan if a.kind == Kind.BWD_INPUT and a.chunk == c]
            weights = [a.microbatch for a in plan if a.kind == Kind.BWD_WEIGHT and a.chunk == c]
            assert sorted(whole + inputs) == list(range(mbs)) and sorted(inputs) == sorted(weights)
        position = {(a.kind, a.microbatch, a.chunk): i for i, a in enumerate(plan)}
        assert all(position[(Kind.BWD_INPUT, *key)] < position[(Kind.BWD_WEIGHT, *key)]
                   for key in ((a.microbatch, a.chunk) for a in plan if a.kind == Kind.BWD_INPUT))
    S.simulate(plans, lambda s, a: 1.0)  # raises on deadlock


def test_the_simulator_names_where_a_deadlocked_schedule_waits():
    # The checks above rely on it: lists whose stages wait on each other end in one error, never a hang.
    stage0, stage1 = S.build_all("gpipe", 2, 1, "never")
    assert text(stage0) == "F0 sf0 rb0 B0"
    waits_first = [stage0[2], *stage0[:2], stage0[3]]  # the gradient awaited before the forward is sent
    with pytest.raises(RuntimeError, match=r"^schedule deadlocks: stages wait at \{0: 'rb0', 1: 'rf0'\}$"):
        S.simulate([waits_first, stage1], lambda s, a: 1.0)


@pytest.mark.parametrize("stages,mbs", [(2, 1), (2, 4), (2, 32), (4, 4), (4, 32), (8, 1), (8, 32)])
def test_simulated_gpipe_bubble_is_theory_for_equal_costs(stages, mbs):
    plans = S.build_all("gpipe", stages, mbs, "never")
    spans = S.simulate(plans, lambda s, a: 1.0 if a.kind == Kind.FWD else 2.0)
    assert S.bubble(spans) == pytest.approx(S.theoretical_bubble(stages, mbs))


def peak_graphs(plan):
    """The most micro-batches whose graph (or stored input) a stage holds at once."""
    live = peak = 0
    for a in plan:
        live += a.kind == Kind.FWD
        live -= a.kind in S.RELEASE
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("stages,mbs", [(2, 1), (2, 8), (3, 2), (4, 8), (4, 16)])
def test_1f1b_and_zero_bubble_bound_inflight_microbatches(stages, mbs):
    one = [peak_graphs(plan) for plan in S.build_all("1f1b", stages, mbs)]
    assert one == [min(stages - s, mbs) for s in range(stages)]
    # ZB-H1 holds each graph until its W, but no stage holds more than 1F1B's busiest stage
    zero = [peak_graphs(plan) for plan in S.build_all("zero-bubble", stages, mbs)]
    assert all(z <= max(one) for z in zero) and zero[0] == one[0]
    gpipe_peak = max(sum(a.kind == Kind.FWD for a in plan) for plan in S.build_all("gpipe", stages, mbs))
    assert gpipe_peak == mbs


def test_bad_names_are_clear():
    with pytest.raises(ValueError, match="unknown schedule 'zb'"):
        S.build("zb", 0, 2, 2)
    with pytest.raises(ValueError, match="unknown checkpoint mode 'sometimes'"):
        S.build("gpipe", 0, 2, 2, "sometimes")


def test_render_prints_one_line_per_stage():
    assert S.render(S.build_all("gpipe", 2, 1, "never")).splitlines() == [
        "stage 0: F0 sf0 rb0 B0", "stage 1: rf0 F0 B0 sb0"]


def test_zero_bubble_k4_m4_by_hand():
    plans = S.build_all("zero-bubble", 4, 4, "never")
    compute = [" ".join(str(a) for a in plan if a.kind in S.COMPUTE) for plan in plans]
    assert compute == ["F0 F1 F2 F3 B0 B1 B2 B3",
                       "F0 F1 F2 Bi0 F3 Bi1 W0 Bi2 W1 Bi3 W2 W3",
                       "F0 F1 Bi0 F2 Bi1 F3 Bi2 W0 Bi3 W1 W2 W3",
                       "F0 Bi0 F1 Bi1 F2 Bi2 F3 Bi3 W0 W1 W2 W3"]
    # the input gradient goes out before the weight gradient is computed
    assert "Bi0 sb0 rf1" in text(plans[3])


def test_zero_bubble_is_1f1b_with_the_backward_split_and_each_w_late_by_its_stage():
    for stages, mbs in ((2, 5), (4, 3), (4, 9)):
        for s, (one, zero) in enumerate(zip(S.build_all("1f1b", stages, mbs, "never"),
                                            S.build_all("zero-bubble", stages, mbs, "never"))):
            backward = [a for a in zero if a.kind in S.GRADIENT]
            assert [(a.microbatch, a.kind == Kind.FWD) for a in zero if a.kind in (Kind.FWD, *S.GRADIENT)] == \
                [(a.microbatch, a.kind == Kind.FWD) for a in one if a.kind in (Kind.FWD, Kind.BWD)]
            for a in (b for b in zero if b.kind == Kind.BWD_WEIGHT):
                # between a micro-batch's B and its W run exactly s other Bs (fewer only at the end)
                between = zero[zero.index(S.Action(Kind.BWD_INPUT, a.microbatch, s)):zero.index(a)]
                assert sum(b.kind == Kind.BWD_INPUT for b in between) - 1 == min(s, mbs - 1 - a.microbatch)
            assert all(a.kind == (Kind.BWD if s == 0 else Kind.BWD_INPUT) for a in backward)


def equal_costs(stage, action):
    """F, B, W and a recompute alike (a whole backward is B + W)."""
    return {Kind.FWD: 1.0, Kind.RECOMPUTE: 1.0, Kind.BWD: 2.0, Kind.BWD_INPUT: 1.0,
            Kind.BWD_WEIGHT: 1.0}.get(action.kind, 0.0)


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_zero_bubble_cuts_1f1b_bubble_to_about_a_third(stages):
    for mbs in range(2 * stages, 4 * stages + 1):
        one = S.bubble(S.simulate(S.build_all("1f1b", stages, mbs, "never"), equal_costs))
        zero = S.bubble(S.simulate(S.build_all("zero-bubble", stages, mbs, "never"), equal_costs))
        # ZB-H1: each stage idles K-1 slots of one pass where 1F1B idles K-1 slots of three
        assert one / 3 < zero <= one / 2
        assert zero == pytest.approx(S.theoretical_bubble(stages, mbs, "zero-bubble"))


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_zero_bubble_halves_gpipe_bubble_when_every_stage_recomputes_alike(checkpoint):
    # (except_last recomputes every micro-batch on stage 0 of the 1F1B family and none on the last stage:
    # that imbalance, not the order, is then most of the idle time)
    for stages in (2, 3, 4):
        for mbs in range(2 * stages, 4 * stages + 1):
            idle = {name: S.bubble(S.simulate(S.build_all(name, stages, mbs, checkpoint), equal_costs))
                    for name in ("gpipe", "1f1b", "zero-bubble")}
            assert idle["zero-bubble"] <= min(idle["gpipe"], idle["1f1b"]) / 2, (stages, mbs, idle)


@pytest.mark.parametrize("name", S.SCHEDULES)
def test_remat_is_marked_on_the_forward_and_recomputed_before_its_backward(name):
    virtual = 2 if S.schedules.get(name).placement == "v" else 1  # a V is two chunks per stage
    for plan in S.build_all(name, 3, 5, "except_last", virtual):
        remat = S.rematerialised(plan)
        recomputed = [(a.microbatch, a.chunk) for a in plan if a.kind == Kind.RECOMPUTE]
        assert sorted(recomputed) == sorted(remat)
        for i, a in enumerate(plan):
            if a.kind == Kind.RECOMPUTE:
                following = next(b for b in plan[i + 1:] if b.kind in S.GRADIENT)
                assert (following.microbatch, following.chunk) == (a.microbatch, a.chunk)
    always = S.build_all(name, 3, 5, "always", virtual)
    assert all({mb for mb, _ in S.rematerialised(plan)} == set(range(5)) for plan in always)
    assert all(not S.rematerialised(plan) for plan in S.build_all(name, 3, 5, "never", virtual))


def test_zero_bubble_shortens_the_simulated_step_of_1f1b():
    for stages, mbs in ((2, 8), (4, 8), (4, 16), (4, 2)):
        one = S.simulate(S.build_all("1f1b", stages, mbs, "never"), equal_costs)
        zero = S.simulate(S.build_all("zero-bubble", stages, mbs, "never"), equal_costs)
        assert S.bubble(zero) < S.bubble(one)
        assert max(sp.end for st in zero for sp in st) < max(sp.end for st in one for sp in st)
        assert S.theoretical_bubble(stages, mbs, "zero-bubble") == pytest.approx(S.bubble(zero))


@pytest.mark.parametrize("stages,mbs,virtual", [(2, 8, 2), (4, 8, 2), (4, 16, 4)])
def test_interleaved_bubble_is_its_theory_and_below_1f1b(stages, mbs, virtual):
    # Each chunk holds 1/V of a stage: the fill and drain shrink V times, (K-1)/(VM+K-1).
    assert S.theoretical_bubble(stages, mbs, "interleaved", virtual) == pytest.approx(
        (stages - 1) / (virtual * mbs + stages - 1))
    assert S.theoretical_bubble(stages, mbs, "interleaved", virtual) < S.theoretical_bubble(stages, mbs, "1f1b")


def test_refused_combinations_say_what_is_allowed():
    with pytest.raises(ValueError, match="needs schedule 'interleaved'"):
        S.build("1f1b", 0, 2, 4, virtual=2)
    with pytest.raises(ValueError, match="multiple of partitions"):
        S.build("interleaved", 0, 2, 3, virtual=2)
    with pytest.raises(ValueError, match="at least 2 partitions"):
        S.build("interleaved", 0, 1, 4, virtual=2)


def test_interleaved_warms_up_as_megatron_does():
    # 2 (K - s - 1) + (V - 1) K forwards, then one more before the first backward: shallower, the bubble with free
    # messages is the same, but each message's latency stalls the steady phase (K=4 M=8 V=2, 0.25 a message:
    # 36 units of time against 32).
    from gpipe_cli.pipeline import schedules

    for stage in range(4):
        order = schedules.get("interleaved").order(stage, 4, 8, 2)
        first_backward = next(i for i, step in enumerate(order) if step[0] is not Kind.FWD)
        assert first_backward == 2 * (4 - stage - 1) + (2 - 1) * 4 + 1, stage


def test_the_bubble_is_the_mean_idle_fraction_over_stages_not_the_worst_stages():
    # Stage 0 computes the whole makespan, stage 1 half of it: idle 0 and 1/2, mean 1/4 (the worst would say 1/2).
    spans = [[S.Span(0, S.Action(Kind.FWD, 0), 0.0, 4.0)],
             [S.Span(1, S.Action(Kind.FWD, 0), 0.0, 1.0), S.Span(1, S.Action(Kind.RECV_FWD, 1), 1.0, 3.0),
              S.Span(1, S.Action(Kind.FWD, 1), 3.0, 4.0)]]
    assert S.bubble(spans) == pytest.approx(0.25)


@pytest.mark.parametrize("name", ["zero-bubble-v", "v-half"])
def test_an_evaluation_pass_runs_each_stages_own_chunks_of_a_v(name):
    # Evaluation runs chunk by chunk; under a V stage 0 runs the first and the last chunk, not chunk K.
    for stages in (2, 3):
        lists = [S.forward_only(s, stages, 5, 2, "v") for s in range(stages)]
        for s, plan in enumerate(lists):
            assert {a.chunk for a in plan} == set(placement.chunks_of(s, stages, 2, "v")), (stages, s)
        S.simulate(lists, lambda stage, action: 1.0, placement="v")  # raises on a deadlock

"""Measuring one stage at a time in one process gives what each stage holds in a real multi-rank step."""

import pytest

from gpipe_cli.estimate.subject import example_batch, resolve
from gpipe_cli.profile import account
from tests.bench import tiny
from tests.multiproc import results, run_ranks
from tests.profile import ranks

CONFIGS = [(4, "gpipe", "except_last"), (4, "gpipe", "never"), (3, "1f1b", "always"), (5, "1f1b", "except_last")]


def subject():
    return resolve(tiny.TRANSFORMER["model"], tiny.sizes(tiny.TRANSFORMER), tiny.TRANSFORMER["set"])


def test_single_process_accounting_equals_the_engines_own_in_a_real_step():
    balance, batch = [2, 2, 2], 10
    real = results(run_ranks(ranks.engine_peaks, 3, subject().to_json(), balance, batch, CONFIGS))[0]
    spec = subject().build()
    inputs, targets = example_batch(spec, batch, 0)
    for chunks, schedule, checkpoint in CONFIGS:
        stages = account.measure(spec, inputs, targets, balance, chunks, schedule, checkpoint, "sgd", 0)
        assert [s.peak_bytes for s in stages] == real[(chunks, schedule, checkpoint)], (chunks, schedule, checkpoint)


def test_weights_gradients_and_optimizer_state_are_counted_exactly():
    spec = subject().build()
    inputs, targets = example_batch(spec, 8, 0)
    naive, = account.measure(spec, inputs, targets, [6], 1, "gpipe", "never", "adam", 0)
    params = sum(p.numel() for layer in spec.build_all() for p in layer.parameters()) * 4
    assert naive.params_bytes == naive.grads_bytes == params
    assert naive.optimizer_bytes == pytest.approx(2 * params, rel=0.01)  # Adam: two moments (+ step counters)
    assert naive.stored_bytes == naive.peak_bytes  # nothing is recomputed


def test_rematerialization_stores_less_than_it_peaks_and_less_than_naive():
    spec = subject().build()
    inputs, targets = example_batch(spec, 16, 0)
    naive, = account.measure(spec, inputs, targets, [6], 1, "gpipe", "never", "sgd", 0)
    remat, = account.measure(spec, inputs, targets, [6], 8, "gpipe", "always", "sgd", 0)
    assert remat.stored_bytes < remat.peak_bytes < naive.peak_bytes

"""The device correction: fitted from probe steps, it brings the largest model found to just under the budget."""

import math

import pytest

from gpipe_cli.estimate.subject import Subject
from gpipe_cli.memory_model import Footprint, bytes_per_parameter, footprints
from gpipe_cli.profile import budget, probe
from gpipe_cli.profile.runner import member_probes

TRANSFORMER = dict(arch="decoder-only", d_model=32, ff=64, heads=2, vocab_size=64, max_len=8)
MiB = 2**20
BLOCK = 512  # the CUDA allocator rounds small allocations to 512 bytes


def device_bytes(fp: Footprint, checkpoint: str) -> float:
    """A made-up device: a fixed workspace, allocations rounded up to blocks, and kernels that keep less than the
    accounting under rematerialization and more without it."""
    factor = 0.7 if checkpoint != "never" else 1.1
    rounded = math.ceil(fp.weights_bytes / BLOCK) * BLOCK + math.ceil(factor * fp.peak_bytes / BLOCK) * BLOCK
    return 256 * 1024 + rounded


class FakeMeter:
    """What the device above would read for a probe step (its tensors as the accounting counts them)."""

    name = "fake device"

    def __init__(self) -> None:
        self.steps = 0

    def peak(self, step: probe.Probe) -> float:
        self.steps += 1
        return device_bytes(step.predicted(), step.checkpoint)


@pytest.fixture(scope="module")
def transformer():
    return budget.TransformerL(TRANSFORMER)


SCENARIOS = [("naive-1", 1, 1, "never"), ("pipeline-1", 1, 4, "except_last"), ("pipeline-2", 2, 4, "except_last")]


def test_fit_recovers_a_known_workspace_and_factors():
    # The weights, gradients and optimizer state count as they are; activations and the loss's gradients scale.
    points = [(Footprint(0, w, 0, a, loss_bytes=g), c,
               3e6 + w + (0.6 if c != "never" else 1.2) * a + (2.5 if c != "never" else 2.0) * g)
              for w, a, g, c in [(1e6, 2e6, 1e6, "never"), (3e6, 5e6, 1e6, "never"), (1e6, 4e6, 2e6, "never"),
                                 (1e6, 2e6, 1e6, "always"), (3e6, 5e6, 1e6, "always"), (1e6, 4e6, 2e6, "always")]]
    found = probe.fit(points)
    assert found.workspace == pytest.approx(3e6, rel=1e-6)
    assert found.activations == pytest.approx({"never": 1.2, "remat": 0.6}, rel=1e-6)
    assert found.loss == pytest.approx({"never": 2.0, "remat": 2.5}, rel=1e-6)
    assert found.worst_error() < 1e-9
    assert probe.from_json(found.to_json()).bytes(points[0][0], "never") == pytest.approx(points[0][2])


def test_the_corrected_search_peaks_within_five_percent_below_the_budget(transformer):
    meter = FakeMeter()
    probes = probe.steps(transformer.members(), SCENARIOS, transformer.kind, "gpipe", "rmsprop")
    assert meter.steps == 0 and len(probes) == 6  # three per (M, checkpoint): weights and activations vary apart
    correction = probe.calibrate(probes, meter)
    assert meter.steps == 6 and correction.workspace > 0 and correction.activations["remat"] < 1
    line = correction.describe()
    assert "\n" not in line and "workspace" in line and "remat x0.7" in line
    limit = 8 * MiB
    rows = budget.search(transformer, SCENARIOS, limit, 8, "gpipe", "rmsprop", correction=correction)
    plain = budget.search(transformer, SCENARIOS, limit, 8, "gpipe", "rmsprop")
    for (name, _, m, checkpoint), row, uncorrected in zip(SCENARIOS, rows, plain, strict=True):
        assert row is not None and uncorrected is not None
        model = transformer.figures(int(row.model))
        stages = footprints(model, row.balance, 8, m, "gpipe", checkpoint, bytes_per_parameter("rmsprop"))
        real = max(device_bytes(fp, checkpoint) for fp in stages)
        assert 0.95 * limit <= real <= limit, (name, real / limit)
        assert row.device_peak_bytes == pytest.approx(real, rel=0.01)
        # The accounting alone is off the device in both directions: too small without remat, too large with it.
        assert (int(uncorrected.model) > int(row.model)) == (checkpoint == "never"), name


def test_on_the_cpu_the_accounting_meter_fits_no_correction():
    subject = Subject("transformer", {"layers": 6, **TRANSFORMER})
    rows = [("pipeline-1", 1, 4, "except_last")]  # three steps, rematerialised: the case counted most carefully
    correction = probe.calibrate(member_probes(subject, rows, "gpipe", "rmsprop", 0), probe.AccountingMeter())
    assert correction.activations == pytest.approx({"remat": 1.0}, abs=0.02)
    assert correction.loss.get("remat", 0.0) == pytest.approx(0.0, abs=0.02)
    assert correction.workspace < 0.01 * min(m for _, m, _ in correction.points)
    assert correction.worst_error() < 0.01


WEIGHTY = dict(TRANSFORMER, vocab_size=4096)  # its vocabulary outweighs a few examples' activations


def phased_device(fp: Footprint) -> float:
    """A made-up device whose optimizer update peaks apart from the step: the step holds the weights beside
    activations its kernels make 1.3x the accounting, the update temporaries of a quarter of the weights."""
    return 256 * 1024 + max(fp.weights_bytes + 1.3 * fp.peak_bytes, 1.25 * fp.weights_bytes)


def test_a_factor_whose_probes_peaked_alike_whatever_their_activations_stays_one():
    family = budget.TransformerL(WEIGHTY)
    probes = probe.steps(family.members(), [("naive-1", 1, 1, "never")], family.kind, "gpipe", "rmsprop")
    assert all(step.predicted().peak_bytes < step.predicted().weights_bytes for step in probes)
    correction = probe.fit([(step.predicted(), step.checkpoint, phased_device(step.predicted())) for step in probes])
    assert correction.unseen == ("never",) and correction.activations == {"never": 1.0}
    assert "never kept x1.000, unsure" in correction.describe()
    assert probe.from_json(correction.to_json()).unseen == ("never",)
    # Where the probes follow their activations, the factor is fitted as before.
    seen = probe.fit([(fp, c, device_bytes(fp, c)) for fp, c in
                      [(step.predicted(), step.checkpoint) for step in probes]])
    assert seen.unseen == () and seen.activations["never"] == pytest.approx(1.1, rel=0.01)


def test_on_a_device_the_probes_grow_until_the_update_no_longer_hides_the_activations():
    family = budget.TransformerL(WEIGHTY)
    rows = [("naive-1", 1, 1, "never")]
    room = 16 * MiB
    grown = probe.steps(family.members(), rows, family.kind, "gpipe", "rmsprop", room=room)
    assert grown[0].batch_size > probe.steps(family.members(), rows, family.kind, "gpipe", "rmsprop")[0].batch_size
    assert all(step.predicted().total_bytes <= room for step in grown)
    assert grown[0].predicted().peak_bytes >= grown[0].predicted().weights_bytes
    correction = probe.fit([(step.predicted(), step.checkpoint, phased_device(step.predicted())) for step in grown])
    assert correction.unseen == () and correction.activations["never"] == pytest.approx(1.3, rel=0.05)
    limit = 24 * MiB
    (row,) = budget.search(family, rows, limit, 8, "gpipe", "rmsprop", correction=correction)
    assert row is not None
    stages = footprints(family.figures(int(row.model)), row.balance, 8, 1, "gpipe", "never",
                        bytes_per_parameter("rmsprop"))
    real = max(phased_device(fp) for fp in stages)
    assert 0.95 * limit <= real <= limit

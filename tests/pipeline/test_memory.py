import torch
from torch import nn

from gpipe_cli.pipeline.memory import ActivationMeter, peak_rss_bytes


def test_saved_tensors_are_counted_once_per_storage_and_released():
    model = nn.Sequential(nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 100))
    meter = ActivationMeter(model.parameters())
    x = torch.randn(32, 100, requires_grad=True)
    with meter.saved_tensors():
        y = model(x)
    # Linear saves its input (x), ReLU its output, the second Linear the same output: 2 storages.
    assert meter.current == meter.peak == 2 * 32 * 100 * 4
    y.sum().backward()
    del y
    assert meter.current == 0 and meter.peak == 2 * 32 * 100 * 4


def test_parameters_are_not_activations():
    lin = nn.Linear(10, 10)
    meter = ActivationMeter(lin.parameters())
    handle = meter.hold(lin.weight)
    assert meter.current == 0
    del handle


def test_hold_and_reset_peak():
    meter = ActivationMeter()
    a = meter.hold(torch.zeros(1000))
    b = meter.hold(torch.zeros(500))
    assert meter.current == 6000
    del a
    assert meter.current == 2000 and meter.peak == 6000
    meter.reset_peak()
    assert meter.peak == 2000
    del b


def test_rss_is_reported():
    assert peak_rss_bytes() > 10 * 2**20


def test_reset_peak_starts_the_host_peak_from_what_host_memory_holds_now():
    meter = ActivationMeter()
    meter.host_hold(300)
    meter.host_release(100)
    meter.reset_peak()
    assert meter.host_peak == 200
    meter.host_hold(50)
    assert meter.host_peak == 250

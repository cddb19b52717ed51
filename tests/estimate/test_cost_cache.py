"""Per-layer seconds measured at launch: cached per model, micro-batch, precision and device; damage re-measures."""

import json
import shutil

import pytest
import torch

from gpipe_cli.estimate import cost_cache
from gpipe_cli.estimate.costs import CostProfile, LayerTiming
from gpipe_cli.recipe.load import load_recipe
from gpipe_cli.recipe_model import model_spec
from gpipe_cli.train.plan import microbatch_size
from tests.train import recipes

CPU = torch.device("cpu")


@pytest.fixture
def recipe(tmp_path):
    return load_recipe(str(recipes.write(tmp_path, recipes.TINY_AMOEBANET)), [])


@pytest.fixture
def measurements(monkeypatch):
    """Count measurements; each returns distinct made-up seconds."""
    calls = []

    def fake(spec, recipe, size, device, repeats=cost_cache.REPEATS):
        calls.append(size)
        layers = [LayerTiming(name, 0.001 * (i + len(calls)), 0.0005, 0.002, 64) for i, name in
                  enumerate(spec.layer_names)]
        return CostProfile(size, 128, 0.0001, layers)

    monkeypatch.setattr(cost_cache, "measure", fake)
    return calls


def test_a_second_launch_reads_the_cache(recipe, cache, measurements):
    spec, size = model_spec(recipe), microbatch_size(recipe)
    first = cost_cache.measured_costs(spec, recipe, size, CPU)
    second = cost_cache.measured_costs(spec, recipe, size, CPU)
    assert measurements == [size]
    assert not first.cached and second.cached
    assert (first.label, second.label) == ("measured time", "measured time, cached")
    assert second.profile == first.profile
    assert [p.name for p in cache.iterdir()] == [cost_cache.cache_path(cost_cache.cache_key(recipe, size, CPU)).name]


@pytest.mark.parametrize("change", ["data.batch_size=32", "train.precision=bf16", "model.filters=12"])
def test_another_micro_batch_precision_or_model_is_measured_again(recipe, tmp_path, cache, measurements, change):
    spec, size = model_spec(recipe), microbatch_size(recipe)
    cost_cache.measured_costs(spec, recipe, size, CPU)
    other = load_recipe(str(recipes.write(tmp_path, recipes.TINY_AMOEBANET)), [change])
    found = cost_cache.measured_costs(model_spec(other), other, microbatch_size(other), CPU)
    assert not found.cached and len(measurements) == 2
    assert len(list(cache.iterdir())) == 2


def test_the_key_names_the_device_threads_and_torch(recipe):
    key = cost_cache.cache_key(recipe, 4, CPU)
    assert key["device"] == "cpu" and key["device_name"] and key["torch"] == torch.__version__
    assert key["threads"] == torch.get_num_threads()
    assert key["microbatch_size"] == 4 and key["precision"] == recipe.train.precision


@pytest.mark.parametrize("damage", [b"", b"{not json", b'{"key": 1}', b"[]", "right key, damaged costs"])
def test_a_damaged_cache_file_is_measured_again_and_replaced(recipe, cache, measurements, damage):
    spec, size = model_spec(recipe), microbatch_size(recipe)
    key = cost_cache.cache_key(recipe, size, CPU)
    path = cost_cache.cache_path(key)
    path.parent.mkdir(parents=True)
    if isinstance(damage, str):
        damage = json.dumps({"key": key, "costs": {"layers": [{"name": 1}]}}).encode()
    path.write_bytes(damage)
    found = cost_cache.measured_costs(spec, recipe, size, CPU)
    assert not found.cached and measurements == [size]
    assert json.loads(path.read_text())["key"] == key
    assert cost_cache.measured_costs(spec, recipe, size, CPU).cached


def test_a_cached_profile_of_another_number_of_layers_is_measured_again(recipe, cache, measurements):
    spec, size = model_spec(recipe), microbatch_size(recipe)
    path = cost_cache.cache_path(cost_cache.cache_key(recipe, size, CPU))
    cost_cache.measured_costs(spec, recipe, size, CPU)
    data = json.loads(path.read_text())
    data["costs"]["layers"] = data["costs"]["layers"][:-1]  # the right key, as a version building fewer layers kept
    path.write_text(json.dumps(data))
    found = cost_cache.measured_costs(spec, recipe, size, CPU)
    assert not found.cached and len(measurements) == 2 and len(found.profile.layers) == len(spec.layers)


def test_an_unwritable_cache_only_costs_a_measurement(recipe, tmp_path, monkeypatch, measurements):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(cost_cache.CACHE_ENV, str(blocker / "cache"))  # under a file: cannot be created
    spec, size = model_spec(recipe), microbatch_size(recipe)
    assert not cost_cache.measured_costs(spec, recipe, size, CPU).cached
    assert not cost_cache.measured_costs(spec, recipe, size, CPU).cached
    assert len(measurements) == 2


def test_a_cache_on_a_full_disk_is_said_not_to_keep_the_costs(tmp_path, monkeypatch):
    # The probe's empty file fits on a full disk: the run said "cached for next time", and nothing was kept.
    monkeypatch.setattr(cost_cache.shutil, "disk_usage", lambda folder: shutil._ntuple_diskusage(10**9, 10**9, 512))
    assert cost_cache.unwritable(tmp_path / "not" / "yet") == f"'{tmp_path / 'not' / 'yet'}' has 512 B free"
    monkeypatch.undo()
    assert cost_cache.unwritable(tmp_path / "not" / "yet") is None and not (tmp_path / "not").exists()


def test_the_cache_lives_under_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.delenv(cost_cache.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cost_cache.cache_dir() == tmp_path / "gpipe" / "layer-costs"
    monkeypatch.setenv(cost_cache.CACHE_ENV, str(tmp_path / "mine"))
    assert cost_cache.cache_dir() == tmp_path / "mine"


def test_measuring_times_every_layer_and_leaves_the_random_streams_alone(recipe):
    spec = model_spec(recipe)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a rank on this machine: several threads on a busy CPU only wait for each other
    try:
        profile = cost_cache.measure(spec, recipe, 2, CPU, repeats=1)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(torch.get_rng_state(), before)
    assert len(profile.layers) == len(spec.layers) and profile.microbatch_size == 2
    assert all(t.forward > 0 and t.backward > 0 and t.recompute_seconds > 0 for t in profile.layers)
    # Rematerialisation runs the graph-less forward and then the recompute in place of the forward.
    never, always = profile.balance_costs("never"), profile.balance_costs("always")
    layers = profile.layers
    assert never[:-1] == [t.forward + t.backward for t in layers[:-1]]
    assert always[:-1] == [t.forward_nograd + t.recompute_seconds + t.backward for t in layers[:-1]]


def test_when_measuring_fails_the_cut_falls_back_to_estimated_flops_and_says_why(recipe, monkeypatch):
    from types import SimpleNamespace

    from gpipe_cli.train.loop import Trainer

    def broken(*args, **kwargs):
        raise RuntimeError("the device is busy\nmore detail")

    monkeypatch.setattr(cost_cache, "measured_costs", broken)
    rank = SimpleNamespace(recipe=recipe, spec=model_spec(recipe), topo=SimpleNamespace(device=CPU),
                           _note=lambda text: None)
    measured, why = Trainer._measure(rank)  # type: ignore[arg-type]
    assert measured is None and why == "estimated FLOPs: measuring failed (RuntimeError: the device is busy)"


@pytest.mark.parametrize("where", ["file", "file/cache"])
def test_the_line_before_a_measurement_claims_the_cache_only_where_it_can_be_written(
        recipe, tmp_path, monkeypatch, measurements, where):
    from types import SimpleNamespace

    from gpipe_cli.train.loop import Trainer

    (tmp_path / "file").write_text("")
    folder = tmp_path / where
    monkeypatch.setenv(cost_cache.CACHE_ENV, str(folder))
    notes: list[str] = []
    rank = SimpleNamespace(recipe=recipe, spec=model_spec(recipe), topo=SimpleNamespace(device=CPU), _note=notes.append)
    for _ in range(2):  # said each time it measures, which is each launch: nothing was kept
        measured, _label = Trainer._measure(rank)  # type: ignore[arg-type]
        assert measured is not None
    assert len(notes) == 2 and notes[0] == notes[1]
    assert "cached for next time" not in notes[0]
    assert f"(not cached: {str(folder)!r} cannot be written: {str(tmp_path / 'file')!r} exists and is not a " \
           f"directory)" in notes[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "recipe.yaml"]  # the probe left nothing behind


def test_the_line_before_a_measurement_says_cached_where_it_is(recipe, cache, measurements):
    notes: list[str] = []
    spec, size = model_spec(recipe), microbatch_size(recipe)
    cost_cache.measured_costs(spec, recipe, size, CPU, measuring=notes.append)
    assert notes == ["cached for next time"]
    assert cost_cache.measured_costs(spec, recipe, size, CPU, measuring=notes.append).cached
    assert notes == ["cached for next time"]  # read back, not measured: nothing more said


def test_the_cpu_peak_is_the_best_rate_this_machine_has_shown(tmp_path, monkeypatch):
    # Measured on cores other runs kept busy, the rate came out a tenth of the CPU's, and MFU 137%.
    monkeypatch.setenv(cost_cache.CACHE_ENV, str(tmp_path))
    assert cost_cache.best_rate(90e9, threads=1) == 90e9
    assert cost_cache.best_rate(8.6e9, threads=1) == 90e9  # a busy machine's low figure does not lower it
    assert cost_cache.best_rate(120e9, threads=1) == 120e9  # a better one is kept
    assert cost_cache.best_rate(8.6e9, threads=1) == 120e9
    assert cost_cache.best_rate(30e9, threads=2) == 30e9  # per thread count
    for path in tmp_path.iterdir():
        path.write_text("{not json")  # a damaged file is measured over, not an error
    assert cost_cache.best_rate(8.6e9, threads=1) == 8.6e9

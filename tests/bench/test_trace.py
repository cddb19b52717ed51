import pytest

from gpipe_cli.bench import trace
from gpipe_cli.pipeline import schedule as sched


def events_of(name: str, stages: int, microbatches: int, virtual: int = 1) -> list[dict]:
    """A simulated step's spans as the events a measured step records."""
    spans = sched.simulate(sched.build_all(name, stages, microbatches, "never", virtual), lambda s, a: 1.0)
    return [sp.record() for stage in spans for sp in stage]


def x_events(events: list[dict]) -> list[dict]:
    return [e for e in trace.chrome_trace(events, "t")["traceEvents"] if e["ph"] == "X"]


def test_zero_bubble_draws_input_and_weight_gradients_apart(tmp_path):
    events = events_of("zero-bubble", 2, 4)
    json_path, png_path = trace.write(tmp_path / "step.json", events, "zero-bubble")
    assert json_path.exists() and (png_path is None or png_path.exists())
    drawn = x_events(events)
    categories = {e["cat"] for e in drawn}
    assert {"backward: input gradient", "backward: weight gradient"} <= categories
    names = {e["name"] for e in drawn if e["tid"] == 1}
    assert {"Bi0", "W0"} <= names and "B0" not in names
    assert trace.LABELS["bwd_input"][1] != trace.LABELS["bwd_weight"][1]


def test_interleaved_names_each_actions_chunk():
    drawn = x_events(events_of("interleaved", 2, 2, virtual=2))
    assert {e["name"] for e in drawn if e["tid"] == 0} >= {"F0/c0", "F0/c2"}
    assert all(e["args"]["chunk"] % 2 == e["tid"] for e in drawn)
    assert not any("/c" in e["name"] for e in x_events(events_of("1f1b", 2, 2)))


def test_a_chart_that_cannot_be_written_takes_its_trace_back(tmp_path, monkeypatch):
    # The line said the trace could not be written, and its JSON stayed on the disk.
    import errno
    import os

    import pytest

    def full(path, events, title):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(trace, "write_gantt", full)
    with pytest.raises(OSError, match="No space left"):
        trace.write(tmp_path / "t.json", events_of("gpipe", 2, 2), "t")
    assert list(tmp_path.iterdir()) == []


def test_the_charts_legend_names_only_the_actions_its_schedule_holds():
    # Every chart's legend listed the split backward's B and W, though only the zero-bubble schedules split it.
    plain = [label for label, _ in trace.legend_entries(events_of("gpipe", 2, 2))]
    assert "forward" in plain and "backward" in plain and not any("gradient" in label for label in plain)
    split = [label for label, _ in trace.legend_entries(events_of("zero-bubble", 2, 4))]
    assert {"backward: input gradient (B)", "backward: weight gradient (W)"} <= set(split)
    waits = [{"kind": "recv_fwd", "stage": 1, "microbatch": 0, "start": 0.0, "end": 1.0}]
    assert [label for label, _ in trace.legend_entries(waits)] == ["wait for a message"]


def test_the_chart_names_each_actions_chunk_as_the_trace_does(tmp_path, monkeypatch):
    # An interleaved stage's row showed two boxes "F0", one of each chunk.
    pytest.importorskip("matplotlib")
    kept = {}
    monkeypatch.setattr(trace.plots, "write", lambda plt, fig, path, dpi: kept.update(fig=fig))
    events = events_of("interleaved", 2, 2, virtual=2)
    assert trace.write_gantt(tmp_path / "t.png", events, "t")
    labels = {t.get_text() for t in kept["fig"].axes[0].texts}
    assert {"F0/c0", "F0/c2"} <= labels and "F0" not in labels
    assert labels <= {e["name"] for e in x_events(events)}

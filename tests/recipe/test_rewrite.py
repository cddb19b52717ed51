"""Recipes written back over the text they were read from: the user's comments, key order and spelling stay."""

from gpipe_cli.recipe.yamlio import parse_document, rewrite

TEXT = """\
# My model, tuned by hand.
name: mine          # the run's folder
model:
  kind: transformer
  layers: 4         # deeper than the default
optimizer:
  lr: 1.0e-3        # as I write it
  betas: [0.9, 0.98]
data:
  # generated, so no network is needed
  source: synthetic
  batch_size: 32
"""


def test_comments_order_and_untouched_values_stay_and_changes_are_applied():
    data = parse_document(TEXT, "r.yaml")
    data["model"]["layers"] = 8
    data["data"]["batch_size"] = 64
    data["optimizer"]["betas"] = [0.9, 0.99]
    data["pipeline"] = {"partitions": 2, "balance": [3, 3]}  # after model, as the data orders it
    data = {k: data[k] for k in ("name", "model", "pipeline", "optimizer", "data")}
    written = rewrite(TEXT, data, "r.yaml")
    assert parse_document(written, "out.yaml") == data
    assert written.startswith("# My model, tuned by hand.\nname: mine          # the run's folder\n")
    assert "  layers: 8         # deeper than the default\n" in written
    assert "  lr: 1.0e-3        # as I write it\n" in written  # unchanged: as written, not 0.001
    assert "  # generated, so no network is needed\n  source: synthetic\n  batch_size: 64\n" in written
    assert "pipeline:\n  partitions: 2\n  balance: [3, 3]\noptimizer:" in written
    assert "betas: [0.9, 0.99]" in written


def test_keys_that_are_gone_are_removed_with_nothing_else():
    data = parse_document(TEXT, "r.yaml")
    del data["optimizer"]["betas"]
    del data["name"]
    written = rewrite(TEXT, data, "r.yaml")
    assert parse_document(written, "out.yaml") == data
    assert "betas" not in written and "name:" not in written and "# deeper than the default" in written


def test_a_value_whose_type_changes_is_written_anew():
    text = "train:\n  steps: 1     # a flag\n  log_every: 1\n"
    data = {"train": {"steps": True, "log_every": 1.0}}
    written = rewrite(text, data, "r.yaml")
    read = parse_document(written, "out.yaml")
    assert read == data and read["train"]["steps"] is True and isinstance(read["train"]["log_every"], float)


def test_four_space_indentation_stays():
    text = "model:\n    kind: transformer    # wide\n    layers: 2\n"
    written = rewrite(text, {"model": {"kind": "transformer", "layers": 6}}, "r.yaml")
    assert written == "model:\n    kind: transformer    # wide\n    layers: 6\n"


def test_a_section_shared_through_an_alias_is_written_as_planned_without_its_comments():
    # Editing the anchored mapping in place would change both sections: the plain dump says what was asked.
    text = "# shared\nbase: &b {x: 1}\nother: *b\n"
    data = {"base": {"x": 2}, "other": {"x": 1}}
    written = rewrite(text, data, "r.yaml")
    assert parse_document(written, "out.yaml") == data

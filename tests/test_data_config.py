"""The data keys combine as the config says, one line per mistake, before anything is read."""

from __future__ import annotations

import pytest

from portapipe.config import ConfigError, load_config


def _lines(**data: object) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config({"data": data, "model": {"mtp_layers": 1} if data.pop("mtp", False) else {}})
    return info.value.problems


def test_each_combination_that_cannot_work_is_one_line() -> None:
    assert _lines(format="tokens", path="a", sources=[{"path": "b"}]) == [
        "data.sources: set beside data.path; give one of them (data.path is a blend of one source)"]
    assert _lines(format="tokens", sources=[]) == ["data.sources: an empty list; give at least one {path, weight}, or data.path"]
    assert _lines(sources=[{"path": "b"}]) == [
        "data.sources: data.format bytes reads one text (data.path); blends and validation sources are token data (data.format: tokens)"]
    assert _lines(document_mask=True) == [
        "data.document_mask: a text read as bytes is one document; it needs token data with document boundaries (data.format: tokens)"]
    assert _lines(format="tokens", sampling="random", sources=[{"path": "a"}, {"path": "b"}]) == [
        "data.sampling: random draws windows from one source; data.sources has 2 (use sampling epochs for a blend)"]
    assert _lines(format="tokens", path="a", val_sources=[{"path": "v"}], val_fraction=0.1) == [
        "data.val_fraction: 0.1 has no effect: data.val_sources is the validation data; remove it"]
    assert _lines(format="tokens", path="a", mask_eos_loss=True, mtp=True) == [
        "data.mask_eos_loss: with multi-token prediction (model.mtp_layers 1) it needs data.document_mask: true (the targets it "
        "leaves out are tokens the prediction modules embed, which only rows kept apart by the document mask may do without)"]
    for eos in (False, True):
        assert load_config({"data": {"format": "tokens", "path": "a", "document_mask": True, "mask_eos_loss": eos},
                            "model": {"mtp_layers": 2}}).data.document_mask
    assert _lines(format="tokens", sources=[{"path": "a", "weight": 0}]) == ["data.sources[0].weight: 0: Input should be greater than 0"]
    assert _lines(format="tokens", sources=[{"weight": 1}]) == ["data.sources[0].path: Field required"]
    assert _lines(format="tokens", sources=[{"path": "a", "weight": "2"}]) == [
        "data.sources[0].weight: '2': text is not a number; give a number without quotes"]


def test_a_blend_with_its_validation_data_loads() -> None:
    c = load_config({"data": {"format": "tokens", "sources": [{"path": "a", "weight": 3}, {"path": "b"}], "val_sources": [{"path": "v"}],
                              "document_mask": True, "mask_eos_loss": True}})
    assert [(s.path, s.weight) for s in c.data.sources] == [("a", 3.0), ("b", 1.0)] and c.data.sampling == "auto"

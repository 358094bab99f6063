"""docs/contract.md §1's table of the spec's keys against the schema: every key it lists is a field
of the config, and every default it states is the field's default (the docstrings stay the
reference; the table cannot drift from them unseen)."""

import dataclasses
import os
import re

from lightning_fasync.config import FasyncConfig
from tests.helpers.paths import REPO


def _rows():
    text = open(os.path.join(REPO, "docs", "contract.md")).read()
    section = text.split("## 1. Key parameters", 1)[1].split("\n## ", 1)[0]
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            yield cells


def _field(cfg, dotted):
    node = cfg
    for part in dotted.split("."):
        if isinstance(node, dict):
            node = node[part]
        else:
            assert part in {f.name for f in dataclasses.fields(node)}, f"`{dotted}`: no field {part!r}"
            node = getattr(node, part)
    return node


def _render(value):
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def test_every_key_of_the_table_is_a_field_with_the_stated_default():
    cfg = FasyncConfig()
    checked = 0
    for key_cell, default_cell, _, _ in _rows():
        keys = re.findall(r"`([a-z_.<>{},]+)`", key_cell)
        defaults = re.findall(r"`([^`]+)`", default_cell)
        for key in keys:
            if "{" in key or "<" in key:  # a family of keys (`algorithm.m2po.{enable,tau}`): its fields exist
                base = key.split(".{")[0].split(".<")[0]
                _field(cfg, base)
                continue
            value = _field(cfg, key)
            if len(keys) == 1 and len(defaults) == 1 and not isinstance(value, (dict, list)):
                assert _render(value) == defaults[0], f"`{key}`: the table says {defaults[0]}, the schema {_render(value)}"
                checked += 1
    assert checked >= 15, checked

"""apps.web.built: the app's drafters at non-default settings, an LRU bounded in count and in the bytes of the
tensors each drafter owns (not those it shares with the target)."""

from __future__ import annotations

import torch

from drafters import build_drafter
from specviz.apps.web.built import BuiltDrafters, own_bytes


def test_the_least_recently_used_goes_first_within_count_and_bytes():
    built = BuiltDrafters(max_count=3, max_bytes=100)
    for key in "abc":
        built.put(key, key, 20)
    assert built.get("a") == "a"  # a is now the most recently used
    built.put("d", "d", 20)  # the count bound: b (least recent) goes
    assert "b" not in built and {"a", "c", "d"} == {k for k in "abcd" if k in built}
    built.put("e", "e", 70)  # the byte bound: c, then a, go until e fits beside d
    assert [k for k in "acde" if k in built] == ["d", "e"] and built.bytes == 90
    built.put("huge", "huge", 101)  # larger than the budget: not kept, nothing evicted
    assert "huge" not in built and len(built) == 2
    assert built.get("nope") is None


def test_a_drafter_owns_its_network_not_the_targets_tensors(tiny_target, tiny_checkpoint):
    target = tiny_target(vocab_size=64, seed=2)
    drafter = build_drafter("eagle2", target, checkpoint=str(tiny_checkpoint(target, "eagle2", epochs=1,
                                                                              prompts=8)))
    shared = {p.untyped_storage().data_ptr() for p in target.model.parameters()}
    own = own_bytes(drafter, shared)
    net = sum(p.numel() * p.element_size() for p in drafter.net.parameters())
    assert net <= own < net + sum(p.numel() * p.element_size() for p in target.model.parameters())
    assert own_bytes(build_drafter("pld", target), shared) == 0  # a drafter without tensors
    view = torch.zeros(10)
    holder = type("Holder", (), {})()
    holder.a, holder.b = view, view[2:]  # one storage, two views: counted once
    assert own_bytes(holder, set()) == 40

"""The engine core (floor 1): trees, the target, acceptance rules, the decode loop, the drafter protocol,
metrics and model loading. It imports nothing from ``drafters`` or ``specviz.apps``."""

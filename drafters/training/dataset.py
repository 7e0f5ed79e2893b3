"""The training and validation sets for a target: a recipe's sequences with the target's features, cached.

``prepare`` is the data step of ``specviz train``: cached features when there, else the sequences (cached,
shipped or made) run through the target once. ``validation_set`` reads the held-out split alone.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from .features import FeatureSet, extract_features, stored_meta
from .sequences import SHIPPED_SEQUENCES, DataRecipe, prepare_sequences


def features_file(cache: Path, part: str, key: str) -> Path:
    """Where ``prepare`` keeps a split's features (``part``: train or val)."""
    return cache / f"{part}-{key}.safetensors"


def extraction_dtype(target, recipe: DataRecipe) -> torch.dtype | None:
    """The dtype a copy of the target extracts the features in, where it is not the target's own (None)."""
    return recipe.feature_dtype if recipe.feature_dtype not in (None, target.dtype) else None


def data_card(target, recipe: DataRecipe) -> dict:
    """The recipe's card with the features' dtype, as training reads it (``LayerTaps`` tap in that dtype)."""
    meta, dtype = recipe.card(target), extraction_dtype(target, recipe)
    if dtype is not None:
        meta["feature_dtype"] = str(dtype).replace("torch.", "")
    return meta


def validation_set(target, recipe: DataRecipe, cache: Path | None = None) -> tuple[FeatureSet, dict]:
    """The held-out FeatureSet and its data card, read alone when cached (the train set can be gigabytes)."""
    if cache is not None:
        path = features_file(cache, "val", recipe.features_key(target))
        if path.exists():
            return FeatureSet.load(path), stored_meta(path)
    _, val_set, meta = prepare(target, recipe, cache)
    return val_set, meta


def prepare(target, recipe: DataRecipe, cache: Path | None = None, shipped: Path | None = SHIPPED_SEQUENCES,
            features: bool = True) -> tuple[FeatureSet, FeatureSet, dict]:
    """The train and validation FeatureSets for ``target`` and their data card, reusing ``cache``.

    Without ``features`` (methods that run the target's body in training anyway, EAGLE-3) and none cached,
    the sets hold the tokens alone, with no feature columns: training computes them on the fly."""
    meta, key = data_card(target, recipe), recipe.features_key(target)
    paths = None
    if cache is not None:
        paths = (features_file(cache, "train", key), features_file(cache, "val", key))
        if all(p.exists() for p in paths):
            return FeatureSet.load(paths[0]), FeatureSet.load(paths[1]), stored_meta(paths[0])
    splits = prepare_sequences(target, recipe, cache, shipped)
    work = {part: None if cache is None else cache / f"features-{key}-{part}" for part in ("train", "val")}
    dtype = extraction_dtype(target, recipe)
    if not features:
        sets = [FeatureSet.build(splits[part], [torch.zeros(s.numel(), 0) for s, _ in splits[part]])
                for part in ("train", "val")]
        meta["features_on_the_fly"] = True
        paths = None  # nothing worth caching
    else:
        sets = [extract_features(target, splits[part], desc=f"features {part}", work=work[part], dtype=dtype)
                for part in ("train", "val")]
    meta.update(train_samples=len(sets[0]), train_tokens=sets[0].num_tokens,
                answer_tokens=int(sum(sets[0].sequence(i)[0].numel() - sets[0].sequence(i)[2]
                                      for i in range(len(sets[0])))),
                val_samples=len(sets[1]))
    if paths is not None:
        for path, feature_set, folder in zip(paths, sets, work.values()):
            feature_set.save(path, meta)
            shutil.rmtree(folder, ignore_errors=True)  # the shards are in the saved file now
    return sets[0], sets[1], meta

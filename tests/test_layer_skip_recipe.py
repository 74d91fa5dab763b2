"""``python -m training.layerskip_recipe --quick``: LayerSkip's recipe (layer dropout rising with depth, an early-exit
loss at every layer through the shared norm and head) makes a model's own exit accept: the adapter-free
``{"method": "layer_skip", "exit_layer": L}`` accepts more on it than on the same model trained without the recipe
(same data, steps and seed), and greedy output equals no speculation on both."""

from __future__ import annotations

from dataclasses import replace

import pytest

from training.layerskip_recipe import QUICK, acceptance, corpus, heldout_prompts, train


@pytest.mark.slow  # trains two tiny models (seconds each) and runs four engines: ~40 s on a loaded machine
def test_the_recipe_trained_model_exits_early_better_than_the_plain_one(tmp_path) -> None:
    data = corpus(QUICK.files)
    recipe, plain = str(tmp_path / "recipe"), str(tmp_path / "plain")
    assert train(QUICK, recipe, data)["recipe"]
    assert not train(replace(QUICK, recipe=False), plain, data)["recipe"]
    prompts = heldout_prompts(2)
    acc_recipe, same_recipe = acceptance(recipe, 1, prompts, max_tokens=16)
    acc_plain, same_plain = acceptance(plain, 1, prompts, max_tokens=16)
    assert same_recipe and same_plain
    assert acc_recipe > acc_plain + 0.5, (acc_recipe, acc_plain)

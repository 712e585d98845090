"""Per-depth probes (train/instruments/probes.py), with gradients by layer, ablation and
train-step memory (layer_gradients.py, ablation.py, step_memory.py), on hand-built tiny models
whose answers are known, checked against the model's own forward captured by a different route
(`nnx.capture` of method outputs)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arch import reference
from arch.accounting import abstract_model
from config import resolve
from tests.helpers import random_tokens, tiny_config, tiny_model
from tests.test_hyper import perturb_mixing
from train.instruments import ablation, layer_gradients, probes, step_memory
from train.step import next_token_loss, resolve_for_job

GAIN = np.linspace(0.5, 1.5, 32)


@pytest.fixture(scope="module")
def edited():
    """Pre-Norm, ReLU MLP, MHA with K = H = 4, 2 blocks, hand-edited:
    block 1 is the identity (attention and FFN output projections zero), head 1 of block 0 has a
    zero output slice, head 3 of block 0 attends exactly like head 2 (query and key copied), and
    block 0's attention norm has gain GAIN."""
    _, model = tiny_model(ffn="mlp", ffn__activation="relu", attention__num_kv_heads=4)
    blocks = model.blocks
    blocks.attention.output.kernel[...] = blocks.attention.output.kernel[...].at[1].set(0)
    blocks.ffn.down.kernel[...] = blocks.ffn.down.kernel[...].at[1].set(0)
    blocks.attention.output.kernel[...] = blocks.attention.output.kernel[...].at[0, 1].set(0)
    for projection in (blocks.attention.query, blocks.attention.key):
        kernel = projection.kernel[...]
        projection.kernel[...] = kernel.at[0, :, 3].set(kernel[0, :, 2])
    scale = blocks.attention_residual.norm.scale
    scale[...] = scale[...].at[0].set(GAIN)
    tokens_BxT1 = random_tokens((2, 17))
    return model, tokens_BxT1, probes.depth_profile(model, tokens_BxT1, sparsity_threshold=0.05)


def logits(model, inputs_BxT):
    graphdef, state = nnx.split(model)
    return jax.jit(lambda state: nnx.merge(graphdef, state)(inputs_BxT))(state)


def rms(x) -> float:
    return float(np.sqrt(np.mean(np.square(np.asarray(x, np.float64)))))


@pytest.mark.slow
def test_depth_profile_matches_the_model_captured_by_another_route(edited):
    model, tokens_BxT1, profile = edited
    inputs_BxT, targets_BxT = tokens_BxT1[:, :-1], tokens_BxT1[:, 1:]
    graphdef, state = nnx.split(model)

    @jax.jit
    def capture(state, inputs_BxT):  # every method's output (RoPE's, sown in the scan, dropped)
        logits, captured = nnx.capture(nnx.merge(graphdef, state), nnx.Intermediate,
                                       method_outputs=nnx.Intermediate)(inputs_BxT)
        return logits, {key: captured[key] for key in ("blocks", "residual_stream")}

    logits, captured = capture(state, inputs_BxT)
    assert profile["loss"] == pytest.approx(float(next_token_loss(logits, targets_BxT)), rel=1e-6)

    # Depth 0: the embeddings, which block 0's attention norm reads.
    positions_BxT = jnp.broadcast_to(jnp.arange(16), inputs_BxT.shape)
    embedded = np.asarray(model.position.embed(model.embed(inputs_BxT), positions_BxT), np.float64)
    assert profile["hidden_rms"][0] == pytest.approx(rms(embedded), rel=1e-6)
    norm = {key: value[0] for key, value in profile["norms"]["attention"].items()}
    assert norm["input_rms"] == pytest.approx(np.mean(np.sqrt(np.mean(embedded**2, -1))), 1e-6)
    assert norm["input_variance"] == pytest.approx(np.mean(np.var(embedded, -1)), rel=1e-5)
    assert norm["input_mean"] == pytest.approx(np.mean(embedded), rel=1e-4, abs=1e-8)
    assert (norm["gain_mean"], norm["gain_std"]) == pytest.approx((GAIN.mean(), GAIN.std()))
    assert profile["norms"]["ffn"]["gain_std"].tolist() == [0, 0]

    # Block outputs, sublayer outputs and FFN hidden activations as the model's own scan made them.
    blocks = captured["blocks"]
    outputs_LxBxTxD = np.asarray(blocks["ffn_residual"]["write"][0], np.float64)
    final_BxTxD = captured["residual_stream"]["end"][0]
    np.testing.assert_allclose(profile["hidden_rms"][1:], [rms(outputs_LxBxTxD[0]),
                                                           rms(final_BxTxD)], rtol=1e-6)
    attention_BxTxD = np.asarray(blocks["attention"]["output"]["__call__"][0][0], np.float64)
    assert profile["branch_rms"][0, 0] == pytest.approx(rms(attention_BxTxD), rel=1e-6)
    ratio_BxT = np.linalg.norm(attention_BxTxD, axis=-1) / np.linalg.norm(embedded, axis=-1)
    assert profile["update_ratio"][0, 0] == pytest.approx(rms(ratio_BxT), rel=1e-5)
    np.testing.assert_array_equal(profile["branch_rms"][1], [0, 0])  # the identity block
    cosine = np.sum(embedded * outputs_LxBxTxD[0], -1) / (
        np.linalg.norm(embedded, axis=-1) * np.linalg.norm(outputs_LxBxTxD[0], axis=-1))
    assert profile["block_influence"][0] == pytest.approx(1 - cosine.mean(), rel=1e-5)
    assert profile["block_influence"][0] > 0.1 and abs(profile["block_influence"][1]) < 1e-6
    centered = final_BxTxD - final_BxTxD.mean(axis=1, keepdims=True)
    residual = np.linalg.norm(centered, axis=(1, 2)) / np.linalg.norm(final_BxTxD, axis=(1, 2))
    assert profile["rank_collapse"][-1] == pytest.approx(residual.mean(), rel=1e-5)

    hidden = np.maximum(np.asarray(blocks["ffn"]["up"]["__call__"][0], np.float64), 0)  # ReLU
    per_layer = hidden.reshape(hidden.shape[0], -1)
    np.testing.assert_allclose(profile["ffn_sparsity"], np.mean(per_layer < 0.05, axis=1))
    np.testing.assert_allclose(profile["ffn_mean_abs"], np.mean(per_layer, axis=1), rtol=1e-5)
    np.testing.assert_allclose(profile["ffn_rms"], np.sqrt(np.mean(per_layer**2, 1)), rtol=1e-5)
    assert 0.3 < profile["ffn_sparsity"][0] < 0.7  # ReLU zeros about half
    units = hidden.reshape(hidden.shape[0], -1, hidden.shape[-1])  # L × B·T × d_ff
    np.testing.assert_allclose(profile["ffn_dead_units"], np.mean(np.all(units < 0.05, 1), 1))

    # ∂loss/∂x_L directly, through the model's own output path.
    gradient = jax.jit(jax.grad(lambda x: next_token_loss(model.logits_of_hidden(x), targets_BxT)))(
        final_BxTxD)
    assert profile["gradient_rms"][-1] == pytest.approx(rms(gradient), rel=1e-5)
    # Block 1 is the identity, so ∂loss/∂x_1 = ∂loss/∂x_2.
    assert profile["gradient_rms"][1] == pytest.approx(profile["gradient_rms"][2], rel=1e-6)

    similarity = profile["head_similarity"][0]
    assert similarity[2, 3] == pytest.approx(1, abs=1e-6)  # identical attention patterns
    np.testing.assert_allclose(np.diag(similarity), 1, atol=1e-6)
    assert similarity[0, 1] < 0.99 and np.allclose(similarity, similarity.T)


def test_head_ablation_removes_exactly_one_head(edited):
    model, tokens_BxT1, profile = edited
    ablated = ablation.head_ablation(model, tokens_BxT1)
    assert ablated["loss"] == pytest.approx(profile["loss"], rel=1e-6)
    change = ablated["loss_change"]
    assert change.shape == (2, 4)
    assert change[0, 1] == 0  # its output slice was already zero
    np.testing.assert_array_equal(change[1], 0)  # block 1's output projection is zero
    # Another route: head 0's value slice zeroed (K = H, so only head 0 reads it): o_0 = 0.
    graphdef, state = nnx.split(model)
    other = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
    value = other.blocks.attention.value.kernel
    value[...] = value[...].at[0, :, 0].set(0)
    removed = ablation.batch_loss(other, tokens_BxT1)
    assert change[0, 0] != 0
    assert change[0, 0] == pytest.approx(removed - ablated["loss"], rel=1e-5, abs=1e-7)


def test_identity_block_has_no_influence_and_pruning_it_keeps_the_logits(edited):
    model, tokens_BxT1, _ = edited
    result = ablation.prune_by_influence(model, tokens_BxT1, 1)
    assert result["dropped"] == [1] and result["num_layers"] == 1
    assert result["loss_after"] == pytest.approx(result["loss_before"], rel=1e-6)
    assert result["block_influence"][1] < 1e-6 < result["block_influence"][0]
    pruned_cfg, pruned = ablation.prune_blocks(model, [1])
    assert pruned_cfg.num_layers == 1 and model.cfg.num_layers == 2
    inputs_BxT = tokens_BxT1[:, :-1]
    np.testing.assert_allclose(logits(pruned, inputs_BxT), logits(model, inputs_BxT),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(pruned.blocks.ffn.up.kernel[...][0],
                                  model.blocks.ffn.up.kernel[...][0])
    with pytest.raises(ValueError, match=r"drop=\[2\]: expected distinct block indices in 0..1"):
        ablation.prune_blocks(model, [2])


def test_unsupported_models_give_one_clear_line():
    config = tiny_config(reversible=True)
    config = resolve(config, 1)
    with pytest.raises(ValueError, match="model.reversible=True: the probes walk the residual"):
        probes.depth_profile(abstract_model(config.model), random_tokens((2, 17)))
    config = tiny_config(residual="deepnorm")
    config = resolve(config, 1)
    with pytest.raises(ValueError, match="model.residual.name='deepnorm': pruning changes"):
        ablation.prune_blocks(abstract_model(config.model), [0])
    # width, n = 4: without block 0 (2 sublayers) block 1 would write into other branches.
    config = tiny_config(residual="width")
    config = resolve(config, 1)
    with pytest.raises(ValueError,
                       match=r"model.residual.name='width': dropping blocks \[0\] moves"):
        ablation.prune_blocks(abstract_model(config.model), [0])
    # AttnRes blocks of S = 4 sublayers: {0..3}, {4, 5}; without block 0, 2..5 would be one.
    config = tiny_config(residual="block_attnres", num_layers=3)
    config = resolve(config, 1)
    with pytest.raises(ValueError, match=r"'block_attnres': dropping blocks \[0\] regroups"):
        ablation.prune_blocks(abstract_model(config.model), [0])


def test_pure_attention_without_skips_collapses_to_rank_one_and_prenorm_does_not():
    tokens_BxT1 = random_tokens((4, 17))
    collapse = {residual: probes.depth_profile(
        tiny_model(residual=residual, use_ffn=False, num_layers=6)[1], tokens_BxT1,
        gradients=False)
        for residual in ("noskip", "prenorm")}
    noskip, prenorm = collapse["noskip"]["rank_collapse"], collapse["prenorm"]["rank_collapse"]
    assert noskip[0] == pytest.approx(prenorm[0], rel=1e-5)  # the same embeddings, ...
    assert prenorm[0] > 0.9  # ... far from rank 1
    assert np.all(np.diff(noskip) < 0) and noskip[-1] < 0.1
    assert prenorm[-1] > 0.3
    assert np.isnan(collapse["noskip"]["branch_rms"][:, 1]).all()  # no FFN sublayer
    assert "gradient_rms" not in collapse["noskip"]


def test_train_step_memory_counts_parameters_and_adam_moments():
    config = tiny_config()
    config.mesh.data = 8  # data parallel: every device holds all parameters and moments
    memory = step_memory.train_step_memory(resolve_for_job(config))
    assert memory["devices"] == 8
    assert memory["parameter_bytes"] == 4 * memory["parameter_count"]  # float32
    counters = memory["optimizer_state_bytes"] - 2 * memory["parameter_bytes"]  # μ and ν
    assert 0 < counters <= 16 and counters % 4 == 0  # AdamW's int32 step counts
    assert memory["batch_bytes"] == 4 * 17  # one row of B×(T+1) int32 per device
    state_and_batch = sum(memory[key] for key in ("parameter_bytes", "optimizer_state_bytes",
                                                  "model_state_bytes", "step_bytes",
                                                  "batch_bytes"))
    assert memory["argument_bytes"] == state_and_batch  # XLA agrees with the count
    assert memory["temp_bytes"] > 0


def test_interleaved_moe_blocks_come_out_in_network_order():
    # 4 blocks in 2 groups of k = 2: blocks 1 and 3 are MoE (no dense hidden activations: NaN).
    _, model = tiny_model(num_layers=4, ffn="moe", moe__every=2, moe__experts=2, moe__top_k=1,
                          moe__dense_ffn="mlp", moe__expert_ffn="mlp")
    tokens_BxT1 = random_tokens((2, 17))
    profile = probes.depth_profile(model, tokens_BxT1, gradients=False)
    assert profile["loss"] == pytest.approx(ablation.batch_loss(model, tokens_BxT1), rel=1e-6)
    assert np.isnan(profile["ffn_sparsity"]).tolist() == [False, True, False, True]
    assert np.isfinite(profile["branch_rms"]).all() and profile["hidden_rms"].shape == (5,)


# Multi-stream mechanisms --------------------------------------------------------------------------

def copy_params(source, target):
    """Every parameter of `source` into the parameter of `target` at the same path."""
    target_params = dict(nnx.to_flat_state(nnx.state(target, nnx.Param)))
    for path, variable in nnx.to_flat_state(nnx.state(source, nnx.Param)):
        target_params[path][...] = variable[...]


def zero_outputs(model, block: int):
    """Block `block`'s attention and FFN outputs zero."""
    for kernel in (model.blocks.attention.output.kernel, model.blocks.ffn.down.kernel):
        kernel[...] = kernel[...].at[block].set(0)


@pytest.mark.slow
def test_hc_at_its_pre_norm_initialization_has_the_pre_norm_profile(edited):
    """Static HC (`residual__dynamic=False`; the dynamic part's zero-initialized projections
    would add 0) with n = 4 streams at its Pre-Norm initialization, holding the Pre-Norm model's
    parameters: every stream is the Pre-Norm stream x_i, the readout
    h_i = Σ_m h_m = 4·x_i, each read's mixture is x_i, and ∂loss/∂u_i = Σ_m ∂loss/∂h_m =
    ∂loss/∂x_i. So the profile is Pre-Norm's, with the hidden RMS and the final norm's input ×4
    (the final norm removes the scale, up to its ε)."""
    reference, tokens_BxT1, expected = edited
    _, model = tiny_model(residual="hc", residual__dynamic=False, ffn="mlp", ffn__activation="relu",
                          attention__num_kv_heads=4)
    copy_params(reference, model)
    profile = probes.depth_profile(model, tokens_BxT1, sparsity_threshold=0.05)
    assert profile["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    np.testing.assert_allclose(profile["hidden_rms"], 4 * expected["hidden_rms"], rtol=1e-5)
    for name in ("gradient_rms", "rank_collapse", "branch_rms", "update_ratio", "ffn_sparsity",
                 "ffn_mean_abs", "ffn_rms", "head_similarity"):
        np.testing.assert_allclose(profile[name], expected[name], rtol=1e-4, atol=1e-7,
                                   err_msg=name)
    np.testing.assert_allclose(profile["block_influence"], expected["block_influence"],
                               rtol=1e-4, atol=1e-6)
    for sublayer in ("attention", "ffn"):
        for key, value in expected["norms"][sublayer].items():
            np.testing.assert_allclose(profile["norms"][sublayer][key], value, rtol=1e-4,
                                       atol=1e-7, err_msg=f"{sublayer} {key}")
    final, scale = profile["norms"]["final"], {"input_mean": 4, "input_variance": 16,
                                               "input_rms": 4}
    for key, value in expected["norms"]["final"].items():
        assert final[key] == pytest.approx(scale.get(key, 1) * value, rel=1e-4, abs=1e-7), key

    # Pruning: block 0 made an identity on the streams (zero outputs, mixing I) in a model whose
    # streams differ (perturbed mixing; block 1 gets block 0's outputs back). Block 1 moves from
    # sublayers 2, 3 to 0, 1: its reads follow k mod 4 only through the shifted read offsets.
    graphdef, state = nnx.split(model)
    other = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
    for kernel in (other.blocks.attention.output.kernel, other.blocks.ffn.down.kernel):
        kernel[...] = kernel[...].at[1].set(kernel[...][0])
    zero_outputs(other, 0)
    for seed, name in enumerate(("attention_residual", "ffn_residual")):
        residual = getattr(other.blocks, name)
        perturb_mixing(residual, seed, fan_in=32)
        residual.static_mixing[...] = residual.static_mixing[...].at[0].set(jnp.eye(4))
    profile = probes.depth_profile(other, tokens_BxT1)  # the same graph: no new compile
    assert abs(profile["block_influence"][0]) < 1e-6 < 0.1 < profile["block_influence"][1]
    _, pruned = ablation.prune_blocks(other, [0])
    assert ablation.batch_loss(pruned, tokens_BxT1) == pytest.approx(profile["loss"], rel=1e-5)


def test_block_attnres_profile_and_pruning():
    """Blocks of S = 2 sublayers (one per Transformer block), random pseudo-queries, block 1's
    outputs zero: its AttnRes block adds a zero source, which scales the final read over the
    available sources (h_1 → c·h_1, softmax), so its influence is 0. Pruning keeps the
    pseudo-query rows of sublayers 0, 1 and of the final read, and with static depth weights the
    weight columns of the source slots that remain."""
    tokens_BxT1 = random_tokens((2, 17))
    _, model = tiny_model(residual="block_attnres", attnres__block_size=2)
    queries = model.residual_stream.pseudo_queries  # 5 × D: sublayers 0..3 and the final read
    queries[...] = jax.random.normal(jax.random.key(1), queries.shape)
    zero_outputs(model, 1)
    profile = probes.depth_profile(model, tokens_BxT1, gradients=False)
    assert profile["loss"] == pytest.approx(ablation.batch_loss(model, tokens_BxT1), rel=1e-6)
    assert profile["hidden_rms"].shape == profile["rank_collapse"].shape == (3,)
    assert profile["branch_rms"].shape == profile["update_ratio"].shape == (2, 2)
    assert profile["head_similarity"].shape == (2, 4, 4)
    assert all(np.isfinite(value).all() for value in jax.tree.leaves(profile))
    assert abs(profile["block_influence"][1]) < 1e-6 < 0.1 < profile["block_influence"][0]
    _, pruned = ablation.prune_blocks(model, [1])
    np.testing.assert_array_equal(pruned.residual_stream.pseudo_queries[...],
                                  np.asarray(queries[...])[[0, 1, 4]])

    _, model = tiny_model(residual="block_attnres", attnres__block_size=2,
                          attnres__weights="static")
    weights = model.residual_stream.static_weights  # rows × slots × heads: 5 × 3 × 1
    weights[...] = jax.random.normal(jax.random.key(2), weights.shape)
    _, pruned = ablation.prune_blocks(model, [0])  # rows of sublayers 2, 3 and 4; slots 0 and 2
    np.testing.assert_array_equal(pruned.residual_stream.static_weights[...],
                                  np.asarray(weights[...])[[2, 3, 4]][:, [0, 2]])


def test_gated_residual_profile_is_the_model_and_finite():
    tokens_BxT1 = random_tokens((2, 17))
    _, model = tiny_model(residual="gated_residual", residual__dynamic=False)
    profile = probes.depth_profile(model, tokens_BxT1, gradients=False)
    assert profile["loss"] == pytest.approx(ablation.batch_loss(model, tokens_BxT1), rel=1e-6)
    assert all(np.isfinite(value).all() for value in jax.tree.leaves(profile))
    # The branch normalization's gains are the n × D `scale`, 1 at initialization.
    assert profile["norms"]["attention"]["gain_mean"].tolist() == [1, 1]


def test_layer_gradient_norms_equal_the_hand_written_reference_and_vanish_behind_a_zero_output():
    """‖∂loss/∂W‖_F per layer against autodiff of `arch.reference` (a separate implementation of
    the same decoder); with block 1's attention output projection zeroed, its attention output
    no longer depends on its query, key and value, so their gradients are exactly zero there."""
    cfg, model = tiny_model(num_layers=3)
    tokens_BxT1 = random_tokens((2, 17))
    norms = layer_gradients.layer_gradient_norms(model, tokens_BxT1)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    grads = jax.jit(jax.grad(lambda p: reference.loss(cfg, p, tokens_BxT1)))(params)["blocks"]
    expected = {".".join(str(k.key) for k in path): np.sqrt(np.sum(
                    np.asarray(g, np.float64).reshape(3, -1) ** 2, axis=1))
                for path, g in jax.tree_util.tree_leaves_with_path(grads)}
    assert set(norms) == set(expected) >= {
        "attention.query.kernel", "attention.key.kernel", "attention.value.kernel",
        "attention.output.kernel", "ffn.gate.kernel", "ffn.up.kernel", "ffn.down.kernel"}
    for key, value in expected.items():
        np.testing.assert_allclose(norms[key], value, rtol=2e-4, err_msg=key)

    output = model.blocks.attention.output.kernel
    output[...] = output[...].at[1].set(0)
    norms = layer_gradients.layer_gradient_norms(model, tokens_BxT1)
    for name in ("query", "key", "value"):
        assert norms[f"attention.{name}.kernel"][1] == 0
        assert np.all(norms[f"attention.{name}.kernel"][[0, 2]] > 0)
    assert norms["attention.output.kernel"][1] > 0


def test_dead_units_are_the_hidden_units_never_active_by_hand():
    """ReLU MLP with block 0's attention output zeroed, so the FFN of block 0 reads the embedding:
    a = relu(RMSNorm(E[tokens]) ⊙ g · W_up) by hand, with 8 columns of W_up zeroed (dead)."""
    cfg, model = tiny_model(ffn="mlp", ffn__activation="relu", position="learned")
    blocks = model.blocks
    blocks.attention.output.kernel[...] = blocks.attention.output.kernel[...].at[0].set(0)
    blocks.ffn.up.kernel[...] = blocks.ffn.up.kernel[...].at[0, :, :8].set(0)
    tokens_BxT1 = random_tokens((2, 17))
    threshold = 0.05
    profile = probes.depth_profile(model, tokens_BxT1, sparsity_threshold=threshold,
                                   gradients=False)
    x = (np.asarray(model.embed.embedding[...], np.float64)[np.asarray(tokens_BxT1[:, :-1])]
         + np.asarray(model.position.table[...], np.float64)[:16])
    x = x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + cfg.norm.eps)
    x = x * np.asarray(blocks.ffn_residual.norm.scale[0], np.float64)
    hidden = np.maximum(x @ np.asarray(blocks.ffn.up.kernel[0], np.float64), 0)
    dead = np.all(np.abs(hidden) < threshold, axis=(0, 1))
    assert dead[:8].all() and dead.mean() > 8 / hidden.shape[-1] - 1e-9
    assert profile["ffn_dead_units"][0] == pytest.approx(dead.mean())
    assert profile["ffn_sparsity"][0] == pytest.approx(np.mean(np.abs(hidden) < threshold),
                                                       abs=1e-6)

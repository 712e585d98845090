"""The jit boundary: train state, its shardings, and the pure train and eval steps.

The model is split into a static graph, its parameters and its other state (e.g. BatchNorm running
statistics); what gets jitted is a pure function of (state pytree, batch), with the model merged
back inside. The train state is a plain dict {"step": int32, "params": nnx.State, "model_state":
nnx.State, "opt_state": optax state}, every leaf placed by a NamedSharding derived from its
variable's logical axis names; with optimizer.ema_decay > 0 it also holds "ema", an exponential
moving average of the parameters (same tree and shardings as "params").

EMA and self-distillation (optimizer.ema_decay = d, objective.ema_distill_weight = w): after each
optimizer update, ema ← d·ema + (1 − d)·params (`ema_update`; plain, no bias correction, started
at the initial parameters). With w > 0 the loss adds w·KL(softmax(z_ema/τ) ‖ softmax(z/τ))
(`distillation_kl`), z_ema the logits of the same model with the EMA parameters (the teacher, in
training mode like the student, its model-state writes discarded) under `jax.lax.stop_gradient`.
Two separate rules: the stop-gradient is a gradient boundary (the teacher's logits are a constant
of the backward pass), and the EMA is the only way the teacher changes (it never takes a gradient
step). Cost: one parameter-sized buffer; with distillation one more forward pass per step.

Sequence parallelism (mesh.sequence = S > 1): the steps permute each batch's inputs, targets and
positions into the striped order of `sharding.sequence.stripe_batch` (here and only here), so
every sequence shard has equal causal work; the loss, a mean over positions, is unchanged.

Gradient accumulation (accumulation_steps = k > 1): the train step splits the global batch into
k microbatches of B/k sequences and scans over them, summing gradients, loss and metrics and
threading the model state, then applies one update with the mean gradient. For a mean loss over
equal microbatches, ∇L(B) = (1/k) Σ_i ∇L(B_i), so the update equals the unsplit batch's (exactly
so up to float rounding, except where the loss couples the rows of a batch: MoE balancing and
capacity, BatchNorm statistics, which are then per microbatch). Cost: activation memory of one
microbatch plus one gradient-sized sum; the same FLOPs, with the gradient reduction across
batch shards run once per microbatch.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from arch import dropout
from arch.model import TransformerLM
from arch.moe import AuxLoss, DroppedFraction
from arch.quantized import quantized_structure
from arch.remat import host_offload_supported
from config import check, resolve
from config.defaults import quantization_config
from config.resolution import require_resolved
from sharding.mesh import make_mesh, maybe_initialize_distributed, slice_count
from sharding.rules import constrain, named_sharding
from sharding.sequence import stripe_batch, stripe_order
from train.optim import make_optimizer, schedule


def all_finite(tree) -> jax.Array:
    """Whether every floating-point leaf of `tree` is finite: one boolean, one fused reduction."""
    leaves = [leaf for leaf in jax.tree.leaves(tree)
              if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)]
    if not leaves:
        return jnp.bool_(True)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in leaves]))


def next_token_loss(logits_BxTxV: jax.Array, targets_BxT: jax.Array) -> jax.Array:
    """Mean cross-entropy of the targets (the inputs shifted by one), in float32."""
    return optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, targets_BxT).mean()


def distillation_kl(student_logits_BxTxV: jax.Array, teacher_logits_BxTxV: jax.Array,
                    temperature: float = 1.0) -> jax.Array:
    """Mean over positions of KL(p_t ‖ p_s) = Σ_v p_t,v (log p_t,v − log p_s,v), with
    p_t = softmax(teacher/τ) and p_s = softmax(student/τ), in float32 (Hinton et al. 2015,
    without their τ² factor: the weight absorbs it). Zero when the logits agree; its gradient
    with respect to the student logits is (p_s − p_t)/τ per position. The caller detaches the
    teacher. Cost: O(B·T·V)."""
    log_p_student = jax.nn.log_softmax(student_logits_BxTxV.astype(jnp.float32) / temperature)
    log_p_teacher = jax.nn.log_softmax(teacher_logits_BxTxV.astype(jnp.float32) / temperature)
    return jnp.mean(jnp.sum(jnp.exp(log_p_teacher) * (log_p_teacher - log_p_student), axis=-1))


def ema_update(ema, params, decay: float):
    """ema ← decay·ema + (1 − decay)·params, leaf by leaf (the EMA rule: the only update an EMA
    teacher ever gets). Cost: O(parameters)."""
    return jax.tree.map(lambda average, param: decay * average + (1 - decay) * param, ema, params)


def masked_next_token_loss(logits_BxTxV: jax.Array, targets_BxT: jax.Array,
                           valid_BxT: jax.Array) -> jax.Array:
    """Mean cross-entropy over the positions where `valid_BxT` is True, in float32."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, targets_BxT)
    valid = valid_BxT.astype(jnp.float32)
    return jnp.sum(losses * valid) / jnp.sum(valid)


def multi_token_batch(tokens_BxT1: jax.Array, depth: int, shards: int = 1
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(future_tokens, targets, valid), each K×B×T (K = `depth`), of a batch of T + 1 tokens
    t_0 … t_T for multi-token prediction (arch/mtp.py), in the order of `stripe_batch`'s inputs
    (`stripe_order(T, shards)`). Module j = 1 … K at input position i reads
    future_tokens[j−1, :, i] = t_{i+j} and predicts targets[j−1, :, i] = t_{i+j+1}; valid is
    True exactly where that target exists, i ≤ T − 1 − j (T − j positions per sequence; the
    last j are excluded from the mean). Missing tokens are 0 and are never a valid target."""
    batch, length = tokens_BxT1.shape[0], tokens_BxT1.shape[1] - 1
    padded_BxP = jnp.pad(tokens_BxT1, ((0, 0), (0, depth + 1)))
    order = stripe_order(length, shards)
    stripe = (lambda x: x[..., order]) if shards > 1 else (lambda x: x)
    future, targets, valid = [], [], []
    for j in range(1, depth + 1):
        future.append(stripe(padded_BxP[:, j:j + length]))
        targets.append(stripe(padded_BxP[:, j + 1:j + 1 + length]))
        valid.append(jnp.broadcast_to(stripe(np.arange(length) <= length - 1 - j),
                                      (batch, length)))
    return jnp.stack(future), jnp.stack(targets), jnp.stack(valid)


def _masked(leaf) -> bool:
    return isinstance(leaf, optax.MaskedNode)


class TrainProgram:
    """The compiled pieces of one (config, mesh): model graph, optimizer, shardings and steps.

    `init(seed)`, `train_step(state, batch)`, `eval_loss(state, batch, ema=False)`; batches are
    int32 token arrays of shape [batch_size, seq_len + 1] placed with `put_batch`. `uses_ema`:
    whether the state holds "ema" (optimizer.ema_decay > 0).
    """

    def __init__(self, config, mesh: jax.sharding.Mesh):
        require_resolved(config, "TrainProgram")
        self.config, self.mesh = config, mesh
        self.sequence_shards = mesh.shape["sequence"]
        self.model_cfg, self.execution = config.model, config.execution
        abstract = nnx.eval_shape(lambda: self._model(nnx.Rngs(0)))
        self.graphdef, abstract_params, abstract_model_state = nnx.split(abstract, nnx.Param, ...)
        self.optimizer = make_optimizer(config.optimizer, config.steps)
        self.ema_decay = float(config.optimizer.get("ema_decay", 0.0))
        self.uses_ema = self.ema_decay > 0
        objective = config.get("objective", {})
        self.distill_weight = float(objective.get("ema_distill_weight", 0.0))
        self.distill_temperature = float(objective.get("ema_distill_temperature", 1.0))
        self.learning_rate = schedule(config.optimizer, config.steps)
        replicated = NamedSharding(mesh, PartitionSpec())
        param_shardings, model_state_shardings = (
            jax.tree.map(lambda x, spec: named_sharding(mesh, spec, x.shape),
                         abstract, nnx.get_partition_spec(abstract))
            for abstract in (abstract_params, abstract_model_state))
        # A partitioned optimizer (Muon) holds MaskedNodes where a branch skips a parameter.
        opt_shardings = optax.tree_map_params(
            self.optimizer, lambda leaf, sharding: leaf if _masked(leaf) else sharding,
            jax.eval_shape(self.optimizer.init, abstract_params), param_shardings,
            transform_non_params=lambda _: replicated, is_leaf=_masked)
        self.state_shardings = {"step": replicated, "params": param_shardings,
                                "model_state": model_state_shardings, "opt_state": opt_shardings}
        if self.uses_ema:
            self.state_shardings["ema"] = param_shardings
        self.batch_sharding = named_sharding(mesh, ("act_batch", None))
        self._init = jax.jit(self._init_state, out_shardings=self.state_shardings)
        self._train_step = jax.jit(
            self._step, in_shardings=(self.state_shardings, self.batch_sharding),
            out_shardings=(self.state_shardings, replicated), donate_argnums=0)
        self._eval_loss = jax.jit(
            self._evaluation_loss,
            in_shardings=(param_shardings, model_state_shardings, self.batch_sharding),
            out_shardings=replicated)

    # pure functions (traced) ------------------------------------------------------------------
    def model_inputs(self, tokens_BxT1):
        """(inputs_BxT, targets_BxT, positions_BxT) of a batch: shifted by one and, under sequence
        parallelism, striped (`sharding.sequence.stripe_batch`); `model(inputs, positions)` gives
        logits in the same order as the targets."""
        return stripe_batch(tokens_BxT1, self.sequence_shards)

    def _model(self, rngs: nnx.Rngs) -> TransformerLM:
        """The model; a quantized run's (config `quantization`) holds the quantized layers of
        `arch.quantized`, whose values come from its checkpoint (scripts/quantize.py)."""
        model = TransformerLM(self.model_cfg, execution=self.execution, rngs=rngs)
        return quantized_structure(model, self.config.get("quantization", quantization_config()))

    def _init_state(self, seed):
        model = self._model(nnx.Rngs(jax.random.key(seed)))
        _, params, model_state = nnx.split(model, nnx.Param, ...)
        state = {"step": jnp.zeros((), jnp.int32), "params": params, "model_state": model_state,
                 "opt_state": self.optimizer.init(params)}
        if self.uses_ema:
            state["ema"] = jax.tree.map(jnp.copy, params)
        return state

    def _loss_and_grads(self, params, model_state, tokens_BxT1, teacher_params=None,
                        dropout_key=None):
        """Training-mode loss, its gradients with respect to the parameters, the model state after
        the forward pass (nnx.value_and_grad carries that state's updates), and extra metrics.
        `dropout_key`: the model's dropout key (`dropout_key`), None: no dropout.

        The loss is next-token cross-entropy plus the sum of every `arch.moe.AuxLoss` the forward
        pass wrote (MoE balancing and z-losses), plus, with multi-token prediction
        (`model.head.mtp_depth` = k > 0, arch/mtp.py), (λ/k) Σ_j CE_j over the positions that
        have a target for depth j (`multi_token_batch`), plus, given `teacher_params` (the EMA),
        w·KL of the teacher's stop-gradient logits to the student's (`distillation_kl`). The
        metrics are {"aux_loss", "moe_dropped_fraction" (mean over layers)} for a model with such
        variables, {"next_token_loss", "mtp_loss" ((λ/k) Σ_j CE_j), "mtp_loss_<j>" (CE_j)} with
        MTP, and "distill_kl" (the KL, unweighted) with a teacher."""
        inputs_BxT, targets_BxT, positions_BxT = self.model_inputs(tokens_BxT1)
        teacher_logits_BxTxV = None
        if teacher_params is not None:
            # Its own merged copy: what its forward pass writes (BatchNorm statistics, MoE aux
            # losses) is dropped; stop_gradient makes its logits a constant of the backward pass.
            teacher = nnx.merge(self.graphdef, teacher_params, model_state)
            teacher_logits_BxTxV = jax.lax.stop_gradient(teacher(inputs_BxT, positions_BxT))
        model = nnx.merge(self.graphdef, params, model_state)
        depth = self.model_cfg.head.get("mtp_depth", 0)

        def loss(model):
            metrics = {}
            if depth:
                future_KxBxT, mtp_targets_KxBxT, valid_KxBxT = multi_token_batch(
                    tokens_BxT1, depth, self.sequence_shards)
                logits_BxTxV, *mtp_logits = model.multi_token_logits(
                    inputs_BxT, positions_BxT, future_KxBxT, dropout_key=dropout_key)
                value = metrics["next_token_loss"] = next_token_loss(logits_BxTxV, targets_BxT)
                for j, logits_j in enumerate(mtp_logits, start=1):
                    metrics[f"mtp_loss_{j}"] = masked_next_token_loss(
                        logits_j, mtp_targets_KxBxT[j - 1], valid_KxBxT[j - 1])
                metrics["mtp_loss"] = (self.model_cfg.head.mtp_weight / depth) * sum(
                    metrics[f"mtp_loss_{j}"] for j in range(1, depth + 1))
                value = value + metrics["mtp_loss"]
            else:
                logits_BxTxV = model(inputs_BxT, positions_BxT, dropout_key=dropout_key)
                value = next_token_loss(logits_BxTxV, targets_BxT)
            if teacher_logits_BxTxV is not None:
                metrics["distill_kl"] = distillation_kl(logits_BxTxV, teacher_logits_BxTxV,
                                                        self.distill_temperature)
                value = value + self.distill_weight * metrics["distill_kl"]
            aux_losses = jax.tree.leaves(nnx.state(model, AuxLoss))
            if aux_losses:
                metrics["aux_loss"] = sum(jnp.sum(leaf) for leaf in aux_losses)
                value = value + metrics["aux_loss"]
            dropped = jax.tree.leaves(nnx.state(model, DroppedFraction))
            if dropped:
                metrics["moe_dropped_fraction"] = jnp.mean(jnp.stack(
                    [jnp.mean(leaf) for leaf in dropped]))
            return value, metrics

        (value, metrics), grads = nnx.value_and_grad(loss, has_aux=True)(model)
        return value, grads, nnx.state(model, nnx.Not(nnx.Param)), metrics

    def microbatches(self, tokens_BxT1: jax.Array) -> jax.Array:
        """[B/k, k, T+1] microbatches of a batch (k = accumulation_steps), each keeping the batch
        sharding: microbatch i holds rows i, k + i, 2k + i, ..., so a device holding a contiguous
        block of rows keeps B/(k·shards) of them in every microbatch (no communication): a reshape
        whose outer axis keeps the batch sharding, sliced along the unsharded inner axis."""
        steps = self.config.accumulation_steps
        batch, length = tokens_BxT1.shape
        split = tokens_BxT1.reshape(batch // steps, steps, length)
        return constrain(split, ("act_batch", None, None))

    def dropout_key(self, step, microbatch=0) -> jax.Array | None:
        """The model's dropout key for train step `step`, accumulation microbatch `microbatch`:
        a pure function of (config.seed, step, microbatch) (`arch.dropout.train_key`), so a
        resumed or re-sharded run draws the same masks; None when every `model.dropout` rate is
        0 (nothing random is traced)."""
        if not dropout.enabled(self.model_cfg):
            return None
        return dropout.train_key(self.config.seed, step, microbatch)

    def _accumulated_loss_and_grads(self, params, model_state, tokens_BxT1: jax.Array,
                                    teacher_params=None, step=0):
        """`_loss_and_grads` of the whole batch as the mean over `accumulation_steps`
        microbatches, scanned: the carry holds the sums of gradients, loss and metrics, and
        the model state, updated by each microbatch in turn. With one step, no scan. `step`:
        the train step, for the dropout keys (microbatch i folds in i)."""
        steps = self.config.accumulation_steps
        if steps == 1:
            return self._loss_and_grads(params, model_state, tokens_BxT1, teacher_params,
                                        self.dropout_key(step))
        micro = self.microbatches(tokens_BxT1)
        # Abstract first pass: the metrics' structure and dtypes, to start the sums at zero.
        _, _, _, abstract_metrics = jax.eval_shape(self._loss_and_grads, params, model_state,
                                                   micro[:, 0], teacher_params)

        # The parameters (and the teacher's) ride in the carry, unchanged: nnx cannot merge a
        # closed-over tracer.
        def accumulate(carry, index):
            params, teacher_params, loss_sum, grad_sum, model_state, metric_sum = carry
            tokens = constrain(jax.lax.dynamic_index_in_dim(micro, index, 1, keepdims=False),
                               ("act_batch", None))
            loss, grads, model_state, metrics = self._loss_and_grads(
                params, model_state, tokens, teacher_params, self.dropout_key(step, index))
            return (params, teacher_params, loss_sum + loss,
                    jax.tree.map(jnp.add, grad_sum, grads), model_state,
                    jax.tree.map(jnp.add, metric_sum, metrics)), None

        zeros = (params, teacher_params, jnp.zeros((), jnp.float32),
                 jax.tree.map(jnp.zeros_like, params), model_state,
                 jax.tree.map(lambda m: jnp.zeros(m.shape, m.dtype), abstract_metrics))
        (_, _, loss, grads, model_state, metrics), _ = jax.lax.scan(accumulate, zeros,
                                                                    jnp.arange(steps))
        loss, grads, metrics = jax.tree.map(lambda total: total / steps, (loss, grads, metrics))
        return loss, grads, model_state, metrics

    def _evaluation_loss(self, params, model_state, tokens_BxT1):
        """Pure cross-entropy: auxiliary losses are training objectives, not evaluation."""
        model = nnx.merge(self.graphdef, params, model_state)
        model.eval()  # e.g. BatchNorm uses its running statistics
        inputs_BxT, targets_BxT, positions_BxT = self.model_inputs(tokens_BxT1)
        return next_token_loss(model(inputs_BxT, positions_BxT), targets_BxT)

    def _step(self, state, tokens_BxT1):
        """One update; metrics["finite"] says whether the loss, the gradient norm and every
        floating leaf of the new parameters, model state and optimizer state are finite (one
        fused reduction). With config.nonfinite_policy="skip" a non-finite step keeps the
        previous parameters, model state and optimizer state (the step counter still advances:
        the batch is consumed) and metrics["skipped"] is 1. With an EMA, it is updated from the
        new parameters after the optimizer update (and kept, too, on a skipped step); with
        distillation the EMA is also the teacher, which takes no gradient step."""
        teacher_params = state["ema"] if self.distill_weight > 0 else None
        loss, grads, model_state, aux_metrics = self._accumulated_loss_and_grads(
            state["params"], state["model_state"], tokens_BxT1, teacher_params, state["step"])
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        grad_norm = optax.tree.norm(grads)
        updated = {"params": params, "model_state": model_state, "opt_state": opt_state}
        if self.uses_ema:
            updated["ema"] = ema_update(state["ema"], params, self.ema_decay)
        finite = all_finite((loss, grad_norm, updated))
        metrics = {"loss": loss, "grad_norm": grad_norm,
                   "update_norm": optax.tree.norm(updates),
                   "learning_rate": self.learning_rate(state["step"]), "finite": finite,
                   **aux_metrics}
        if self.config.get("nonfinite_policy", "stop") == "skip":
            previous = {name: state[name] for name in updated}
            updated = jax.tree.map(lambda new, old: jnp.where(finite, new, old), updated,
                                   previous)
            metrics["skipped"] = jnp.logical_not(finite).astype(jnp.int32)
        return {"step": state["step"] + 1, **updated}, metrics

    # entry points (run under the mesh) ---------------------------------------------------------
    def init(self, seed: int):
        with jax.set_mesh(self.mesh):
            return self._init(jnp.int32(seed))

    def train_step(self, state, tokens_BxT1):
        with jax.set_mesh(self.mesh):
            return self._train_step(state, tokens_BxT1)

    def eval_loss(self, state, tokens_BxT1, *, ema: bool = False):
        """Evaluation-mode loss of a train state on one batch; with `ema`, of its EMA parameters
        (with the state's model state, e.g. BatchNorm's running statistics)."""
        with jax.set_mesh(self.mesh):
            return self._eval_loss(state["ema" if ema else "params"], state["model_state"],
                                   tokens_BxT1)

    def abstract_state(self, *, ema: bool | None = None):
        """ShapeDtypeStructs with this mesh's shardings: restore targets for checkpoints. `ema`:
        with or without the "ema" entry (default: as this program's state), to read a checkpoint
        of a run that differs only in that (a fine-tune's source)."""
        shapes = jax.eval_shape(self._init_state, jnp.int32(0))
        shardings = dict(self.state_shardings)
        if ema is not None and ema != self.uses_ema:
            if ema:
                shapes["ema"], shardings["ema"] = shapes["params"], shardings["params"]
            else:
                del shapes["ema"], shardings["ema"]
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            shapes, shardings)

    def put_batch(self, local_tokens):
        """Place this process's rows of the global batch (all rows in a single process)."""
        global_shape = (self.config.batch_size, self.config.seq_len + 1)
        if jax.process_count() == 1:
            return jax.device_put(local_tokens, self.batch_sharding)
        return jax.make_array_from_process_local_data(self.batch_sharding, local_tokens,
                                                      global_shape)

    def process_rows(self) -> np.ndarray:
        """The rows of the global batch this process loads: those its devices hold."""
        global_shape = (self.config.batch_size, self.config.seq_len + 1)
        return rows_held(self.batch_sharding, global_shape, self.batch_sharding.addressable_devices)


def resolve_for_job(config):
    """`config.resolve` for the devices of this job, all its processes' (`jax.distributed`
    initialized first when launched as several), in their TPU slices."""
    maybe_initialize_distributed()
    return resolve(config, jax.device_count(), slice_count(jax.devices()))


def build_program(config) -> TrainProgram:
    """The program of a resolved `config` on the job's devices (`make_mesh`). The one check left
    is of the devices themselves: `execution.remat='offload'` needs pinned host memory."""
    require_resolved(config, "build_program")
    check(config.execution.remat != "offload" or host_offload_supported(), "execution.remat",
          config.execution.remat, "the default device has no pinned_host memory to offload to; "
          "use save_attention_and_ffn_outputs")
    return TrainProgram(config, make_mesh(config))


def rows_held(sharding: jax.sharding.Sharding, global_shape: tuple[int, ...],
              devices) -> np.ndarray:
    """The rows (first-axis indices, ascending) of a global array of `global_shape` placed by
    `sharding` that `devices` hold: for one process's devices, the rows it must load.

    Rows shard over the batch axes (data × fsdp × expert) and repeat over the others, so a
    process loads the rows of each distinct batch shard its devices hold: half the batch for
    each of 2 processes under data parallelism, all of it for each when tensor parallelism spans
    the processes. `jax.make_array_from_process_local_data` takes exactly these rows in this
    order (the process's distinct shards, sorted by their first row, concatenated), also when
    the mesh interleaves processes along the batch axes.
    """
    index_map = sharding.devices_indices_map(tuple(global_shape))
    held = {row for device in devices
            for row in range(*index_map[device][0].indices(global_shape[0]))}
    return np.array(sorted(held), dtype=np.int64)


def compile_train_step(program: TrainProgram) -> tuple[float, jax.stages.Compiled]:
    """Seconds to lower and compile the program's jitted train step (from abstract state and
    batch: nothing is allocated or run), and the executable; `memory_analysis()` of the
    executable gives XLA's per-device argument, output, alias and temp bytes."""
    config = program.config
    state = program.abstract_state()
    batch = jax.ShapeDtypeStruct((config.batch_size, config.seq_len + 1), jnp.int32,
                                 sharding=program.batch_sharding)
    start = time.perf_counter()
    with jax.set_mesh(program.mesh):
        compiled = program._train_step.lower(state, batch).compile()
    return time.perf_counter() - start, compiled

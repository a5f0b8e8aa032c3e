"""A user's own model (Trainer(model_factory=...)): its mistakes are one clear ConfigError before
anything compiles, and a sharded step's gradients equal plain jax.grad of the same model."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxpar.config import ConfigError, make_config
from jaxpar.nn import constrain, param
from jaxpar.train.trainer import Trainer

VOCAB, DIM, HIDDEN, SEQ = 256, 16, 32, 16


class Bigram(nnx.Module):
    """Token and predecessor -> MLP -> vocab (the shape of examples/custom_model.py)."""

    def __init__(self, rngs, vocab=VOCAB, axes_in=("embed", "mlp"), out_vocab=None):
        self.embed = param(rngs, (vocab, DIM), ("vocab", "embed"))
        self.w_in = param(rngs, (2 * DIM, HIDDEN), axes_in)
        self.w_out = param(rngs, (HIDDEN, DIM), ("mlp", "embed"))
        self.head = param(rngs, (DIM, out_vocab or vocab), ("embed", "vocab"))

    def __call__(self, tokens):
        x = jnp.take(self.embed[...], tokens, axis=0)
        prev = jnp.pad(x, ((0, 0), (1, 0), (0, 0)))[:, :-1]
        h = jax.nn.gelu(jnp.concatenate([x, prev], -1) @ self.w_in[...])
        h = constrain(h, ("batch", "seq", "mlp"))
        return (x + h @ self.w_out[...]) @ self.head[...]


def cfg_of(*overrides):
    return make_config({"mesh": {"data": 2, "fsdp": 2, "tensor": 2}, "sharding": {"zero_stage": 3},
                        "train": {"steps": 2, "global_batch": 8, "seq_len": SEQ, "compute_dtype": "float32",
                                  "progress": False},
                        "checkpoint": {"enabled": False}}, list(overrides))


def trainer(factory, *overrides, devices=None):
    return Trainer(cfg_of(*overrides), model_factory=factory, devices=devices, log=lambda s: None)


def test_sharded_gradients_equal_plain_jax_grad(devices):
    """data 2 x fsdp 2 x tensor 2, ZeRO-3: the step's gradients are jax.grad's of the mean token
    cross-entropy on one device, float32."""
    t = trainer(lambda rngs: Bigram(rngs))
    state = t.init_state()
    rows = np.random.default_rng(0).integers(0, VOCAB, (8, SEQ + 1))
    params = jax.device_get(state["params"])
    _, metrics = t.make_step(return_grads=True)(state, t.put_batch(rows))
    grads = jax.device_get(metrics["grads"])
    model = t.model

    def loss(p):
        logits = model.merge(model.state(p))(jnp.asarray(rows[:, :-1]))
        return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(rows[:, 1:])).mean()

    want = jax.grad(loss)(params)
    for k in want:
        np.testing.assert_allclose(np.asarray(grads[k]), np.asarray(want[k]), rtol=2e-4, atol=1e-6,
                                   err_msg=k)


def test_logits_of_another_vocabulary_are_refused(devices):
    """A head of 128 on data whose ids reach 255 would be a NaN loss on some batches."""
    with pytest.raises(ConfigError, match=r"vocabulary of 128, but the data's ids go up to "
                                          r"model.vocab_size=256"):
        trainer(lambda rngs: Bigram(rngs, out_vocab=128))


@pytest.mark.parametrize("cut, shape", [(lambda y: y[:, -1], r"\[2, 256\]"),
                                        (lambda y: y[:, :-1], r"\[2, 15, 256\]")])
def test_logits_of_the_wrong_shape_are_refused(devices, cut, shape):
    class Cut(Bigram):
        def __call__(self, tokens):
            return cut(super().__call__(tokens))

    with pytest.raises(ConfigError, match=rf"logits for tokens \[2, 16\] have shape {shape} where "
                                          rf"\[batch, seq, vocab\]"):
        trainer(lambda rngs: Cut(rngs))


@pytest.mark.parametrize("where", ["param", "constrain"])
def test_an_unknown_logical_axis_is_refused(devices, where):
    """A typo'd name left the dim replicated, silently (under ZeRO-3 beside the others)."""
    if where == "param":
        factory = lambda rngs: Bigram(rngs, axes_in=("embd", "mlp"))
        name = r"w_in: dim 0 is named 'embd'"
    else:
        class Typo(Bigram):
            def __call__(self, tokens):
                return constrain(super().__call__(tokens), ("batch", "sequence", "vocab"))
        factory, name = (lambda rngs: Typo(rngs)), r"constrain .*: dim 1 is named 'sequence'"
    with pytest.raises(ConfigError, match=name + r", which no sharding rule knows"):
        trainer(factory)
    if where == "param":  # a rule for the new name makes it valid
        trainer(factory, "sharding.rules.embd=[fsdp]")


def test_state_other_than_params_is_refused(devices):
    class Counting(Bigram):
        def __init__(self, rngs):
            super().__init__(rngs)
            self.calls = nnx.Variable(jnp.zeros((), jnp.int32))

    with pytest.raises(ConfigError, match=r"state other than nnx.Param: calls \(Variable\)"):
        trainer(lambda rngs: Counting(rngs))


def test_factory_mistakes(devices):
    with pytest.raises(ConfigError, match="must take one argument, an nnx.Rngs"):
        trainer(lambda: Bigram(nnx.Rngs(0)))
    with pytest.raises(ConfigError, match="is not callable"):
        trainer("Bigram")
    with pytest.raises(ConfigError, match="returned NoneType, not an nnx.Module"):
        trainer(lambda rngs: None)
    with pytest.raises(ConfigError, match="takes a jaxpar Config, got dict"):
        Trainer({"mesh": {"data": 8}})


def test_step_keywords_the_model_does_not_take_are_named(devices):
    """Context parallelism passes positions=; the model must take them (and mix the sequence only
    through jaxpar.nn.attention)."""
    with pytest.raises(ConfigError, match=r"mesh.context=2 calls the model as model\(tokens, "
                                          r"positions=...\), but Bigram.__call__ does not take positions"):
        trainer(lambda rngs: Bigram(rngs), "mesh.data=4", "mesh.fsdp=1", "mesh.tensor=1", "mesh.context=2")


def test_pipeline_without_a_layer_stack_says_so_first(devices):
    with pytest.raises(ConfigError, match=r"mesh.pipeline=2 needs a model whose layers are stacked"):
        trainer(lambda rngs: Bigram(rngs), "mesh.data=4", "mesh.fsdp=1", "mesh.tensor=1",
                "mesh.pipeline=2", "sharding.zero_stage=1", "train.grad_accum=2")


def test_params_without_axis_names_are_named_in_the_replication_error(devices):
    class Plain(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
            self.head = nnx.Linear(DIM, VOCAB, rngs=rngs)

        def __call__(self, tokens):
            return self.head(self.embed(tokens))

    with pytest.raises(ConfigError, match=r"no logical axis names, so no rule can shard them: create "
                                          r"weights with jaxpar.nn.param"):
        trainer(lambda rngs: Plain(rngs), "mesh.data=4", "mesh.fsdp=1", "sharding.zero_stage=0")


def test_a_bad_yaml_override_names_it():
    with pytest.raises(ConfigError, match=r"override 'train.steps=\[1,': '\[1,' is not a YAML value"):
        make_config({}, ["train.steps=[1,"])


def test_generate_on_a_custom_models_run_says_so(devices, tmp_path):
    """Its saved config describes jaxpar's default model, not the factory's: one message (was an
    orbax shape error about arrays the user never named)."""
    from jaxpar.checkpoint import CheckpointError
    from jaxpar.generate import load
    t = Trainer(cfg_of("train.steps=1", "checkpoint.enabled=true", "checkpoint.async_save=false",
                       f"run_dir={tmp_path}", "name=custom"),
                model_factory=lambda rngs: Bigram(rngs), log=lambda s: None)
    ckpt = t.make_checkpointer(t.cfg.out_dir)  # a checkpoint as fit writes it (no step compiled)
    t.save(ckpt, 1, t.init_state())
    ckpt.close()
    with pytest.raises(CheckpointError, match=r"its params are not those of the model its saved config "
                                              r"describes: .*model_factory"):
        load(t.cfg.out_dir)


class StackedBias(nnx.Module):
    """Embed -> a scan over stacked layers, each a matrix plus a bias (a per-layer vector, stored
    [layers, embed]) -> vocab head."""

    def __init__(self, rngs, layers=2):
        self.embed = param(rngs, (VOCAB, DIM), ("vocab", "embed"))
        self.stack = nnx.Module()
        self.stack.w = param(rngs, (layers, DIM, DIM), ("layers", "embed", "mlp"))
        self.stack.b = param(rngs, (layers, DIM), ("layers", "mlp"), ones=True)
        self.head = param(rngs, (DIM, VOCAB), ("embed", "vocab"))

    def __call__(self, tokens):
        from jaxpar.nn import scan_layers
        x = jnp.take(self.embed[...], tokens, axis=0)
        x = scan_layers(self.stack, x, lambda layer, h: h + jnp.tanh(h @ layer.w[...] + layer.b[...]))
        return x @ self.head[...]


def test_a_stacked_layers_bias_takes_no_weight_decay(devices):
    """README: weight decay is not on 1-D params. A bias stacked over layers ([layers, dim]) is one
    vector per layer: its first AdamW step equals float64 numpy's without decay, the matrices'
    with it (a stack's `layers` dim made the bias look 2-D, and it was decayed)."""
    lr, wd = 0.1, 0.5
    t = trainer(lambda rngs: StackedBias(rngs), "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1",
                "sharding.zero_stage=0", f"optimizer.lr={lr}", f"optimizer.weight_decay={wd}",
                "optimizer.warmup_steps=0", "optimizer.clip_norm=null", devices=devices[:1])
    state = t.init_state()
    p0 = jax.tree.map(lambda x: np.asarray(x, np.float64), jax.device_get(state["params"]))
    rows = np.random.default_rng(0).integers(0, VOCAB, (8, SEQ + 1))
    state, metrics = t.make_step(return_grads=True)(state, t.put_batch(rows))
    grads = jax.tree.map(lambda x: np.asarray(x, np.float64), jax.device_get(metrics["grads"]))
    eps = t.cfg.optimizer.eps

    def adamw_first_step(p, g, decayed):  # bias-corrected moments of one step: g and g**2
        return p - lr * (g / (np.abs(g) + eps) + (wd * p if decayed else 0.0))

    got = jax.device_get(state["params"])["stack"]
    for name, decayed in (("b", False), ("w", True)):
        want = adamw_first_step(p0["stack"][name], grads["stack"][name], decayed)
        np.testing.assert_allclose(got[name], want, rtol=1e-6, atol=1e-7, err_msg=name)

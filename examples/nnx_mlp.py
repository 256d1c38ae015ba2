"""An NNX model, optax's AdamW with a cosine schedule, Fashion-MNIST on 2 devices: jaxtrain's steps and loop."""
from flax import nnx

import jaxtrain as jt
from jaxtrain.data import loader, sources
from jaxtrain.models import classify
from jaxtrain.train.loop import fit

devices = jt.setup_devices(2)  # first: CPU gets 2 virtual devices


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden, self.out = nnx.Linear(784, 256, rngs=rngs), nnx.Linear(256, 10, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)  # draws from the step's key

    def __call__(self, x):
        return self.out(self.drop(nnx.relu(self.hidden(x.reshape(x.shape[0], -1)))))


net = jt.from_nnx(MLP(nnx.Rngs(0)), loss=lambda logits, b: classify.mean_loss(logits, b["label"]),
                  per_example=lambda logits, b: classify.per_example(logits, b["label"]))
train = loader.Loader(sources.load_split("fashion_mnist", "train").head(12_000), 128, train=True, seed=0)
test = loader.Loader(sources.load_split("fashion_mnist", "test"), 500, train=False)
tx = jt.make_optimizer("adamw", 2e-3, weight_decay=1e-4, schedule="cosine", total_steps=2 * len(train))
trainer = jt.make_train_step(net.loss_fn, tx, mesh=devices)
state, history, _ = fit(trainer, trainer.init(net.params, net.model_state), train,
                        jt.make_eval_step(net.eval_fn, mesh=devices), test, epochs=2)
print(f"test accuracy {history[-1].test_acc:.3f}")
trained = net.merge(state)  # an nnx.Module holding the trained weights
